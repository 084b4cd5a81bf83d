"""Gets in rows (kvstore/scatter.py): a block's payload straight into a KV cache in shared memory.

Against references: numpy's own strided copy for `Scatter`, and `KVCache.load` of the same blocks
for the daemon's copy, with a real daemon process (CPU tier, disk tier, a coded block). Hostile
rows from a client of the daemon are refused before any copy (docs/guarantees.md: Limits).
"""

from __future__ import annotations

import gc

import grpc
import numpy as np
import pytest
import torch

from compression import get_codec
from engine_adapter.client import KVStoreClient
from engine_adapter.kv_cache import KVCache
from engine_adapter.prefix_cache import PrefixCache
from engine_adapter.shared_kv import (
    Rows,
    SharedKVMemory,
    SharedRegion,
    get_rows,
    region_of,
)
from kvstore.keys import KVLayout, Namespace, prefix_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.scatter import MIN_ROW_BYTES, Scatter, Unfit

LAYOUT = KVLayout(num_layers=5, num_kv_heads=3, head_dim=48, dtype="float32")
NS = Namespace("scatter-test", LAYOUT, chunk_tokens=24)
N = NS.chunk_tokens


def _context(chunks: int, seed: int) -> tuple[list[bytes], KVCache]:
    """Keys of ``chunks`` chunks and a KV cache holding random (never zero) KV for them."""
    rng = np.random.default_rng(seed)
    keys = prefix_keys(NS, rng.integers(0, 50000, size=chunks * N).tolist())
    kv = KVCache(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, chunks * N, torch.float32, "cpu")
    kv.write_layers(0, torch.from_numpy(rng.standard_normal((5, 3, chunks * N, 48)).astype(np.float32)),
                    torch.from_numpy(rng.standard_normal((5, 3, chunks * N, 48)).astype(np.float32)))
    kv.length = chunks * N
    return keys, kv


def _put(client: KVStoreClient, keys: list[bytes], kv: KVCache) -> None:
    client.put(NS, [(keys[c], N, kv.export(c * N, (c + 1) * N)) for c in range(len(keys))])


# -- Scatter against numpy ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_a_scatter_copies_rows_as_a_strided_reference_does(seed):
    rng = np.random.default_rng(seed)
    row_bytes = int(rng.integers(MIN_ROW_BYTES, 700))
    stride = row_bytes + int(rng.integers(0, 300))
    rows = int(rng.integers(2, 40))
    size = (rows - 1) * stride + row_bytes + int(rng.integers(0, 100))
    dest = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    before = np.frombuffer(bytes(dest), dtype=np.uint8).copy()
    payload = rng.integers(0, 256, rows * row_bytes, dtype=np.uint8)
    Scatter(memoryview(dest), row_bytes, stride).fill(payload.tobytes())
    expected = before.copy()
    for i in range(rows):
        expected[i * stride : i * stride + row_bytes] = payload[i * row_bytes : (i + 1) * row_bytes]
    assert np.array_equal(np.frombuffer(dest, dtype=np.uint8), expected)  # rows in place, gaps untouched


def test_a_scatter_refuses_rows_that_overlap_leave_the_destination_or_are_tiny():
    dest = memoryview(bytearray(4096))
    for row_bytes, stride in ((MIN_ROW_BYTES - 1, 128), (0, 0), (256, 255), (256, 4097), (256, 2**64 - 1)):
        with pytest.raises(ValueError):
            Scatter(dest, row_bytes, stride)
    scatter = Scatter(dest, 256, 1024)
    assert scatter.rows(4 * 256) == 4 and scatter.fits(256)
    assert not scatter.fits(5 * 256)      # the fifth row would start past the destination
    assert not scatter.fits(3 * 256 + 1)  # not whole rows
    assert not scatter.fits(0)
    with pytest.raises(Unfit):
        scatter.fill(np.arange(5 * 256, dtype=np.uint32).astype(np.uint8).tobytes())
    assert bytes(dest) == bytes(4096)  # nothing copied


# -- the daemon's copy --------------------------------------------------------------------------


def _reference(keys: list[bytes], kv: KVCache, capacity: int) -> KVCache:
    ref = KVCache(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, capacity, torch.float32, "cpu")
    for c in range(len(keys)):
        ref.load(kv.export(c * N, (c + 1) * N), c * N)
    return ref


