import os

import numpy as np
import pytest

from kvstore.block import BlockHeader, CorruptBlockError, payload_checksum
from kvstore.keys import KVLayout
from tiers.allocator import ExtentAllocator
from tiers.base import TierFullError
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

LAYOUT = KVLayout(3, 2, 32, "float16")


def make_block(seed: int, tokens: int = 50) -> tuple[BlockHeader, memoryview]:
    rng = np.random.default_rng(seed)
    payload = rng.standard_normal(LAYOUT.block_bytes(tokens) // 2).astype(np.float16).tobytes()
    header = BlockHeader(key=rng.bytes(16), namespace=b"n" * 16, layout=LAYOUT, tokens=tokens,
                         payload_len=len(payload), checksum=payload_checksum(payload))
    return header, memoryview(payload)


def read(tier, header) -> bytes:
    dest = bytearray(header.payload_len + 7)
    got = tier.read_payload_into(header.key, memoryview(dest))
    assert got == header
    return bytes(dest[: header.payload_len])


def test_allocator_random_operations_keep_integrity():
    rng = np.random.default_rng(0)
    alloc = ExtentAllocator(1 << 20, align=64)
    live: list[int] = []
    for step in range(3000):
        if live and (rng.random() < 0.45 or not alloc.can_allocate(4096)):
            alloc.free(live.pop(rng.integers(len(live))))
        else:
            offset = alloc.allocate(int(rng.integers(1, 40000)))
            if offset is not None:
                live.append(offset)
        if step % 100 == 0:
            alloc.check_integrity()
    for offset in live:
        alloc.free(offset)
    alloc.check_integrity()
    assert alloc.used_bytes == 0 and alloc.largest_free == alloc.capacity


def fill(tier, blocks) -> list:
    """Put blocks until the tier is full; the ones stored."""
    stored = []
    for header, payload in blocks:
        try:
            tier.put(header, payload)
        except TierFullError:
            break
        stored.append((header, payload))
    return stored


def test_cpu_tier_round_trip_full_and_integrity():
    blocks = [make_block(i, tokens=37 + i) for i in range(6)]
    tier = CpuTier(capacity_bytes=4 * blocks[0][0].block_len)
    stored = fill(tier, blocks)
    assert 2 <= len(stored) < len(blocks)
    tier.check_integrity()
    for header, payload in stored:
        assert read(tier, header) == bytes(payload)
    freed = tier.delete(stored[0][0].key)
    assert freed == stored[0][0].block_len and stored[0][0].key not in tier
    tier.check_integrity()
    with pytest.raises(KeyError):
        tier.read_payload_into(stored[0][0].key, memoryview(bytearray(10**6)))


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_checksummed_put_stores_the_payload_with_its_checksum(kind, tmp_path):
    """CPU: hashed as it is copied; disk: the default, hashed then put. Either: as a put of the
    header with the checksum computed first, and readable (disk verifies it)."""
    header, payload = make_block(7, tokens=2000)  # 768 KB: several copy_checksummed steps
    tier = CpuTier(capacity_bytes=1 << 22) if kind == "cpu" else DiskTier(tmp_path, capacity_bytes=1 << 22)
    unhashed = BlockHeader(key=header.key, namespace=header.namespace, layout=LAYOUT, tokens=2000,
                           payload_len=header.payload_len, checksum=0)
    stored = tier.put_checksummed(unhashed, payload)
    assert stored == header and tier.header(header.key) == header
    assert read(tier, header) == bytes(payload)
    with pytest.raises(ValueError):
        tier.put_checksummed(make_block(8)[0], payload)  # payload_len disagrees: nothing stored
    assert len(tier) == 1


def test_disk_tier_round_trip_and_restart(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=1 << 24)
    blocks = [make_block(i) for i in range(5)]
    for header, payload in blocks:
        tier.put(header, payload)
    tier.check_integrity()
    sub = tmp_path / blocks[0][0].key.hex()[:2]
    (sub / f".{blocks[0][0].key.hex()}.tmp.1.2").write_bytes(b"partial")
    foreign = ("report.tmp.docx", "notes.kvb", ".leftover.tmp.1.2")  # not the daemon's names: kept
    for name in foreign:
        (sub / name).write_bytes(b"someone else's")
    reopened = DiskTier(tmp_path, capacity_bytes=1 << 24)
    assert set(reopened.keys()) == {h.key for h, _ in blocks}
    assert reopened.used_bytes == sum(h.block_len for h, _ in blocks)
    assert not (sub / f".{blocks[0][0].key.hex()}.tmp.1.2").exists(), "interrupted writes are cleaned at start"
    assert all((sub / name).read_bytes() == b"someone else's" for name in foreign)
    assert tmp_path.stat().st_mode & 0o777 == 0o700
    for header, payload in blocks:
        assert read(reopened, header) == bytes(payload)
    reopened.check_integrity()
    with pytest.raises(TierFullError):
        DiskTier(tmp_path / "small", capacity_bytes=1000).put(*blocks[0])


def test_disk_tier_detects_flipped_and_truncated_files(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=1 << 24)
    (h1, p1), (h2, p2), (h3, p3) = [make_block(i) for i in range(3)]
    for h, p in ((h1, p1), (h2, p2), (h3, p3)):
        tier.put(h, p)
    path = tier._path(h1.key)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="checksum"):
        read(tier, h1)
    path2 = tier._path(h2.key)
    path2.write_bytes(path2.read_bytes()[:-500])
    with pytest.raises(CorruptBlockError):
        read(tier, h2)
    # On restart the truncated file no longer matches its header size: dropped and counted.
    reopened = DiskTier(tmp_path, capacity_bytes=1 << 24)
    assert h2.key not in reopened and reopened.corrupt_on_start == 1
    assert read(reopened, h3) == bytes(p3)


