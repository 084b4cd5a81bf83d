"""Placement: which tier holds which block, LRU eviction, demotion, promotion and pins.

Tiers are ordered top (fastest) to bottom: ``[gpu, cpu, disk, s3]``, each optional.

    Put ──► top tier ──queue[1]──► tier 1 ──queue[2]──► tier 2 ... (write-behind, one bounded
                 │                                                   queue per lower tier)
                 │  full? evict LRU: a victim the next tier lacks is demoted first
    Get ◄── first tier holding the key; a lower-tier hit is promoted to the top in the background
    Lookup: longest run of consecutive keys held by any available tier; keys no tier holds are
            first asked of shared tiers (S3), which may hold blocks other hosts stored

Write-behind: a Put queues its key for tier 1 (a full queue drops the copy and counts it: the block
still moves down when evicted). Each lower tier has worker tasks that copy a queued block from the
highest tier holding it, re-encoded into the target's codec, then queue it for the tier below,
waiting for room there: a slow tier (S3) backs its queue up into the one above, never into Put.

Concurrency: everything runs on one asyncio loop. Index changes and evictions hold ``_lock``;
small reads from memory tiers are synchronous (no await between finding and copying a block), so
they need no lock; large Gets copy CPU-tier blocks in worker threads, and the CPU tier frees the
extent of a block deleted meanwhile only after those copies end (``Tier.busy``; eviction skips busy
blocks). Blocking tiers (disk) are read in worker threads and written by one writer
thread; network tiers (S3) get a thread pool of their own (``Tier.io_threads``). Write-behind
copies read the block under ``_lock`` but write it without, so a slow tier never holds up Put; a
Delete that lands during such a write undoes it afterwards. A block found corrupt is deleted,
counted, and reported as a miss; a tier that is unreachable costs misses, never errors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, TypeVar

from kvstore.block import BlockHeader, CorruptBlockError
from kvstore.keys import KVLayout, LookupResult
from kvstore.metrics import Metrics
from kvstore.shm_index import TICK_S, KeyIndexWriter
from kvstore.transcode import transcode
from tiers.base import Tier, TierError, TierFullError, TierUnavailableError

if TYPE_CHECKING:
    from kvstore.events import EventPublisher

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Worker threads for blocking-tier reads (promotions, demotions and Gets).
READER_THREADS = 4
#: A Get moving at least this many bytes copies memory-tier blocks in worker threads.
OFFLOAD_GET_BYTES = 1 << 20
#: Longest a Put waits for reads in flight to release space when everything else is pinned.
BUSY_WAIT_S = 5.0
#: Longest a Lookup waits for shared tiers to answer about keys no tier holds.
DISCOVER_TIMEOUT_S = 0.5
#: A layer-wise read keeps its blocks from eviction while it streams, renewed at each layer; a
#: reader that stalls longer loses that hold (its stream ends with an error if a block then goes).
STREAM_HOLD_S = 10.0


class BlockGoneError(RuntimeError):
    """A block left its tier while a layer-wise read was streaming it (deleted, or evicted after
    the reader stalled past ``STREAM_HOLD_S``)."""


@dataclass(frozen=True)
class GetResult:
    header: BlockHeader
    tier: str


class _TierLRU(OrderedDict):
    """One tier's LRU order (oldest first), and the one path by which the store records a block
    entering or leaving a tier: ``d[key] = None``, ``pop`` and ``clear``. Each change is mirrored
    into the shared key index and the KV-event stream here, so neither can miss one (put, demotion,
    promotion, write-behind copy, eviction, delete, clear, a shared tier's adopted keys)."""

    def __init__(self, tier: Tier, level: int, index: KeyIndexWriter | None, events: EventPublisher | None) -> None:
        super().__init__()
        self._tier, self._level = tier, level
        self._index, self._events = index, events

    def __setitem__(self, key: bytes, value: None) -> None:
        if key not in self:
            if self._index is not None:
                self._index.add(key, self._level)
            if self._events is not None:
                self._events.stored(key, self._level, self._tier.header(key).tokens if key in self._tier else 0)
        super().__setitem__(key, value)

    def pop(self, key: bytes, *default):
        if key in self:
            if self._index is not None:
                self._index.remove(key, self._level)
            if self._events is not None:
                self._events.removed(key, self._level)
        return super().pop(key, *default)

    def clear(self) -> None:
        for key in self:
            if self._index is not None:
                self._index.remove(key, self._level)
            if self._events is not None:
                self._events.removed(key, self._level)
        super().clear()


class BlockStore:
    def __init__(self, tiers: list[Tier], metrics: Metrics | None = None, write_through: bool = True,
                 queue_depth: int = 256, promote_on_get: bool = True, codecs: list[str | None] | None = None,
                 discover_timeout_s: float = DISCOVER_TIMEOUT_S, key_index: KeyIndexWriter | None = None,
                 events: EventPublisher | None = None) -> None:
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
        self.discover_timeout_s = discover_timeout_s
        #: Same-host clients' view of which tier holds what (kvstore/shm_index.py); None: not published.
        self.key_index = key_index
        #: KV events for routers (kvstore/events.py); None: not published. Started and closed by the daemon.
        self.events = events
        self._lru: list[OrderedDict[bytes, None]] = [_TierLRU(tier, level, key_index, events)
                                                     for level, tier in enumerate(tiers)]
        for level, tier in enumerate(tiers):
            for key in tier.keys():
                self._lru[level][key] = None
        self._pinned: set[bytes] = set()
        #: Blocks handed to a client by reference (gpu_direct Get) -> lease expiry (monotonic s).
        self._leases: dict[bytes, float] = {}
        #: Blocks layer-wise reads are streaming -> [streams, expiry of the hold (monotonic s)].
        self._streaming: dict[bytes, list] = {}
        #: Tenant of each top-tier block put under a quota; pruned at each quota put.
        self._owners: dict[bytes, str] = {}
        self._layouts: dict[bytes, KVLayout] = {}
        for tier in tiers:
            for key in tier.keys():
                header = tier.header(key)
                self._layouts.setdefault(header.namespace, header.layout)
        self._lock = asyncio.Lock()
        #: Write-behind queue of each lower tier (keyed by its level), holding keys to copy into it.
        self._queues: dict[int, asyncio.Queue[bytes]] = {
            level: asyncio.Queue(maxsize=queue_depth) for level in range(1, len(tiers))}
        self._queued: set[tuple[int, bytes]] = set()  # (level, key) now in a queue: no duplicates
        #: Keys being written into a lower tier outside ``_lock`` -> still wanted (Delete/Clear
        #: set False, and the writer deletes the copy it just made).
        self._inflight: dict[bytes, bool] = {}
        self._promoting: set[bytes] = set()
        self._background: set[asyncio.Task] = set()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-writer")
        self._readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvstore-reader")
        #: Tiers that want many requests in flight (S3) get threads of their own for reads and writes.
        self._pools = {t.name: ThreadPoolExecutor(t.io_threads, thread_name_prefix=f"kvstore-{t.name}")
                       for t in tiers if t.io_threads}
        #: Executor calls one batched Get splits its blocking reads into: one per core, since a
        #: disk read from the page cache is a CPU-bound copy and hash (more would only contend).
        self.read_lanes = max(1, min(READER_THREADS, os.cpu_count() or 1))
        self._workers: list[asyncio.Task] = []
        self.write_errors = 0
        for tier in tiers:  # fixed for the daemon's life (a disk tier fits itself to free space at start)
            self.metrics.capacity_bytes.labels(tier.name).set(tier.capacity_bytes)
        self._refresh_gauges()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._workers:
            return
        loop = asyncio.get_running_loop()
        for level in self._queues:
            # One worker per single-writer tier (disk); a few for tiers that take parallel writes.
            workers = max(1, self.tiers[level].io_threads // 4)
            self._workers += [loop.create_task(self._write_behind(level)) for _ in range(workers)]
        if self.key_index is not None:
            self._workers.append(loop.create_task(self._tick_index()))

    async def _tick_index(self) -> None:
        """Keep the shared key index's heartbeat, tier availability and shared-tier keys fresh."""
        while True:
            try:
                self._adopt_new_keys()
                self.key_index.tick(t.available for t in self.tiers)
            except Exception:  # never let the heartbeat die silently: clients would fall back for good
                log.exception("key index refresh failed")
            await asyncio.sleep(TICK_S)

    async def close(self, flush: bool = True) -> None:
        """Stop background work; with ``flush``, first finish queued lower-tier writes."""
        if flush and self._workers:
            await self.flush()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
        if self.key_index is not None:
            self.key_index.close()

    async def flush(self) -> None:
        """Wait until every queued lower-tier write is done (each tier's queue feeds the next)."""
        for level in sorted(self._queues):
            await self._queues[level].join()

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

    def locate(self, key: bytes) -> int | None:
        """Index of the highest tier holding ``key``."""
        for level, tier in enumerate(self.tiers):
            if key in tier:
                return level
        return None

    def lookup(self, keys: list[bytes]) -> LookupResult:
        self._adopt_new_keys()
        tiers: list[str] = []
        for key in keys:
            tier = next((t for t in self.tiers if key in t and t.available), None)
            if tier is None:
                break
            tiers.append(tier.name)
        self.metrics.requested.labels("lookup").inc(len(keys))
        self.metrics.misses.inc(len(keys) - len(tiers))
        return LookupResult(len(tiers), tuple(tiers))

    async def discover(self, keys: list[bytes]) -> int:
        """Ask shared tiers (S3) about the keys no tier here holds, from the first such key on:
        another host may have stored them since this daemon indexed the bucket. Waits at most
        ``discover_timeout_s``; returns how many were found (now indexed, so a Lookup hits)."""
        shared = [(level, t) for level, t in enumerate(self.tiers) if t.shared and t.available]
        first = next((i for i, k in enumerate(keys) if self.locate(k) is None), None)
        if not shared or first is None:
            return 0
        missing = [k for k in keys[first:] if self.locate(k) is None]
        loop = asyncio.get_running_loop()
        found = 0
        for level, tier in shared:
            try:
                keys_found = await asyncio.wait_for(
                    loop.run_in_executor(None, tier.discover, missing, self.discover_timeout_s),
                    self.discover_timeout_s + 0.25)
            except asyncio.TimeoutError:
                continue
            found += len(keys_found)
            self.metrics.discovered.labels(tier.name).inc(len(keys_found))
        self._adopt_new_keys()
        return found

    def _adopt_new_keys(self) -> None:
        """Take into the LRU the keys shared tiers indexed on their own (listing, discovery), as
        least recently used: this daemon has not used them yet."""
        for level, tier in enumerate(self.tiers):
            if not tier.shared:
                continue
            for key in tier.take_new_keys():
                if key not in self._lru[level]:
                    self._lru[level][key] = None
                    self._lru[level].move_to_end(key, last=False)
                    header = tier.header(key)
                    self._layouts.setdefault(header.namespace, header.layout)

    def publish_availability(self) -> None:
        """Tell the shared key index which tiers can be read now (after each call that may have
        tripped or reset a tier's circuit breaker; the index's tick catches the rest)."""
        if self.key_index is not None:
            self.key_index.set_available(t.available for t in self.tiers)

    def header(self, key: bytes) -> BlockHeader | None:
        level = self.locate(key)
        return None if level is None else self.tiers[level].header(key)

    # -- writes -------------------------------------------------------------------------------

    def check_namespace(self, header: BlockHeader) -> None:
        known = self._layouts.get(header.namespace)
        if known is not None and known != header.layout:
            raise ValueError(f"layout {header.layout} does not match namespace {header.namespace.hex()}, "
                             f"whose blocks have layout {known}")

    async def put(self, header: BlockHeader, payload: memoryview, owner: str = "", quota: int = 0,
                  durable: bool = False) -> None:
        """Store a block in the top tier (evicting as needed) and queue its copy to lower tiers.

        ``owner`` with ``quota`` > 0: the owner may hold at most ``quota`` bytes in the top tier;
        its own least recently used blocks are evicted (demoted) first. ``durable``: return only
        once a durable tier (fsynced disk, S3) holds the block. Raises ValueError for a layout
        that contradicts the namespace or a durable put without a durable tier, TierFullError when
        the block cannot fit even after evicting every unpinned block, TierError when the durable
        copy failed.
        """
        self.check_namespace(header)
        durable_level = self._durable_level() if durable else 0
        async with self._lock:
            if quota:
                await self._enforce_quota(owner, quota, header.block_len)
            await self._store_in(0, header, payload)
            if quota:
                self._owners[header.key] = owner
            self._layouts.setdefault(header.namespace, header.layout)
        for level in range(1, durable_level + 1):
            if not await self._copy_behind(level, header.key):
                raise TierError(f"the block could not be made durable in {self.tiers[durable_level].name}")
        if self.write_through:
            self._enqueue(durable_level + 1 if durable else 1, header.key)
        self._refresh_gauges()

    def _durable_level(self) -> int:
        level = next((i for i, tier in enumerate(self.tiers) if tier.durable), None)
        if level is None:
            raise ValueError("a durable put needs a durable tier: a disk tier with disk_fsync on, or S3")
        return level

    async def _enforce_quota(self, owner: str, quota: int, nbytes: int) -> None:
        """Evict ``owner``'s LRU top-tier blocks until ``nbytes`` more fit in its quota. Holds ``_lock``."""
        if nbytes > quota:
            raise TierFullError(f"a {nbytes}-byte block exceeds tenant {owner!r}'s quota of {quota} bytes")
        top = self.tiers[0]
        for key in [k for k in self._owners if k not in top]:
            del self._owners[key]  # blocks that left the top tier since the last quota put
        owned = [k for k in self._lru[0] if self._owners.get(k) == owner]  # LRU order
        used = sum(top.header(k).block_len for k in owned)
        for key in owned:
            if used + nbytes <= quota:
                return
            if key not in self._pinned:
                used -= top.header(key).block_len
                await self._evict(0, key)
        if used + nbytes > quota:
            raise TierFullError(f"tenant {owner!r} holds {used} bytes (pinned) of its {quota}-byte quota")

    def _enqueue(self, level: int, key: bytes) -> None:
        """Queue a write-behind copy of ``key`` into tier ``level`` without waiting; a full queue
        drops it and counts it (the block still reaches that tier when evicted above)."""
        if level not in self._queues or (level, key) in self._queued:
            return
        try:
            self._queues[level].put_nowait(key)
        except asyncio.QueueFull:
            self.metrics.queue_dropped.inc()
            self.metrics.tier_queue_dropped.labels(self.tiers[level].name).inc()
            return
        self._queued.add((level, key))

    async def _store_in(self, level: int, header: BlockHeader, payload: memoryview) -> None:
        """Write one block into tier ``level``, evicting LRU blocks to make room. Holds ``_lock``."""
        tier = self.tiers[level]
        if header.key in tier and tier.header(header.key).checksum == header.checksum:
            # Keys are content addresses: the same block again only refreshes its LRU position.
            self._lru[level].move_to_end(header.key)
            return
        if header.key in tier:
            await self._run(tier, tier.delete, header.key)
            self._lru[level].pop(header.key, None)
        await self._make_room(level, header.block_len)
        for attempt in range(8):
            try:
                await self._run(tier, tier.put, header, payload)
                break
            except TierFullError:
                # The device filled up before our byte count said so (disk full): evict and retry.
                victim = next((k for k in self._lru[level] if self._evictable(tier, k)), None)
                if victim is None or attempt == 7:
                    raise
                await self._evict(level, victim)
        self._lru[level][header.key] = None
        self._lru[level].move_to_end(header.key)
        self.metrics.bytes_in.labels(tier.name).inc(header.block_len)

    async def _make_room(self, level: int, nbytes: int) -> None:
        tier = self.tiers[level]
        deadline = time.monotonic() + BUSY_WAIT_S
        while not tier.can_fit(nbytes):
            victim = next((k for k in self._lru[level] if self._evictable(tier, k)), None)
            if victim is None:
                if tier.reads_in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)  # a read in a worker thread ends within milliseconds
                    continue
                raise TierFullError(f"{tier.name}: {nbytes} bytes do not fit and every stored block is pinned "
                                    f"(capacity {tier.capacity_bytes} bytes)")
            await self._evict(level, victim)

    async def _evict(self, level: int, key: bytes) -> None:
        if level + 1 < len(self.tiers) and key not in self.tiers[level + 1]:
            if await self._copy_down(level, key):
                self.metrics.demotions.labels(self.tiers[level + 1].name).inc()
        await self._run(self.tiers[level], self.tiers[level].delete, key)
        self._lru[level].pop(key, None)
        self.metrics.evictions.labels(self.tiers[level].name).inc()

    async def _encoded_for(self, level: int, header: BlockHeader, payload: memoryview
                           ) -> tuple[BlockHeader, memoryview]:
        """The block re-encoded into tier ``level``'s codec (in a worker thread), or as it is."""
        spec = self.codecs[level]
        if spec is None or spec == header.codec:
            return header, payload
        return await asyncio.get_running_loop().run_in_executor(self._readers, transcode, header, payload, spec)

    async def _copy_down(self, level: int, key: bytes) -> bool:
        """Copy a block from tier ``level`` into the next one. Holds ``_lock``. False on failure."""
        source, target = self.tiers[level], self.tiers[level + 1]
        try:
            header, payload = await self._encoded_for(level + 1, *await self._read_whole(level, key))
            await self._store_in(level + 1, header, payload)
        except (TierError, CorruptBlockError, KeyError) as exc:
            self._count_write_error(target, f"demoting {key.hex()} from {source.name}", exc)
            return False
        return True

    def _count_write_error(self, target: Tier, what: str, exc: Exception) -> None:
        self.write_errors += 1
        self.metrics.write_errors.labels(target.name).inc()
        if isinstance(exc, TierUnavailableError):
            self.metrics.unavailable.labels(target.name).inc()
            log.debug("%s to %s failed: %s", what, target.name, exc)
        else:
            log.warning("%s to %s failed: %s", what, target.name, exc)

    async def _read_whole(self, level: int, key: bytes) -> tuple[BlockHeader, memoryview]:
        tier = self.tiers[level]
        header = tier.header(key)
        view = getattr(tier, "payload_view", None)
        if view is not None:
            return header, view(key)
        buffer = memoryview(bytearray(header.payload_len))
        await self._run(tier, tier.read_payload_into, key, buffer, reader=True)
        return header, buffer

    async def _write_behind(self, level: int) -> None:
        """Worker of tier ``level``'s queue: copy each block in, then queue it for the tier below,
        waiting for room there (backpressure from a slower tier stops here, not at Put)."""
        queue = self._queues[level]
        while True:
            key = await queue.get()
            try:
                self._queued.discard((level, key))
                if await self._copy_behind(level, key) and level + 1 in self._queues \
                        and (level + 1, key) not in self._queued:
                    self._queued.add((level + 1, key))
                    await self._queues[level + 1].put(key)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let a worker die
                log.exception("write-behind of %s into %s failed", key.hex(), self.tiers[level].name)
            finally:
                queue.task_done()
                self._refresh_queue_gauges()

    async def _copy_behind(self, level: int, key: bytes) -> bool:
        """Copy ``key`` into tier ``level`` from the highest tier above holding it; True if the
        tier holds it afterwards. Reads under ``_lock``, writes without it (see the module doc)."""
        target = self.tiers[level]
        if key in target:
            return True
        async with self._lock:
            source = self.locate(key)
            if source is None or source > level or key in target:
                return key in target
            if not target.available:
                self._count_write_error(target, f"write-behind of {key.hex()}",
                                        TierUnavailableError(f"{target.name} is unreachable"))
                return False
            try:
                header, payload = await self._read_whole(source, key)
                if not self.tiers[source].blocking_io:
                    payload = memoryview(bytes(payload))  # arena bytes are reused once the lock is free
                await self._make_room(level, header.block_len)
            except (TierError, CorruptBlockError, KeyError) as exc:
                self._count_write_error(target, f"write-behind of {key.hex()}", exc)
                return False
            self._inflight[key] = True
        try:
            header, payload = await self._encoded_for(level, header, payload)
            await self._run(target, target.put, header, payload)
        except (TierError, CorruptBlockError, ValueError) as exc:
            self._inflight.pop(key, None)
            self._count_write_error(target, f"write-behind of {key.hex()}", exc)
            return False
        async with self._lock:
            if not self._inflight.pop(key, True):  # deleted while we wrote: undo
                await self._run(target, target.delete, key)
                return False
            self._lru[level][key] = None
            self._lru[level].move_to_end(key)
            self.metrics.bytes_in.labels(target.name).inc(header.block_len)
        self._refresh_gauges()
        return True

    # -- reads --------------------------------------------------------------------------------

    def gpu_pool(self):
        """The pool tensor of a top GPU tier, or None."""
        return getattr(self.tiers[0], "pool", None)

    def gpu_offset(self, key: bytes) -> int | None:
        """Offset of ``key``'s payload in the GPU pool, when the top tier is a GPU tier holding it."""
        offset_of = getattr(self.tiers[0], "payload_offset", None)
        return offset_of(key) if offset_of is not None and key in self.tiers[0] else None

    def lease(self, key: bytes, seconds: float) -> None:
        """Keep ``key`` from eviction and demotion for ``seconds`` (a client is copying it by
        reference, or will load it soon); an existing longer lease stays."""
        now = time.monotonic()
        if len(self._leases) > 4 * max(sum(map(len, self._lru)), 1024):  # keys deleted while leased: drop the expired
            self._leases = {k: t for k, t in self._leases.items() if t > now}
        self._leases[key] = max(self._leases.get(key, 0.0), now + seconds)

    def release(self, keys: list[bytes]) -> int:
        return sum(self._leases.pop(k, None) is not None for k in keys)

    def _evictable(self, tier: Tier, key: bytes) -> bool:
        """Not pinned, not handed out by reference, not being streamed or copied by a reader."""
        return key not in self._pinned and not self._leased(key) and not self._held(key) and not tier.busy(key)

    def _hold(self, key: bytes) -> None:
        entry = self._streaming.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] = time.monotonic() + STREAM_HOLD_S

    def _renew(self, key: bytes) -> None:
        entry = self._streaming.get(key)
        if entry is not None:
            entry[1] = time.monotonic() + STREAM_HOLD_S

    def _unhold(self, key: bytes) -> None:
        entry = self._streaming.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] <= 0:
                del self._streaming[key]

    def _held(self, key: bytes) -> bool:
        entry = self._streaming.get(key)
        return entry is not None and entry[1] > time.monotonic()

    def _leased(self, key: bytes) -> bool:
        expiry = self._leases.get(key)
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self._leases[key]
            return False
        return True

    async def get_layerwise(self, requests: list[tuple[bytes, memoryview]]
                            ) -> AsyncIterator[tuple[int, list[GetResult | None] | None]]:
        """Yield ``(-1, results)``, then ``(layer, None)`` once that layer of every block is in
        its destination. Raw blocks in memory tiers are copied layer by layer; other blocks
        (encoded, or in a disk or S3 tier: verified whole first) arrive before layer 0::

            payload  [L0 K|V][L1 K|V] ... [Ln-1 K|V]    one layer = payload_len / num_layers

        Holds no lock while the caller sends (a reader that is slow, or never reads, delays
        nobody): the streamed blocks are kept from eviction instead (``STREAM_HOLD_S``, renewed at
        each layer), and before each layer's copy, with no await in between, each block is checked
        to be the same one still in its tier; a block deleted meanwhile raises BlockGoneError,
        never a copy of bytes that now belong to another block.
        """
        results: list[GetResult | None] = [None] * len(requests)
        layered: list[tuple[memoryview, object, BlockHeader, Tier, bytes]] = []
        whole: list[int] = []
        for i, (key, dest) in enumerate(requests):
            level = self.locate(key)
            tier = self.tiers[level] if level is not None else None
            if tier is None or tier.blocking_io or tier.header(key).codec != "raw":
                whole.append(i)
                continue
            source = tier.payload_source(key)
            if source is None:
                whole.append(i)
                continue
            header = tier.header(key)
            self._hold(key)
            results[i] = self._hit(level, key, header)
            layered.append((dest, source, header, tier, key))
        try:
            if whole:
                found = await self.get_many_into([requests[i] for i in whole])
                for i, result in zip(whole, found):
                    results[i] = result
            yield -1, results
            for layer in range(max((h.layout.num_layers for _, _, h, _, _ in layered), default=0)):
                for dest, source, header, tier, key in layered:
                    if layer >= header.layout.num_layers:
                        continue
                    if key not in tier or tier.header(key) is not header:
                        raise BlockGoneError(f"block {key.hex()} left the {tier.name} tier during a layer-wise read")
                    self._renew(key)
                    size = header.payload_len // header.layout.num_layers
                    _copy_range(dest, source, layer * size, size)
                yield layer, None
        finally:
            for _, _, _, _, key in layered:
                self._unhold(key)

    async def get_into(self, key: bytes, dest: memoryview, first_level: int = 0) -> GetResult | None:
        """Copy the payload of ``key`` into ``dest`` from the highest tier at or below
        ``first_level`` holding it; None on a miss. Corrupt copies are dropped; unreachable tiers skipped."""
        self._adopt_new_keys()
        for level, tier in enumerate(self.tiers):
            if level < first_level or key not in tier:
                continue
            try:
                if tier.blocking_io:
                    header = await self._run(tier, tier.read_payload_into, key, dest, reader=True)
                else:
                    header = tier.read_payload_into(key, dest)
            except KeyError:
                self._forget_vanished(level, key)  # deleted underneath us: try the next tier
                continue
            except CorruptBlockError as exc:
                await self._drop_corrupt(level, key, exc)
                continue
            except TierUnavailableError as exc:
                self.metrics.unavailable.labels(tier.name).inc()
                log.debug("%s", exc)
                continue
            return self._hit(level, key, header)
        self.metrics.misses.inc()
        return None

    async def get_many_into(self, requests: list[tuple[bytes, memoryview]]) -> list[GetResult | None]:
        """:meth:`get_into` for many blocks (one Get call); results in request order.

        Blocks whose highest copy is in a blocking tier are read in at most ``read_lanes`` executor
        calls (not one thread hop per block); so are blocks in a memory tier with thread-safe reads
        (CPU) when the call moves at least ``OFFLOAD_GET_BYTES``: the event loop keeps serving
        other clients while the copies run, on every core. Smaller calls copy at once (a thread hop
        would cost more than the copy). A block that turns out corrupt or vanished falls back to
        :meth:`get_into`, which drops the corrupt copy and tries the tiers below.
        """
        self._adopt_new_keys()
        results: list[GetResult | None] = [None] * len(requests)
        blocking: dict[int, list[int]] = {}  # tier level -> indices into requests
        batched: dict[int, list[int]] = {}   # memory tiers that copy a whole batch at once (GPU)
        offload = sum(len(dest) for _, dest in requests) >= OFFLOAD_GET_BYTES
        for i, (key, dest) in enumerate(requests):
            level = self.locate(key)
            if level is not None and (self.tiers[level].blocking_io or (offload and self.tiers[level].threadsafe_reads)):
                blocking.setdefault(level, []).append(i)
            elif level is not None and hasattr(self.tiers[level], "read_many_into"):
                batched.setdefault(level, []).append(i)
            else:
                results[i] = await self.get_into(key, dest)  # memory tier or miss: no await inside
        for level, indices in batched.items():
            # One call: one copy per run of pool- and destination-adjacent blocks (no await inside).
            headers = self.tiers[level].read_many_into([requests[i] for i in indices])
            for i, header in zip(indices, headers):
                results[i] = self._hit(level, requests[i][0], header)
        if not blocking:
            return results
        loop = asyncio.get_running_loop()
        calls, lanes_of = [], []
        for level, indices in blocking.items():
            tier = self.tiers[level]
            # A network tier reads one block per thread, all in flight at once; disk, one lane per core.
            lanes = min(tier.io_threads or self.read_lanes, len(indices))
            pool = self._pools.get(tier.name, self._readers)
            for lane in range(lanes):
                lane_indices = indices[lane::lanes]
                calls.append(loop.run_in_executor(pool, _read_lane, tier, [requests[i] for i in lane_indices]))
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
                elif isinstance(outcome, TierUnavailableError):
                    self.metrics.unavailable.labels(self.tiers[level].name).inc()
                elif isinstance(outcome, KeyError):
                    self._forget_vanished(level, key)
                results[i] = await self.get_into(key, dest, level + 1)  # the tiers below, or a counted miss
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
        level = self.locate(key)
        try:
            prefetched = None
            if level is not None and level > 0 and self.tiers[level].blocking_io:
                # A disk or S3 read happens before the lock: a slow tier delays no other call.
                prefetched = await self._read_or_drop(level, key)
                if prefetched is None:
                    return
            async with self._lock:
                level = self.locate(key)
                if level is None or level == 0:
                    return
                if prefetched is not None and self.tiers[level].header(key).checksum == prefetched[0].checksum:
                    header, payload = prefetched
                else:  # a memory tier (read under the lock: its view is only valid there), or it changed
                    found = await self._read_or_drop(level, key)
                    if found is None:
                        return
                    header, payload = found
                await self._store_in(0, header, payload)
                self.metrics.promotions.labels(self.tiers[0].name).inc()
            if self.write_through and level > 1:
                self._enqueue(1, key)  # fill the tiers between (disk under cpu) behind it
        except TierUnavailableError as exc:
            self.metrics.unavailable.labels(self.tiers[level or 0].name).inc()  # the tier it was read from
            log.debug("promotion of %s skipped: %s", key.hex(), exc)
        except TierFullError as exc:
            log.info("promotion of %s skipped: %s", key.hex(), exc)
        finally:
            self._promoting.discard(key)
            self._refresh_gauges()

    async def _read_or_drop(self, level: int, key: bytes) -> tuple[BlockHeader, memoryview] | None:
        """The whole block from tier ``level``; None (corrupt copy dropped, vanished key forgotten)
        when there is none to read."""
        try:
            return await self._read_whole(level, key)
        except CorruptBlockError as exc:
            await self._drop_corrupt(level, key, exc)
        except KeyError:
            self._forget_vanished(level, key)
        return None

    async def _drop_corrupt(self, level: int, key: bytes, exc: Exception) -> None:
        tier = self.tiers[level]
        log.warning("%s: block %s is corrupt (%s); deleted", tier.name, key.hex(), exc)
        self.metrics.corrupt.labels(tier.name).inc()
        await self._run(tier, tier.delete, key)
        self._lru[level].pop(key, None)
        if self.locate(key) is None:
            self._pinned.discard(key)

    def _forget_vanished(self, level: int, key: bytes) -> None:
        """A block its tier no longer holds (removed underneath, e.g. by another host): unindex it."""
        if key not in self.tiers[level]:
            self._lru[level].pop(key, None)

    # -- maintenance --------------------------------------------------------------------------

    async def delete(self, keys: list[bytes]) -> int:
        """Remove blocks from every tier; absent keys are not an error (the cache may have evicted them)."""
        deleted = 0
        async with self._lock:
            for key in keys:
                found = False
                for level, tier in enumerate(self.tiers):
                    if key in tier:
                        await self._run(tier, tier.delete, key)
                        self._lru[level].pop(key, None)
                        found = True
                self._pinned.discard(key)
                if key in self._inflight:
                    self._inflight[key] = False
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
                    await self._run(tier, tier.delete, key)
                    cleared += 1
                self._lru[level].clear()
                for key in self._inflight:
                    self._inflight[key] = False
            self._pinned = {k for k in self._pinned if self.locate(k) is not None}
        self._refresh_gauges()
        return cleared

    def check_integrity(self) -> None:
        """Every tier's own invariants, and the LRU index equal to what each tier holds."""
        self._adopt_new_keys()
        for level, tier in enumerate(self.tiers):
            tier.check_integrity()
            if set(self._lru[level]) != set(tier.keys()):
                raise RuntimeError(f"{tier.name}: LRU index ({len(self._lru[level])} keys) does not match "
                                   f"the tier ({len(tier)} keys)")
        if self.key_index is not None:
            expected: dict[bytes, int] = {}
            for level, lru in enumerate(self._lru):
                for key in lru:
                    expected[key] = expected.get(key, 0) | (1 << level)
            self.key_index.check_integrity(expected)
        stray = [k for k in self._pinned if self.locate(k) is None]
        if stray:
            raise RuntimeError(f"{len(stray)} pinned keys are stored in no tier")

    @property
    def pinned(self) -> int:
        return len(self._pinned)

    @property
    def queue_depth(self) -> int:
        """Pending write-behind copies, all lower tiers together."""
        return sum(q.qsize() for q in self._queues.values())

    def _refresh_gauges(self) -> None:
        self._adopt_new_keys()
        for tier in self.tiers:
            self.metrics.used_bytes.labels(tier.name).set(tier.used_bytes)
            self.metrics.blocks.labels(tier.name).set(len(tier))
        self._refresh_queue_gauges()

    def _refresh_queue_gauges(self) -> None:
        for level, queue in self._queues.items():
            self.metrics.tier_queue_depth.labels(self.tiers[level].name).set(queue.qsize())
        self.metrics.queue_depth.set(self.queue_depth)

    async def _run(self, tier: Tier, fn: Callable[..., T], *args, reader: bool = False) -> T:
        """Call a tier: directly for memory tiers, else in the tier's own pool, the reader pool
        (``reader``) or the single writer thread (which keeps a disk's puts and deletes in order)."""
        if not tier.blocking_io:
            return fn(*args)
        pool = self._pools.get(tier.name) or (self._readers if reader else self._writer)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _copy_range(dest: memoryview, source: object, start: int, size: int) -> None:
    """dest[start:start+size] = source[start:start+size], for a host view or a (device) tensor."""
    if isinstance(source, memoryview):
        dest[start : start + size] = source[start : start + size]
        return
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        target = torch.frombuffer(dest[start : start + size], dtype=torch.uint8)
    target.copy_(source[start : start + size])


def _read_lane(tier: Tier, requests: list[tuple[bytes, memoryview]]) -> list[BlockHeader | Exception]:
    """Read blocks one after another in a worker thread: each a header, or the KeyError,
    CorruptBlockError or TierUnavailableError that made it a miss in this tier (others propagate)."""
    outcomes: list[BlockHeader | Exception] = []
    for key, dest in requests:
        try:
            outcomes.append(tier.read_payload_into(key, dest))
        except (KeyError, CorruptBlockError, TierUnavailableError) as exc:
            outcomes.append(exc)
    return outcomes
