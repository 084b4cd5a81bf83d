"""Scatter destinations: a block's payload copied in rows straight to where an engine keeps it.

A raw block is [num_layers, 2, num_kv_heads, tokens, head_dim]; a KV cache of capacity C keeps the
same rows, each a run of tokens * head_dim elements, but C * head_dim elements apart. A Get item
with ``row_bytes`` set copies payload row i to byte i * ``row_stride`` of its destination slice, so
a KV cache that lives in a shared-memory arena is filled by the daemon's one copy, with no second
copy out of a staging slot::

    payload   [row 0][row 1][row 2] ...                 rows = payload_len / row_bytes
    dest      [row 0]....[row 1]....[row 2]....         row i at i * row_stride

What is copied is bounded like any Get: every row lies inside the destination slice, which the
daemon has bounds-checked inside the caller's own arena; rows are at least `MIN_ROW_BYTES`, so a
call cannot turn into millions of tiny copies; and a payload that is not a whole number of rows
that fit (a coded block, a block of another size) is not copied at all: its item comes back
found, with its meta, and the caller Gets it into a plain slice.

A Put item with ``row_bytes`` set is the same in reverse (`Gather`): the daemon reads payload row i
from byte i * ``row_stride`` of the item's slice, so a block an engine computed into a KV cache in
shared memory is stored by the daemon's one copy, with no copy into a staging slot before it. Its
checksum is of the copy, as for any Put (kvstore/block.py: `copy_checksummed`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import xxhash

from kvstore.block import CHECKSUM_STEP, native_copies

#: Smallest row a scatter copies: a cache line. A row is tokens * head_dim * dtype size (e.g. 16 *
#: 64 * 2 = 2 KiB for 16-token fp16 blocks), so any real layout is far above it.
MIN_ROW_BYTES = 64


class Unfit(ValueError):
    """A payload that is not whole rows of a scatter destination: nothing of it was copied."""


def _check_rows(row_bytes: int, row_stride: int, span: int, what: str) -> None:
    if row_bytes < MIN_ROW_BYTES:
        raise ValueError(f"row_bytes {row_bytes} is under the minimum of {MIN_ROW_BYTES}")
    if not row_bytes <= row_stride <= span:
        raise ValueError(f"row_stride {row_stride} is outside row_bytes..{span} (the {what}'s bytes): rows "
                         f"may not overlap or start past the {what}")


def _whole_rows(payload_len: int, row_bytes: int, row_stride: int, span: int) -> int | None:
    """Rows of a ``payload_len``-byte payload, or None when it is not a whole number of rows that
    all lie within ``span`` bytes."""
    rows, rest = divmod(payload_len, row_bytes)
    if rest or rows == 0 or (rows - 1) * row_stride + row_bytes > span:
        return None
    return rows


def _strided(view: memoryview, rows: int, row_bytes: int, row_stride: int) -> np.ndarray:
    """The rows of ``view`` as a [rows, row_bytes] uint8 array over its memory."""
    base = np.frombuffer(view, dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(base, shape=(rows, row_bytes), strides=(row_stride, 1))


def copy_streamed(dest: np.ndarray, source: np.ndarray) -> None:
    """``source`` into ``dest`` (uint8 arrays of one shape, rows contiguous): a Get's copy, with
    streamed stores where the C kernel applies (`kernels.copy_hash.copy_rows_streamed`), else
    numpy's."""
    copy_streamed_many([(dest, source)])


