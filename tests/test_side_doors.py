"""Side doors (issue #39): who can read KV events and /metrics, what a flood of replay requests can
do to live events, drops a subscriber can see, and lock files planted in a shared folder.

The access rules and the lock files are the daemon's: they run real ``kvstore serve`` processes.
Replay's bounds are the publisher thread's: those tests drive an ``EventPublisher`` in-process,
filled with thousands of batches (a daemon would need thousands of Puts)."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import zmq

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.daemon import event_replay as events  # the replay's bounds: events.REPLAY_BURST, ...
from kvstore.daemon.config import load_config
from kvstore.daemon.event_format import END_SEQ, block_hash, decode_batch
from kvstore.daemon.event_replay import replay
from kvstore.daemon.events import EventPublisher
from tests.conftest import free_port
from tests.test_daemon import NS, make_blocks
from tests.test_events import Subscriber, small_header
from tests.test_operator import finish, kvstore, one_line_error, serve

TOKEN = "side-doors-token-0123456789abcdef"
#: A daemon that starts by mistake is stopped this soon (it should have refused in a second or two).
REFUSE_S = 30


def loopback_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


# -- KV events: who can read them ----------------------------------------------------------------


def test_events_are_confined_to_loopback_and_to_the_daemons_user_when_it_has_a_token(daemon_factory, short_tmp):
    """guarantees: Isolation — a tcp events address must be a loopback IP address (decided by
    address, not name); a daemon with a token publishes on ipc:// only (0600), unless events_public."""
    for address in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://localhost.example.com:5557"):
        with pytest.raises(ValueError, match=re.escape(f"events_listen {address} is not a loopback address")):
            load_config(overrides={"events_listen": address}, environ={})
    with pytest.raises(ValueError, match="events_replay tcp://0.0.0.0:5558 is not a loopback address"):
        load_config(overrides={"events_listen": "tcp://127.0.0.1:5557", "events_replay": "tcp://0.0.0.0:5558"},
                    environ={})
    for address in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:5557"):
        load_config(overrides={"events_listen": address}, environ={})
    load_config(overrides={"events_listen": "tcp://0.0.0.0:5557", "events_public": "true"}, environ={})

    # A daemon with a token: loopback TCP is open to every local user, so it is refused in one line.
    sock = short_tmp / "tcp-refused.sock"
    result = finish(kvstore(*serve(listen=f"unix:{sock}", disk_path="", auth_token=TOKEN,
                                   events_listen=loopback_endpoint())), timeout=REFUSE_S)
    one_line_error(result, "events_listen tcp://127.0.0.1:", "auth_token", "ipc://", "events_public")

    # On ipc:// it publishes, and only its own user can connect (socket files 0600).
    short_tmp.chmod(0o711)  # others may pass through the folders: the sockets' own mode decides
    pub_path, replay_path = short_tmp / "d0" / "events.ipc", short_tmp / "d0" / "replay.ipc"
    d = daemon_factory(auth_token=TOKEN, events_listen=f"ipc://{pub_path}", events_replay=f"ipc://{replay_path}")
    for path in (pub_path, replay_path):
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600, path
    live = Subscriber(f"ipc://{pub_path}")
    keys, payloads = make_blocks(1, seed=391)
    with KVStoreClient(d.address, token=TOKEN) as client:
        client.put(NS, [(keys[0], 64, payloads[0])])
    seen = [key for _, payload in live.drain(quiet_s=1.0) for event in decode_batch(payload).events
            for key in getattr(event, "block_hashes", [])]
    live.close()
    assert block_hash(keys[0]) in seen
    if os.geteuid() == 0:  # another local user is refused by the kernel
        for path in (pub_path, replay_path):
            assert _connect_as_nobody(path) == "refused", path
    # With events_public, TCP is the operator's explicit choice.
    other = daemon_factory("d1", auth_token=TOKEN, events_listen=loopback_endpoint(), events_public="true")
    assert other.alive


