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
"""

from __future__ import annotations

import numpy as np

#: Smallest row a scatter copies: a cache line. A row is tokens * head_dim * dtype size (e.g. 16 *
#: 64 * 2 = 2 KiB for 16-token fp16 blocks), so any real layout is far above it.
MIN_ROW_BYTES = 64


class Unfit(ValueError):
    """A payload that is not whole rows of a scatter destination: nothing of it was copied."""


class Scatter:
    """A destination in rows: payload row i (``row_bytes`` bytes) at ``dest[i * row_stride:]``."""

    def __init__(self, dest: memoryview, row_bytes: int, row_stride: int) -> None:
        if row_bytes < MIN_ROW_BYTES:
            raise ValueError(f"row_bytes {row_bytes} is under the minimum of {MIN_ROW_BYTES}")
        if not row_bytes <= row_stride <= len(dest):
            raise ValueError(f"row_stride {row_stride} is outside row_bytes..{len(dest)} (the destination's "
                             f"bytes): rows may not overlap or start past the destination")
        self.dest, self.row_bytes, self.row_stride = dest, row_bytes, row_stride

    def rows(self, payload_len: int) -> int | None:
        """Rows of a ``payload_len``-byte payload, or None when it is not a whole number of rows
        that all fit the destination (nothing of it may then be copied)."""
        rows, rest = divmod(payload_len, self.row_bytes)
        if rest or rows == 0 or (rows - 1) * self.row_stride + self.row_bytes > len(self.dest):
            return None
        return rows

    def fits(self, payload_len: int) -> bool:
        return self.rows(payload_len) is not None

    def fill(self, source) -> None:
        """Copy ``source`` (a contiguous buffer or uint8 array of a payload that `fits`) in rows;
        `Unfit`, with nothing copied, for one that does not."""
        source = np.frombuffer(source, dtype=np.uint8) if not isinstance(source, np.ndarray) else source
        rows = self.rows(source.nbytes)
        if rows is None:
            raise Unfit(f"a {source.nbytes}-byte payload is not whole rows of {self.row_bytes} bytes "
                        f"within the {len(self.dest)}-byte destination")
        base = np.frombuffer(self.dest, dtype=np.uint8)
        target = np.lib.stride_tricks.as_strided(base, shape=(rows, self.row_bytes), strides=(self.row_stride, 1))
        np.copyto(target, source.reshape(rows, self.row_bytes))
