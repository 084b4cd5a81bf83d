"""The daemon's HTTP probes (/healthz, /readyz, /metrics on metrics_listen), its start log and its
periodic summary (issue #40): real daemons as subprocesses, and a daemon in this process where the
moment matters (before it serves, while it stops, with its event loop wedged)."""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.daemon import process as daemon_module
from kvstore.daemon.config import DaemonConfig, load_config
from kvstore.daemon.process import Daemon
from tests.conftest import free_port
from tests.test_daemon import BLOCK, NS, make_blocks
from tests.test_tiers import make_block


def http(port: int, path: str, method: str = "GET", timeout: float = 5.0) -> tuple[int, str, str]:
    """(status, content type, body) of one request to the daemon's probe port."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.headers.get("Content-Type", ""), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_healthz_readyz_and_metrics_answer_what_they_mean(daemon_factory):
    """guarantees: Observability — /healthz is 200 "ok", /readyz 200 "ready" once the daemon serves,
    /metrics the Prometheus text with its content type, any other path 404 (before: every path,
    /healthz and /nope too, answered 200 with the metrics)."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    keys, payloads = make_blocks(2, seed=401)
    with KVStoreClient(d.address, shared_memory=False) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        client.get(keys, BLOCK)
    assert http(port, "/healthz") == (200, "text/plain; charset=utf-8", "ok\n")
    assert http(port, "/readyz") == (200, "text/plain; charset=utf-8", "ready\n")
    assert http(port, "/readyz?verbose=1")[0] == 200
    status, content_type, text = http(port, "/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=") and "charset=utf-8" in content_type
    assert 'kvstore_hits_total{tier="cpu"} 2.0' in text
    for path in ("/nope", "/", "/metrics/x", "/healthzz"):
        assert http(port, path)[0] == 404, path
    assert http(port, "/healthz", method="POST")[0] == 405
    assert http(port, "/healthz", method="HEAD")[:2] == (200, "text/plain; charset=utf-8")
    with grpc.insecure_channel(d.address) as channel:  # the gRPC probe, as docs/operations.md names it
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "kvstore.v1.KVStore"):
            assert check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_idle_connections_hold_no_thread_and_delay_no_probe(daemon_factory):
    """guarantees: Observability — 100 idle connections to the probe port cost the daemon no thread
    each, /healthz still answers within 2 s, a connection that sends no whole request within 2 s is
    closed, and oversized headers are refused (before: a thread per connection, held for ever)."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    before = threads_of(d.proc.pid)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(100)]
    try:
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        slow.sendall(b"GET /healthz HTTP/1.1\r\n")  # and never the end of its headers
        time.sleep(0.5)
        started = time.monotonic()
        assert http(port, "/healthz", timeout=2)[:1] == (200,)
        assert time.monotonic() - started < 2
        assert threads_of(d.proc.pid) - before < 5
        # Each was given 2 s from its accept: by now every idle one and the slow one are closed.
        time.sleep(2.0)
        for conn in (*idle[:5], slow):
            conn.settimeout(3)
            assert conn.recv(100) == b"", "a connection that sent no request is still open"
        slow.close()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as big:
            big.sendall(b"GET /healthz HTTP/1.1\r\nX-Filler: " + b"x" * 20000 + b"\r\n\r\n")
            assert big.recv(100).startswith(b"HTTP/1.1 431 ")
    finally:
        for conn in idle:
            conn.close()
    assert http(port, "/healthz", timeout=2)[0] == 200


def _config(folder: Path, port: int, **settings) -> DaemonConfig:
    return DaemonConfig(**{"listen": f"unix:{folder / 'kvstore.sock'}", "cpu_capacity": 64 * 2**20,
                           "disk_path": str(folder / "disk"), "disk_capacity": 256 * 2**20, "disk_fsync": False,
                           "shm_index": False, "metrics_listen": f"127.0.0.1:{port}",
                           "tenant_secret_file": str(folder / "tenant-secret"), **settings})


async def _http(port: int, path: str) -> tuple[int, str]:
    status, _, body = await asyncio.to_thread(http, port, path)
    return status, body


async def _until_listening(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


def test_readyz_is_starting_before_the_daemon_serves_and_stopping_while_writes_drain(short_tmp, monkeypatch):
    """guarantees: Observability — /readyz answers 503 "starting" until gRPC serves (tiers opened,
    disk index rebuilt, store started) and 503 "stopping" from the first moment of a graceful stop,
    while its queued writes drain; /healthz stays 200 throughout; the port closes once stopped."""
    port = free_port()
    gate = asyncio.Event()
    serving = daemon_module._set_serving

    async def held_serving(servicer):  # the start held just before it declares itself serving
        await gate.wait()
        await serving(servicer)

    monkeypatch.setattr(daemon_module, "_set_serving", held_serving)

    async def scenario() -> None:
        daemon = Daemon(_config(short_tmp, port))
        starting = asyncio.create_task(daemon.start())
        await _until_listening(port)
        assert await _http(port, "/readyz") == (503, "starting\n")
        assert await _http(port, "/healthz") == (200, "ok\n")
        assert not starting.done()
        gate.set()
        await starting
        assert await _http(port, "/readyz") == (200, "ready\n")

        disk = daemon.store.tiers[1]
        put = disk.put

        def slow_put(header, payload):  # a slow lower tier: each write-behind copy takes 0.2 s
            time.sleep(0.2)
            return put(header, payload)

        disk.put = slow_put
        blocks = [make_block(900 + i) for i in range(8)]
        for header, payload in blocks:
            await daemon.store.put(header, payload)
        stopping = asyncio.create_task(daemon.stop())
        await asyncio.sleep(0.05)
        assert daemon.store.write_behind.depth > 0 and not stopping.done()
        assert await _http(port, "/readyz") == (503, "stopping\n")
        assert await _http(port, "/healthz") == (200, "ok\n")
        await stopping
        assert all(header.key in disk for header, _ in blocks)  # drained: a graceful stop
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()

    asyncio.run(scenario())


def test_a_wedged_event_loop_fails_liveness_and_an_unreachable_top_tier_readiness(short_tmp, monkeypatch):
    """guarantees: Observability — /healthz answers 503 once the daemon's event loop has not run for
    the stall limit (10 s; here 0.5 s), and 200 again when it runs; /readyz is 503 naming the top
    tier while that tier is unavailable."""
    port = free_port()

    async def scenario() -> None:
        daemon = Daemon(_config(short_tmp, port))
        await daemon.start()
        try:
            assert await _http(port, "/healthz") == (200, "ok\n")
            daemon.probes.stall_s = 0.5
            seen: list[tuple[int, str, str]] = []
            probe = threading.Thread(target=lambda: (time.sleep(1.0), seen.append(http(port, "/healthz"))))
            probe.start()
            time.sleep(1.6)  # the loop wedged: nothing on it runs
            probe.join()
            assert seen[0][0] == 503 and seen[0][2].startswith("event loop stalled for "), seen
            await asyncio.sleep(0.1)  # it runs again: the heartbeat is stamped
            assert await _http(port, "/healthz") == (200, "ok\n")

            with monkeypatch.context() as patched:
                patched.setattr(type(daemon.store.tiers[0]), "available", property(lambda self: False))
                assert await _http(port, "/readyz") == (503, "tier cpu unavailable\n")
            assert await _http(port, "/readyz") == (200, "ready\n")
        finally:
            await daemon.stop(grace=0)

    asyncio.run(scenario())


def _start_lines(log: str) -> list[str]:
    """The INFO lines of the last start in a daemon log (from its last "kvstore serving on")."""
    lines = log.splitlines()
    first = max(i for i, line in enumerate(lines) if "kvstore serving on" in line)
    return lines[first:first + 4]


def test_the_start_log_says_what_the_daemon_is(daemon_factory):
    """guarantees: Observability — the daemon logs at start its address, TLS, auth, tenants, metrics
    and probe address, KV events, the summary interval, and each tier with its capacity, codec and
    (disk) the blocks its index rebuild found (before: the address and tier sizes only)."""
    port = free_port()
    settings = dict(log_level="INFO", metrics_listen=f"127.0.0.1:{port}", disk_codec="int8")
    d = daemon_factory("d0", **settings)
    text = "\n".join(_start_lines(d.log.read_text()))
    assert f"kvstore serving on unix:{d.socket}, TLS off, auth: no token, tenants: 0;" in text
    assert f"metrics and probes: http://127.0.0.1:{port} (/metrics, /healthz, /readyz)" in text
    assert "KV events: off" in text and "summary: every 60 s" in text
    assert re.search(r"tiers: cpu 64\.0 MiB, codec as put; disk [\d.]+ MiB, codec int8 at \S+: 0 blocks \(0 B\) "
                     r"found on disk", text), text
    keys, payloads = make_blocks(3, seed=402)
    with KVStoreClient(d.address, shared_memory=False) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    d.stop()  # drains the copies to disk

    again = daemon_factory("d0", **settings)  # the same folder: a restart
    text = "\n".join(_start_lines(again.log.read_text()))
    assert re.search(r"disk [\d.]+ MiB, codec int8 at \S+: 3 blocks \([\d.]+ [KM]iB\) found on disk", text), text


def test_a_summary_line_reports_each_interval_what_changed(daemon_factory):
    """guarantees: Observability — with summary_interval, one INFO line each interval gives what
    changed since the last: keys requested by RPC, hits by tier, misses, evictions, promotions,
    write errors, dropped copies, and the queue depth; 0 turns it off."""
    d = daemon_factory(log_level="INFO", summary_interval=0.5)
    keys, payloads = make_blocks(3, seed=403)
    with KVStoreClient(d.address, shared_memory=False) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys[:2], payloads[:2])])
        assert client.get(keys, BLOCK)[2] is None  # 2 hits, 1 miss
    time.sleep(2.0)
    lines = [line for line in d.log.read_text().splitlines() if "summary of the last 0.5 s:" in line]
    assert len(lines) >= 2, lines
    pattern = re.compile(r"requested (\d+).*, hits (\d+).*, misses (\d+), evictions (\d+), promotions (\d+), "
                         r"write errors (\d+), copies dropped (\d+); queue depth (\d+)$")
    counts = [tuple(int(n) for n in pattern.search(line).groups()) for line in lines]
    assert sum(c[0] for c in counts) == 3 and sum(c[1] for c in counts) == 2 and sum(c[2] for c in counts) == 1
    assert any("requested 3 (get 3)" in line or "(get " in line for line in lines), lines  # by RPC
    assert any("(cpu " in line for line in lines), lines  # by tier
    assert counts[-1] == (0, 0, 0, 0, 0, 0, 0, 0), lines  # deltas, not totals

    with pytest.raises(ValueError, match="summary_interval must be 0"):
        load_config(overrides={"summary_interval": "-1"}, environ={})
    assert load_config(overrides={"summary_interval": "0"}, environ={}).summary_interval == 0


def test_readyz_names_a_disk_tier_that_keeps_failing_and_stays_200(daemon_factory):
    """A lower tier that keeps failing (issue #57: the disk folder made unwritable) makes /readyz
    answer 200 "degraded: tier disk ..." (the daemon still serves from memory; a 503 would take the
    pod out of its Service), sets kvstore_tier_degraded{tier="disk"} and logs it once."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}", log_level="INFO")
    assert http(port, "/readyz")[::2] == (200, "ready\n")
    disk = d.folder / "disk"
    disk.rename(d.folder / "disk.gone")  # unwritable even for root: a file where the folder was
    disk.write_text("")
    keys, payloads = make_blocks(4, seed=571)
    with KVStoreClient(d.address, shared_memory=False) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        deadline = time.monotonic() + 15
        while (answer := http(port, "/readyz"))[2] == "ready\n" and time.monotonic() < deadline:
            time.sleep(0.1)
        status, _, body = answer
        assert status == 200 and body.startswith("degraded: tier disk 3+ write errors in 60 s"), answer
        assert body.rstrip().endswith("Error (Not a directory)"), body
        assert not re.search(r"[0-9a-f]{32}", body), "a key (a block's file name) never shows on the metrics port"
        assert len(client.get(keys, BLOCK)) == 4, "the CPU tier still serves every block"
    metrics = http(port, "/metrics")[2]
    assert 'kvstore_tier_degraded{tier="disk"} 1.0' in metrics and 'kvstore_tier_degraded{tier="cpu"} 0.0' in metrics
    assert re.search(r'kvstore_write_errors_total\{tier="disk"\} [1-9]', metrics)
    assert d.log.read_text().count("tier disk degraded") == 1


