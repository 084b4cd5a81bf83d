"""Reads: Get of one block or many, layer-wise reads, and what a read does with a bad copy.

    get_many_into(requests)      per block, its highest tier:
        blocking tier (disk, s3), or a CPU tier in a Get of >= OFFLOAD_BYTES
                                 ─► at most read_lanes executor calls per tier (_read_lane)
        memory tier              ─► one Tier.read_many_into per tier, on the loop (no await)
        miss, or a copy that failed
                                 ─► get_into from the tiers below: a counted miss at the end
    each hit                     ─► counted, then note_read (the store's): a lower-tier hit is
                                    promoted to the top in the background (promotion.py)

A destination may be a :class:`kvstore.scatter.Scatter` (a raw payload copied in rows straight into
a KV cache in the caller's arena): tiers that copy in rows (CPU) do it themselves; the others read
into a buffer first (`read_payload`). A payload that turns out not to be whole rows is, in that
tier, a miss like a vanished block.

A small read from a memory tier is synchronous (no await between finding and copying a block), so
it needs no lock; large Gets copy CPU-tier blocks in worker threads, and the CPU tier frees the
extent of a block deleted meanwhile only after those copies end (``Tier.busy``; eviction skips busy
blocks). A block found corrupt is deleted, counted, and reported as a miss; a tier that is
unreachable costs misses, never errors.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from kvstore.block import BlockHeader, CorruptBlockError
from kvstore.daemon.holds import Holds
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.residency import Residency
from kvstore.daemon.tier_io import OFFLOAD_BYTES, TierIO
from kvstore.scatter import Scatter, Unfit
from tiers.base import Tier, TierUnavailableError

#: Where a read copies a payload: a slice of an arena or a reply buffer, or a slice in rows.
Dest = memoryview | Scatter

log = logging.getLogger(__name__)


class BlockGoneError(RuntimeError):
    """A block left its tier while a layer-wise read was streaming it (deleted, or evicted after
    the reader stalled past ``STREAM_HOLD_S``)."""


@dataclass(frozen=True)
class GetResult:
    header: BlockHeader
    tier: str


class Reader:
    def __init__(self, tiers: list[Tier], residency: Residency, holds: Holds, io: TierIO, metrics: Metrics,
                 note_read: Callable[[int, bytes], None]) -> None:
        """Reads find blocks through ``residency`` (and touch them there), drop bad copies through
        it, hold streamed blocks in ``holds`` and call blocking tiers through ``io``.
        ``note_read(level, key)``: called on the loop for each hit, after it is counted (the store
        decides there what a hit earns: a copy below under admission "reused", a promotion)."""
        self.tiers, self.residency, self.holds, self.io, self.metrics = tiers, residency, holds, io, metrics
        self._note_read = note_read

    async def get_into(self, key: bytes, dest: Dest, first_level: int = 0) -> GetResult | None:
        """Copy the payload of ``key`` into ``dest`` from the highest tier at or below
        ``first_level`` holding it; None on a miss. Corrupt copies are dropped; unreachable tiers skipped."""
        for level, tier in enumerate(self.tiers):
            if level < first_level or key not in tier:
                continue
            try:
                if tier.blocking_io:
                    header = await self.io.run(tier, read_payload, tier, key, dest, reader=True)
                else:
                    header = read_payload(tier, key, dest)
            except Unfit:
                continue  # a coded copy, or one of another size: not for this destination
            except KeyError:
                self.forget_vanished(level, key)  # deleted underneath us: try the next tier
                continue
            except CorruptBlockError as exc:
                await self.drop_corrupt(level, key, exc)
                continue
            except TierUnavailableError as exc:
                self.metrics.unavailable.labels(tier.name).inc()
                log.debug("%s", exc)
                continue
            return self._hit(level, key, header)
        self.metrics.misses.inc()
        return None

    async def get_many_into(self, requests: list[tuple[bytes, Dest]]) -> list[GetResult | None]:
        """:meth:`get_into` for many blocks (one Get call); results in request order. The hits are
        used in each tier as one chain (``Residency.touch_chain``: a Get names a prompt's blocks
        first to last)."""
        results = await self._get_many_into(requests)
        used: dict[str, list[bytes]] = {}
        for (key, _), result in zip(requests, results):
            if result is not None:
                used.setdefault(result.tier, []).append(key)
        for level, tier in enumerate(self.tiers):
            if tier.name in used:
                self.residency.touch_chain(level, used[tier.name])
        return results

    async def _get_many_into(self, requests: list[tuple[bytes, Dest]]) -> list[GetResult | None]:
        """The reads of :meth:`get_many_into`, the LRU not yet touched.

        Blocks whose highest copy is in a blocking tier are read in at most ``read_lanes`` executor
        calls (not one thread hop per block); so are blocks in a memory tier with thread-safe reads
        (CPU) when the call moves at least ``OFFLOAD_BYTES``: the event loop keeps serving
        other clients while the copies run, on every core. Smaller calls copy at once, one
        ``read_many_into`` per tier (a thread hop would cost more than the copy). A block that
        turns out corrupt or vanished falls back to :meth:`get_into`, which drops the corrupt copy
        and tries the tiers below.
        """
        results: list[GetResult | None] = [None] * len(requests)
        blocking: dict[int, list[int]] = {}  # tier level -> indices into requests
        in_memory: dict[int, list[int]] = {}  # memory tiers: copied on the loop, one call per tier
        spans = (len(dest.dest) if isinstance(dest, Scatter) else len(dest) for _, dest in requests)
        offload = sum(spans) >= OFFLOAD_BYTES
        for i, (key, dest) in enumerate(requests):
            level = self.residency.locate(key)
            if level is None:
                results[i] = await self.get_into(key, dest)  # a counted miss (no await inside)
            elif self.tiers[level].blocking_io or (offload and self.tiers[level].threadsafe_reads):
                blocking.setdefault(level, []).append(i)
            else:
                in_memory.setdefault(level, []).append(i)
        for level, indices in in_memory.items():
            tier = self.tiers[level]
            rows = [i for i in indices if isinstance(requests[i][1], Scatter)] if not tier.scatters else []
            if rows:  # read one at a time: a buffer each, then copied in rows
                for i in rows:
                    results[i] = await self.get_into(*requests[i], first_level=level)
                indices = [i for i in indices if not isinstance(requests[i][1], Scatter)]
            # One call: the GPU tier copies each run of pool- and destination-adjacent blocks at once.
            headers = tier.read_many_into([requests[i] for i in indices])
            for i, header in zip(indices, headers):
                results[i] = self._hit(level, requests[i][0], header, touch=False)
        if not blocking:
            return results
        loop = asyncio.get_running_loop()
        calls, lanes_of = [], []
        for level, indices in blocking.items():
            tier = self.tiers[level]
            # A network tier reads one block per thread, all in flight at once; disk, one lane per core.
            lanes = min(tier.io_threads or self.io.read_lanes, len(indices))
            pool = self.io.read_pool(tier)
            for lane in range(lanes):
                lane_indices = indices[lane::lanes]
                calls.append(loop.run_in_executor(pool, _read_lane, tier, [requests[i] for i in lane_indices]))
                lanes_of.append((level, lane_indices))
        outcomes = await asyncio.gather(*calls)
        for (level, lane_indices), lane_outcomes in zip(lanes_of, outcomes):
            for i, outcome in zip(lane_indices, lane_outcomes):
                key, dest = requests[i]
                if isinstance(outcome, BlockHeader):
                    results[i] = self._hit(level, key, outcome, touch=False)
                    continue
                if isinstance(outcome, CorruptBlockError):
                    await self.drop_corrupt(level, key, outcome)
                elif isinstance(outcome, TierUnavailableError):
                    self.metrics.unavailable.labels(self.tiers[level].name).inc()
                elif isinstance(outcome, KeyError):
                    self.forget_vanished(level, key)
                # (Unfit: this tier's copy is not whole rows of the destination; try those below)
                results[i] = await self.get_into(key, dest, level + 1)  # the tiers below, or a counted miss
        return results

    async def get_layerwise(self, requests: list[tuple[bytes, Dest]], owner: str = ""
                            ) -> AsyncIterator[tuple[int, list[GetResult | None] | None]]:
        """Yield ``(-1, results)``, then ``(layer, None)`` once that layer of every block is in
        its destination. Raw blocks in memory tiers are copied layer by layer; other blocks
        (encoded, or in a disk or S3 tier: verified whole first) arrive before layer 0::

            payload  [L0 K|V][L1 K|V] ... [Ln-1 K|V]    one layer = payload_len / num_layers

        Holds no lock while the caller sends (a reader that is slow, or never reads, delays
        nobody): the streamed blocks are kept from eviction instead (``STREAM_HOLD_S``, renewed at
        each layer), and before each layer's copy, with no await in between, each block is checked
        to be the same one still in its tier; a block deleted meanwhile raises BlockGoneError,
        never a copy of bytes that now belong to another block. The holds count against
        ``owner``'s bound of held bytes; a block past it streams unheld.
        """
        holds = self.holds
        results: list[GetResult | None] = [None] * len(requests)
        layered: list[tuple[memoryview, object, BlockHeader, Tier, bytes, bool]] = []
        whole: list[int] = []
        used: dict[int, list[bytes]] = {}  # tier level -> keys streamed from it, in request order
        for i, (key, dest) in enumerate(requests):
            level = self.residency.locate(key)
            tier = self.tiers[level] if level is not None else None
            if tier is None or tier.blocking_io or tier.header(key).codec != "raw":
                whole.append(i)
                continue
            source = tier.payload_source(key)
            if source is None:
                whole.append(i)
                continue
            header = tier.header(key)
            held = holds.hold(key, header.block_len, owner)
            results[i] = self._hit(level, key, header, touch=False)
            used.setdefault(level, []).append(key)
            layered.append((dest, source, header, tier, key, held))
        for level, keys in used.items():
            self.residency.touch_chain(level, keys)
        try:
            if whole:
                found = await self.get_many_into([requests[i] for i in whole])
                for i, result in zip(whole, found):
                    results[i] = result
            yield -1, results
            for layer in range(max((h.layout.num_layers for _, _, h, _, _, _ in layered), default=0)):
                for dest, source, header, tier, key, _ in layered:
                    if layer >= header.layout.num_layers:
                        continue
                    if key not in tier or tier.header(key) is not header:
                        raise BlockGoneError(f"block {key.hex()} left the {tier.name} tier during a layer-wise read")
                    holds.renew(key)
                    size = header.payload_len // header.layout.num_layers
                    _copy_range(dest, source, layer * size, size)
                yield layer, None
        finally:
            for _, _, _, _, key, held in layered:
                if held:
                    holds.unhold(key)

    def _hit(self, level: int, key: bytes, header: BlockHeader, touch: bool = True) -> GetResult:
        tier = self.tiers[level]
        if touch:
            self.residency.touch(level, key)
        self.metrics.hits.labels(tier.name).inc()
        self.metrics.bytes_out.labels(tier.name).inc(header.payload_len)
        self._note_read(level, key)
        return GetResult(header, tier.name)

    # -- bad copies ---------------------------------------------------------------------------

    async def read_or_drop(self, level: int, key: bytes) -> tuple[BlockHeader, memoryview] | None:
        """The whole block from tier ``level``; None (corrupt copy dropped, vanished key forgotten)
        when there is none to read. Raises TierUnavailableError."""
        try:
            return await self.io.read_whole(self.tiers[level], key)
        except CorruptBlockError as exc:
            await self.drop_corrupt(level, key, exc)
        except KeyError:
            self.forget_vanished(level, key)
        return None

    async def drop_corrupt(self, level: int, key: bytes, exc: Exception) -> None:
        """Delete a copy that failed validation from tier ``level`` and count it; a block left in
        no tier loses its pins and leases too."""
        tier = self.tiers[level]
        log.warning("%s: block %s is corrupt (%s); deleted", tier.name, key.hex(), exc)
        self.metrics.corrupt.labels(tier.name).inc()
        await self.residency.delete(level, key)
        if self.residency.locate(key) is None:
            self.holds.forget(key)

    def forget_vanished(self, level: int, key: bytes) -> None:
        """A block its tier no longer holds (removed underneath, e.g. by another host): unindex it."""
        if key not in self.tiers[level]:
            self.residency.forget(level, key)


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


def read_payload(tier: Tier, key: bytes, dest: Dest) -> BlockHeader:
    """``tier.read_payload_into(key, dest)``, a `Scatter` too: a tier that cannot copy in rows reads
    the payload into a buffer, which is then copied in rows (Unfit, with nothing copied, for a
    payload that is not whole rows of the destination)."""
    if not isinstance(dest, Scatter) or tier.scatters:
        return tier.read_payload_into(key, dest)
    payload_len = tier.header(key).payload_len
    if not dest.fits(payload_len):
        raise Unfit(f"a {payload_len}-byte payload is not whole rows of the destination")
    buffer = memoryview(bytearray(payload_len))
    header = tier.read_payload_into(key, buffer)
    dest.fill(buffer[: header.payload_len])
    return header


def _read_lane(tier: Tier, requests: list[tuple[bytes, Dest]]) -> list[BlockHeader | Exception]:
    """Read blocks one after another in a worker thread: each a header, or the KeyError,
    CorruptBlockError, TierUnavailableError or Unfit that made it a miss in this tier (others propagate)."""
    outcomes: list[BlockHeader | Exception] = []
    for key, dest in requests:
        try:
            outcomes.append(read_payload(tier, key, dest))
        except (KeyError, CorruptBlockError, TierUnavailableError, Unfit) as exc:
            outcomes.append(exc)
    return outcomes
