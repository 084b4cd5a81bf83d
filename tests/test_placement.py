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

    monkeypatch.setattr(reads, "OFFLOAD_GET_BYTES", 0)  # every Get copies in worker threads
    release = threading.Event()
    real_copyto = np.copyto

    def slow_copyto(dst, src):
        release.wait(10)
        real_copyto(dst, src)

    async def scenario():
        store = make_store(tmp_path, cpu_blocks=2)
        (a, pa), (b, pb), (c, pc) = blocks(3, start=40)
        await store.put(a, pa)
        await store.put(b, pb)
        monkeypatch.setattr(np, "copyto", slow_copyto)
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
        monkeypatch.setattr(np, "copyto", real_copyto)
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
