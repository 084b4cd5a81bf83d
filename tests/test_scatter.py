"""Gets and Puts in rows (kvstore/scatter.py): a block's payload straight into, and out of, a KV
cache in shared memory.

Against references: numpy's own strided copy for `Scatter`, and `KVCache.load` of the same blocks
for the daemon's copy, with a real daemon process (CPU tier, disk tier, a coded block). Hostile
rows from a client of the daemon are refused before any copy (docs/guarantees.md: Limits). A Put
in rows is checked against the same blocks put the usual way (`KVCache.export`).
"""

from __future__ import annotations

import gc

import grpc
import numpy as np
import pytest
import torch

from compression import get_codec
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.reference.kv_cache import KVCache
from engine_adapter.client.prefix_cache import PrefixCache
from engine_adapter.client.shared_kv import (
    RowsInRegion, SharedKVMemory, SharedRegion, block_to_store, region_of, rows_in)
from kvstore.block import CHECKSUM_STEP, payload_checksum
from kvstore.keys import KVLayout, Namespace, prefix_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.scatter import MIN_ROW_BYTES, Gather, Scatter, Unfit
from kvstore.wire import layout_message

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


@pytest.fixture(params=["cpu", "disk"])
def top_tier(request, daemon_factory, short_tmp):
    """A daemon whose top tier is the CPU tier, or the disk (no CPU tier), and that tier's name."""
    settings = {"cpu_capacity": 0, "disk_path": short_tmp / "blocks"} if request.param == "disk" else {}
    return daemon_factory(**settings), request.param


def test_a_get_in_rows_fills_a_shared_kv_cache_as_a_load_does(top_tier):
    d, tiers = top_tier
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
        assert cache.load(keys, kv, tiers_seen) == 5 and kv.length == 5 * N
        assert tiers_seen == [tiers] * 5
        assert torch.equal(kv.data[:, :, :, : 5 * N], _reference(keys, source, capacity).data[:, :, :, : 5 * N])
        assert bool((kv.data[:, :, :, 5 * N :] == 7.0).all())  # past the blocks: untouched
        assert cache.errors == 0
        # A run with a gap stops there: the chunks after the gap are not counted as loaded.
        other, _ = _context(2, seed=2)
        kv.truncate(0)
        assert cache.load([keys[0], other[1], keys[2]], kv, []) == 1 and kv.length == N
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
        places = [rows_in(kv, region, c * N, N) for c in range(4)]
        kv.data.fill_(-3.0)
        found = client.get_rows(region.arena_id, keys, places, NS.layout)
        assert [g.in_place for g in found] == [True, True, False, False]
        assert [g.codec for g in found] == ["raw", "raw", "int8", "int8"]
        assert bool((kv.data[:, :, :, 2 * N :] == -3.0).all())  # the coded blocks' rows: nothing copied
        plain = KVCache(5, 3, 48, 4 * N, torch.float32, "cpu")
        assert cache.load_run(keys, lambda c, b: plain.load(b, c * N), []) == 4
        kv.truncate(0)
        assert cache.load(keys, kv, []) == 4 and kv.length == 4 * N
        assert torch.equal(kv.data, plain.data)  # the same bytes as a load through the staging arena
        assert not torch.equal(kv.data[:, :, :, 2 * N :], source.data[:, :, :, 2 * N :])  # int8: lossy, decoded
        del kv, region
        gc.collect()


