"""Write-behind: one bounded queue and its workers per lower tier, copying blocks down after a Put.

    Put ──enqueue──► queue[1] ──worker──► tier 1 ──put (waits for room)──► queue[2] ──► tier 2 ...

A Put queues its key for tier 1 without waiting (a full queue drops the copy and counts it: the
block still moves down when evicted). A worker copies a queued block from the highest tier holding
it, re-encoded into the target's codec, then queues it for the tier below, waiting for room there:
a slow tier (S3) backs its queue up into the one above, never into Put.

A copy reads the block under the store lock but writes it without, so a slow tier never holds up
Put; a Delete or Clear that lands during such a write marks it unwanted (:meth:`cancel`), and the
worker deletes the copy it just made.

Runs on the store's event loop: ``enqueue`` and ``cancel`` never wait, the workers are its tasks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from kvstore.block import CorruptBlockError
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.residency import Residency
from kvstore.daemon.tier_io import TierIO
from tiers.base import Tier, TierError, TierUnavailableError

log = logging.getLogger(__name__)


class WriteBehind:
    def __init__(self, tiers: list[Tier], residency: Residency, io: TierIO, lock: asyncio.Lock, metrics: Metrics, *,
                 codecs: list, queue_depth: int, make_room: Callable[[int, int, str], Awaitable[None]],
                 count_write_error: Callable[[Tier, str, Exception], None],
                 refresh_gauges: Callable[[], None]) -> None:
        """Copies find their source through ``residency`` and record the copy there, under the
        store's ``lock``; tiers are called through ``io``. ``codecs``: the codec each tier
        re-encodes copies into (None: keep). ``queue_depth``: each lower tier's queue bound.
        ``make_room(level, nbytes, owner)``: evict (and demote) until a copy fits in tier
        ``level``, under ``lock`` (eviction.py). ``count_write_error(target, what, exc)``: a copy
        into ``target`` failed (counted and logged by the store). ``refresh_gauges()``: the
        store's gauges (tiers' bytes and blocks, these queues' depths), after each copy."""
        self.tiers, self.residency, self.io, self.lock, self.metrics = tiers, residency, io, lock, metrics
        self.codecs = codecs
        self._make_room, self._count_write_error, self._refresh_gauges = make_room, count_write_error, refresh_gauges
        #: Write-behind queue of each lower tier (keyed by its level), holding keys to copy into it.
        self._queues: dict[int, asyncio.Queue[bytes]] = {
            level: asyncio.Queue(maxsize=queue_depth) for level in range(1, len(tiers))}
        self._queued: set[tuple[int, bytes]] = set()  # (level, key) now in a queue: no duplicates
        #: Keys being written into a lower tier outside the store lock -> still wanted (Delete/Clear
        #: set False, and the writer deletes the copy it just made).
        self._inflight: dict[bytes, bool] = {}

    def start(self) -> list[asyncio.Task]:
        """Start the workers (on the running loop); the caller cancels the tasks returned."""
        loop = asyncio.get_running_loop()
        workers = []
        for level in self._queues:
            # One worker per single-writer tier (disk); a few for tiers that take parallel writes.
            count = max(1, self.tiers[level].io_threads // 4)
            workers += [loop.create_task(self._worker(level)) for _ in range(count)]
        return workers

    @property
    def depth(self) -> int:
        """Pending copies, all lower tiers together."""
        return sum(q.qsize() for q in self._queues.values())

    async def flush(self) -> None:
        """Wait until every queued copy is done (each tier's queue feeds the next)."""
        for level in sorted(self._queues):
            await self._queues[level].join()

    def enqueue(self, level: int, key: bytes) -> None:
        """Queue a copy of ``key`` into tier ``level`` without waiting; a full queue drops it and
        counts it (the block still reaches that tier when evicted above)."""
        if level not in self._queues or (level, key) in self._queued:
            return
        try:
            self._queues[level].put_nowait(key)
        except asyncio.QueueFull:
            self.metrics.queue_dropped.inc()
            self.metrics.tier_queue_dropped.labels(self.tiers[level].name).inc()
            return
        self._queued.add((level, key))

    def cancel(self, key: bytes | None = None) -> None:
        """A copy of ``key`` (None: of every key) being written now is no longer wanted."""
        for written in ([key] if key is not None else list(self._inflight)):
            if written in self._inflight:
                self._inflight[written] = False

    def refresh_gauges(self) -> None:
        """Set the queue depth gauges (all tiers, and each lower tier's)."""
        for level, queue in self._queues.items():
            self.metrics.tier_queue_depth.labels(self.tiers[level].name).set(queue.qsize())
        self.metrics.queue_depth.set(self.depth)

    async def _worker(self, level: int) -> None:
        """Worker of tier ``level``'s queue: copy each block in, then queue it for the tier below,
        waiting for room there (backpressure from a slower tier stops here, not at Put)."""
        queue = self._queues[level]
        while True:
            key = await queue.get()
            try:
                self._queued.discard((level, key))
                if await self.copy(level, key) and level + 1 in self._queues \
                        and (level + 1, key) not in self._queued:
                    self._queued.add((level + 1, key))
                    await self._queues[level + 1].put(key)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let a worker die
                log.exception("write-behind of %s into %s failed", key.hex(), self.tiers[level].name)
            finally:
                queue.task_done()
                self.refresh_gauges()

    async def copy(self, level: int, key: bytes) -> bool:
        """Copy ``key`` into tier ``level`` from the highest tier above holding it; True if the
        tier holds it afterwards. Reads under the store lock, writes without it."""
        target = self.tiers[level]
        if key in target:
            return True
        async with self.lock:
            source = self.residency.locate(key)
            if source is None or source > level or key in target:
                return key in target
            if not target.available:
                self._count_write_error(target, f"write-behind of {key.hex()}",
                                        TierUnavailableError(f"{target.name} is unreachable"))
                return False
            try:
                header, payload = await self.io.read_whole(self.tiers[source], key)
                if not self.tiers[source].blocking_io:
                    payload = memoryview(bytes(payload))  # arena bytes are reused once the lock is free
                await self._make_room(level, header.block_len, self.residency.owner(key))
            except (TierError, CorruptBlockError, KeyError) as exc:
                self._count_write_error(target, f"write-behind of {key.hex()}", exc)
                return False
            self._inflight[key] = True
        try:
            header, payload = await self.io.encoded(self.codecs[level], header, payload)
            await self.io.run(target, target.put, header, payload)
        except asyncio.CancelledError:
            self._inflight.pop(key, None)
            raise
        except Exception as exc:  # noqa: BLE001 - a block the codec cannot take is not copied; others go on
            self._inflight.pop(key, None)
            self._count_write_error(target, f"write-behind of {key.hex()}", exc)
            return False
        async with self.lock:
            if not self._inflight.pop(key, True):  # deleted while we wrote: undo
                await self.io.run(target, target.delete, key)
                return False
            self.residency.record(level, key)
            self.metrics.bytes_in.labels(target.name).inc(header.block_len)
        self._refresh_gauges()
        return True