def copy_streamed_many(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """:func:`copy_streamed` of each ``(dest, source)`` pair, in order: a Get's blocks in one call
    to the kernels (`kernels.copy_hash.copy_rows_streamed_many`), numpy's copy for the pairs the
    C kernel does not take."""
    native = native_copies()
    left = range(len(pairs)) if native is None else native.copy_rows_streamed_many(pairs)
    for i in left:
        np.copyto(*pairs[i])


class Scatter:
    """A destination in rows: payload row i (``row_bytes`` bytes) at ``dest[i * row_stride:]``."""

    def __init__(self, dest: memoryview, row_bytes: int, row_stride: int, payload_len: int | None = None) -> None:
        _check_rows(row_bytes, row_stride, len(dest), "destination")
        self.dest, self.row_bytes, self.row_stride = dest, row_bytes, row_stride
        #: Whether the payload planned into it (``payload_len``: the block a Get found; None: none)
        #: is whole rows of it (`fits`).
        self.fit = payload_len is not None and self.fits(payload_len)

    def rows(self, payload_len: int) -> int | None:
        """Rows of a ``payload_len``-byte payload, or None when it is not a whole number of rows
        that all fit the destination (nothing of it may then be copied)."""
        return _whole_rows(payload_len, self.row_bytes, self.row_stride, len(self.dest))

    def fits(self, payload_len: int) -> bool:
        return self.rows(payload_len) is not None

    def fill(self, source) -> None:
        """Copy ``source`` (a contiguous buffer or uint8 array of a payload that `fits`) in rows;
        `Unfit`, with nothing copied, for one that does not."""
        copy_streamed(*self.pair(source))

    def pair(self, source) -> tuple[np.ndarray, np.ndarray]:
        """The copy :meth:`fill` makes, not made: ``(destination rows, source rows)``, each
        [rows, row_bytes], for :func:`copy_streamed_many` (a tier copying a Get's blocks at once);
        `Unfit` for a payload that is not whole rows of the destination."""
        source = np.frombuffer(source, dtype=np.uint8) if not isinstance(source, np.ndarray) else source
        rows = self.rows(source.nbytes)
        if rows is None:
            raise Unfit(f"a {source.nbytes}-byte payload is not whole rows of {self.row_bytes} bytes "
                        f"within the {len(self.dest)}-byte destination")
        return _strided(self.dest, rows, self.row_bytes, self.row_stride), source.reshape(rows, self.row_bytes)


def scatters(specs: list[tuple[memoryview, int, int, int | None]]) -> list[Scatter | ValueError]:
    """A `Scatter` of each ``(dest, row_bytes, row_stride, payload_len)`` (a Get's items in rows, in
    one call), or the ValueError that refuses it, for the caller to raise naming its item."""
    made: list[Scatter | ValueError] = []
    for dest, row_bytes, row_stride, payload_len in specs:
        try:
            made.append(Scatter(dest, row_bytes, row_stride, payload_len))
        except ValueError as exc:
            made.append(exc)
    return made


class Gather:
    """A Put's payload in rows: row i (``row_bytes`` bytes) at ``source[i * row_stride:]``,
    ``payload_len`` bytes in all. ValueError unless they are whole rows within ``source``."""

    def __init__(self, source: memoryview, row_bytes: int, row_stride: int, payload_len: int) -> None:
        _check_rows(row_bytes, row_stride, len(source), "source slice")
        rows = _whole_rows(payload_len, row_bytes, row_stride, len(source))
        if rows is None:
            raise ValueError(f"payload_len {payload_len} is not whole rows of {row_bytes} bytes within the "
                             f"{len(source)}-byte slice at a stride of {row_stride}")
        self.row_bytes, self.nbytes = row_bytes, payload_len
        self._rows = _strided(source, rows, row_bytes, row_stride)

    def __len__(self) -> int:
        return self.nbytes

    def _pieces(self) -> Iterator[tuple[np.ndarray, int]]:
        """The payload in order as (piece of the source, its byte offset in the payload), each at
        most `CHECKSUM_STEP` bytes: several whole rows where rows are small, part of a row where
        they are large; a Python step per piece, never one per row of a large number."""
        if self.row_bytes < CHECKSUM_STEP:
            step = CHECKSUM_STEP // self.row_bytes
            for start in range(0, len(self._rows), step):
                yield self._rows[start : start + step], start * self.row_bytes
            return
        for row in range(len(self._rows)):
            for start in range(0, self.row_bytes, CHECKSUM_STEP):
                yield self._rows[row, start : start + CHECKSUM_STEP], row * self.row_bytes + start

    def checksum(self) -> int:
        """The payload's checksum (`kvstore.block.payload_checksum` of its bytes in one run); a
        piece that is not one run is copied into a buffer that stays in cache first."""
        buffer = np.empty(min(CHECKSUM_STEP, self.nbytes), dtype=np.uint8)
        digest = xxhash.xxh3_64()
        for piece, _ in self._pieces():
            if not piece.flags.c_contiguous:
                staged = buffer[: piece.size].reshape(piece.shape)
                np.copyto(staged, piece)
                piece = staged
            digest.update(piece)
        return digest.intdigest()

    def copy_checksummed(self, dest: memoryview, step: int = CHECKSUM_STEP) -> int:
        """Copy the rows into ``dest`` (``len(self)`` bytes) in one run and return the checksum of
        what ``dest`` now holds, as `kvstore.block.copy_checksummed` does for a payload in one run:
        in one pass by the C kernel where it applies (rows of a multiple of 64 bytes), else each
        piece hashed from cache just after its copy (``step`` 0: all rows in one copy, then one
        hash)."""
        if len(dest) != self.nbytes:
            raise ValueError(f"destination of {len(dest)} bytes for a {self.nbytes}-byte payload")
        flat = np.frombuffer(dest, dtype=np.uint8)
        native = native_copies()
        if native is not None:
            digest = native.copy_rows_checksummed(flat, self._rows)  # None: rows not whole stripes, or no AVX2
            if digest is not None:
                return digest
        if not step:
            np.copyto(flat.reshape(self._rows.shape), self._rows)
            return xxhash.xxh3_64_intdigest(flat)
        digest = xxhash.xxh3_64()
        for piece, at in self._pieces():
            target = flat[at : at + piece.size].reshape(piece.shape)
            np.copyto(target, piece)
            digest.update(target)
        return digest.intdigest()

    def tobytes(self) -> memoryview:
        """The payload in one run, a new buffer (for a tier that cannot copy rows itself)."""
        return memoryview(np.ascontiguousarray(self._rows).reshape(-1))