@pytest.mark.parametrize("local_lookup", [True, False], ids=["key-index", "rpc-lookup"])
def test_a_get_in_rows_of_the_leading_run_copies_that_run_alone(daemon, local_lookup):
    """``get_rows(..., leading_run=True)``, a load's lookup and Get in one call: the blocks after
    the first gap are not copied, though the daemon holds them; nothing held, nothing copied."""
    keys, source = _context(4, seed=8)
    with KVStoreClient(daemon.address, local_lookup=local_lookup) as client:
        client.put(NS, [(keys[c], N, source.export(c * N, (c + 1) * N)) for c in (0, 1, 3)])
        kv = KVCache(5, 3, 48, 4 * N, torch.float32, "cpu", SharedKVMemory(client))
        region = region_of(kv.data)
        places = [rows_in(kv, region, c * N, N) for c in range(4)]
        kv.data.fill_(-3.0)
        found = client.get_rows(region.arena_id, keys, places, NS.layout, leading_run=True)
        assert [(g.found, g.in_place, g.codec) for g in found] == [(True, True, "raw")] * 2
        assert torch.equal(kv.data[:, :, :, : 2 * N], source.data[:, :, :, : 2 * N])
        assert bool((kv.data[:, :, :, 2 * N :] == -3.0).all())  # chunk 3 is held, after the gap: not copied
        assert (client.local_lookups, client.rpc_lookups) == ((1, 0) if local_lookup else (0, 1))
        other, _ = _context(2, seed=9)
        assert client.get_rows(region.arena_id, other, places[:2], NS.layout, leading_run=True) == []
        assert bool((kv.data[:, :, :, 2 * N :] == -3.0).all())
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
            assert PrefixCache(fresh, NS).load(keys, kv, []) == 1
        assert torch.equal(kv.data, source.data)
        del kv, new
        gc.collect()
        memory.close()


# -- Puts in rows: the daemon's one copy out of a KV cache in shared memory -----------------------


@pytest.mark.parametrize("path", ["kernel", "python"])  # kernels/copy_hash.c, or the fallback without it
@pytest.mark.parametrize("seed", range(6))
def test_a_gather_copies_and_hashes_rows_as_the_payload_in_one_run(seed, path, monkeypatch):
    if path == "python":
        monkeypatch.setattr("kvstore.scatter.native_copies", lambda: None)
    rng = np.random.default_rng(seed)
    row_bytes = int(rng.integers(MIN_ROW_BYTES, 3000)) if seed % 2 else CHECKSUM_STEP // 3 + 5  # small, and > a step
    stride = row_bytes + int(rng.integers(0, 300))
    rows = int(rng.integers(2, 40))
    if seed == 5:  # the smallest rows, many steps of them
        row_bytes, stride, rows = MIN_ROW_BYTES, MIN_ROW_BYTES + 8, 3 * CHECKSUM_STEP // MIN_ROW_BYTES + 17
    if seed == 4:  # rows of more than a step, hashed a part of a row at a time
        row_bytes, stride, rows = 2 * CHECKSUM_STEP + 7, 2 * CHECKSUM_STEP + 100, 3
    if path == "kernel":  # rows the kernel takes: whole 64-byte stripes (others fall back, as in "python")
        row_bytes = row_bytes // 64 * 64
        stride = max(stride, row_bytes)
    source = rng.integers(1, 256, (rows - 1) * stride + row_bytes + int(rng.integers(0, 100)), dtype=np.uint8)
    payload = b"".join(source[i * stride : i * stride + row_bytes].tobytes() for i in range(rows))
    gather = Gather(memoryview(source), row_bytes, stride, rows * row_bytes)
    assert len(gather) == len(payload) and bytes(gather.tobytes()) == payload
    assert gather.checksum() == payload_checksum(payload)
    for step in (CHECKSUM_STEP, 0):  # a step per piece (on the event loop), or all rows at once (in a thread)
        dest = bytearray(len(payload))
        assert gather.copy_checksummed(memoryview(dest), step) == payload_checksum(payload) and bytes(dest) == payload


def test_a_gather_refuses_rows_that_are_not_whole_leave_the_slice_or_are_tiny():
    source = memoryview(bytearray(4096))
    for row_bytes, stride, length in ((MIN_ROW_BYTES - 1, 128, 630), (256, 255, 512), (256, 4097, 512),
                                      (256, 1024, 5 * 256), (256, 1024, 3 * 256 + 1), (256, 1024, 0),
                                      (256, 2**64 - 1, 512)):
        with pytest.raises(ValueError):
            Gather(source, row_bytes, stride, length)
    assert len(Gather(source, 256, 1024, 4 * 256)) == 1024