def _connect_as_nobody(path) -> str:
    """Connect to the unix socket ``path`` as user nobody, from a fresh process (not a fork of this
    one: see ``exec_after``)."""
    probe = ("import os, socket, sys\ns = socket.socket(socket.AF_UNIX)\nos.setgroups([])\nos.setgid(65534)\n"
             "os.setuid(65534)\ntry:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(11)\nsys.exit(10)")
    done = subprocess.run([sys.executable, "-c", probe, str(path)], timeout=30, check=False, capture_output=True,
                          text=True)
    code = done.returncode
    return {10: "connected", 11: "refused"}.get(code, f"failed ({code}): {done.stderr.strip()[-300:]}")


# -- replay: bounded, never ahead of live batches, never thinned ---------------------------------


def filled_publisher(groups: int, events_per_group: int = 1, **settings) -> EventPublisher:
    """A started publisher holding about ``groups`` batches of ``events_per_group`` events each."""
    publisher = EventPublisher(loopback_endpoint(), [("cpu", False)], replay_endpoint=loopback_endpoint(),
                               **settings)
    publisher.start()
    queued = 1  # AllBlocksCleared, in a batch of its own
    while publisher.published < queued:
        time.sleep(0.001)
    for group in range(groups):
        for i in range(events_per_group):
            key = (group * events_per_group + i).to_bytes(16, "big")
            publisher.stored(key, 0, small_header(key))
        queued += events_per_group
        deadline = time.monotonic() + 5
        while publisher.published < queued:  # one batch per group: the next waits for this one
            assert time.monotonic() < deadline, "the publisher stopped publishing"
            time.sleep(0)
    return publisher


def test_a_flood_of_replay_requests_never_holds_up_live_events():
    """guarantees: Limits — replay requests are rate-limited and bounded; live batches go first
    (before: 400 requests of 8 bytes held a new block's event back for tens of seconds)."""
    publisher = filled_publisher(5000)
    attackers = []
    try:
        live = Subscriber(publisher.endpoint)
        for _ in range(40):  # 400 requests from 40 peers that never read their replies
            attacker = zmq.Context.instance().socket(zmq.DEALER)
            attacker.setsockopt(zmq.LINGER, 0)
            attacker.connect(publisher.replay_endpoint)
            attackers.append(attacker)
        for _ in range(10):
            for attacker in attackers:
                attacker.send_multipart((b"", (0).to_bytes(8, "big")))
        time.sleep(0.3)  # the flood has reached the publisher
        new_key = b"\xfe" * 16
        publisher.stored(new_key, 0, small_header(new_key))
        started = time.monotonic()
        arrived = None
        while arrived is None and time.monotonic() - started < 10 and live.sock.poll(10_000):
            _, _, payload = live.sock.recv_multipart()
            if any(block_hash(new_key) in getattr(e, "block_hashes", []) for e in decode_batch(payload).events):
                arrived = time.monotonic() - started
        live.close()
        assert arrived is not None and arrived < 1.5, f"the new block's event took {arrived} s"
        assert publisher.replays["refused"] >= 400 - events.REPLAY_BURST - events.MAX_REPLIES
        assert publisher.dropped == 0
        # A well-behaved consumer still gets every batch, in replies of at most REPLY_BATCHES.
        time.sleep(2.5)  # the bucket refills
        replayed = replay(publisher.replay_endpoint, 0, timeout_s=10)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        assert sum(len(batch.events) for _, batch in replayed) == publisher.published  # and heartbeats
    finally:
        for attacker in attackers:
            attacker.close()
        publisher.close()