@pytest.mark.parametrize("tiers", ["cpu", "disk"])
def test_a_get_in_rows_fills_a_shared_kv_cache_as_a_load_does(daemon_factory, short_tmp, tiers):
    settings = {"cpu_capacity": 0, "disk_path": short_tmp / "blocks"} if tiers == "disk" else {}
    d = daemon_factory(**settings)
    keys, source = _context(5, seed=1)
    with KVStoreClient(d.address) as client:
        _put(client, keys, source)
        cache = PrefixCache(client, NS)
        capacity = 5 * N + 7  # rows of one block are capacity * head_dim apart, not tokens * head_dim
        kv = KVCache(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, capacity, torch.float32, "cpu",
                     SharedKVMemory(client))
        region = region_of(kv.data)
        assert region is not None
        kv.data.fill_(7.0)
        tiers_seen: list[str] = []
        assert cache.load_rows(keys, kv, region, tiers_seen) == 5 and kv.length == 5 * N
        assert tiers_seen == [tiers] * 5
        assert torch.equal(kv.data[:, :, :, : 5 * N], _reference(keys, source, capacity).data[:, :, :, : 5 * N])
        assert bool((kv.data[:, :, :, 5 * N :] == 7.0).all())  # past the blocks: untouched
        assert cache.errors == 0
        # A run with a gap stops there: the chunks after the gap are not counted as loaded.
        other, _ = _context(2, seed=2)
        kv.truncate(0)
        assert cache.load_rows([keys[0], other[1], keys[2]], kv, region, []) == 1 and kv.length == N
        del kv, region
        gc.collect()


def test_a_coded_block_is_not_copied_in_rows_and_loads_the_usual_way(daemon):
    keys, source = _context(4, seed=3)
    with KVStoreClient(daemon.address) as client:
        _put(client, keys[:2], source)
        for c in (2, 3):
            encoded = get_codec("int8").encode(source.export(c * N, (c + 1) * N))
            client.put(NS, [(keys[c], N, encoded.payload)], codec=encoded.codec, codec_params=encoded.params)
        cache = PrefixCache(client, NS)
        kv = KVCache(5, 3, 48, 4 * N, torch.float32, "cpu", SharedKVMemory(client))
        region = region_of(kv.data)
        places = [Rows(region.offset_of(kv.data) + o, rb, s, r) for o, rb, s, r in
                  (kv.block_rows(c * N, N) for c in range(4))]
        kv.data.fill_(-3.0)
        found = get_rows(client, region, keys, places)
        assert [in_place for _, in_place in found] == [True, True, False, False]
        assert [b.codec for b, _ in found] == ["raw", "raw", "int8", "int8"]
        assert bool((kv.data[:, :, :, 2 * N :] == -3.0).all())  # the coded blocks' rows: nothing copied
        plain = KVCache(5, 3, 48, 4 * N, torch.float32, "cpu")
        assert cache.load_run(keys, lambda c, b: plain.load(b, c * N), []) == 4
        kv.truncate(0)
        assert cache.load_rows(keys, kv, region, []) == 4 and kv.length == 4 * N
        assert torch.equal(kv.data, plain.data)  # the same bytes as a load through the staging arena
        assert not torch.equal(kv.data[:, :, :, 2 * N :], source.data[:, :, :, 2 * N :])  # int8: lossy, decoded
        del kv, region
        gc.collect()


def test_without_shared_memory_a_cache_is_plain_memory_and_loads_as_before(daemon):
    keys, source = _context(2, seed=4)
    with KVStoreClient(daemon.address, shared_memory=False) as client:
        assert SharedRegion.request(client, 1 << 20) is None
        _put(client, keys, source)
        kv = KVCache(5, 3, 48, 2 * N, torch.float32, "cpu", SharedKVMemory(client))
        assert region_of(kv.data) is None
        assert PrefixCache(client, NS).load_run(keys, lambda c, b: kv.load(b, c * N), []) == 2
        assert torch.equal(kv.data, source.data)


def test_a_freed_cache_lends_its_shared_memory_to_the_next_and_extra_regions_are_released(daemon):
    def daemon_arenas() -> int:
        with open(f"/proc/{daemon.proc.pid}/maps") as maps:
            return sum("memfd:kvstore-arena" in line for line in maps)

    with KVStoreClient(daemon.address) as client:
        memory = SharedKVMemory(client, keep=1)
        before = daemon_arenas()
        kv = KVCache(5, 3, 48, N, torch.float32, "cpu", memory)
        first = region_of(kv.data).arena_id
        kv.data.normal_()
        kept = kv.data.clone()
        kv.length = N
        kv.reserve(3 * N)  # grows into a new region, the valid tokens copied over
        assert region_of(kv.data).arena_id != first and torch.equal(kv.data[:, :, :, :N], kept)
        small = KVCache(5, 3, 48, N, torch.float32, "cpu", memory)
        assert region_of(small.data).arena_id == first  # the idle region, no new arena
        view = small.keys[0]
        del small
        gc.collect()
        other = KVCache(5, 3, 48, N, torch.float32, "cpu", memory)
        assert region_of(other.data).arena_id != first  # a view of the last cache still uses it
        assert daemon_arenas() == before + 3
        del view, other
        gc.collect()
        last = KVCache(5, 3, 48, N, torch.float32, "cpu", memory)  # reuses one; keep=1 releases the other
        assert daemon_arenas() == before + 2
        del kv, last
        gc.collect()
        memory.close()
        assert daemon_arenas() == before


