"""KV events from a real daemon: vLLM's wire format, replay rebuilding the store's exact state, late
and stalled subscribers, the bounded queue, and no events with tenants."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.daemon.config import load_config
from kvstore.block import BlockHeader, pack_token_ids
from kvstore.daemon.event_format import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, block_hash, decode_batch,
                                         sub_block_hashes)
from kvstore.daemon.event_replay import replay
from kvstore.daemon.events import EventPublisher
from kvstore.keys import KVLayout, Namespace, prefix_keys
from tests.conftest import free_port
from tests.test_daemon import BLOCK, NS, make_blocks

try:  # vLLM's own classes, in .venv-vllm; the main venv decodes with kvstore's structs only
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch
except ImportError:
    VllmBatch = None

SMALL = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16")
SMALL_NS = Namespace("tiny-model", SMALL, chunk_tokens=64)


#: The tier an event names, from its medium and locality (events name no ``ownership``).
TIER_OF = {("CPU", "LOCAL"): "cpu", ("STORAGE", "LOCAL"): "disk", ("STORAGE", "REMOTE"): "s3", ("GPU", "LOCAL"): "gpu"}


def small_header(key: bytes, tokens: int = 64, parent: bytes = b"", token_ids=None) -> BlockHeader:
    """A header of a SMALL block, as a tier would give the publisher."""
    return BlockHeader(key=key, namespace=SMALL_NS.id, layout=SMALL, tokens=tokens, payload_len=SMALL.block_bytes(tokens),
                       checksum=1, parent=parent, token_ids=pack_token_ids(token_ids) if token_ids is not None else b"")


def endpoints() -> dict[str, str]:
    return {"events_listen": f"tcp://127.0.0.1:{free_port()}", "events_replay": f"tcp://127.0.0.1:{free_port()}"}


class Subscriber:
    """A SUB socket on a daemon's events, as a router would hold it."""

    def __init__(self, endpoint: str, rcvhwm: int | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the publisher asynchronously

    def drain(self, quiet_s: float = 0.3) -> list[tuple[int, bytes]]:
        """(seq, payload) of every message until none arrives for ``quiet_s``."""
        got = []
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            got.append((int.from_bytes(seq, "big"), payload))
        return got

    def close(self) -> None:
        self.sock.close()


def apply(state: dict[int, set[str]], events, strict: bool = True) -> None:
    """Update {block hash: tiers holding it} with one batch's events, strictly: a removal of a key
    the stream never stored there is a bug in the stream. Not ``strict`` after a snapshot, whose
    blocks the kept batches after it may store or remove again (as routers apply them)."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            state.clear()
            continue
        assert event.ownership is None  # Dynamo drops events that name one
        tier = TIER_OF[event.medium, event.locality]
        for key in event.block_hashes:
            assert isinstance(key, int) and 0 <= key < 2**64
            if isinstance(event, BlockStored):
                assert not strict or tier not in state.get(key, set()), f"{key:x} stored twice in {tier}"
                state.setdefault(key, set()).add(tier)
            else:
                assert not strict or tier in state.get(key, set()), f"{key:x} removed from {tier}, which lacks it"
                state.get(key, set()).discard(tier)
                if not state.get(key, True):
                    del state[key]


def store_state(client: KVStoreClient, keys: list[bytes]) -> dict[int, set[str]]:
    """Which tiers hold each key (by its event hash), from the daemon's key index (mirrors each
    tier's LRU exactly)."""
    index = client._index
    state = {}
    for key in keys:
        mask = index.mask(key)
        if mask:
            state[block_hash(key)] = {name for i, name in enumerate(index.tier_names) if mask >> i & 1}
    return state


def replayed_state(endpoint: str) -> tuple[dict[int, set[str]], list[int]]:
    state: dict[int, set[str]] = {}
    batches = replay(endpoint, 0)
    snapshot = bool(batches) and batches[0][0] > 0  # the batches before the oldest kept, compacted
    for _, batch in batches:
        apply(state, batch.events, strict=not snapshot)
    return state, [seq for seq, _ in batches]


def wait_for_state(client, keys, replay_endpoint, timeout=10.0):
    """Replay until the events describe what the store holds (the publisher runs behind the store)."""
    deadline = time.monotonic() + timeout
    while True:
        expected = store_state(client, keys)
        state, seqs = replayed_state(replay_endpoint)
        if state == expected or time.monotonic() > deadline:
            return state, expected, seqs
        time.sleep(0.1)


def test_replaying_every_event_gives_the_store_final_state(daemon_factory):
    # ~10 blocks fit the CPU tier and ~6 the disk tier: 30 puts evict from both, demoting CPU
    # victims to disk (write-back); Gets of disk blocks promote them; then deletes and a clear.
    ends = endpoints()
    d = daemon_factory(cpu_capacity="1500KiB", disk_capacity="1MiB", write_policy="write-back", **ends)
    live = Subscriber(ends["events_listen"])
    keys, payloads = make_blocks(30, seed=11)
    more_keys, more_payloads = make_blocks(6, seed=12)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        on_disk = [k for k in keys if client.lookup([k]).tiers == ("disk",)]
        assert on_disk, "no block is only on disk"
        client.get(on_disk[:2], BLOCK)  # disk hits: promoted to the CPU tier in the background
        time.sleep(0.3)
        assert client.delete(keys[-3:]) == 3
        assert client.clear(["cpu"]) > 0
        client.put(NS, [(k, 64, p) for k, p in zip(more_keys, more_payloads)])
        client.delete(more_keys[:1])
        all_keys = keys + more_keys
        state, expected, seqs = wait_for_state(client, all_keys, ends["events_replay"])
        assert expected and {"cpu", "disk"} == set().union(*expected.values())
        assert state == expected
        assert seqs == list(range(len(seqs)))
        stats = client.stats()
        assert stats["events_dropped"] == 0 and stats["events_published"] > len(all_keys)
        assert stats["tiers"]["cpu"]["evictions"] and stats["tiers"]["disk"]["evictions"]
        assert stats["tiers"]["disk"]["demotions_in"] and stats["tiers"]["cpu"]["promotions_in"]

    # The live stream carries the same batches, byte for byte, in vLLM's format (from the first one
    # after it subscribed: batch 0, sent at start, went out before it joined).
    received = live.drain()
    live.close()
    buffered = {seq: batch for seq, batch in replay(ends["events_replay"], 0)}
    assert received and [seq for seq, _ in received] == sorted(buffered)[received[0][0]:]
    kinds = set()
    for seq, payload in received:
        batch = decode_batch(payload)
        assert batch == buffered[seq] and batch.data_parallel_rank == 0
        kinds |= {type(e).__name__ for e in batch.events}
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                assert event.medium in ("CPU", "STORAGE") and event.locality == "LOCAL" and event.ownership is None
                assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.block_hashes)
            if isinstance(event, BlockStored):  # these Puts named neither parents nor tokens
                assert event.block_size == 64 and event.token_ids == [] and event.parent_block_hash is None
        if VllmBatch is not None:  # vLLM's own classes read it, and write the same bytes back
            theirs = msgspec.msgpack.Decoder(VllmBatch).decode(payload)
            assert msgspec.msgpack.encode(theirs) == payload
    assert kinds >= {"BlockStored", "BlockRemoved"}
    assert isinstance(buffered[0].events[0], AllBlocksCleared)