def test_a_reply_its_peer_cannot_take_at_once_is_never_thinned():
    """guarantees: Limits — a reply past the peer's queue waits for it to read (before: the batches
    past ZMQ's limit were dropped unseen); a peer that reads nothing loses the rest, counted."""
    publisher = filled_publisher(3000, events_per_group=40)  # ~3 KB batches: ~9 MB in all
    peers = []

    def slow_peer() -> zmq.Socket:
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.RCVHWM, 1)
        peer.setsockopt(zmq.RCVBUF, 4096)
        peer.connect(publisher.replay_endpoint)
        peer.send_multipart((b"", (0).to_bytes(8, "big")))
        peers.append(peer)
        return peer

    def read(peer: zmq.Socket) -> tuple[list[int], bool]:
        seqs = []
        while peer.poll(3000):
            _, _, seq, _ = peer.recv_multipart()
            if seq == END_SEQ:
                return seqs, True
            seqs.append(int.from_bytes(seq, "big"))
        return seqs, False

    try:
        late_reader = slow_peer()
        time.sleep(1.0)  # reads nothing for a while
        seqs, ended = read(late_reader)
        assert seqs == list(range(len(seqs))), "the reply skipped batches"
        assert ended and len(seqs) == events.REPLY_BATCHES
        never_reads = slow_peer()
        time.sleep(events.REPLY_STALL_S + 1.0)
        assert publisher.replays["abandoned"] == 1
        seqs, ended = read(never_reads)  # what did get queued is an unbroken run, without an end marker
        assert seqs == list(range(len(seqs))) and not ended
    finally:
        for peer in peers:
            peer.close()
        publisher.close()


def test_events_the_full_queue_dropped_leave_a_seq_gap_live_and_in_replay():
    """guarantees: Observability — dropped events cost a seq no batch carries (before: the seqs ran
    on over them, and no subscriber could tell)."""
    publisher = EventPublisher(loopback_endpoint(), [("cpu", False)], replay_endpoint=loopback_endpoint(),
                               queue_depth=5)
    gate = threading.Event()
    gate.set()
    publish = publisher._publish  # held at the gate, the thread drains nothing: the queue fills
    publisher._publish = lambda *args: (gate.wait(10), publish(*args))[1]
    publisher.start()
    try:
        live = Subscriber(publisher.endpoint)
        gate.clear()
        for i in range(20):
            key = i.to_bytes(16, "big")
            publisher.stored(key, 0, small_header(key))
        assert publisher.dropped == 15
        gate.set()
        for published in (6, 7):  # AllBlocksCleared and 5 events, then one stored after the drops
            deadline = time.monotonic() + 5
            while publisher.published < published and time.monotonic() < deadline:
                time.sleep(0.01)
            if published == 6:
                publisher.stored(b"\xff" * 16, 0, small_header(b"\xff" * 16))
        received = [seq for seq, _ in live.drain()]
        live.close()
        replayed = [seq for seq, _ in replay(publisher.replay_endpoint, 0)]
        assert [seq for seq in received if seq >= 1] == [1, 3]  # seq 2 stands for the 15 dropped
        assert replayed == [0, 1, 3]
    finally:
        gate.set()
        publisher.close()


def test_malformed_replay_requests_are_counted_and_logged_once_a_minute(daemon_factory):
    """guarantees: Observability — malformed replay requests are counted in /metrics and logged
    once, then at most once a minute with a count (before: one warning line each)."""
    port = free_port()
    ends = {"events_listen": loopback_endpoint(), "events_replay": loopback_endpoint()}
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}", **ends)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(ends["events_replay"])
    try:
        for _ in range(2000):
            peer.send_multipart((b"", b"bad"))
        peer.send_multipart((b"", (0).to_bytes(8, "big")))  # after them on the same pipe: answered last
        frames = []
        while peer.poll(10_000):
            frames = peer.recv_multipart()
            if frames[2] == END_SEQ:
                break
        assert frames and frames[2] == END_SEQ
    finally:
        peer.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert d.stop() == 0  # the publisher logs the count of repeats when it closes
    lines = [line for line in d.log.read_text().splitlines() if "malformed KV-event replay" in line]
    assert len(lines) == 2, f"{len(lines)} lines"
    assert "ignored 1999 more malformed KV-event replay requests" in lines[1]
    assert 'kvstore_events_replays_total{outcome="malformed"} 2000.0' in text
    assert 'kvstore_events_replays_total{outcome="served"} 1.0' in text