def test_tier_health_counts_errors_over_a_window_and_a_tier_that_says_it_is_down():
    """3 write errors within 60 s degrade a tier until 60 s after the burst; an unavailable lower
    tier (S3's breaker open) is degraded; an unavailable top tier is not ready (503)."""
    from types import SimpleNamespace

    from kvstore.daemon.tier_health import TierHealth

    now = [1000.0]
    cpu, disk = SimpleNamespace(name="cpu", available=True, shared=False), \
        SimpleNamespace(name="disk", available=True, shared=False)
    s3 = SimpleNamespace(name="s3", available=True, shared=True)
    health = TierHealth([cpu, disk, s3], clock=lambda: now[0])
    for _ in range(2):
        health.note_write_error("disk", OSError(30, "Read-only file system"))
    assert health.degraded() == {} and health.degraded_text() is None
    now[0] += 59
    health.note_write_error("disk", OSError(30, "Read-only file system"))  # 3 within 59 s
    assert list(health.degraded()) == ["disk"] and health.not_ready() is None
    assert health.degraded_text() == "degraded: tier disk 3+ write errors in 60 s, last 0 s ago: OSError (Read-only " \
                                     "file system)"
    now[0] += 2  # the first error has left the window: 2 in the last 60 s
    assert health.degraded() == {}
    s3.available = False
    assert health.degraded() == {"s3": "unavailable (circuit open)"}
    cpu.available = False
    assert health.not_ready() == "tier cpu unavailable"
    with pytest.raises(ValueError, match="errors must be >= 1"):
        TierHealth([cpu], errors=0)