def test_a_late_subscriber_catches_up_through_replay(daemon_factory):
    ends = endpoints()
    d = daemon_factory(**ends)
    keys, payloads = make_blocks(8, seed=21)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys[:5], payloads[:5])])
        late = Subscriber(ends["events_listen"])  # joins after five puts: it missed them
        caught_up = replay(ends["events_replay"], 0)
        client.put(NS, [(k, 64, p) for k, p in zip(keys[5:], payloads[5:])])
        client.delete(keys[:1])
        live = late.drain()
        late.close()
        # Replay, then the live stream from the first seq replay did not have: no gap, no double.
        last = caught_up[-1][0]
        seqs = [seq for seq, _ in caught_up] + [seq for seq, _ in live if seq > last]
        assert seqs == list(range(len(seqs)))
        state: dict[bytes, set[str]] = {}
        for _, batch in caught_up:
            apply(state, batch.events)
        for seq, payload in live:
            if seq > last:
                apply(state, decode_batch(payload).events)
        deadline = time.monotonic() + 5
        while state != store_state(client, keys) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state == store_state(client, keys)


def test_a_restarted_daemon_first_clears_then_publishes_what_it_found_on_disk(daemon_factory):
    ends = endpoints()
    d = daemon_factory(**ends)
    keys, payloads = make_blocks(3, seed=41)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    assert d.stop() == 0  # drains the write-through copies to disk
    d.start()
    with KVStoreClient(d.address) as client:
        state, expected, seqs = wait_for_state(client, keys, ends["events_replay"])
    assert state == expected == {block_hash(k): {"disk"} for k in keys} and seqs[0] == 0