def test_disk_tier_o_direct_reads(tmp_path):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    tier = DiskTier(tmp_path, capacity_bytes=1 << 24, o_direct=True)
    header, payload = make_block(9, tokens=77)
    tier.put(header, payload)
    try:
        assert read(tier, header) == bytes(payload)
    except CorruptBlockError as exc:
        if "Invalid argument" in str(exc):
            pytest.skip(f"filesystem of {tmp_path} refuses O_DIRECT")
        raise


def test_cpu_tier_frees_a_block_deleted_mid_read_only_after_the_read(monkeypatch):
    """A read copying in a worker thread keeps its extent: a delete and a put meanwhile must not
    hand those bytes to the new block."""
    import threading

    tier = CpuTier(2 * make_block(1)[0].block_len + 8192, pin=False)
    (a, pa), (b, pb), (c, pc) = make_block(1), make_block(2), make_block(3)
    tier.put(a, pa)
    tier.put(b, pb)
    release, started = threading.Event(), threading.Event()
    real_copyto = np.copyto

    def slow_copyto(pairs):
        started.set()
        release.wait(10)
        for dst, src in pairs:
            real_copyto(dst, src)

    from kvstore.scatter import copy_streamed_many

    monkeypatch.setattr("tiers.cpu.copy_streamed_many", slow_copyto)  # the tier's copies out
    dest = memoryview(bytearray(a.payload_len))
    reader = threading.Thread(target=tier.read_payload_into, args=(a.key, dest))
    reader.start()
    assert started.wait(10)
    assert tier.busy(a.key) and not tier.busy(b.key) and tier.reads_in_flight == 1
    assert tier.delete(a.key) == a.block_len and a.key not in tier
    assert not tier.can_fit(c.block_len)  # the deleted block's extent is still being read
    with pytest.raises(TierFullError):
        tier.put(c, pc)
    tier.check_integrity()  # a doomed extent is accounted for
    release.set()
    reader.join(10)
    monkeypatch.setattr("tiers.cpu.copy_streamed_many", copy_streamed_many)
    assert bytes(dest) == bytes(pa) and tier.reads_in_flight == 0
    tier.put(c, pc)  # freed by the reader
    assert read(tier, c) == bytes(pc) and read(tier, b) == bytes(pb)
    tier.check_integrity()
