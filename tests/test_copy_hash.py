"""The one-pass copy and checksum (kernels/copy_hash.c) against the `xxhash` package's XXH3-64 and a
plain copy, and its streamed Get copy against numpy's, on random bytes of irregular lengths, rows,
strides and alignments."""

from __future__ import annotations

import platform
import threading

import numpy as np
import pytest
import xxhash

from kernels.copy_hash import copy_rows_checksummed, copy_rows_streamed, native_library

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or native_library() is None,
                                reason="the kernel is built for x86-64 with a C compiler")

BLOCK = 1024  # XXH3's block with the default secret: lengths around its multiples test the last block


def _rows(rng, rows: int, row_bytes: int, stride: int, offset: int = 0) -> np.ndarray:
    base = rng.integers(0, 256, offset + (rows - 1) * stride + row_bytes, dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(base[offset:], shape=(rows, row_bytes), strides=(stride, 1))


def _applies(dest: np.ndarray, rows: np.ndarray) -> int:
    digest = copy_rows_checksummed(dest, rows)
    if digest is None:
        pytest.skip("no AVX2 on this CPU: the callers keep their Python path")
    return digest


@pytest.mark.parametrize("length", [241, 255, 256, BLOCK - 1, BLOCK, BLOCK + 1, BLOCK + 63, BLOCK + 64, 2 * BLOCK,
                                    2 * BLOCK + 65, 7 * BLOCK + 241, (1 << 20) + 3, 3_000_017])
@pytest.mark.parametrize("dest_offset", [0, 1, 32])  # streamed stores (32-byte aligned) and plain ones
def test_one_run_is_copied_and_hashed_as_xxh3(length, dest_offset):
    rng = np.random.default_rng(length + dest_offset)
    source = rng.integers(0, 256, length + 3, dtype=np.uint8)[3:]  # a source that is not aligned either
    room = np.zeros(length + 64, dtype=np.uint8)
    room[:] = rng.integers(0, 256, room.size, dtype=np.uint8)
    guard = room.copy()
    dest = room[dest_offset:dest_offset + length]
    assert _applies(dest, source) == xxhash.xxh3_64_intdigest(source.tobytes())
    assert np.array_equal(dest, source)
    assert np.array_equal(room[:dest_offset], guard[:dest_offset])  # nothing written outside it
    assert np.array_equal(room[dest_offset + length:], guard[dest_offset + length:])


@pytest.mark.parametrize("rows, row_bytes, stride", [(2, 192, 193), (5, 64, 64 * 3), (40, 128, 1000),
                                                     (16, 2048, 2048 * 7 + 64), (3, 4096, 4096), (33, 320, 960)])
@pytest.mark.parametrize("dest_offset", [0, 8])  # streamed and plain stores
def test_rows_are_copied_into_one_run_and_hashed_as_it(rows, row_bytes, stride, dest_offset):
    rng = np.random.default_rng(rows * row_bytes)
    source = _rows(rng, rows, row_bytes, stride, offset=5)
    dest = np.zeros(rows * row_bytes + 64, dtype=np.uint8)[dest_offset:dest_offset + rows * row_bytes]
    one_run = np.ascontiguousarray(source).reshape(-1)
    assert _applies(dest, source) == xxhash.xxh3_64_intdigest(one_run.tobytes())
    assert np.array_equal(dest, one_run)


def test_what_the_kernel_does_not_take_is_left_untouched():
    rng = np.random.default_rng(3)
    for source in (rng.integers(0, 256, 240, dtype=np.uint8),  # XXH3's short inputs
                   _rows(rng, 4, 100, 128),                     # rows that are not whole stripes
                   np.zeros((0, 64), dtype=np.uint8)):          # nothing to copy
        dest = np.full(source.size, 7, dtype=np.uint8)
        assert copy_rows_checksummed(dest, source) is None
        assert (dest == 7).all()
    assert not copy_rows_streamed(np.zeros((0, 64), dtype=np.uint8), np.zeros((0, 64), dtype=np.uint8))
    shared = rng.integers(0, 256, 4096, dtype=np.uint8)  # overlapping buffers: numpy's path, which handles them
    assert copy_rows_checksummed(shared[64:], shared[:-64]) is None
    assert not copy_rows_streamed(shared[64:], shared[:-64])
    one_row = _rows(rng, 1, 1000, 1000)  # one row of any length is one run
    assert _applies(np.zeros(1000, dtype=np.uint8), one_row) == xxhash.xxh3_64_intdigest(one_row.tobytes())


@pytest.mark.parametrize("copy", [copy_rows_checksummed, copy_rows_streamed])
def test_bad_destinations_are_refused_before_a_byte_is_written(copy):
    source = np.random.default_rng(4).integers(0, 256, 4096, dtype=np.uint8)
    read_only = np.zeros(4096, dtype=np.uint8)
    read_only.flags.writeable = False
    for dest in (read_only, np.zeros(4095, dtype=np.uint8), np.zeros(8192, dtype=np.uint8)[::2],
                 np.zeros(1024, dtype=np.uint32)):
        with pytest.raises(ValueError, match=f"{copy.__name__} needs"):
            copy(dest, source)


def test_the_checksum_is_of_the_copy_while_the_source_is_rewritten():
    """A client may rewrite its arena during a Put: whatever lands in the destination, its checksum
    is what the kernel returns (each stripe is stored and hashed from the same registers)."""
    rng = np.random.default_rng(5)
    source = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    patterns = [rng.integers(0, 256, source.size, dtype=np.uint8) for _ in range(2)]
    dest = np.zeros_like(source)
    stop = threading.Event()

    def rewrite():
        i = 0
        while not stop.is_set():
            np.copyto(source, patterns[i % 2])  # releases the GIL, as the kernel's call does
            i += 1

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        for _ in range(30):  # how often a copy straddles a rewrite depends on the host; its checksum never does
            assert _applies(dest, source) == xxhash.xxh3_64_intdigest(dest.tobytes())
    finally:
        stop.set()
        writer.join()


@pytest.mark.parametrize("rows, row_bytes, source_stride, dest_stride, offset", [
    (1, 3_000_017, 0, 0, 3), (1, 31, 0, 0, 1), (40, 32768, 262144, 32768, 0), (7, 129, 300, 200, 5),
    (3, 31, 40, 33, 1), (16, 4096 + 96, 4096 + 96, 3 * 4096, 32)])
def test_a_streamed_copy_writes_the_rows_and_nothing_else(rows, row_bytes, source_stride, dest_stride, offset):
    rng = np.random.default_rng(rows * row_bytes + offset)
    source_stride, dest_stride = max(source_stride, row_bytes), max(dest_stride, row_bytes)
    source = _rows(rng, rows, row_bytes, source_stride, offset)
    room = rng.integers(0, 256, offset + (rows - 1) * dest_stride + row_bytes + 64, dtype=np.uint8)
    guard = room.copy()
    dest = np.lib.stride_tricks.as_strided(room[offset:], shape=(rows, row_bytes), strides=(dest_stride, 1))
    if not copy_rows_streamed(dest, source):
        pytest.skip("no AVX2 on this CPU: the callers copy with numpy")
    assert np.array_equal(dest, source)
    outside = np.ones(room.size, dtype=bool)
    for r in range(rows):
        outside[offset + r * dest_stride : offset + r * dest_stride + row_bytes] = False
    assert np.array_equal(room[outside], guard[outside])
