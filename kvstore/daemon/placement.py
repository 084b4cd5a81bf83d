"""Placement: the store that coordinates tiers. Which tier holds which block, LRU eviction,
demotion, pins and quotas live here or in the modules it holds; a request's path:

    Put ──► top tier ──queue[1]──► tier 1 ──queue[2]──► tier 2 ... (write-behind, one bounded
                 │                                                   queue per lower tier)
                 │  full? evict LRU: a victim the next tier lacks is demoted first
    Get ◄── first tier holding the key; a lower-tier hit is promoted to the top in the background
    Lookup: longest run of consecutive keys held by any available tier; keys no tier holds are
            first asked of shared tiers (S3), which may hold blocks other hosts stored

Tiers are ordered top (fastest) to bottom: ``[gpu, cpu, disk, s3]``, each optional.

    BlockStore (this file)  put, quotas, admission, delete/clear, lookup, discovery, lifecycle
    ├── residency.py        which tier holds which key: per-tier LRU, owners' bytes, the one
    │                       change path the key index (shm_index) and KV events follow
    ├── holds.py            pins, leases, layer-wise reads' holds: what eviction must skip
    ├── eviction.py         a block into a tier: LRU blocks evicted for room, demoted first
    ├── reads.py            Get of one or many blocks, layer-wise reads, bad copies dropped
    ├── promotion.py        lower-tier hits copied to the top in the background
    ├── write_behind.py     a queue and workers per lower tier
    └── tier_io.py          the threads each tier is called in

No helper holds the store: each is built from the parts and operations (named callables) it uses,
and callers call the helper owning an operation: ``store.reads``, ``.promoter``, ``.write_behind``, ``.evictor``.

Concurrency: everything runs on one asyncio loop. Index changes and evictions hold ``lock``;
small reads from memory tiers are synchronous (no await between finding and copying a block), so
they need no lock (see reads.py). Blocking tiers (disk) are read in worker threads and written by
one writer thread; network tiers (S3) get a thread pool of their own (``Tier.io_threads``).
Write-behind copies read the block under ``lock`` but write it without (see write_behind.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING

from kvstore.block import BlockHeader
from kvstore.daemon.config import ADMISSION_POLICIES, EVICTION_POLICIES
from kvstore.daemon.eviction import Evictor
from kvstore.daemon.holds import STREAM_HOLD_S, HoldRefused, Holds
from kvstore.keys import LookupResult
from kvstore.daemon.log_limit import LogLimit
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.namespaces import DEFAULT_LIMIT as DEFAULT_NAMESPACES, NamespaceLayouts
from kvstore.daemon.promotion import Promoter
from kvstore.daemon.reads import BlockGoneError, GetResult, Reader
from kvstore.daemon.residency import Residency, WalkBudget
from kvstore.shm_index import TICK_S, KeyIndexWriter
from kvstore.daemon.tier_health import TierHealth
from kvstore.daemon.tier_io import TierIO
from kvstore.daemon.write_behind import WriteBehind
from tiers.base import Tier, TierError, TierUnavailableError

if TYPE_CHECKING:
    from kvstore.daemon.events import EventPublisher
    from kvstore.scatter import Gather

__all__ = ["DISCOVER_TIMEOUT_S", "STREAM_HOLD_S", "BlockGoneError", "BlockStore", "GetResult", "HoldRefused",
           "LookupResult"]

log = logging.getLogger(__name__)

#: Longest a Lookup waits for shared tiers to answer about keys no tier holds.
DISCOVER_TIMEOUT_S = 0.5


class BlockStore:
    """The tiers and what coordinates them; called only on its event loop (see Concurrency above)."""

    def __init__(self, tiers: list[Tier], metrics: Metrics | None = None, write_through: bool = True,
                 queue_depth: int = 256, promote_on_get: bool = True, codecs: list[str | None] | None = None,
                 discover_timeout_s: float = DISCOVER_TIMEOUT_S, key_index: KeyIndexWriter | None = None,
                 events: EventPublisher | None = None, quotas: dict[str, int] | None = None,
                 hold_share: float | None = None, tenants: int = 1, eviction: str = EVICTION_POLICIES[0],
                 admission: str = ADMISSION_POLICIES[0], max_namespaces: int = DEFAULT_NAMESPACES) -> None:
        if not tiers:
            raise ValueError("BlockStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {admission!r}")
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
        self._availability_lock = threading.Lock()
        for tier in tiers:
            tier.on_availability_change(self.publish_availability)
        #: KV events for routers (kvstore/daemon/events.py); None: not published. Started and closed by the daemon.
        self.events = events
        #: Held by every change of what a tier holds, and by evictions.
        self.lock = asyncio.Lock()
        self.io = TierIO(tiers)
        self.residency = Residency(tiers, self.io, key_index, events, eviction)
        #: Which blocks lower tiers take (docs/policy.md): "all", or "reused": only blocks read
        #: since they were stored (by write-through once read, and on eviction)
        self.admission = admission
        #: Tenant -> most bytes it may hold in each tier it is charged in (0 or absent: no quota).
        self.quotas = dict(quotas or {})
        #: Share of the smallest bounded tier that all tenants' pins and leases may take together,
        #: split equally among ``tenants`` (None: holds are not bounded).
        self.hold_share, self.tenants = hold_share, max(1, tenants)
        self.holds = Holds(self.hold_bound if hold_share is not None else None)
        #: One discovery in flight per tenant: a tenant's flood of Lookups waits behind itself.
        self._discovering: dict[str, asyncio.Lock] = {}
        self._error_log = LogLimit()
        #: Tiers that keep failing (write errors over a window, S3's breaker open): /readyz, a gauge.
        self.health = TierHealth(tiers, self.metrics.tier_degraded)
        self.evictor = Evictor(tiers, self.residency, self.holds, self.io, self.metrics, codecs=self.codecs,
                               quotas=self.quotas, admits=self.admits, count_write_error=self.count_write_error)
        self.write_behind = WriteBehind(tiers, self.residency, self.io, self.lock, self.metrics, codecs=self.codecs,
                                        queue_depth=queue_depth, make_room=self.evictor.make_room,
                                        count_write_error=self.count_write_error, refresh_gauges=self.refresh_gauges)
        self.reads = Reader(tiers, self.residency, self.holds, self.io, self.metrics, note_read=self.note_read)
        self.promoter = Promoter(tiers, self.residency, self.lock, self.metrics, read_or_drop=self.reads.read_or_drop,
                                 store_in=self.evictor.store_in, refresh_gauges=self.refresh_gauges,
                                 enqueue_copy=self.write_behind.enqueue if write_through else None)
        #: namespace -> the layout of its blocks, bounded (kvstore/daemon/namespaces.py)
        self.namespaces = NamespaceLayouts(max_namespaces)
        for tier in tiers:
            for key in tier.keys():
                self.namespaces.note(tier.header(key))
        self._workers: list[asyncio.Task] = []
        self.write_errors = 0
        for tier in tiers:  # fixed for the daemon's life (a disk tier fits itself to free space at start)
            self.metrics.capacity_bytes.labels(tier.name).set(tier.capacity_bytes)
        self.refresh_gauges()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._workers:
            return
        self._workers += self.write_behind.start()
        if self.key_index is not None or any(t.shared for t in self.tiers):
            self._workers.append(asyncio.get_running_loop().create_task(self._tick()))

    async def _tick(self) -> None:
        """Every TICK_S: adopt the keys shared tiers indexed on their own, and keep the shared key
        index's heartbeat and tier availability fresh."""
        while True:
            try:
                self._adopt_shared()
                if self.key_index is not None:
                    with self._availability_lock:
                        self.key_index.tick(t.available for t in self.tiers)
            except Exception:  # never let the heartbeat die silently: clients would fall back for good
                log.exception("key index refresh failed")
            await asyncio.sleep(TICK_S)

    async def close(self, flush: bool = True) -> None:
        """Stop background work; with ``flush``, first finish queued lower-tier writes."""
        if flush and self._workers:
            await self.write_behind.flush()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        await self.promoter.cancel()
        self.io.shutdown()
        for tier in self.tiers:
            tier.close()
        if self.key_index is not None:
            self.key_index.close()

    async def demote_all(self) -> int:
        """Copy every block the lowest tier lacks down to it (write-back shutdown). Returns blocks copied."""
        copied = 0
        async with self.lock:
            for level in range(len(self.tiers) - 1):
                for key in list(self.residency[level]):
                    if key not in self.tiers[-1] and await self.evictor.copy_down(level, key):
                        copied += 1
        return copied

    # -- queries ------------------------------------------------------------------------------

    def locate(self, key: bytes) -> int | None:
        """Index of the highest tier holding ``key``."""
        return self.residency.locate(key)

    def lookup(self, keys: list[bytes]) -> LookupResult:
        tiers: list[str] = []
        for key in keys:
            tier = next((t for t in self.tiers if key in t and t.available), None)
            if tier is None:
                break
            tiers.append(tier.name)
        self.metrics.requested.labels("lookup").inc(len(keys))
        self.metrics.misses.inc(len(keys) - len(tiers))
        return LookupResult(len(tiers), tuple(tiers))

    async def discover(self, keys: list[bytes], owner: str = "", stop_at_absent: bool = False) -> int:
        """Ask shared tiers (S3) about the keys no tier here holds, from the first such key on:
        another host may have stored them since this daemon indexed the bucket. Waits at most
        ``discover_timeout_s``; returns how many were found (now indexed, so a Lookup hits).

        ``stop_at_absent``: ask no key after the first one absent (a Lookup's hit run ends there;
        a Get wants every key). One discovery per ``owner`` runs at a time (a tenant's next one waits for it, within the
        same timeout, and finds nothing if it cannot start): a tenant that floods Lookups of
        unknown keys delays its own, never another tenant's."""
        shared = [(level, t) for level, t in enumerate(self.tiers) if t.shared and t.available]
        if not shared:  # no tier another host writes: nothing to find (and no key to look at)
            return 0
        first = next((i for i, k in enumerate(keys) if self.locate(k) is None), None)
        if first is None:
            return 0
        deadline = time.monotonic() + self.discover_timeout_s
        gate = self._discovering.setdefault(owner, asyncio.Lock())
        try:
            await asyncio.wait_for(gate.acquire(), self.discover_timeout_s)
        except asyncio.TimeoutError:
            return 0
        try:
            missing = [k for k in keys[first:] if self.locate(k) is None]
            loop = asyncio.get_running_loop()
            found = 0
            for level, tier in shared:
                left = deadline - time.monotonic()
                if left <= 0 or not missing:
                    break
                try:
                    keys_found = await asyncio.wait_for(
                        loop.run_in_executor(None, tier.discover, missing, left, stop_at_absent), left + 0.25)
                except asyncio.TimeoutError:
                    continue
                found += len(keys_found)
                self.metrics.discovered.labels(tier.name).inc(len(keys_found))
        finally:
            gate.release()
            if not gate.locked() and not gate._waiters:  # noqa: SLF001 - drop idle tenants' locks
                self._discovering.pop(owner, None)
        self._adopt_shared()  # at once: the key index and KV events show them when Lookup answers
        return found

    def _adopt_shared(self) -> None:
        """Keys shared tiers indexed on their own join the LRU (the tick, a discovery, a check)."""
        for tier, key in self.residency.adopt_shared():
            self.namespaces.note(tier.header(key))
        for tier in self.tiers:
            if tier.shared:
                refused = tier.take_refused()  # forged objects, or made under another secret
                if refused:
                    self.metrics.corrupt.labels(tier.name).inc(refused)

    def publish_availability(self) -> None:
        """Tell the shared key index which tiers can be read now: called by a tier whose circuit
        breaker opened or closed, in the thread that saw it (`Tier.on_availability_change`), so
        clients' local Lookups see a tier go down at once; the index's tick (every TICK_S) catches
        the rest (a cooldown over) and any publication two threads raced."""
        if self.key_index is not None:
            with self._availability_lock:
                try:
                    self.key_index.set_available([t.available for t in self.tiers])
                except (ValueError, TypeError):  # the index closed meanwhile (the daemon stopping): nothing to tell
                    pass

    def header(self, key: bytes) -> BlockHeader | None:
        return self.residency.header(key)

    def missing(self, keys: list[bytes]) -> list[bytes]:
        return [k for k in keys if self.locate(k) is None]

    # -- reads (the rest in reads.py, promotion.py) -------------------------------------------

    def note_looked_up(self, keys: list[bytes]) -> int:
        """A same-host client's local Lookups found ``keys`` (its report, kvstore/shm_index.py): each
        one a tier holds is a use for eviction ``adaptive``, as a Get's hit is (a Get of it that
        follows is not counted again: `Residency.note_lookup`). How many were held."""
        used = self.residency.note_looked_up(keys)
        if used:  # only the adaptive policy's segments moved
            self._refresh_arc_gauges()
        return used

    def note_read(self, level: int, key: bytes) -> None:
        """A Get found ``key`` in tier ``level`` (``reads`` calls this on the loop for each hit): a
        use for eviction ``adaptive``; under admission "reused" it now earns the copy below that
        write-through skipped at its Put, and a lower-tier hit is promoted to the top in the
        background (``promote_on_get``)."""
        self.residency.note_hit(level, key)
        if self.admission != "all" and not self.residency.reused(key):
            self.residency.mark_reused(key)
            if self.write_through and level + 1 < len(self.tiers) and key not in self.tiers[level + 1]:
                self.write_behind.enqueue(level + 1, key)
        if level > 0 and self.promote_on_get:
            self.promoter.schedule(key)

    def gpu_pool(self):
        """The pool tensor of a top GPU tier, or None."""
        return self.tiers[0].pool

    def gpu_offset(self, key: bytes) -> int | None:
        """Offset of ``key``'s payload in the GPU pool, when the top tier is a GPU tier holding it."""
        return self.tiers[0].payload_offset(key) if key in self.tiers[0] else None

    # -- writes -------------------------------------------------------------------------------

    def check_namespace(self, header: BlockHeader) -> None:
        self.namespaces.check(header)

    async def put(self, header: BlockHeader, payload: memoryview, owner: str = "", quota: int = 0,
                  durable: bool = False, hash_payload: bool = False, parent: bytes = b"",
                  walk: WalkBudget | None = None) -> BlockHeader:
        """Store a block in the top tier (evicting as needed) and queue its copy to lower tiers;
        returns the header stored.

        ``hash_payload``: ``header.checksum`` is not given but computed here from ``payload``, in
        the same pass as the copy into a host-memory top tier (see ``Tier.put_checksummed``).

        ``owner`` with ``quota`` > 0: the owner may hold at most ``quota`` bytes in the top tier;
        its own least recently used blocks are evicted (demoted) first. ``durable``: return only
        once a durable tier (fsynced disk, S3) holds the block. ``parent``: the key before it in its
        chain (an eviction hint, ``Residency.link``), whose ancestors are refreshed within ``walk``
        (one budget for a whole call's blocks). Raises ValueError for a layout that contradicts the
        namespace or a durable put without a durable tier, TierFullError when the block cannot fit
        even after evicting every unpinned block, TierError when the durable copy failed.
        """
        self.check_namespace(header)
        durable_level = self._durable_level() if durable else 0
        if quota:
            self.quotas[owner] = quota
        async with self.lock:
            header = await self.evictor.store_in(0, header, payload, hash_payload, owner=owner)
            # linked once stored: a Put no tier took keeps nothing of its hint
            self.residency.link(header.key, parent, 0, walk if walk is not None else WalkBudget())
            self.namespaces.note(header, owner)
            self.residency.note_use(header.key, header.block_len)
        await self._make_durable(header, durable_level)
        self._queue_lower(header, durable, durable_level)
        self.refresh_gauges()
        return header

    async def put_many(self, blocks: list[tuple[BlockHeader, memoryview | Gather, bytes]], owner: str = "",
                       quota: int = 0, durable: bool = False, stored: list | None = None,
                       offload: bool = True) -> list[BlockHeader]:
        """:meth:`put` of ``(header, payload, parent)`` blocks of one owner, each hashed as it is
        copied (``hash_payload``), the parents walked within one budget. Into a CPU top tier the
        copies of a large call run in worker threads (``Evictor.store_many``; not ``offload``: on
        the event loop).
        ``stored``: a list as long as ``blocks``, filled in place with each header as its block is
        stored, so that a caller whose call fails midway knows which blocks were."""
        stored = stored if stored is not None else [None] * len(blocks)
        layouts: dict[bytes, object] = {}
        for header, _, _ in blocks:
            self.check_namespace(header)
            if layouts.setdefault(header.namespace, header.layout) != header.layout:
                raise ValueError(f"layout {header.layout} does not match namespace {header.namespace.hex()}, "
                                 f"whose blocks have layout {layouts[header.namespace]}")
        durable_level = self._durable_level() if durable else 0
        if quota:
            self.quotas[owner] = quota
        walk = WalkBudget()
        try:
            async with self.lock:
                try:
                    await self.evictor.store_many(0, [(header, payload) for header, payload, _ in blocks], owner, stored,
                                                  offload)
                finally:  # the blocks stored, even when a later one failed
                    for header, (_, _, parent) in zip(stored, blocks):
                        if header is not None:
                            self.residency.link(header.key, parent, 0, walk)
                            self.namespaces.note(header, owner)
                            self.residency.note_use(header.key, header.block_len)
            for header in stored:
                await self._make_durable(header, durable_level)
        finally:
            for header in stored:
                if header is not None:
                    self._queue_lower(header, durable, durable_level)
            self.refresh_gauges()
        return stored

    async def _make_durable(self, header: BlockHeader, durable_level: int) -> None:
        """Copy a block just stored in the top tier down to the durable tier at ``durable_level``
        (0: not a durable put); TierError when that fails."""
        for level in range(1, durable_level + 1):
            if not await self.write_behind.copy(level, header.key):
                raise TierError(f"the block could not be made durable in {self.tiers[durable_level].name}")

    def _queue_lower(self, header: BlockHeader, durable: bool, durable_level: int) -> None:
        """Queue a stored block's copy to the tiers below (the tier below the durable one, for a
        durable put), as write-through and admission allow."""
        if self.write_through and (durable or self.admits(header.key)):
            self.write_behind.enqueue(durable_level + 1 if durable else 1, header.key)
        elif self.write_through and len(self.tiers) > 1:
            self.metrics.not_admitted.labels(self.tiers[1].name).inc()

    def _durable_level(self) -> int:
        level = next((i for i, tier in enumerate(self.tiers) if tier.durable), None)
        if level is None:
            raise ValueError("a durable put needs a durable tier: a disk tier with disk_fsync on, or S3")
        return level

    def hold_bound(self, owner: str) -> int:
        """Most bytes ``owner`` may hold pinned or leased: its share of ``hold_share`` of the
        smallest bounded tier, and never more than its quota."""
        sizes = [t.capacity_bytes for t in self.tiers if t.capacity_bytes and not t.shared]
        share = int((self.hold_share or 0) * min(sizes, default=0) / self.tenants) if sizes else 1 << 62
        quota = self.quotas.get(owner, 0)
        return min(share, quota) if quota else share

    def admits(self, key: bytes) -> bool:
        """May lower tiers take ``key`` now (``admission``)?"""
        return self.admission == "all" or self.residency.reused(key)

    def count_write_error(self, target: Tier, what: str, exc: Exception) -> None:
        """A copy into ``target`` failed: counted; logged at most once a minute per tier and kind of
        error, with how many more there were (a flood of bad blocks writes no flood of lines)."""
        self.write_errors += 1
        self.metrics.write_errors.labels(target.name).inc()
        self.health.note_write_error(target.name, exc)
        if isinstance(exc, TierUnavailableError):
            self.metrics.unavailable.labels(target.name).inc()
            log.debug("%s to %s failed: %s", what, target.name, exc)
            return
        suppressed = self._error_log.admit((target.name, type(exc).__name__))
        if suppressed is not None:
            more = f" ({suppressed} more like it in the last minute)" if suppressed else ""
            log.warning("%s to %s failed: %s: %s%s", what, target.name, type(exc).__name__, exc, more)

    # -- holds (holds.py) ---------------------------------------------------------------------

    def pin(self, keys: list[bytes], owner: str = "") -> int:
        """Keep blocks from eviction in every tier holding them, all or none; HoldRefused when
        ``owner`` would pass its bound (:meth:`hold_bound`). Caller checks they exist."""
        try:
            return self.holds.pin([(k, self.header(k).block_len) for k in keys], owner)
        except HoldRefused:
            self.metrics.holds_refused.labels("pin").inc()
            raise

    def unpin(self, keys: list[bytes]) -> int:
        return self.holds.unpin(keys)

    def lease(self, key: bytes, seconds: float, owner: str = "") -> bool:
        """Keep ``key`` from eviction and demotion for ``seconds`` (a client is copying it by
        reference, or will load it soon); an existing longer lease stays. False (not leased) for a
        key no tier holds or when ``owner`` would pass its bound."""
        header = self.header(key)
        if header is None:
            return False
        if self.holds.lease(key, seconds, header.block_len, owner):
            return True
        self.metrics.holds_refused.labels("lease").inc()
        return False

    def claim(self, keys: list[bytes], owner: str) -> None:
        """``owner`` named these keys: charge it for copies nobody is charged for (found at start)."""
        if owner:
            for key in keys:
                self.residency.claim(key, owner)

    def release(self, keys: list[bytes]) -> int:
        return self.holds.release(keys)

    @property
    def pinned(self) -> int:
        return len(self.holds.pinned)

    # -- maintenance --------------------------------------------------------------------------

    async def delete(self, keys: list[bytes]) -> int:
        """Remove blocks from every tier; absent keys are not an error (the cache may have evicted them)."""
        deleted = 0
        async with self.lock:
            for key in keys:
                found = False
                for level, tier in enumerate(self.tiers):
                    if key in tier:
                        await self.residency.delete(level, key)
                        found = True
                self.holds.forget(key)
                self.write_behind.cancel(key)
                deleted += found
        self.refresh_gauges()
        return deleted

    async def clear(self, tier_names: list[str] | None = None) -> int:
        known = [t.name for t in self.tiers]
        unknown = set(tier_names or []) - set(known)
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}; this daemon has {known}")
        cleared = 0
        async with self.lock:
            for level, tier in enumerate(self.tiers):
                if tier_names and tier.name not in tier_names:
                    continue
                cleared += await self.residency.clear(level)
                self.write_behind.cancel()
            self.holds.keep_pins_of(lambda k: self.locate(k) is not None)
        self.refresh_gauges()
        return cleared

    def check_integrity(self) -> None:
        """Every tier's own invariants, the LRU index equal to what each tier holds (and the key
        index to the LRU), and no pin of a key no tier holds."""
        self._adopt_shared()
        for tier in self.tiers:
            tier.check_integrity()
        self.residency.check_integrity()
        self.holds.check_integrity()
        stray = [k for k in self.holds.pinned if self.locate(k) is None]
        if stray:
            raise RuntimeError(f"{len(stray)} pinned keys are stored in no tier")

    def refresh_gauges(self) -> None:
        for tier in self.tiers:
            self.metrics.used_bytes.labels(tier.name).set(tier.used_bytes)
            self.metrics.blocks.labels(tier.name).set(len(tier))
        self._refresh_arc_gauges()
        self.metrics.namespaces.set(len(self.namespaces))
        self.write_behind.refresh_gauges()

    def _refresh_arc_gauges(self) -> None:
        """`kvstore_arc_frequent_blocks` per tier, where eviction ``adaptive`` keeps ARC's segments."""
        for level, tier in enumerate(self.tiers):
            arc = self.residency[level].arc
            if arc is not None:
                self.metrics.arc_frequent.labels(tier.name).set(len(arc.frequent))