@pytest.mark.parametrize("chunks", [4, 8])  # 0.55 MB: the CPU tier copies on the loop; 1.1 MB: in threads
def test_a_put_in_rows_stores_what_an_export_would(top_tier, chunks):
    d, tiers = top_tier
    keys, source = _context(chunks, seed=8)
    with KVStoreClient(d.address) as client:
        kv = KVCache(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, chunks * N + 5, torch.float32, "cpu",
                     SharedKVMemory(client))
        kv.load(source.data, 0)  # rows capacity * head_dim apart, not tokens * head_dim
        blocks = [block_to_store(kv, c * N, N) for c in range(chunks)]
        assert all(isinstance(b, RowsInRegion) for b in blocks)
        cache = PrefixCache(client, NS)
        assert cache.put([(k, N, b, keys[c - 1] if c else b"") for c, (k, b) in enumerate(zip(keys, blocks))])
        assert cache.errors == 0 and client.lookup(keys).hits == chunks
        with client.fetch(keys, LAYOUT.block_bytes(N)) as fetched:
            for c, block in enumerate(fetched):
                assert block.tier == tiers
                assert bytes(block.payload) == source.export(c * N, (c + 1) * N).numpy().tobytes()
        # the same blocks again (the daemon compares checksums, stores nothing new), then other
        # bytes under a stored key: replaced, its checksum of what was copied
        assert cache.put([(keys[0], N, blocks[0])])
        kv.data.add_(1.0)
        assert cache.put([(keys[1], N, block_to_store(kv, N, N))])
        with client.fetch(keys[:2], LAYOUT.block_bytes(N)) as fetched:
            assert bytes(fetched[0].payload) == source.export(0, N).numpy().tobytes()
            assert bytes(fetched[1].payload) == kv.export(N, 2 * N).numpy().tobytes()
        with pytest.raises(ValueError, match="filled range"):
            block_to_store(kv, chunks * N, N)
        del kv, blocks
        gc.collect()


def test_a_put_from_a_region_the_daemon_dropped_is_copied_and_stored(daemon):
    keys, source = _context(2, seed=9)
    with KVStoreClient(daemon.address) as client:
        kv = KVCache(5, 3, 48, 2 * N, torch.float32, "cpu", SharedKVMemory(client))
        kv.load(source.data, 0)
        blocks = [block_to_store(kv, c * N, N) for c in range(2)]
    daemon.stop()
    daemon.start()  # the region is gone from the daemon; the cache's memory is still this process's
    with KVStoreClient(daemon.address) as fresh:
        cache = PrefixCache(fresh, NS)
        assert not blocks[0].region.alive
        assert cache.put([(k, N, b) for k, b in zip(keys, blocks)]) and cache.errors == 0
        assert fresh.get(keys, LAYOUT.block_bytes(N)) == [source.export(c * N, (c + 1) * N).numpy().tobytes()
                                                          for c in range(2)]
    del kv, blocks
    gc.collect()


