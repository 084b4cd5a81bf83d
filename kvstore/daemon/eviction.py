"""Eviction with demotion: a block written into a tier, the tier's least recently used blocks
making room for it, each one the next tier lacks copied down first.

    store_in(level, block)
      └─► make_room(level, nbytes, owner)
            ├─► over the owner's quota (memory tiers)?  evict its own LRU blocks first
            └─► over the tier's capacity?                evict anyone's LRU block that holds.py allows
                  └─► _evict(level, victim)
                        ├─► the next tier lacks it, admission lets it in?  copy_down: store_in(level + 1)
                        └─► Residency.delete(level, victim)

Demotion recurses: making room in tier 1 for a demoted block may evict (and demote) from tier 1.
A block that cannot be demoted (a codec that cannot take it) is counted and dropped from the tier
it leaves: one bad block never stops eviction. A tier that fills before its byte count says so
(a disk running out of space) evicts and retries.

Runs on the store's event loop; every call here holds the store lock (the caller takes it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Mapping

from kvstore.block import BlockHeader, payload_checksum
from kvstore.daemon.holds import Holds
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.residency import Residency
from kvstore.daemon.tier_io import OFFLOAD_BYTES, TierIO
from kvstore.scatter import Gather
from tiers.base import Tier, TierFullError

#: Longest a Put waits for reads in flight to release space when everything else is pinned.
BUSY_WAIT_S = 5.0


class Evictor:
    def __init__(self, tiers: list[Tier], residency: Residency, holds: Holds, io: TierIO, metrics: Metrics, *,
                 codecs: list, quotas: Mapping[str, int], admits: Callable[[bytes], bool],
                 count_write_error: Callable[[Tier, str, Exception], None]) -> None:
        """``codecs``: the codec each tier re-encodes demoted blocks into (None: keep).
        ``quotas``: tenant -> most bytes it may hold in each memory tier, read at each call (the
        store adds to it as Puts name quotas). ``admits(key)``: may lower tiers take the block now
        (the store's admission policy); one they may not is dropped, not demoted.
        ``count_write_error(target, what, exc)``: a demotion into ``target`` failed (counted and
        logged by the store, which counts write-behind's failures the same way)."""
        self.tiers, self.residency, self.holds, self.io, self.metrics = tiers, residency, holds, io, metrics
        self.codecs, self.quotas = codecs, quotas
        self._admits, self._count_write_error = admits, count_write_error

    async def store_in(self, level: int, header: BlockHeader, payload: memoryview,
                       hash_payload: bool = False, owner: str | None = None) -> BlockHeader:
        """Write one block into tier ``level``, evicting LRU blocks to make room; returns the
        header stored (``hash_payload``: with the checksum computed from ``payload``, see
        ``BlockStore.put``). The block's bytes are charged to ``owner`` (None: the key's owner in
        another tier), within its quota there. Holds the store lock. Raises TierFullError (see
        :meth:`make_room`)."""
        tier = self.tiers[level]
        if owner is None:
            owner = self.residency.owner(header.key)
        if header.key in tier:
            checksum = header.checksum
            if hash_payload:  # the stored copy's checksum is compared before anything is copied
                checksum = payload.checksum() if isinstance(payload, Gather) else payload_checksum(payload)
            if tier.header(header.key).checksum == checksum:
                # Keys are content addresses: the same block again only refreshes its LRU position.
                self.residency.touch(level, header.key)
                return dataclasses.replace(header, checksum=checksum)
            # other bytes under the key: replaced, hashed again as they are copied (a client's
            # arena may change between the two reads; the stored checksum is of what was stored)
            await self.residency.delete(level, header.key)
        await self.make_room(level, header.block_len, owner)
        for attempt in range(8):
            try:
                if hash_payload:
                    header = await self.residency.put_checksummed(level, header, payload, owner)
                else:
                    await self.residency.put(level, header, payload, owner)
                break
            except TierFullError:
                # The device filled up before our byte count said so (disk full): evict and retry.
                victim = self._victim(level)
                if victim is None or attempt == 7:
                    raise
                await self._evict(level, victim)
        self.metrics.bytes_in.labels(tier.name).inc(header.block_len)
        return header

    async def store_many(self, level: int, blocks: list[tuple[BlockHeader, memoryview | Gather]],
                         owner: str, stored: list, offload: bool = True) -> None:
        """:meth:`store_in` of several blocks, each hashed as it is copied (``hash_payload``), each
        header stored set in ``stored`` (as long as ``blocks``) as its block is. Into a tier with
        ``threadsafe_fills`` (CPU), blocks of at least ``OFFLOAD_BYTES`` in all are copied in worker
        threads (unless not ``offload``), several at once, while the event loop serves others::

            per block   make room (the blocks reserved so far count), reserve an extent
            then        fill every reserved extent in io.fill_lanes threads    (TierIO.fill_many;
                        io.row_fill_lanes for a Put in rows)
            then        commit each in order: indexed, recorded, charged to ``owner``

        A block that finds no room beside the extents reserved so far (a tier or a quota smaller
        than the call) first has those filled and committed, which makes them evictable as they
        would be one block at a time. Holds the store lock throughout, so nothing else evicts,
        deletes or puts meanwhile. A copy that fails stores the blocks before it, as one block at a
        time would, and frees the extents of the rest; a cancelled call frees those not committed,
        once every copy has ended."""
        tier = self.tiers[level]
        if not (offload and tier.threadsafe_fills) or sum(header.payload_len for header, _ in blocks) < OFFLOAD_BYTES:
            for i, (header, payload) in enumerate(blocks):
                stored[i] = await self.store_in(level, header, payload, True, owner)
            return
        group: list[tuple[int, int, BlockHeader, memoryview | Gather]] = []  # (index, offset, header, payload)
        group_keys: set[bytes] = set()  # the keys in ``group``, for a key the call repeats

        def unreserve_group() -> None:
            for _, offset, _, _ in group:
                tier.unreserve(offset)
            group.clear()
            group_keys.clear()

        async def fill_and_commit() -> None:
            try:
                outcomes = await self.io.fill_many(tier, [(offset, header, payload)
                                                          for _, offset, header, payload in group])
            except BaseException:
                unreserve_group()
                raise
            for outcome in outcomes:  # in order: the blocks before a failed copy are stored
                if not isinstance(outcome, int):
                    unreserve_group()
                    raise outcome if outcome is not None else RuntimeError("a copy was skipped")
                i, offset, header, _ = group[0]
                stored[i] = tier.commit(offset, header, outcome)
                group.pop(0)  # indexed: no longer ours to free
                group_keys.discard(header.key)
                self.residency.record(level, header.key, owner)
                self.metrics.bytes_in.labels(tier.name).inc(header.block_len)

        try:
            for i, (header, payload) in enumerate(blocks):
                if header.key in tier or header.key in group_keys:
                    # the same block again (a touch), or other bytes under its key: the blocks
                    # before it first, as one block at a time would
                    if group:
                        await fill_and_commit()
                    stored[i] = await self.store_in(level, header, payload, True, owner)
                    continue
                try:
                    await self.make_room(level, header.block_len, owner, sum(h.block_len for _, _, h, _ in group),
                                         wait=not group)
                    offset = tier.reserve(header, payload)
                except TierFullError:
                    if not group:
                        raise
                    await fill_and_commit()
                    await self.make_room(level, header.block_len, owner)
                    offset = tier.reserve(header, payload)
                group.append((i, offset, header, payload))
                group_keys.add(header.key)
            if group:
                await fill_and_commit()
        except BaseException:
            unreserve_group()  # reserved, no copy started
            raise

    async def make_room(self, level: int, nbytes: int, owner: str = "", reserved: int = 0, wait: bool = True) -> None:
        """Evict ``owner``'s LRU blocks of tier ``level`` until ``nbytes`` fit in its quota there
        (beside ``reserved`` bytes it has in extents being filled), then anyone's LRU blocks until
        they fit in the tier. Holds the store lock. TierFullError when every block left is pinned,
        leased or held (after waiting for reads in flight, unless not ``wait``)."""
        await self._enforce_quota(level, owner, nbytes, reserved)
        tier = self.tiers[level]
        deadline = time.monotonic() + (BUSY_WAIT_S if wait else 0.0)
        while not tier.can_fit(nbytes):
            victim = self._victim(level)
            if victim is None:
                if tier.reads_in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)  # a read in a worker thread ends within milliseconds
                    continue
                raise TierFullError(f"{tier.name}: {nbytes} bytes do not fit and every stored block is pinned "
                                    f"(capacity {tier.capacity_bytes} bytes)")
            await self._evict(level, victim)

    async def copy_down(self, level: int, key: bytes) -> bool:
        """Copy a block from tier ``level`` into the next one, re-encoded into that tier's codec
        and making room there as :meth:`store_in` does. Holds the store lock. False on failure
        (counted through ``count_write_error``)."""
        source, target = self.tiers[level], self.tiers[level + 1]
        try:
            header, payload = await self.io.read_whole(source, key)
            header, payload = await self.io.encoded(self.codecs[level + 1], header, payload)
            await self.store_in(level + 1, header, payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad block (a forged codec parameter, a layout
            # the target's codec cannot take) is not demoted, and eviction goes on for everyone
            self._count_write_error(target, f"demoting {key.hex()} from {source.name}", exc)
            return False
        return True

    async def _enforce_quota(self, level: int, owner: str, nbytes: int, reserved: int = 0) -> None:
        """Evict ``owner``'s LRU blocks of tier ``level`` until ``nbytes`` more fit in its quota
        there, beside the ``reserved`` bytes of its blocks being filled. A quota bounds a tenant's
        bytes in each memory tier (GPU, CPU), however they got there (Put, promotion, Prefetch); in
        disk and S3 its bytes are counted but share the tier's LRU with everyone's. The owner's
        bytes are kept by the tier's LRU: nothing is scanned unless it is over."""
        quota = self.quotas.get(owner, 0) if owner else 0
        if not quota or self.tiers[level].blocking_io:
            return
        if nbytes > quota:
            raise TierFullError(f"a {nbytes}-byte block exceeds tenant {owner!r}'s quota of {quota} bytes")
        lru = self.residency[level]
        while lru.owned_bytes(owner) + reserved + nbytes > quota:
            # the same blocks eviction spares: pinned, leased, streamed or being copied by a reader
            victim = next((k for k in lru.owned(owner) if self.holds.evictable(self.tiers[level], k)), None)
            if victim is None:
                raise TierFullError(f"tenant {owner!r} holds {lru.owned_bytes(owner)} bytes (pinned or in use) "
                                    f"of its {quota}-byte quota in {self.tiers[level].name}")
            await self._evict(level, victim)

    def _victim(self, level: int) -> bytes | None:
        tier = self.tiers[level]
        return next((k for k in self.residency[level] if self.holds.evictable(tier, k)), None)

    async def _evict(self, level: int, key: bytes) -> None:
        if level + 1 < len(self.tiers) and key not in self.tiers[level + 1]:
            if not self._admits(key):
                self.metrics.not_admitted.labels(self.tiers[level + 1].name).inc()
            elif await self.copy_down(level, key):
                self.metrics.demotions.labels(self.tiers[level + 1].name).inc()
        await self.residency.delete(level, key)
        self.metrics.evictions.labels(self.tiers[level].name).inc()
