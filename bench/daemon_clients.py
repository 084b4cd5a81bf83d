"""The daemon benchmark's blocks and its clients: what one client of `bench/daemon_throughput.py` does.

Client id ``i`` has its own namespace, keys and payloads (seeded by ``i``): a new id Puts new
blocks, each one 256-token SmolLM2-135M chunk (`BLOCK`, 5.9 MB). The multi-client cases run each
client in a worker process (`run_clients`, `lookup_latencies`), lined up on a barrier so that no
timing starts before every client is set up. `bench/ab_pairs.py` copies this file with the
benchmark into older revisions: it uses no helper they may lack.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

try:
    from engine_adapter.client.kvstore_client import KVStoreClient
except ImportError:  # a revision before engine_adapter/client/ (bench/ab_pairs.py runs this file there too)
    from engine_adapter.client import KVStoreClient
from kvstore.keys import KVLayout, Namespace, prefix_keys

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")
CHUNK = 256
BLOCK = LAYOUT.block_bytes(CHUNK)
LOOKUP_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")  # 8 KiB blocks


def namespace(client_id: int) -> Namespace:
    return Namespace(f"bench-{client_id}", LAYOUT, chunk_tokens=CHUNK)


def keys_for(client_id: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(client_id)
    return prefix_keys(namespace(client_id), rng.integers(0, 49152, size=n * CHUNK))


def blocks_for(client_id: int, n: int) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(10_000 + client_id)
    payloads = [rng.standard_normal(BLOCK // 2).astype(np.float16) for _ in range(n)]
    return keys_for(client_id, n), payloads


def wait_until(ready) -> None:
    """Line up the clients of one run: every client's set-up (payloads, connection, arena) ends
    before any timing starts. ``ready`` is a barrier shared by the run's clients (None: one client)."""
    if ready is not None:
        ready.wait(timeout=900)


# -- one client's work (runs in a worker process for the multi-client cases) -----------------------


def client_put(args) -> tuple[float, int]:
    address, client_id, n, shm, batch, ready = args
    keys, payloads = blocks_for(client_id, n)
    ns = namespace(client_id)
    with KVStoreClient(address, shared_memory=shm, arena_bytes=(batch + 2) * (BLOCK + 8192) * 2) as client:
        wait_until(ready)
        start = time.perf_counter()
        for i in range(0, n, batch):
            client.put(ns, [(k, CHUNK, p) for k, p in zip(keys[i:i + batch], payloads[i:i + batch])])
        return time.perf_counter() - start, n * BLOCK


def client_put_rows(args) -> tuple[float, int]:
    """Puts of ``n`` blocks from a KV cache in shared memory (engine_adapter/client/shared_kv.py), as the
    reference engine stores a prompt's chunks: the daemon copies each block's rows out of the cache
    (``batch`` chunks of it, rows capacity * head_dim apart), one copy in all. Revisions without
    Puts in rows raise ImportError (the benchmark then skips the row)."""
    import torch

    try:
        from engine_adapter.client.blocks import BlockToPut
        from engine_adapter.client.shared_kv import SharedKVMemory, block_to_store
        from engine_adapter.reference.kv_cache import KVCache

        def put_rows(client, ns, blocks):
            return client.put_rows(ns, blocks)
    except ImportError:  # a revision before engine_adapter/client/ (bench/ab_pairs.py)
        from engine_adapter.kv_cache import KVCache
        from engine_adapter.shared_kv import SharedKVMemory, block_to_store, put_rows

        def BlockToPut(key, tokens, payload):  # noqa: N802 - that revision's tuple
            return key, tokens, payload

    address, client_id, n, batch, ready = args
    keys = keys_for(client_id, n)
    ns = namespace(client_id)
    with KVStoreClient(address, shared_memory=True, arena_bytes=(batch + 2) * (BLOCK + 8192) * 2) as client:
        memory = SharedKVMemory(client)
        kv = KVCache(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, batch * CHUNK, torch.float16, "cpu",
                     memory)
        rng = np.random.default_rng(10_000 + client_id)
        # numpy, not a torch op: one client runs in the benchmark's own process, which then forks the
        # others, and a fork after torch's OpenMP pool has run leaves the children hung in it
        kv.data.numpy()[:] = rng.standard_normal(tuple(kv.data.shape), dtype=np.float32).astype(np.float16)
        kv.length = batch * CHUNK
        blocks = [block_to_store(kv, c * CHUNK, CHUNK) for c in range(batch)]
        if any(isinstance(b, torch.Tensor) for b in blocks):
            raise RuntimeError("the daemon gave no shared memory for the KV cache")
        wait_until(ready)
        start = time.perf_counter()
        for i in range(0, n, batch):
            put_rows(client, ns, [BlockToPut(k, CHUNK, b) for k, b in zip(keys[i:i + batch], blocks)])
        took = time.perf_counter() - start
        del blocks, kv
        memory.close()
        return took, n * BLOCK