def flood(port: int, stop: threading.Event, opened: list[int]) -> None:
    """Open and close connections to ``port`` as fast as one thread can, some sending half a
    request first, until ``stop``; counts them in ``opened``."""
    n = 0
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1.0)
        except OSError:
            continue
        try:
            if n % 4 == 0:
                sock.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a RST
        except OSError:
            pass
        sock.close()
        n += 1
    opened.append(n)


def probes_answered(port: int) -> int:
    """How many of 10 probes (/readyz and /healthz in turn, 0.4 s apart, after 0.5 s of flood)
    answer 200 within 1 s, as a kubelet asks."""
    answered = 0
    time.sleep(0.5)
    for i in range(10):
        try:
            answered += http(port, "/healthz" if i % 2 else "/readyz", timeout=1.0)[0] == 200
        except OSError:
            pass
        time.sleep(0.4)
    return answered


def test_probes_answer_while_a_local_user_floods_the_port_with_connections(daemon_factory):
    """guarantees: Observability — a flood of short connections to the metrics port (several
    threads for 5 s, connecting and closing as fast as they can, some leaving half a request)
    keeps /healthz and /readyz answering within 1 s, as a kubelet asks (issue 56, medium 6:
    /healthz answered 0 of 10 under 1.39M connections in 35 s)."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    assert http(port, "/readyz")[0] == 200
    stop, opened = threading.Event(), []
    flooders = [threading.Thread(target=flood, args=(port, stop, opened), daemon=True) for _ in range(6)]
    for t in flooders:
        t.start()
    try:
        answered = probes_answered(port)
    finally:
        stop.set()
        for t in flooders:
            t.join(10)
    print(f"probes answered {answered} of 10 while {sum(opened)} connections were opened")
    assert sum(opened) > 1000, "the flood did not flood"
    assert answered >= 8, f"only {answered} of 10 probes answered under the flood"
    assert d.alive and http(port, "/healthz")[0] == 200


#: A flood at the kernel's speed, run as its own process: non-blocking connects, up to 256 in
#: flight, the oldest reset (SO_LINGER 0) as each new one starts; argv: port, seconds; prints the count.
FLOODER = """
import socket, struct, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
pending, count, end = [], 0, time.monotonic() + seconds
while time.monotonic() < end:
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(("127.0.0.1", port))
    pending.append(sock)
    count += 1
    if len(pending) > 256:
        old = pending.pop(0)
        try:
            old.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        old.close()