# -- hostile rows ---------------------------------------------------------------------------------


def test_hostile_rows_are_refused_before_any_copy(daemon):
    """guarantees: Limits — a Get in rows copies only whole rows inside the caller's own slice."""
    keys, source = _context(1, seed=6)
    with KVStoreClient(daemon.address) as client:
        _put(client, keys, source)
        region = SharedRegion.request(client, 1 << 20)
        array = np.frombuffer(memoryview(region.tensor((1 << 20,), torch.uint8).numpy()), dtype=np.uint8)
        array[:] = 0xA5
        row_bytes = N * 48 * 4
        rows = 5 * 2 * 3

        def get(row_bytes, row_stride, offset=0, length=1 << 20, dest=True, method=None):
            item = pb.GetItem(key=keys[0], row_bytes=row_bytes, row_stride=row_stride)
            if dest:
                item.dest.CopyFrom(pb.ArenaSlice(arena_id=region.arena_id, offset=offset, length=length))
            call = method or client._stub.Get
            try:
                reply = call(pb.GetRequest(items=[item]))
                return grpc.StatusCode.OK, list(reply) if method is not None else reply
            except grpc.RpcError as exc:
                return exc.code(), exc.details()

        refused = [
            get(1, 1),                                  # a million one-byte copies
            get(row_bytes, row_bytes - 1),              # overlapping rows
            get(row_bytes, (1 << 20) + 1),              # rows past the slice
            get(row_bytes, 2**64 - 1),                  # a stride no pointer can take
            get(row_bytes, row_bytes, dest=False),      # rows, but nowhere to put them
            get(row_bytes, row_bytes, offset=(1 << 20) - 10, length=4096),  # a slice past the arena
            get(row_bytes, row_bytes, method=client._stub.GetLayers),       # layer-wise copies: plain slices only
        ]
        assert [code for code, _ in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * len(refused), refused
        assert "row_bytes" in refused[0][1] and "row_stride" in refused[1][1]
        # Rows that do not all fit the slice: found, nothing copied.
        code, reply = get(row_bytes, row_bytes + 64, length=(rows - 1) * (row_bytes + 64))
        assert code == grpc.StatusCode.OK and reply.results[0].found
        assert reply.results[0].meta.payload_len == rows * row_bytes
        assert bool((array == 0xA5).all())
        # Whole rows: copied, and only into them.
        stride = row_bytes + 128
        code, reply = get(row_bytes, stride, offset=4096, length=(rows - 1) * stride + row_bytes)
        assert code == grpc.StatusCode.OK and reply.results[0].found
        placed = np.lib.stride_tricks.as_strided(array[4096:], shape=(rows, row_bytes), strides=(stride, 1))
        assert np.array_equal(placed.reshape(-1), source.export(0, N).numpy().view(np.uint8).reshape(-1))
        assert bool((array[:4096] == 0xA5).all())
        assert bool((array[4096 + (rows - 1) * stride + row_bytes :] == 0xA5).all())
        del array
        region.close()


def test_regions_a_restarted_daemon_no_longer_holds_are_not_reused(daemon):
    with KVStoreClient(daemon.address) as client:
        memory = SharedKVMemory(client)
        kv = KVCache(5, 3, 48, N, torch.float32, "cpu", memory)
        old = region_of(kv.data)
        assert old.alive
        old_id = old.arena_id
        del kv, old
        gc.collect()  # idle in the pool now
        daemon.stop()
        daemon.start()
        kv = KVCache(5, 3, 48, N, torch.float32, "cpu", memory)  # the same size: the idle region would fit
        new = region_of(kv.data)
        assert new is not None and new.alive and new.arena_id != old_id
        keys, source = _context(1, seed=7)
        with KVStoreClient(daemon.address) as fresh:
            _put(fresh, keys, source)
            assert PrefixCache(fresh, NS).load_rows(keys, kv, new, []) == 1
        assert torch.equal(kv.data, source.data)
        del kv, new
        gc.collect()
        memory.close()
