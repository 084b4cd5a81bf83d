"""A payload copied and hashed in one pass (`copy_hash.c`): the daemon's Put copy; and its Get copy
with streamed stores.

`copy_rows_checksummed` copies rows (or one run) of bytes into a destination and returns the
XXH3-64 of what it wrote, the block format's payload checksum (`kvstore.block.payload_checksum`),
reading each source byte once (but the last block's, at most 1 KiB, hashed back from the
destination) and streaming the stores into a 32-byte aligned destination. It returns None where the
C kernel does not apply (no compiler, no AVX2, a payload of 240 bytes or fewer, several rows of a
length that is not a multiple of 64, overlapping buffers): the caller then copies and hashes the way it did before (`kvstore/block.py`,
`kvstore/scatter.py`), which is also the reference the tests hold the kernel to.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from kernels.native import build

SOURCE = Path(__file__).with_name("copy_hash.c")
_U64 = ctypes.c_uint64


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use (`kernels.native.build`); None when it cannot be."""
    library = build(SOURCE, "copy and hash")
    if library is None:
        return None
    library.kvstore_copy_xxh3.restype = ctypes.c_int
    library.kvstore_copy_xxh3.argtypes = [ctypes.c_void_p, ctypes.c_void_p, _U64, _U64, _U64, ctypes.POINTER(_U64)]
    library.kvstore_copy_streamed.restype = ctypes.c_int
    library.kvstore_copy_streamed.argtypes = [ctypes.c_void_p, _U64, ctypes.c_void_p, _U64, _U64, _U64]
    return library


def copy_rows_checksummed(dest: np.ndarray, rows: np.ndarray) -> int | None:
    """Copy ``rows`` (uint8 [R, row_bytes], each row contiguous, any row stride; or [N], one run)
    into ``dest`` (uint8 [R * row_bytes], contiguous, writable) and return the XXH3-64 of ``dest``;
    None, with nothing written, where the kernel does not apply. ctypes releases the GIL for the
    call, so it runs beside the event loop when called from a worker thread."""
    library = native_library()
    if library is None or rows.size == 0 or np.may_share_memory(dest, rows):
        return None  # nothing to copy, or overlapping buffers: the caller's path
    if rows.ndim == 1:
        rows = rows.reshape(1, -1)
    count, row_bytes = rows.shape if rows.ndim == 2 else (0, 0)
    if (rows.ndim != 2 or rows.dtype != np.uint8 or dest.dtype != np.uint8 or dest.size != count * row_bytes
            or not dest.flags.c_contiguous or not dest.flags.writeable or (row_bytes > 1 and rows.strides[1] != 1)
            or (count > 1 and rows.strides[0] < 0)):
        raise ValueError(f"copy_rows_checksummed needs uint8 rows with contiguous rows and a contiguous uint8 "
                         f"destination of their size; got rows {rows.dtype} {rows.shape} strides {rows.strides}, "
                         f"destination {dest.dtype} {dest.shape}")
    digest = _U64()
    status = library.kvstore_copy_xxh3(dest.ctypes.data, rows.ctypes.data, row_bytes, rows.strides[0] if count > 1
                                       else row_bytes, count, ctypes.byref(digest))
    return digest.value if status == 0 else None


def copy_rows_streamed(dest: np.ndarray, source: np.ndarray) -> bool:
    """Copy ``source`` into ``dest`` (uint8, both [R, row_bytes] with contiguous rows at any row
    stride, or [N]) with streamed stores; False, with nothing written, where the kernel does not
    apply (no compiler, no AVX2, nothing to copy, overlapping buffers). The GIL is released for the
    call."""
    library = native_library()
    if library is None or source.size == 0 or np.may_share_memory(dest, source):
        return False  # nothing to copy, or overlapping buffers: the caller's path
    dest, source = (a.reshape(1, -1) if a.ndim == 1 else a for a in (dest, source))
    if (dest.dtype != np.uint8 or source.dtype != np.uint8 or dest.shape != source.shape or dest.ndim != 2
            or not dest.flags.writeable or any(a.shape[1] > 1 and a.strides[1] != 1 for a in (dest, source))
            or (dest.shape[0] > 1 and min(dest.strides[0], source.strides[0]) < 0)):
        raise ValueError(f"copy_rows_streamed needs uint8 rows of one shape, each row contiguous, into writable "
                         f"memory; got {source.dtype} {source.shape} strides {source.strides} into {dest.dtype} "
                         f"{dest.shape} strides {dest.strides}")
    rows, row_bytes = dest.shape
    return library.kvstore_copy_streamed(dest.ctypes.data, dest.strides[0], source.ctypes.data, source.strides[0],
                                         row_bytes, rows) == 0


def copy_rows_streamed_many(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[int]:
    """:func:`copy_rows_streamed` of each ``(dest, source)`` pair, in order (a Get's blocks, one
    call from Python's side); the indices of the pairs it did not copy, left to the caller's path."""
    return [i for i, (dest, source) in enumerate(pairs) if not copy_rows_streamed(dest, source)]
