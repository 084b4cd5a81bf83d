"""ArenaSpace: the extents of a client's shared-memory arena, shared by the client's threads.

The arena budget, one way for put, fetch and fetch_layers: a call needs the sum of `slot_bytes` of
its items. A call may take the whole arena (`ArenaSpace.reserve_waiting` refuses more: it could
never be served); put's batches and `KVStoreClient.max_fetch_blocks` plan for half of it, so that a
background store and a load share the arena instead of queueing behind each other.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

from kvstore.limits import MAX_ITEMS_PER_CALL
from tiers.allocator import ExtentAllocator

#: The allocator aligns extents to 4 KiB (and rounds the arena down to it).
ARENA_ALIGN = 4096


def slot_bytes(size: int) -> int:
    """Arena bytes one item of ``size`` bytes takes: its extent, rounded up to the alignment, so
    calls that fill the arena exactly (e.g. 16 x 4 MiB in 64 MiB) still fit."""
    return -(-max(size, 1) // ARENA_ALIGN) * ARENA_ALIGN


def batches(sizes: Sequence[int], budget: int) -> Iterator[range]:
    """Split items of ``sizes`` into runs of at most MAX_ITEMS_PER_CALL whose `slot_bytes` fit
    ``budget`` (a single larger item goes alone)."""
    start, used = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (used + slot_bytes(size) > budget or i - start == MAX_ITEMS_PER_CALL):
            yield range(start, i)
            start, used = i, 0
        used += slot_bytes(size)
    if start < len(sizes):
        yield range(start, len(sizes))


class ArenaSpace:
    """Which extents of an arena of ``capacity`` bytes the client's calls hold.

    It mutates only its allocator, and only under its condition; any thread may call any method.
    Extents a reserve returns belong to the caller until it passes them to `free`, once, after the
    daemon's call on them has ended. `reserve_waiting` (and `slices`) may block: call it only while
    this thread holds no extents of its own, or two threads can each wait for the other's space.
    `try_reserve` never waits for space.
    """

    def __init__(self, capacity: int) -> None:
        self._allocator = ExtentAllocator(capacity, align=ARENA_ALIGN)
        self._space = threading.Condition()  # guards _allocator; notified when extents are freed

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    def try_reserve(self, sizes: Sequence[int]) -> list[int] | None:
        """Extents for ``sizes`` now, or None (nothing kept) when they do not fit."""
        with self._space:
            return self._take(sizes)

    def reserve_waiting(self, sizes: Sequence[int]) -> list[int]:
        """Extents for ``sizes``, waiting while other threads hold the space; ValueError when they
        need more than the whole arena."""
        needed = sum(slot_bytes(s) for s in sizes)
        if needed > self.capacity:
            raise ValueError(f"{len(sizes)} blocks of up to {max(sizes)} bytes need {needed} arena bytes; the "
                             f"arena has {self.capacity}: move fewer blocks per call (see "
                             f"max_fetch_blocks) or create the client with a larger arena_bytes")
        with self._space:
            while (offsets := self._take(sizes)) is None:
                self._space.wait()
        return offsets

    @contextlib.contextmanager
    def slices(self, sizes: Sequence[int]) -> Iterator[list[int]]:
        """`reserve_waiting` for one call, freed when the ``with`` block ends."""
        offsets = self.reserve_waiting(sizes)
        try:
            yield offsets
        finally:
            self.free(offsets)

    def free(self, offsets: Sequence[int]) -> None:
        """Give back extents a reserve returned, and wake the threads waiting for space."""
        with self._space:
            for offset in offsets:
                self._allocator.free(offset)
            self._space.notify_all()

    def _take(self, sizes: Sequence[int]) -> list[int] | None:
        """Extents for ``sizes``, or None with nothing kept; under ``_space``."""
        offsets: list[int] = []
        for size in sizes:
            offset = self._allocator.allocate(max(size, 1))
            if offset is None:
                for taken in offsets:
                    self._allocator.free(taken)
                return None
            offsets.append(offset)
        return offsets
