"""Promotion: a block hit in a lower tier is copied into the top tier in the background.

    hit in tier n > 0 ─► schedule(key) ─► task: read it from tier n (a blocking tier: before the
    lock) ─► under the lock, still the same block? store it in the top tier (evicting as Put does)
    ─► write-through: queue it for tier 1 (fills the tiers between: disk under cpu, from s3)

A failure costs only the promotion: an unreachable tier is counted against the tier that failed
(``kvstore_tier_unavailable``), a full top tier is logged.

Memory is bounded: promotions in flight hold at most ``MAX_PROMOTING_BYTES`` of blocks (each reads
its block into a buffer of its own); the rest wait, at most ``MAX_WAITING`` keys, in order, and
what does not fit there is not promoted (a later hit asks again). A Prefetch of a terabyte of
disk blocks so costs the daemon no more memory than one of a few blocks. The promoted copy is
charged to the block's owner within its quota, like a Put of it.

Runs on the store's event loop: ``schedule`` starts its tasks there.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Awaitable, Callable

from kvstore.block import BlockHeader
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.residency import Residency
from tiers.base import Tier, TierError, TierFullError, TierUnavailableError

log = logging.getLogger("kvstore.daemon.promotion")

#: Block bytes that promotions in flight may hold at once (one larger block may run alone).
MAX_PROMOTING_BYTES = 128 * 2**20
#: Keys that may wait for a promotion slot; past that, a request to promote is declined.
MAX_WAITING = 4096


class Promoter:
    def __init__(self, tiers: list[Tier], residency: Residency, lock: asyncio.Lock, metrics: Metrics, *,
                 read_or_drop: Callable[[int, bytes], Awaitable[tuple[BlockHeader, memoryview] | None]],
                 store_in: Callable[[int, BlockHeader, memoryview], Awaitable[BlockHeader]],
                 enqueue_copy: Callable[[int, bytes], None] | None, refresh_gauges: Callable[[], None],
                 max_bytes: int = MAX_PROMOTING_BYTES, max_waiting: int = MAX_WAITING) -> None:
        """Promotions find blocks through ``residency`` and copy them under the store's ``lock``.
        ``read_or_drop(level, key)``: the whole block, or None with a bad copy dropped (reads.py).
        ``store_in(0, header, payload)``: write it into the top tier, evicting (and demoting) as a
        Put does, under ``lock`` (eviction.py). ``enqueue_copy(1, key)``: queue a write-behind
        copy into tier 1 (WriteBehind.enqueue); None under write-back. ``refresh_gauges()``: the
        store's gauges (tiers' bytes and blocks), after each promotion ends."""
        self.tiers, self.residency, self.lock, self.metrics = tiers, residency, lock, metrics
        self._read_or_drop, self._store_in = read_or_drop, store_in
        self._enqueue_copy, self._refresh_gauges = enqueue_copy, refresh_gauges
        self.max_bytes, self.max_waiting = max_bytes, max_waiting
        #: Keys promoting now -> the bytes counted for them.
        self._promoting: dict[bytes, int] = {}
        self._promoting_bytes = 0
        #: Keys waiting for room in ``max_bytes``, oldest first -> their bytes.
        self._waiting: OrderedDict[bytes, int] = OrderedDict()
        #: Promotions running now (the store cancels them on close).
        self.tasks: set[asyncio.Task] = set()

    @property
    def promoting_bytes(self) -> int:
        """Bytes of the blocks being promoted now (never above ``max_bytes`` but for one block)."""
        return self._promoting_bytes

    def schedule(self, key: bytes) -> bool:
        """Copy a lower-tier block into the top tier in the background, now or once promotions in
        flight leave room. False if there is nothing to do or no room to wait."""
        level = self.residency.locate(key)
        if level is None or level == 0 or key in self._promoting or key in self._waiting:
            return False
        if len(self._waiting) >= self.max_waiting:
            return False
        self._waiting[key] = self.tiers[level].header(key).block_len
        self._start_waiting()
        return True

    def _start_waiting(self) -> None:
        while self._waiting:
            key, nbytes = next(iter(self._waiting.items()))
            if self._promoting and self._promoting_bytes + nbytes > self.max_bytes:
                return
            del self._waiting[key]
            self._promoting[key] = nbytes
            self._promoting_bytes += nbytes
            task = asyncio.get_running_loop().create_task(self._promote(key))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def cancel(self) -> None:
        """Drop the waiting promotions and cancel those running (the store's close)."""
        self._waiting.clear()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _promote(self, key: bytes) -> None:
        try:
            level = self.residency.locate(key)
            prefetched = None
            if level is not None and level > 0 and self.tiers[level].blocking_io:
                # A disk or S3 read happens before the lock: a slow tier delays no other call.
                prefetched = await self._read(level, key)
                if prefetched is None:
                    return
            async with self.lock:
                level = self.residency.locate(key)
                if level is None or level == 0:
                    return
                if prefetched is not None and self.tiers[level].header(key).checksum == prefetched[0].checksum:
                    header, payload = prefetched
                else:  # a memory tier (read under the lock: its view is only valid there), or it changed
                    found = await self._read(level, key)
                    if found is None:
                        return
                    header, payload = found
                try:
                    await self._store_in(0, header, payload)
                except TierUnavailableError as exc:
                    self._unavailable(0, key, exc)
                    return
                self.metrics.promotions.labels(self.tiers[0].name).inc()
            if self._enqueue_copy is not None and level > 1:
                self._enqueue_copy(1, key)  # fill the tiers between (disk under cpu) behind it
        except TierFullError as exc:
            log.info("promotion of %s skipped: %s", key.hex(), exc)
        except TierError as exc:  # e.g. an I/O error: logged, and the block stays where it is
            log.warning("promotion of %s failed: %s", key.hex(), exc)
        finally:
            self._promoting_bytes -= self._promoting.pop(key)
            self._refresh_gauges()
            self._start_waiting()

    async def _read(self, level: int, key: bytes) -> tuple[BlockHeader, memoryview] | None:
        """The whole block from tier ``level``, or None: dropped as corrupt, vanished, or the tier
        is unreachable (counted against it)."""
        try:
            return await self._read_or_drop(level, key)
        except TierUnavailableError as exc:
            self._unavailable(level, key, exc)
            return None

    def _unavailable(self, level: int, key: bytes, exc: Exception) -> None:
        self.metrics.unavailable.labels(self.tiers[level].name).inc()
        log.debug("promotion of %s skipped: %s", key.hex(), exc)
