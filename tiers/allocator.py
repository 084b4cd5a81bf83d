"""First-fit extent allocator over a fixed byte range, with coalescing frees.

Used by tiers that carve blocks out of one pre-allocated arena (CPU now, GPU later), so a put
never allocates memory. Extents are aligned to ``align`` bytes::

    arena  |--used A--|....free....|--used B--|--used C--|.......free.......|
           0          a            f0         b          c                  capacity
    free list (sorted by offset): [(f0, b - f0), (c_end, capacity - c_end)]

Fragmentation is answered by the store's eviction: it frees LRU blocks until an extent fits.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    def __init__(self, capacity: int, align: int = 64) -> None:
        if capacity <= 0 or align <= 0 or align & (align - 1):
            raise ValueError(f"capacity must be > 0 and align a power of two, got {capacity}, {align}")
        self.capacity = capacity - capacity % align
        self.align = align
        self._free_offsets: list[int] = [0]
        self._free_sizes: dict[int, int] = {0: self.capacity}
        self._used: dict[int, int] = {}  # offset -> rounded size

    def _round(self, nbytes: int) -> int:
        return max(self.align, (nbytes + self.align - 1) // self.align * self.align)

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def used_extents(self) -> dict[int, int]:
        """Allocated extents as {offset: rounded size} (a copy)."""
        return dict(self._used)

    @property
    def largest_free(self) -> int:
        return max(self._free_sizes.values(), default=0)

    def can_allocate(self, nbytes: int) -> bool:
        return self._round(nbytes) <= self.largest_free

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least ``nbytes``, or None when no free extent fits."""
        size = self._round(nbytes)
        for offset in self._free_offsets:
            free = self._free_sizes[offset]
            if free >= size:
                index = bisect.bisect_left(self._free_offsets, offset)
                del self._free_offsets[index]
                del self._free_sizes[offset]
                if free > size:
                    bisect.insort(self._free_offsets, offset + size)
                    self._free_sizes[offset + size] = free - size
                self._used[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        index = bisect.bisect_left(self._free_offsets, offset)
        # Merge with the following free extent.
        if index < len(self._free_offsets) and self._free_offsets[index] == offset + size:
            size += self._free_sizes.pop(self._free_offsets.pop(index))
        # Merge with the preceding free extent.
        if index > 0:
            prev = self._free_offsets[index - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(index, offset)
        self._free_sizes[offset] = size

    def check_integrity(self) -> None:
        extents = sorted([(o, s, "used") for o, s in self._used.items()] +
                         [(o, s, "free") for o, s in self._free_sizes.items()])
        cursor = 0
        previous_kind = None
        for offset, size, kind in extents:
            if offset != cursor:
                raise RuntimeError(f"allocator: gap or overlap at {cursor} (next extent at {offset})")
            if kind == "free" and previous_kind == "free":
                raise RuntimeError(f"allocator: adjacent free extents not coalesced at {offset}")
            cursor = offset + size
            previous_kind = kind
        if cursor != self.capacity:
            raise RuntimeError(f"allocator: extents cover {cursor} bytes, capacity is {self.capacity}")
        if self._free_offsets != sorted(self._free_sizes):
            raise RuntimeError("allocator: free list out of order")
