"""Placement policy, in process: LRU order, demotion, promotion, pins, write policies, corruption."""

import asyncio

import pytest

from kvstore.daemon.metrics import Metrics
from kvstore.daemon.placement import BlockStore
from tests.test_tiers import make_block
from tiers.base import TierFullError
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

BLOCK = make_block(0)[0].block_len


def make_store(tmp_path, cpu_blocks=3, disk_blocks=6, write_through=False, **kw) -> BlockStore:
    # A CPU arena of cpu_blocks blocks (+ slack for extent rounding), a disk of disk_blocks.
    tiers = [CpuTier(cpu_blocks * BLOCK + 4096), DiskTier(tmp_path, disk_blocks * BLOCK, fsync=False)]
    return BlockStore(tiers, Metrics(), write_through=write_through, **kw)


async def get(store, header):
    dest = memoryview(bytearray(header.payload_len))
    result = await store.reads.get_into(header.key, dest)
    if result is not None:
        assert bytes(dest) == bytes(make_block_payload(header))
    return result


_PAYLOADS: dict[bytes, bytes] = {}


def blocks(n, start=0):
    out = [make_block(i) for i in range(start, start + n)]
    for h, p in out:
        _PAYLOADS[h.key] = bytes(p)
    return out


def make_block_payload(header):
    return _PAYLOADS[header.key]


def run(coro):
    return asyncio.run(coro)


def test_lru_eviction_demotes_in_order_and_lookup_reports_tiers(tmp_path):
    async def scenario():
        store = make_store(tmp_path)
        store.start()
        bs = blocks(5)
        for h, p in bs[:3]:
            await store.put(h, p)
        await get(store, bs[0][0])               # touch 0: LRU order is now 1, 2, 0
        await store.put(*bs[3])                  # evicts 1
        await store.put(*bs[4])                  # evicts 2
        keys = [h.key for h, _ in bs]
        assert [store.locate(k) for k in keys] == [0, 1, 1, 0, 0]
        result = store.lookup(keys)
        assert result.hits == 5 and result.tiers == ("cpu", "disk", "disk", "cpu", "cpu")
        assert store.lookup([keys[0], b"x" * 16, keys[1]]).hits == 1
        m = store.metrics
        assert m.value(m.evictions, tier="cpu") == 2 and m.value(m.demotions, tier="disk") == 2
        store.check_integrity()
        await store.close()
    run(scenario())


def test_lower_tier_hit_is_promoted(tmp_path):
    async def scenario():
        store = make_store(tmp_path)
        store.start()
        bs = blocks(4, start=10)
        for h, p in bs:
            await store.put(h, p)
        first = bs[0][0]
        assert store.locate(first.key) == 1
        result = await get(store, first)
        assert result.tier == "disk"
        await asyncio.gather(*store.promoter.tasks)
        assert store.locate(first.key) == 0
        assert (await get(store, first)).tier == "cpu"
        assert store.metrics.value(store.metrics.promotions, tier="cpu") == 1
        store.check_integrity()
        await store.close()
    run(scenario())


def test_pinned_blocks_are_never_evicted(tmp_path):
    async def scenario():
        store = make_store(tmp_path, cpu_blocks=2, disk_blocks=2)
        store.start()
        bs = blocks(5, start=20)
        await store.put(*bs[0])
        await store.put(*bs[1])
        store.pin([bs[0][0].key, bs[1][0].key])
        with pytest.raises(TierFullError, match="pinned"):
            await store.put(*bs[2])
        store.unpin([bs[0][0].key])
        await store.put(*bs[2])
        assert store.locate(bs[1][0].key) == 0 and store.locate(bs[0][0].key) == 1
        store.check_integrity()
        await store.close()
    run(scenario())


def test_write_through_copies_every_put_down(tmp_path):
    async def scenario():
        store = make_store(tmp_path, write_through=True)
        store.start()
        bs = blocks(3, start=30)
        for h, p in bs:
            await store.put(h, p)
        await store.write_behind.flush()
        assert all(h.key in store.tiers[1] for h, _ in bs)
        assert all(h.key in store.tiers[0] for h, _ in bs)
        # A delete cancels a queued copy and removes every tier's copy.
        assert await store.delete([bs[0][0].key]) == 1
        assert store.locate(bs[0][0].key) is None
        store.check_integrity()
        await store.close()
    run(scenario())