# -- metrics --------------------------------------------------------------------------------------


def test_metrics_are_loopback_unless_asked_and_show_no_tenant(daemon_factory, short_tmp):
    """guarantees: Isolation — /metrics binds loopback (':PORT' is 127.0.0.1); a non-loopback
    address needs metrics_public; it shows totals only: no tenant name, token or key."""
    sock = short_tmp / "refused.sock"
    result = finish(kvstore(*serve(listen=f"unix:{sock}", disk_path="", metrics_listen=f"0.0.0.0:{free_port()}")),
                    timeout=REFUSE_S)
    one_line_error(result, "metrics_listen 0.0.0.0:", "not a loopback address", "metrics_public")
    load_config(overrides={"metrics_listen": "0.0.0.0:9464", "metrics_public": "true"}, environ={})

    tenants = short_tmp / "tenants.toml"
    names = {"tenant-alpha-x7": "token-alpha-0123456789abcdef", "tenant-beta-q3": "token-beta-0123456789abcdef"}
    tenants.write_text("".join(f'[[tenant]]\nname = "{n}"\ntoken = "{t}"\n\n' for n, t in names.items()))
    port = free_port()
    d = daemon_factory(tenants_file=str(tenants), metrics_listen=f":{port}")
    assert _listening_addresses(port) == {"127.0.0.1"}
    keys, payloads = make_blocks(4, seed=392)
    for (name, token), key_pair, payload_pair in zip(names.items(), (keys[:2], keys[2:]), (payloads[:2], payloads[2:])):
        with KVStoreClient(d.address, token=token) as client:
            client.put(NS, [(k, 64, p) for k, p in zip(key_pair, payload_pair)])
            client.lookup(key_pair)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvstore_requested_total{rpc="lookup"} 4.0' in text  # both tenants' traffic, summed
    for secret in [*names, *names.values(), *(k.hex() for k in keys)]:
        assert secret not in text, secret
    from prometheus_client.parser import text_string_to_metric_families

    labels = {name for family in text_string_to_metric_families(text) for sample in family.samples
              for name in sample.labels}
    assert not any("tenant" in name for name in labels), labels


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of TCP sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:
                    raw = bytes.fromhex(address)
                    if width == 8:
                        found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                    else:
                        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                        found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


# -- lock files in a shared folder ----------------------------------------------------------------


def test_a_link_planted_at_a_lock_file_is_refused_and_its_target_left_alone(short_tmp):
    """guarantees: Durability — SOCKET.lock and DISK/.lock are opened in their folder without
    following a symlink, and one that is a symlink or a second link is refused in one line
    (before: the daemon truncated the file it pointed to and wrote its pid there)."""
    victim = short_tmp / "precious.txt"
    victim.write_text("precious\n")
    shared = short_tmp / "shared"
    shared.mkdir()
    sock = shared / "kvstore.sock"
    (shared / "kvstore.sock.lock").symlink_to(victim)
    result = finish(kvstore(*serve(listen=f"unix:{sock}", disk_path="")), timeout=REFUSE_S)
    one_line_error(result, f"{sock}.lock is a symbolic link")
    assert victim.read_text() == "precious\n"

    (shared / "kvstore.sock.lock").unlink()
    os.link(victim, shared / "kvstore.sock.lock")
    result = finish(kvstore(*serve(listen=f"unix:{sock}", disk_path="")), timeout=REFUSE_S)
    one_line_error(result, f"{sock}.lock is a file with 2 links")
    assert victim.read_text() == "precious\n"

    disk = short_tmp / "disk"
    disk.mkdir()
    (disk / ".lock").symlink_to(victim)
    result = finish(kvstore(*serve(listen=f"unix:{short_tmp / 'other.sock'}", disk_path=disk)), timeout=REFUSE_S)
    one_line_error(result, f"{disk / '.lock'} is a symbolic link")
    assert victim.read_text() == "precious\n"
