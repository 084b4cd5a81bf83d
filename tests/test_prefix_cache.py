"""The engines' one guarded load/store path (engine_adapter/client/prefix_cache.py), against a real daemon:
an outage costs misses and is said once when it starts and once when it ends; a connecting cache
steps aside for ``retry_s``; the store thread keeps order and its queue bound."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.client.prefix_cache import PrefixCache
from kvstore.keys import KVLayout, Namespace, prefix_keys

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16")
N = 16


def blocks(count: int, seed: int = 0) -> tuple[Namespace, list[tuple[bytes, int, torch.Tensor]]]:
    namespace = Namespace("prefix-cache-test", LAYOUT, chunk_tokens=N)
    rng = np.random.default_rng(seed)
    keys = prefix_keys(namespace, rng.integers(0, 1000, size=count * N))
    payloads = [torch.from_numpy(rng.standard_normal(LAYOUT.block_shape(N)).astype(np.float16)) for _ in keys]
    return namespace, [(key, N, payload) for key, payload in zip(keys, payloads)]


def test_an_outage_is_said_once_costs_misses_and_ends_when_the_daemon_is_back(daemon_factory, caplog):
    daemon = daemon_factory(disk_fsync="true")
    namespace, items = blocks(3)
    connects = []

    def connect() -> KVStoreClient:
        connects.append(time.monotonic())
        return KVStoreClient(daemon.address, timeout=2)

    cache = PrefixCache(None, namespace, connect=connect, retry_s=0.5, address=daemon.address)
    caplog.set_level(logging.DEBUG, logger="engine_adapter.client.prefix_cache")
    assert cache.put(items, durable=True) and cache.lookup([k for k, _, _ in items]).hits == 3
    daemon.stop(signal_kill=True)
    assert not cache.put(items[:1])  # the daemon died: counted (Lookups may still read its key index)
    for _ in range(5):  # within retry_s: no call, no new connection, no new line
        assert cache.lookup([items[0][0]]) is None and not cache.put(items[:1])
    assert cache.errors == 1 and cache.outages == 1 and len(connects) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "put failed" in warnings[0] and daemon.address in warnings[0]
    daemon.start()  # the disk tier kept the blocks (durable)
    deadline = time.monotonic() + 10
    while cache.lookup([items[0][0]]) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cache.lookup([k for k, _, _ in items]).hits == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "is back" in warnings[1]
    assert cache.outages == 1 and len(connects) >= 2
    cache.close()


def test_stores_run_in_order_within_the_queue_bound(daemon):
    namespace, items = blocks(7, seed=1)
    with KVStoreClient(daemon.address) as client:
        cache = PrefixCache(client, namespace, max_queued=5)
        gate = threading.Event()
        made: list[int] = []

        def block(i: int):
            gate.wait(30)  # hold the store thread so the queue fills
            made.append(i)
            return items[i]

        stored: list[int] = []
        done_a, done_b = threading.Event(), threading.Event()
        assert cache.store_blocks_async(4, block, done_a, stored=stored.append) == 4
        assert cache.store_room() == 1
        assert cache.store_blocks_async(3, lambda i: (made.append(4 + i), items[4 + i])[1], done_b,
                                        stored=stored.append) == 1  # only the room is queued
        assert cache.store_room() == 0
        gate.set()
        assert done_a.wait(30) and done_b.wait(30)
        assert made == [0, 1, 2, 3, 4] and stored == [4, 1] and cache.store_room() == 5
        assert client.lookup([k for k, _, _ in items]).hits == 5  # the first five, in order
        assert cache.errors == 0
        cache.close()


def test_a_store_queue_behind_takes_nothing_and_skips_are_counted_by_the_daemon(daemon_factory):
    """"No cost when nothing repeats": once the oldest store has waited ``max_lag_s`` (the daemon or
    the copies slower than the requests) there is no room, so the connector skips its saves instead
    of queueing them; skips are counted here and, on the client's next call, by the daemon."""
    import urllib.request

    from tests.conftest import free_port

    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    namespace, items = blocks(3, seed=5)
    with KVStoreClient(d.address) as client:
        cache = PrefixCache(client, namespace, max_queued=8, max_lag_s=0.01)
        assert cache.available() and cache.store_room() == 8
        gate, done = threading.Event(), threading.Event()
        assert cache.store_blocks_async(1, lambda i: (gate.wait(30), items[0])[1], done) == 1
        time.sleep(0.05)  # the store has now waited past max_lag_s
        assert cache.store_room() == 0
        cache.skip(2)
        gate.set()
        assert done.wait(30) and cache.store_room() == 8  # caught up: room again
        assert cache.skipped == 2
        client.lookup([items[0][0]])  # any call carries the count
        assert client.stats() is not None
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvstore_client_stores_skipped_total 2.0" in text
        cache.close()
    down = PrefixCache(None, namespace, connect=lambda: (_ for _ in ()).throw(ConnectionError("down")), retry_s=60)
    assert down.available()  # may try: the store thread connects, never the caller
    assert down.client() is None and not down.available()  # within retry_s of the failure