def test_hostile_put_rows_are_refused_before_any_copy(daemon_factory, short_tmp):
    """guarantees: Limits — a Put in rows reads only whole rows inside the caller's own slice."""
    tenants = short_tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntoken = "tenant-a-token-0123456789"\n\n'
                       '[[tenant]]\nname = "b"\ntoken = "tenant-b-token-0123456789"\n')
    tenants.chmod(0o600)
    d = daemon_factory(tenants_file=str(tenants))
    keys, source = _context(1, seed=10)
    row_bytes, rows = N * 48 * 4, 5 * 2 * 3
    with KVStoreClient(d.address, token="tenant-a-token-0123456789") as a, \
            KVStoreClient(d.address, token="tenant-b-token-0123456789") as b:
        region = SharedRegion.request(a, 1 << 20)
        theirs = SharedRegion.request(b, 1 << 20)

        def put(row_bytes, row_stride, offset=0, length=1 << 20, payload_len=rows * row_bytes, arena=None,
                inline=False):
            meta = pb.BlockMeta(key=keys[0], namespace=NS.id, tokens=N, layout=layout_message(LAYOUT),
                                codec="raw", payload_len=payload_len)
            item = pb.PutItem(meta=meta, row_bytes=row_bytes, row_stride=row_stride)
            if inline:
                item.inline = b"\x01" * payload_len
            else:
                item.slice.CopyFrom(pb.ArenaSlice(arena_id=arena or region.arena_id, offset=offset, length=length))
            try:
                return grpc.StatusCode.OK, a._stub.Put(pb.PutRequest(items=[item]), metadata=a._metadata)
            except grpc.RpcError as exc:
                return exc.code(), exc.details()

        refused = [
            put(1, 1, payload_len=rows),                          # one-byte rows
            put(row_bytes, row_bytes - 1),                        # overlapping rows
            put(row_bytes, (1 << 20) + 1),                        # a stride past the slice
            put(row_bytes, 2**64 - 1),                            # a stride no pointer can take
            put(row_bytes, row_bytes + 64, length=(rows - 1) * (row_bytes + 64)),  # the last row leaves the slice
            put(row_bytes, row_bytes, payload_len=rows * row_bytes - 1),          # not whole rows
            put(row_bytes, row_bytes, inline=True),               # rows, but inline bytes
            put(row_bytes, row_bytes, offset=(1 << 20) - 10, length=4096),        # a slice past the arena
            put(0, row_bytes),                                    # a stride without rows
        ]
        assert [code for code, _ in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * len(refused), refused
        assert "row_bytes" in refused[0][1] and "row_stride" in refused[1][1]
        code, _ = put(row_bytes, row_bytes, arena=theirs.arena_id)  # another tenant's memory
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert a.lookup(keys).hits == 0  # nothing stored by any of them
        # Whole rows in its own region: stored, the rows and nothing between them.
        array = region.bytes(1 << 20)
        array[:] = 0xA5
        stride = row_bytes + 128
        placed = np.lib.stride_tricks.as_strided(array[4096:], shape=(rows, row_bytes), strides=(stride, 1))
        placed[:] = source.export(0, N).numpy().view(np.uint8).reshape(rows, row_bytes)
        code, reply = put(row_bytes, stride, offset=4096, length=(rows - 1) * stride + row_bytes)
        assert code == grpc.StatusCode.OK and reply.stored == 1
        assert a.get(keys, LAYOUT.block_bytes(N)) == [source.export(0, N).numpy().tobytes()]
        del array, placed
        region.close()
        theirs.close()


def test_a_failed_put_in_rows_retires_its_region(daemon):
    """The daemon may still read a region after a failed call (a timeout): no later cache is
    computed into it; the cache in it keeps working, and the engine replaces it (`alive`)."""
    keys, source = _context(1, seed=11)
    wrong = Namespace("scatter-test", KVLayout(5, 3, 48, "float16"), chunk_tokens=N)  # half the bytes per block
    with KVStoreClient(daemon.address) as client:
        kv = KVCache(5, 3, 48, N, torch.float32, "cpu", SharedKVMemory(client))
        kv.load(source.data, 0)
        block = block_to_store(kv, 0, N)
        assert block.region.alive
        cache = PrefixCache(client, wrong)
        assert not cache.put([(keys[0], N, block)]) and cache.errors == 1
        assert not block.region.alive and torch.equal(kv.data, source.data)
        assert isinstance(block_to_store(kv, 0, N), torch.Tensor)  # stored the usual way from now on
        del kv, block
        gc.collect()