def test_write_back_copies_only_on_eviction_or_shutdown(tmp_path):
    async def scenario():
        store = make_store(tmp_path)
        store.start()
        bs = blocks(2, start=40)
        for h, p in bs:
            await store.put(h, p)
        assert len(store.tiers[1]) == 0
        assert await store.demote_all() == 2
        assert all(h.key in store.tiers[1] for h, _ in bs)
        await store.close()
    run(scenario())


def test_corrupt_disk_block_is_a_counted_miss_and_deleted(tmp_path):
    async def scenario():
        store = make_store(tmp_path, cpu_blocks=1, promote_on_get=False)
        store.start()
        bs = blocks(2, start=50)
        for h, p in bs:
            await store.put(h, p)
        victim = bs[0][0]
        path = store.tiers[1]._path(victim.key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        assert await get(store, victim) is None
        assert store.locate(victim.key) is None and not path.exists()
        m = store.metrics
        assert m.value(m.corrupt, tier="disk") == 1 and m.value(m.misses) == 1
        store.check_integrity()
        await store.close()
    run(scenario())


def test_a_layout_that_contradicts_the_namespace_is_refused(tmp_path):
    from dataclasses import replace

    from kvstore.keys import KVLayout

    async def scenario():
        store = make_store(tmp_path)
        h, p = blocks(1, start=60)[0]
        await store.put(h, p)
        other = replace(h, key=b"z" * 16, layout=KVLayout(3, 4, 16, "float16"))
        with pytest.raises(ValueError, match="does not match namespace"):
            await store.put(other, p)
        await store.close()
    run(scenario())


def test_large_gets_copy_off_the_loop_and_puts_wait_for_busy_blocks(tmp_path, monkeypatch):
    import threading

    import numpy as np

    from kvstore.daemon import reads
    from kvstore.scatter import copy_streamed_many

    monkeypatch.setattr(reads, "OFFLOAD_BYTES", 0)  # every Get copies in worker threads
    release = threading.Event()
    real_copyto = np.copyto

    def slow_copyto(pairs):
        release.wait(10)
        for dst, src in pairs:
            real_copyto(dst, src)

    async def scenario():
        store = make_store(tmp_path, cpu_blocks=2)
        (a, pa), (b, pb), (c, pc) = blocks(3, start=40)
        await store.put(a, pa)
        await store.put(b, pb)
        monkeypatch.setattr("tiers.cpu.copy_streamed_many", slow_copyto)  # the tier's copies out
        dests = [memoryview(bytearray(h.payload_len)) for h in (a, b)]
        reads = asyncio.create_task(store.reads.get_many_into([(a.key, dests[0]), (b.key, dests[1])]))
        await asyncio.sleep(0.05)
        assert not reads.done()  # the copies wait in worker threads; the loop is free
        put = asyncio.create_task(store.put(c, pc))
        await asyncio.sleep(0.05)
        assert not put.done()  # both CPU blocks are being read: nothing to evict yet
        release.set()
        results = await reads
        await put
        monkeypatch.setattr("tiers.cpu.copy_streamed_many", copy_streamed_many)
        assert [r.tier for r in results] == ["cpu", "cpu"]
        assert bytes(dests[0]) == bytes(pa) and bytes(dests[1]) == bytes(pb)
        assert store.lookup([c.key]).tiers == ("cpu",)
        assert (await get(store, a)) is not None and (await get(store, b)) is not None  # one demoted
        store.check_integrity()
        await store.close()

    run(scenario())


def test_a_quota_evicts_none_of_its_owners_leased_blocks(tmp_path):
    """Quota eviction spares what any eviction spares: a block the owner leased (a reader copies
    it by reference, or vLLM will load it) stays in the top tier; an unleased one goes instead,
    and with only leased blocks left the put is refused rather than taking one."""
    async def scenario():
        store = make_store(tmp_path, cpu_blocks=6, disk_blocks=6)
        store.start()
        quota = 2 * BLOCK + 2 * 4096
        bs = blocks(4, start=40)
        await store.put(*bs[0], owner="a", quota=quota)
        await store.put(*bs[1], owner="a", quota=quota)
        store.lease(bs[0][0].key, 30)              # the oldest, which quota eviction would pick
        await store.put(*bs[2], owner="a", quota=quota)
        assert [store.locate(h.key) for h, _ in bs[:3]] == [0, 1, 0]
        store.lease(bs[2][0].key, 30)
        with pytest.raises(TierFullError, match="in use"):
            await store.put(*bs[3], owner="a", quota=quota)
        assert store.locate(bs[0][0].key) == 0 and store.locate(bs[2][0].key) == 0
        await store.close()

    run(scenario())


def _in_rows(payload: memoryview, row_bytes: int, stride: int, seed: int):
    """``payload`` as a Put in rows (kvstore/scatter.py: `Gather`): its rows ``stride`` apart in a
    buffer whose other bytes are not zero, as a KV cache keeps a chunk."""
    import numpy as np

    from kvstore.scatter import Gather

    rows = len(payload) // row_bytes
    source = np.random.default_rng(seed).integers(1, 255, (rows - 1) * stride + row_bytes, dtype=np.uint8)
    np.lib.stride_tricks.as_strided(source, (rows, row_bytes), (stride, 1))[:] = \
        np.frombuffer(payload, dtype=np.uint8).reshape(rows, row_bytes)
    return Gather(memoryview(source), row_bytes, stride, len(payload))


@pytest.mark.parametrize("case", ["tier smaller than the call", "quota smaller than the call",
                                  "keys the call repeats or the tier holds"])
def test_a_large_put_copies_in_threads_and_ends_as_one_block_at_a_time_would(tmp_path, monkeypatch, case):
    """A Put into the CPU tier copies its blocks in worker threads, several at once
    (`Evictor.store_many`); whatever the call meets, the store ends as the one-block-at-a-time
    path leaves it: the same blocks in each tier in the same LRU order, the same checksums, every
    byte read back, integrity intact. Payloads alternate between one run and rows."""
    from kvstore.daemon import eviction

    async def scenario(threads: bool):
        monkeypatch.setattr(eviction, "OFFLOAD_BYTES", 0 if threads else 1 << 62)
        store = make_store(tmp_path / str(threads), cpu_blocks=4, disk_blocks=12)
        fills = []
        real_fill_many = store.io.fill_many

        async def fill_many(tier, items):
            fills.append(len(items))
            return await real_fill_many(tier, items)

        store.io.fill_many = fill_many
        store.io.fill_lanes = 2  # as on a host of four cores or more: copies interleaved across lanes
        store.start()
        earlier = blocks(2, start=200)
        for h, p in earlier:
            await store.put(h, p, owner="a")
        call = blocks(6, start=210)
        quota = 0
        if case == "quota smaller than the call":
            quota = 3 * BLOCK + 100
        elif case == "keys the call repeats or the tier holds":
            call = [earlier[1], call[0], call[1], call[0], call[2]]
        # row sizes that divide the payload (38,400 bytes): 12 rows of 3,200, 30 of 1,280
        items = [(h, p if i % 2 else _in_rows(p, (3200, 1280)[i % 4 // 2], 4096 + 64 * i, seed=i), b"")
                 for i, (h, p) in enumerate(call)]
        stored = await store.put_many(items, owner="a", quota=quota)
        assert [s.checksum for s in stored] == [h.checksum for h, _ in call]
        state = [list(store.residency[level]) for level in (0, 1)]
        store.check_integrity()
        for h, _ in earlier + call:
            assert await get(store, h) is not None  # `get` compares every byte (and promotes)
        await store.close()
        assert bool(fills) == threads and (not threads or max(fills) > 1)
        return state

    serial = run(scenario(False))
    assert run(scenario(True)) == serial


def test_a_puts_copies_leave_a_reader_thread_for_other_clients(monkeypatch):
    """However many cores, one Put's copies take at most all but one of the reader threads, so
    another client's read (a disk Get, a large CPU Get) never queues behind a whole large copy."""
    from kvstore.daemon import tier_io

    for cores in (1, 2, 3, 4, 6, 8, 64):
        monkeypatch.setattr(tier_io.os, "cpu_count", lambda cores=cores: cores)
        io = tier_io.TierIO([])
        assert 1 <= io.fill_lanes <= io.row_fill_lanes == min(cores, tier_io.READER_THREADS - 1)


def test_a_put_in_rows_copies_in_every_lane_and_a_staged_put_in_half(tmp_path, monkeypatch):
    """A Put whose payloads are all rows of a client's KV cache (`Gather`: the client only waits)
    copies in `TierIO.row_fill_lanes` threads; one with a payload in the staging arena (its client
    copies its next part meanwhile) in `fill_lanes`. Either way every block is stored, readable,
    checksummed as sent."""
    from kvstore.daemon import eviction, tier_io

    monkeypatch.setattr(eviction, "OFFLOAD_BYTES", 0)
    lanes: list[int] = []
    real_lane = tier_io._fill_lane

    def fill_lane(tier, fills):
        lanes.append(len(fills))
        return real_lane(tier, fills)

    monkeypatch.setattr(tier_io, "_fill_lane", fill_lane)

    async def scenario():
        store = make_store(tmp_path, cpu_blocks=12)
        store.io.fill_lanes, store.io.row_fill_lanes = 1, 3
        store.start()
        seen = []
        for start, in_rows in ((300, (True,) * 6), (310, (True, False) * 3)):
            call = blocks(6, start=start)
            items = [(h, _in_rows(p, 3200, 4096 + 64 * i, seed=start + i) if rows else p, b"")
                     for i, ((h, p), rows) in enumerate(zip(call, in_rows))]
            lanes.clear()
            stored = await store.put_many(items, owner="a")
            assert [s.checksum for s in stored] == [h.checksum for h, _ in call]
            for h, _ in call:
                assert await get(store, h) is not None  # every byte compared
            seen.append(sorted(lanes))
        store.check_integrity()
        await store.close()
        return seen

    assert run(scenario()) == [[2, 2, 2], [6]]


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_put_whose_copy_fails_stores_the_blocks_before_it_and_frees_the_rest(tmp_path, monkeypatch, lanes):
    """A copy that raises in a worker thread (injected: a real source cannot fail this way) fails
    the Put as one block at a time would: the blocks before it stored, its extent and those of
    the blocks after it freed, nothing indexed that was not filled."""
    from kvstore.daemon import eviction

    monkeypatch.setattr(eviction, "OFFLOAD_BYTES", 0)

    async def scenario():
        store = make_store(tmp_path, cpu_blocks=6)
        store.io.fill_lanes = lanes
        cpu = store.tiers[0]
        call = blocks(5, start=230)
        bad = call[2][0]
        real_fill = cpu.fill

        def fill(offset, header, payload, in_thread=False):
            if header.key == bad.key:
                raise OSError("injected: the source could not be read")
            return real_fill(offset, header, payload, in_thread)

        monkeypatch.setattr(cpu, "fill", fill)
        stored = [None] * len(call)
        with pytest.raises(OSError, match="injected"):
            await store.put_many([(h, p, b"") for h, p in call], stored=stored)
        assert [s is not None for s in stored] == [True, True, False, False, False]
        assert [store.locate(h.key) for h, _ in call] == [0, 0, None, None, None]
        assert cpu.used_bytes == 2 * BLOCK
        store.check_integrity()
        for h, _ in call[:2]:
            assert await get(store, h) is not None
        await store.close()

    run(scenario())


def test_a_cancelled_put_frees_its_extents_only_after_its_copies_end(tmp_path, monkeypatch):
    """A Put cancelled (its client gone) while its copies run in worker threads returns only once
    they have ended: an extent freed under a running copy could be handed to another block and
    overwritten. Afterwards nothing of it is stored or reserved."""
    import threading

    from kvstore.daemon import eviction

    monkeypatch.setattr(eviction, "OFFLOAD_BYTES", 0)
    release, started = threading.Event(), threading.Event()

    async def scenario():
        store = make_store(tmp_path, cpu_blocks=6)
        store.io.fill_lanes = 2
        cpu = store.tiers[0]
        real_fill = cpu.fill

        def fill(offset, header, payload, in_thread=False):
            started.set()
            release.wait(10)
            return real_fill(offset, header, payload, in_thread)

        monkeypatch.setattr(cpu, "fill", fill)
        call = blocks(4, start=240)
        put = asyncio.create_task(store.put_many([(h, p, b"") for h, p in call]))
        while not started.is_set():
            await asyncio.sleep(0.005)
        put.cancel()
        await asyncio.sleep(0.05)
        assert not put.done()  # the copies still run: their extents stay reserved
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert [store.locate(h.key) for h, _ in call] == [None] * 4 and cpu.used_bytes == 0
        store.check_integrity()
        assert cpu.can_fit(6 * BLOCK)  # every extent free again
        await store.close()

    run(scenario())