def test_a_failed_store_ends_its_job_and_says_how_many_the_daemon_took(daemon):
    namespace, items = blocks(6, seed=2)
    client = KVStoreClient(daemon.address, timeout=2)
    cache = PrefixCache(client, namespace)
    bad = (items[5][0], N, items[5][2][:1])  # one layer short: refused by the daemon
    stored: list[int] = []
    done = threading.Event()
    cache.store_blocks_async(6, lambda i: items[i] if i != 4 else bad, done, stored=stored.append)
    assert done.wait(30)
    assert stored == [4] and cache.errors == 1  # the first Put of four, then the failing one
    assert client.lookup([k for k, _, _ in items]).hits == 4
    client.close()


def test_coded_blocks_are_decoded_ahead_in_order_and_waited_for_on_close():
    """A Get's coded blocks decode on the pool; the caller gets them in order, equal to a decode
    in place; closing early waits for the running decodes (they read the Get's arena)."""
    import dataclasses

    import pytest

    from compression import get_codec
    from engine_adapter.client.blocks import FetchedBlock
    from engine_adapter.client.prefix_cache import decoded_ahead, fetched_tensor

    _, items = blocks(6, seed=3)
    codec = get_codec("int4-g32+shuffle+zstd")
    fetched: list[FetchedBlock | None] = []
    for i, (key, tokens, payload) in enumerate(items):
        if i == 2:
            fetched.append(FetchedBlock(key, LAYOUT, tokens, "raw", {}, "cpu", memoryview(payload.numpy().tobytes())))
        else:
            encoded = codec.encode(payload)
            fetched.append(FetchedBlock(key, LAYOUT, tokens, encoded.codec, encoded.params, "disk",
                                        memoryview(encoded.payload)))
    fetched.append(None)  # a miss stays a miss
    got = list(decoded_ahead(fetched))
    assert got[-1] is None and got[2] is fetched[2]
    for before, after in zip(fetched[:-1], got[:-1]):
        assert after.key == before.key and torch.equal(fetched_tensor(after), fetched_tensor(before))
    assert all(b.decoded is not None for i, b in enumerate(got[:-1]) if i != 2)
    ahead = decoded_ahead(fetched, window=1)  # at most two decodes ahead of the caller
    assert next(ahead).decoded is not None
    ahead.close()  # cancels what has not started, waits for what runs

    # a block whose decode fails comes as it was: the caller meets the error where it did before
    broken = dataclasses.replace(fetched[1], payload=memoryview(b"\x00" * 10))
    got = list(decoded_ahead([fetched[0], broken, fetched[3]]))
    assert got[1] is broken and got[1].decoded is None and got[2].decoded is not None
    with pytest.raises(Exception):
        fetched_tensor(got[1])


def test_loads_and_stores_with_two_calls_in_flight_keep_every_byte_and_never_deadlock(daemon):
    """`KVStoreClient.fetch_ahead` and the pipelined Put (two Gets or Puts in flight) with four
    threads sharing an arena that holds about two calls' worth: every block comes back whole and in
    order, and no thread waits for space another waiting thread holds."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16")
    n = 64
    namespace = Namespace("pipelined", layout, chunk_tokens=n)
    slot = layout.block_bytes(n)  # 32 KiB blocks; the arena holds about 12 of them
    rng = np.random.default_rng(7)
    with KVStoreClient(daemon.address, arena_bytes=400 * 1024) as client:
        cache = PrefixCache(client, namespace)
        runs = []
        for t in range(4):
            keys = prefix_keys(namespace, rng.integers(0, 5000, size=11 * n))
            runs.append([(k, n, rng.integers(1, 255, slot, dtype=np.uint8)) for k in keys])
        errors: list[BaseException] = []

        def work(run) -> None:
            try:
                for _ in range(3):
                    assert client.put(namespace, run) == len(run)
                    got: list[bytes] = []
                    cache.fetch_blocks([k for k, _, _ in run], slot,
                                       lambda i, b: got.append(bytes(b.payload)) or True)
                    assert got == [p.tobytes() for _, _, p in run]
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(run,)) for run in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads), "a thread is stuck waiting for arena space"
        assert not errors, errors[0]
        assert cache.errors == 0
        # every batch was taken in order, with the view of a batch released before it is reused
        seen = []
        for first, batch in client.fetch_ahead([k for k, _, _ in runs[0]], slot, batch=3):
            seen.append((first, [bytes(b.payload) for b in batch]))
        assert [f for f, _ in seen] == [0, 3, 6, 9]
        assert [p for _, ps in seen for p in ps] == [p.tobytes() for _, _, p in runs[0]]