print(count)
"""


def test_probes_answer_while_two_processes_flood_the_port_at_kernel_speed(daemon_factory):
    """guarantees: Observability — the same probes under a faster flood: two processes of
    non-blocking connects (about 190,000 connections in 6 s here, the issue's 1.39M in 35 s
    about as fast); at least 8 of 10 probes answer within 1 s (on ee82bf6: 5 of 10)."""
    import subprocess
    import sys

    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    assert http(port, "/readyz")[0] == 200
    flooders = [subprocess.Popen([sys.executable, "-c", FLOODER, str(port), "6"], stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    try:
        answered = probes_answered(port)
    finally:
        opened = sum(int(f.communicate(timeout=60)[0] or 0) for f in flooders)
    print(f"probes answered {answered} of 10 while {opened} connections were attempted")
    assert opened > 5000, "the flood did not flood"
    assert answered >= 8, f"only {answered} of 10 probes answered under the flood"
    assert d.alive and http(port, "/healthz")[0] == 200


def test_kvstore_health_answers_over_the_daemons_socket_during_a_flood_of_the_metrics_port(daemon_factory):
    """guarantees: Observability — `kvstore health`, an exec probe over the daemon's own (0600)
    socket, exits 0 printing SERVING while the metrics port is flooded, and 1 in one line with no
    daemon there."""
    import subprocess
    import sys

    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    stop, opened = threading.Event(), []
    flooders = [threading.Thread(target=flood, args=(port, stop, opened), daemon=True) for _ in range(4)]
    for t in flooders:
        t.start()
    try:
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "health", "--address", d.address],
                              capture_output=True, text=True, timeout=60)
    finally:
        stop.set()
        for t in flooders:
            t.join(10)
    assert (done.returncode, done.stdout) == (0, "SERVING\n"), done.stderr
    missing = subprocess.run([sys.executable, "-m", "kvstore.cli", "health", "--address",
                              f"unix:{d.folder / 'nobody.sock'}"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "no daemon at" in missing.stderr
