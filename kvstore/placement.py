"""Placement: which tier holds which block, LRU eviction, demotion, promotion and pins.

Tiers are ordered top (fastest) to bottom: ``[cpu, disk]`` today, ``[gpu, cpu, disk, s3]`` in time.

    Put ──► top tier ──(write-through queue, bounded)──► lower tiers
                 │  full? evict LRU: a victim the next tier lacks is demoted first
    Get ◄── first tier holding the key; a lower-tier hit is promoted to the top in the background
    Lookup: longest run of consecutive keys held by any tier (no side effects)

Concurrency: everything runs on one asyncio loop. Index changes and evictions hold ``_lock``;
reads from the in-memory top tier are synchronous (no await between finding and copying a block),
so they need no lock. Blocking tiers (disk) are read in worker threads and written by one writer
thread. A block found corrupt is deleted, counted, and reported as a miss.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

from kvstore.block import BlockHeader, CorruptBlockError
from kvstore.keys import KVLayout
from kvstore.metrics import Metrics
from kvstore.transcode import transcode
from tiers.base import Tier, TierError, TierFullError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Worker threads for blocking-tier reads (promotions, demotions and Gets).
READER_THREADS = 4


@dataclass(frozen=True)
class LookupResult:
    hits: int               # keys[0:hits] are stored
    tiers: tuple[str, ...]  # highest tier of each hit


@dataclass(frozen=True)
class GetResult:
    header: BlockHeader
    tier: str


class BlockStore:
    def __init__(self, tiers: list[Tier], metrics: Metrics | None = None, write_through: bool = True,
                 queue_depth: int = 256, promote_on_get: bool = True, codecs: list[str | None] | None = None) -> None:
        if not tiers:
            raise ValueError("BlockStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if codecs is not None and len(codecs) != len(tiers):
            raise ValueError(f"codecs must name one codec (or None) per tier: {len(codecs)} for {len(tiers)} tiers")
        #: Codec each tier re-encodes blocks into when the daemon copies them down (None: keep).
        self.codecs = list(codecs) if codecs is not None else [None] * len(tiers)
        self.tiers = tiers
        self.metrics = metrics or Metrics()
        self.write_through = write_through
        self.promote_on_get = promote_on_get
        self._lru: list[OrderedDict[bytes, None]] = [OrderedDict.fromkeys(t.keys()) for t in tiers]
        self._pinned: set[bytes] = set()
        self._layouts: dict[bytes, KVLayout] = {}
        for tier in tiers:
            for key in tier.keys():
                header = tier.header(key)
                self._layouts.setdefault(header.namespace, header.layout)
        self._lock = asyncio.Lock()
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=queue_depth)
        #: Keys queued for a lower-tier copy -> still wanted (Delete/Clear cancel it).
        self._pending: dict[bytes, bool] = {}
        self._promoting: set[bytes] = set()
        self._background: set[asyncio.Task] = set()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-writer")
        self._readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvstore-reader")
        #: Executor calls one batched Get splits its blocking reads into: one per core, since a
        #: disk read from the page cache is a CPU-bound copy and hash (more would only contend).
        self.read_lanes = max(1, min(READER_THREADS, os.cpu_count() or 1))
        self._worker: asyncio.Task | None = None
        self.write_errors = 0
        self._refresh_gauges()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._worker is None and len(self.tiers) > 1:
            self._worker = asyncio.get_running_loop().create_task(self._write_lower_tiers())

    async def close(self, flush: bool = True) -> None:
        """Stop background work; with ``flush``, first finish queued lower-tier writes."""
        if flush and self._worker is not None:
            await self._queue.join()
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()

    async def flush(self) -> None:
        """Wait until every queued lower-tier write is done."""
        await self._queue.join()

    async def demote_all(self) -> int:
        """Copy every block the lowest tier lacks down to it (write-back shutdown). Returns blocks copied."""
        copied = 0
        async with self._lock:
            for level in range(len(self.tiers) - 1):
                for key in list(self._lru[level]):
                    if key not in self.tiers[-1] and await self._copy_down(level, key):
                        copied += 1
        return copied

    # -- queries ------------------------------------------------------------------------------

    def layout_of(self, namespace: bytes) -> KVLayout | None:
        return self._layouts.get(namespace)

    def locate(self, key: bytes) -> int | None:
        """Index of the highest tier holding ``key``."""
        for level, tier in enumerate(self.tiers):
            if key in tier:
                return level
        return None

    def lookup(self, keys: list[bytes]) -> LookupResult:
        tiers: list[str] = []
        for key in keys:
            level = self.locate(key)
            if level is None:
                break
            tiers.append(self.tiers[level].name)
        return LookupResult(len(tiers), tuple(tiers))

    def header(self, key: bytes) -> BlockHeader | None:
        level = self.locate(key)
        return None if level is None else self.tiers[level].header(key)

    # -- writes -------------------------------------------------------------------------------

    def check_namespace(self, header: BlockHeader) -> None:
        known = self._layouts.get(header.namespace)
        if known is not None and known != header.layout:
            raise ValueError(f"layout {header.layout} does not match namespace {header.namespace.hex()}, "
                             f"whose blocks have layout {known}")

    async def put(self, header: BlockHeader, payload: memoryview) -> None:
        """Store a block in the top tier (evicting as needed) and queue its copy to lower tiers.

        Raises ValueError for a layout that contradicts the namespace and TierFullError when the
        block cannot fit even after evicting every unpinned block.
        """
        self.check_namespace(header)
        async with self._lock:
            await self._store_in(0, header, payload)
            self._layouts.setdefault(header.namespace, header.layout)
        if self.write_through and len(self.tiers) > 1 and header.key not in self._pending:
            try:
                self._queue.put_nowait(header.key)
                self._pending[header.key] = True
            except asyncio.QueueFull:
                # The block still reaches the lower tier when evicted (demotion).
                self.metrics.queue_dropped.inc()
        self._refresh_gauges()

    async def _store_in(self, level: int, header: BlockHeader, payload: memoryview) -> None:
        """Write one block into tier ``level``, evicting LRU blocks to make room. Holds ``_lock``."""
        tier = self.tiers[level]
        if header.key in tier and tier.header(header.key).checksum == header.checksum:
            # Keys are content addresses: the same block again only refreshes its LRU position.
            self._lru[level].move_to_end(header.key)
            return
        if header.key in tier:
            tier.delete(header.key)
            self._lru[level].pop(header.key, None)
        await self._make_room(level, header.block_len)
        await self._run(tier, tier.put, header, payload)
        self._lru[level][header.key] = None
        self._lru[level].move_to_end(header.key)
        self.metrics.bytes_in.labels(tier.name).inc(header.block_len)

    async def _make_room(self, level: int, nbytes: int) -> None:
        tier = self.tiers[level]
        while not tier.can_fit(nbytes):
            victim = next((k for k in self._lru[level] if k not in self._pinned), None)
            if victim is None:
                raise TierFullError(f"{tier.name}: {nbytes} bytes do not fit and every stored block is pinned "
                                    f"(capacity {tier.capacity_bytes} bytes)")
            await self._evict(level, victim)

    async def _evict(self, level: int, key: bytes) -> None:
        if level + 1 < len(self.tiers) and key not in self.tiers[level + 1]:
            if await self._copy_down(level, key):
                self.metrics.demotions.labels(self.tiers[level + 1].name).inc()
        self.tiers[level].delete(key)
        self._lru[level].pop(key, None)
        self.metrics.evictions.labels(self.tiers[level].name).inc()

    async def _copy_down(self, level: int, key: bytes) -> bool:
        """Copy a block from tier ``level`` into the next one. Holds ``_lock``. False on failure."""
        source, target = self.tiers[level], self.tiers[level + 1]
        try:
            header, payload = await self._read_whole(level, key)
            spec = self.codecs[level + 1]
            if spec is not None and spec != header.codec:
                header, payload = await asyncio.get_running_loop().run_in_executor(
                    self._readers, transcode, header, payload, spec)
            await self._store_in(level + 1, header, payload)
        except (TierError, CorruptBlockError, KeyError) as exc:
            self.write_errors += 1
            self.metrics.write_errors.labels(target.name).inc()
            log.warning("demoting %s from %s to %s failed: %s", key.hex(), source.name, target.name, exc)
            return False
        return True

    async def _read_whole(self, level: int, key: bytes) -> tuple[BlockHeader, memoryview]:
        tier = self.tiers[level]
        header = tier.header(key)
        view = getattr(tier, "payload_view", None)
        if view is not None:
            return header, view(key)
        buffer = memoryview(bytearray(header.payload_len))
        await self._run(tier, tier.read_payload_into, key, buffer, reader=True)
        return header, buffer

    async def _write_lower_tiers(self) -> None:
        """Write-through worker: copy queued blocks from the top tier to the next one."""
        while True:
            key = await self._queue.get()
            try:
                wanted = self._pending.pop(key, False)
                if wanted and key in self.tiers[0] and key not in self.tiers[1]:
                    async with self._lock:
                        if key in self.tiers[0] and key not in self.tiers[1]:
                            await self._copy_down(0, key)
            except Exception:  # never let the worker die
                log.exception("write-through of %s failed", key.hex())
            finally:
                self._queue.task_done()
                self.metrics.queue_depth.set(self._queue.qsize())

    # -- reads --------------------------------------------------------------------------------

    async def get_into(self, key: bytes, dest: memoryview) -> GetResult | None:
        """Copy the payload of ``key`` into ``dest``; None on a miss. Corrupt copies are dropped."""
        for level, tier in enumerate(self.tiers):
            if key not in tier:
                continue
            try:
                if tier.blocking_io:
                    header = await self._run(tier, tier.read_payload_into, key, dest, reader=True)
                else:
                    header = tier.read_payload_into(key, dest)
            except KeyError:
                continue  # deleted underneath us: try the next tier
            except CorruptBlockError as exc:
                await self._drop_corrupt(level, key, exc)
                continue
            return self._hit(level, key, header)
        self.metrics.misses.inc()
        return None

    async def get_many_into(self, requests: list[tuple[bytes, memoryview]]) -> list[GetResult | None]:
        """:meth:`get_into` for many blocks (one Get call); results in request order.

        Blocks in memory tiers are copied at once. Blocks whose highest copy is in a blocking tier
        are read in at most ``read_lanes`` executor calls (not one thread hop per block); a block
        that turns out corrupt or vanished there falls back to :meth:`get_into`, which drops the
        corrupt copy and tries the tiers below.
        """
        results: list[GetResult | None] = [None] * len(requests)
        blocking: dict[int, list[int]] = {}  # tier level -> indices into requests
        for i, (key, dest) in enumerate(requests):
            level = self.locate(key)
            if level is not None and self.tiers[level].blocking_io:
                blocking.setdefault(level, []).append(i)
            else:
                results[i] = await self.get_into(key, dest)  # memory tier or miss: no await inside
        if not blocking:
            return results
        loop = asyncio.get_running_loop()
        calls, lanes_of = [], []
        for level, indices in blocking.items():
            lanes = min(self.read_lanes, len(indices))
            for lane in range(lanes):
                lane_indices = indices[lane::lanes]
                calls.append(loop.run_in_executor(self._readers, _read_lane, self.tiers[level],
                                                  [requests[i] for i in lane_indices]))
                lanes_of.append((level, lane_indices))
        outcomes = await asyncio.gather(*calls)
        for (level, lane_indices), lane_outcomes in zip(lanes_of, outcomes):
            for i, outcome in zip(lane_indices, lane_outcomes):
                key, dest = requests[i]
                if isinstance(outcome, BlockHeader):
                    results[i] = self._hit(level, key, outcome)
                    continue
                if isinstance(outcome, CorruptBlockError):
                    await self._drop_corrupt(level, key, outcome)
                results[i] = await self.get_into(key, dest)  # the tiers below, or a counted miss
        return results

    def _hit(self, level: int, key: bytes, header: BlockHeader) -> GetResult:
        tier = self.tiers[level]
        if key in self._lru[level]:
            self._lru[level].move_to_end(key)
        self.metrics.hits.labels(tier.name).inc()
        self.metrics.bytes_out.labels(tier.name).inc(header.payload_len)
        if level > 0 and self.promote_on_get:
            self.schedule_promotion(key)
        return GetResult(header, tier.name)

    def schedule_promotion(self, key: bytes) -> bool:
        """Copy a lower-tier block into the top tier in the background. False if nothing to do."""
        level = self.locate(key)
        if level is None or level == 0 or key in self._promoting:
            return False
        self._promoting.add(key)
        task = asyncio.get_running_loop().create_task(self._promote(key))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    async def _promote(self, key: bytes) -> None:
        try:
            async with self._lock:
                level = self.locate(key)
                if level is None or level == 0:
                    return
                try:
                    header, payload = await self._read_whole(level, key)
                except CorruptBlockError as exc:
                    await self._drop_corrupt(level, key, exc)
                    return
                except KeyError:
                    return
                await self._store_in(0, header, payload)
                self.metrics.promotions.labels(self.tiers[0].name).inc()
        except TierFullError as exc:
            log.info("promotion of %s skipped: %s", key.hex(), exc)
        finally:
            self._promoting.discard(key)
            self._refresh_gauges()

    async def _drop_corrupt(self, level: int, key: bytes, exc: Exception) -> None:
        tier = self.tiers[level]
        log.warning("%s: block %s is corrupt (%s); deleted", tier.name, key.hex(), exc)
        self.metrics.corrupt.labels(tier.name).inc()
        tier.delete(key)
        self._lru[level].pop(key, None)
        if self.locate(key) is None:
            self._pinned.discard(key)

    # -- maintenance --------------------------------------------------------------------------

    async def delete(self, keys: list[bytes]) -> int:
        """Remove blocks from every tier; absent keys are not an error (the cache may have evicted them)."""
        deleted = 0
        async with self._lock:
            for key in keys:
                found = False
                for level, tier in enumerate(self.tiers):
                    if key in tier:
                        tier.delete(key)
                        self._lru[level].pop(key, None)
                        found = True
                self._pinned.discard(key)
                if key in self._pending:
                    self._pending[key] = False
                deleted += found
        self._refresh_gauges()
        return deleted

    def missing(self, keys: list[bytes]) -> list[bytes]:
        return [k for k in keys if self.locate(k) is None]

    def pin(self, keys: list[bytes]) -> int:
        """Keep blocks from eviction in every tier holding them. Caller checks they exist."""
        before = len(self._pinned)
        self._pinned.update(keys)
        return len(self._pinned) - before

    def unpin(self, keys: list[bytes]) -> int:
        before = len(self._pinned)
        self._pinned.difference_update(keys)
        return before - len(self._pinned)

    async def clear(self, tier_names: list[str] | None = None) -> int:
        known = [t.name for t in self.tiers]
        unknown = set(tier_names or []) - set(known)
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}; this daemon has {known}")
        cleared = 0
        async with self._lock:
            for level, tier in enumerate(self.tiers):
                if tier_names and tier.name not in tier_names:
                    continue
                for key in list(self._lru[level]):
                    tier.delete(key)
                    cleared += 1
                self._lru[level].clear()
            for key in self._pending:
                self._pending[key] = False
            self._pinned = {k for k in self._pinned if self.locate(k) is not None}
        self._refresh_gauges()
        return cleared

    def check_integrity(self) -> None:
        """Every tier's own invariants, and the LRU index equal to what each tier holds."""
        for level, tier in enumerate(self.tiers):
            tier.check_integrity()
            if set(self._lru[level]) != set(tier.keys()):
                raise RuntimeError(f"{tier.name}: LRU index ({len(self._lru[level])} keys) does not match "
                                   f"the tier ({len(tier)} keys)")
        stray = [k for k in self._pinned if self.locate(k) is None]
        if stray:
            raise RuntimeError(f"{len(stray)} pinned keys are stored in no tier")

    @property
    def pinned(self) -> int:
        return len(self._pinned)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def _refresh_gauges(self) -> None:
        for tier in self.tiers:
            self.metrics.used_bytes.labels(tier.name).set(tier.used_bytes)
            self.metrics.blocks.labels(tier.name).set(len(tier))
        self.metrics.queue_depth.set(self._queue.qsize())

    async def _run(self, tier: Tier, fn: Callable[..., T], *args, reader: bool = False) -> T:
        if not tier.blocking_io:
            return fn(*args)
        pool = self._readers if reader else self._writer
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _read_lane(tier: Tier, requests: list[tuple[bytes, memoryview]]) -> list[BlockHeader | Exception]:
    """Read blocks one after another in a worker thread: each a header, or the KeyError or
    CorruptBlockError that made it a miss in this tier (other errors propagate)."""
    outcomes: list[BlockHeader | Exception] = []
    for key, dest in requests:
        try:
            outcomes.append(tier.read_payload_into(key, dest))
        except (KeyError, CorruptBlockError) as exc:
            outcomes.append(exc)
    return outcomes