def put_small(client: KVStoreClient, keys: list[bytes], payload: np.ndarray) -> float:
    started = time.perf_counter()
    for key in keys:
        client.put(SMALL_NS, [(key, 64, payload)])
    return time.perf_counter() - started


def test_a_stalled_subscriber_never_slows_puts(daemon_factory):
    ends = endpoints()
    d = daemon_factory(disk_path="", **ends)
    tokens = np.random.default_rng(3).integers(0, 50000, size=64 * 600)
    keys = prefix_keys(SMALL_NS, tokens)
    payload = np.zeros(SMALL.block_bytes(64) // 2, np.float16)
    with KVStoreClient(d.address) as client:
        put_small(client, keys[:50], payload)  # warm up
        alone = put_small(client, keys[50:300], payload)
        stalled = [Subscriber(ends["events_listen"], rcvhwm=1) for _ in range(3)]  # never read
        with_stalled = put_small(client, keys[300:], payload)
        stats = client.stats()
    assert with_stalled < 3 * alone + 1.0, f"{with_stalled:.2f}s with stalled subscribers, {alone:.2f}s without"
    assert stats["events_dropped"] == 0  # the daemon's queue never filled: ZMQ dropped for them alone
    # A stalled subscriber that wakes up finds the rest through replay.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        batches = replay(ends["events_replay"], 0)
        if sum(len(b.events) for _, b in batches) == 1 + len(keys):  # AllBlocksCleared + one per put
            break
        time.sleep(0.1)
    assert sum(len(b.events) for _, b in batches) == 1 + len(keys)
    for sub in stalled:
        sub.close()


def test_a_full_queue_drops_and_counts_without_blocking():
    publisher = EventPublisher(f"tcp://127.0.0.1:{free_port()}", [("cpu", False)],
                               replay_endpoint=f"tcp://127.0.0.1:{free_port()}", queue_depth=5)
    started = time.perf_counter()
    for i in range(10):  # the thread is not started: nothing drains the queue
        publisher.stored(bytes([i]) * 16, 0, small_header(bytes([i]) * 16))
    assert time.perf_counter() - started < 0.1
    assert publisher.dropped == 6  # AllBlocksCleared and four stores fill the 5 places
    publisher.start()
    try:
        deadline = time.monotonic() + 5
        while publisher.published < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        [(seq, batch)] = replay(publisher.replay_endpoint, 0)
        assert seq == 0 and [type(e).__name__ for e in batch.events] == ["AllBlocksCleared"] + ["BlockStored"] * 4
        assert [e.block_hashes for e in batch.events[1:]] == [[block_hash(bytes([i]) * 16)] for i in range(4)]
        assert replay(publisher.replay_endpoint, 1) == []
    finally:
        publisher.close()


def test_replay_answers_a_raw_router_request_as_vllm_does():
    publisher = EventPublisher(f"tcp://127.0.0.1:{free_port()}", [("cpu", False), ("s3", True)],
                               replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv@pod@model")
    publisher.stored(b"k" * 16, 1, small_header(b"k" * 16))
    publisher.start()
    try:
        time.sleep(0.2)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(publisher.replay_endpoint)
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        assert sock.poll(5000)
        empty, topic, seq, payload = sock.recv_multipart()
        assert (empty, topic, seq) == (b"", b"kv@pod@model", (0).to_bytes(8, "big"))
        stored = decode_batch(payload).events[1]
        assert (stored.medium, stored.ownership, stored.locality) == ("STORAGE", None, "REMOTE")
        assert sock.poll(5000) and sock.recv_multipart() == [b"", b"", END_SEQ, b""]
        sock.close()
    finally:
        publisher.close()


def test_tenants_get_no_events(daemon_factory, short_tmp):
    tenants = short_tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntoken = "token-a-0123456789"\n')
    ends = endpoints()
    d = daemon_factory(tenants_file=str(tenants), **ends)
    keys, payloads = make_blocks(2, seed=31)
    with KVStoreClient(d.address, token="token-a-0123456789") as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    assert "KV events are not published" in d.log.read_text()
    with pytest.raises(TimeoutError):
        replay(ends["events_replay"], 0, timeout_s=0.5)  # nothing listens there


def test_event_settings_are_checked(daemon_factory):
    with pytest.raises(ValueError, match="events_listen must be"):
        load_config(overrides={"events_listen": "127.0.0.1:5557"}, environ={})
    with pytest.raises(ValueError, match="events_replay needs events_listen"):
        load_config(overrides={"events_replay": "tcp://127.0.0.1:5558"}, environ={})
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match="cannot publish KV events on"):
            daemon_factory(events_listen=f"tcp://127.0.0.1:{port}")
    finally:
        taken.close()


def test_a_replay_from_before_the_kept_batches_starts_with_a_snapshot_of_what_is_held():
    """With 3 batches kept of 12, a replay from seq 0 rebuilds the state exactly: a snapshot (what
    is held now, each block after its parent) in the seqs before the oldest kept, then those."""
    publisher = EventPublisher(f"tcp://127.0.0.1:{free_port()}", [("cpu", False), ("disk", False)],
                               replay_endpoint=f"tcp://127.0.0.1:{free_port()}", replay_batches=3)
    publisher.start()
    try:
        tokens = np.random.default_rng(5).integers(0, 50000, size=64 * 6).tolist()
        keys = prefix_keys(SMALL_NS, tokens)
        headers = [small_header(k, parent=keys[i - 1] if i else b"", token_ids=tokens[i * 64 : (i + 1) * 64])
                   for i, k in enumerate(keys)]
        expected: dict[int, set[str]] = {}
        steps = [("stored", i, 0) for i in reversed(range(6))]  # children before parents
        steps += [("stored", i, 1) for i in range(3)] + [("removed", 5, 0), ("removed", 0, 1)]
        for n, (kind, i, level) in enumerate(steps, start=2):
            if kind == "stored":
                publisher.stored(keys[i], level, headers[i])
                expected.setdefault(block_hash(keys[i]), set()).add(("cpu", "disk")[level])
            else:
                publisher.removed(keys[i], level)
                expected[block_hash(keys[i])].discard(("cpu", "disk")[level])
            deadline = time.monotonic() + 5
            while publisher.published < n and time.monotonic() < deadline:  # one batch each
                time.sleep(0.01)
        expected = {k: v for k, v in expected.items() if v}
        state, seqs = replayed_state(publisher.replay_endpoint)
        assert state == expected
        # contiguous, a snapshot first (under load two steps may share a batch, and an idle heartbeat
        # batch may follow the last: neither changes the state)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] > 0
        snapshot = decode_batch(publisher.snapshot(1)[0]).events
        assert isinstance(snapshot[0], AllBlocksCleared)
        order = {(TIER_OF[e.medium, e.locality], e.block_hashes[-1]): i for i, e in enumerate(snapshot[1:])}
        chunk_of = {block_hash(k): i for i, k in enumerate(keys)}
        for i, event in enumerate(snapshot[1:]):  # a parent held in the same tier comes first
            parent = (TIER_OF[event.medium, event.locality], event.parent_block_hash)
            assert order.get(parent, -1) < i
            c = chunk_of[event.block_hashes[0]]
            assert event.token_ids == tokens[c * 64 : (c + 1) * 64]
    finally:
        publisher.close()


def test_sub_blocks_chain_and_a_block_shorter_than_one_is_neither_stored_nor_removed():
    """With events_block_size 16: a 64-token block is 4 published blocks of 16 tokens whose ids
    chain (the last is the block's own id, the next block's parent); a 10-token block is not
    announced, and its removal announces nothing either (nor stops the publisher)."""
    publisher = EventPublisher(f"tcp://127.0.0.1:{free_port()}", [("cpu", False)],
                               replay_endpoint=f"tcp://127.0.0.1:{free_port()}", block_size=16)
    publisher.start()
    try:
        tokens = np.random.default_rng(9).integers(0, 50000, size=128).tolist()
        keys = prefix_keys(SMALL_NS, tokens)
        short = b"s" * 16
        publisher.stored(keys[0], 0, small_header(keys[0], token_ids=tokens[:64]))
        publisher.stored(keys[1], 0, small_header(keys[1], parent=keys[0], token_ids=tokens[64:]))
        publisher.stored(short, 0, small_header(short, tokens=10, token_ids=tokens[:10]))
        publisher.removed(short, 0)
        publisher.removed(keys[1], 0)
        deadline = time.monotonic() + 5
        while publisher.published < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        events = [e for _, batch in replay(publisher.replay_endpoint, 0) for e in batch.events]
        first, second, removed = events[1:]
        assert first.block_hashes == sub_block_hashes(keys[0], 4) and first.block_hashes[-1] == block_hash(keys[0])
        assert first.parent_block_hash is None and first.token_ids == tokens[:64] and first.block_size == 16
        assert second.parent_block_hash == block_hash(keys[0]) and second.token_ids == tokens[64:]
        assert len(set(first.block_hashes + second.block_hashes)) == 8
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == second.block_hashes
    finally:
        publisher.close()