def client_get(args) -> tuple[float, int]:
    """``passes`` timed Gets of the client's ``n`` blocks, after one untimed pass (connection,
    first calls), so that with few blocks per client the run is not one call per client."""
    address, client_id, n, shm, batch, ready, passes = args
    keys = keys_for(client_id, n)

    def one_pass() -> int:
        got = 0
        for i in range(0, n, batch):
            with client.fetch(keys[i:i + batch], BLOCK) as fetched:
                got += sum(len(b.payload) for b in fetched if b is not None)
        if got != n * BLOCK:
            raise RuntimeError(f"client {client_id}: got {got} of {n * BLOCK} bytes (blocks missing)")
        return got

    with KVStoreClient(address, shared_memory=shm, arena_bytes=(batch + 2) * (BLOCK + 8192) * 2) as client:
        one_pass()
        wait_until(ready)
        start = time.perf_counter()
        got = sum(one_pass() for _ in range(passes))
        return time.perf_counter() - start, got


def client_lookups(args) -> tuple[list[float], int]:
    """``calls`` Lookups of ``n`` keys; ``interval`` > 0 paces them (an engine's request rate).
    ``local``: a same-host client answering from the daemon's shared key index; else every Lookup
    is an RPC."""
    address, client_id, n, calls, interval, ready, local = args
    # Lookup cost does not depend on block size: the keys are stored with tiny blocks first.
    ns = Namespace(f"bench-lookup-{client_id}", LOOKUP_LAYOUT, chunk_tokens=CHUNK)
    keys = prefix_keys(ns, np.random.default_rng(client_id).integers(0, 49152, size=n * CHUNK))
    tiny = np.random.default_rng(client_id).standard_normal(LOOKUP_LAYOUT.block_bytes(CHUNK) // 2).astype(np.float16)
    latencies = []
    with KVStoreClient(address, shared_memory=local, arena_bytes=2**20, local_lookup=local) as client:
        client.put(ns, [(k, CHUNK, tiny) for k in keys])
        if client.lookup(keys).hits != n:
            raise RuntimeError(f"client {client_id}: its {n} keys are not all stored")
        wait_until(ready)
        next_call = time.perf_counter()
        for _ in range(calls):
            start = time.perf_counter()
            client.lookup(keys)
            latencies.append(time.perf_counter() - start)
            next_call += interval
            pause = next_call - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        fallbacks = client.rpc_lookups if local else 0
    return latencies, fallbacks


def lookups_during_puts(address: str, calls: int, interval: float, put_blocks: int, batch: int) -> dict[str, dict]:
    """One client's paced gRPC Lookups alone, then while another client Puts ``put_blocks`` blocks
    in rows (``batch`` a call) back to back: what a large Put costs the daemon's other callers. The
    Puts start with the Lookups (a barrier) and last longer than them."""
    out = {"grpc paced, 1 client": lookup_latencies(address, 1, calls, interval, False)}
    with multiprocessing.Manager() as manager, ProcessPoolExecutor(2) as pool:
        ready = manager.Barrier(2)
        puts = pool.submit(client_put_rows, (address, 900, put_blocks, batch, ready))
        looks = pool.submit(client_lookups, (address, 1900, 32, calls, interval, ready, False))
        latencies, _ = looks.result()
        took, nbytes = puts.result()
    lat_ms = sorted(x * 1e3 for x in latencies)
    out["grpc paced, 1 client, during puts"] = {
        "calls": len(lat_ms), "interval_ms": interval * 1e3, "rpc_fallbacks": 0, "clients": 1,
        "p50": statistics.median(lat_ms), "p99": lat_ms[int(len(lat_ms) * 0.99) - 1],
        "put_gbps": nbytes / took / 1e9}
    out["grpc paced, 1 client"]["clients"] = 1
    return out


def run_clients(fn, clients: int, make_args) -> float:
    """Aggregate GB/s of ``clients`` processes running ``fn`` together, timed by the slowest."""
    if clients == 1:
        elapsed, nbytes = fn(make_args(0, None))
        return nbytes / elapsed / 1e9
    with multiprocessing.Manager() as manager, ProcessPoolExecutor(clients) as pool:
        ready = manager.Barrier(clients)
        results = list(pool.map(fn, [make_args(i, ready) for i in range(clients)]))
    return sum(b for _, b in results) / max(e for e, _ in results) / 1e9


def lookup_latencies(address: str, clients: int, calls: int, interval: float, local: bool) -> dict:
    with multiprocessing.Manager() as manager, ProcessPoolExecutor(clients) as pool:
        ready = manager.Barrier(clients)
        results = list(pool.map(client_lookups, [(address, 1000 + i, 32, calls, interval, ready, local)
                                                 for i in range(clients)]))
    lat = [x for latencies, _ in results for x in latencies]
    fallbacks = sum(f for _, f in results)
    lat_ms = sorted(x * 1e3 for x in lat)
    return {"calls": len(lat_ms), "interval_ms": interval * 1e3, "rpc_fallbacks": fallbacks, "clients": clients,
            "p50": statistics.median(lat_ms),
            "p99": lat_ms[int(len(lat_ms) * 0.99) - 1]}
