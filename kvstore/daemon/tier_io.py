"""The threads that call tiers: a memory tier is called on the event loop, a blocking one (disk) in
the reader threads or the single writer thread, a network one (S3) in a pool of its own.

    memory tier (cpu, gpu)   fn(*args) on the loop: no await between finding and copying a block
    disk                     reads: READER_THREADS readers; puts and deletes: one writer, in order
    s3 (io_threads > 0)      reads, puts and deletes: its own pool of io_threads
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Callable, TypeVar

from kvstore.block import BlockHeader
from kvstore.scatter import Gather
from compression.transcode import transcode
from tiers.base import Tier

T = TypeVar("T")

#: Worker threads for blocking-tier reads (promotions, demotions and Gets) and the copies of
#: large Gets and Puts of memory tiers.
READER_THREADS = 4
#: The most of them one Put's copies take: one is always left for other clients' reads, which
#: would otherwise queue behind a large Put's whole copy.
FILL_LANES_MAX = READER_THREADS - 1
#: A Get or Put moving at least this many bytes copies memory-tier blocks in worker threads; a
#: smaller one copies on the event loop, where a thread hop would cost more than the copy.
OFFLOAD_BYTES = 1 << 20


class TierIO:
    def __init__(self, tiers: list[Tier]) -> None:
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-writer")
        self._readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvstore-reader")
        #: Tiers that want many requests in flight (S3) get threads of their own for reads and writes.
        self._pools = {t.name: ThreadPoolExecutor(t.io_threads, thread_name_prefix=f"kvstore-{t.name}")
                       for t in tiers if t.io_threads}
        cores = os.cpu_count() or 1
        #: Executor calls one batched Get splits its blocking reads into: one per core, since a
        #: disk read from the page cache is a CPU-bound copy and hash (more would only contend).
        self.read_lanes = max(1, min(READER_THREADS, cores))
        #: Worker threads one large Put copies in: half the cores (FILL_LANES_MAX at most), the
        #: other half left to the clients (a client copies its next payload while the daemon stores
        #: the last) and to the event loop. Measured on 2 cores with the copy then in Python
        #: (bench/ab_pairs.py, 4 pairs): one lane against two, Puts through the staging arena 1.18x
        #: faster, Puts in rows 1.04x, another client's gRPC Lookups during them p50 0.78x, p99
        #: 1.56x (both far below copying on the event loop).
        self.fill_lanes = max(1, min(FILL_LANES_MAX, cores // 2))
        #: Worker threads a Put in rows copies in (`Gather`: out of the client's KV cache, which the
        #: client leaves alone until the call ends, so it has no copy of its own to make
        #: meanwhile): every core, FILL_LANES_MAX at most. With the copy in C (kernels/copy_hash.c,
        #: no GIL held), two lanes against one on 2 cores: a 47 MB Put in rows 3.9-4.8 against
        #: 5.3-6.7 ms, another client's gRPC Lookups meanwhile p50 1.25x, p99 0.99x
        #: (docs/benchmarks.md, "A Put in rows copies in every core").
        self.row_fill_lanes = max(1, min(FILL_LANES_MAX, cores))

    async def run(self, tier: Tier, fn: Callable[..., T], *args, reader: bool = False) -> T:
        """Call a tier: directly for memory tiers, else in the tier's own pool, the reader pool
        (``reader``) or the single writer thread (which keeps a disk's puts and deletes in order)."""
        if not tier.blocking_io:
            return fn(*args)
        pool = self._pools.get(tier.name) or (self._readers if reader else self._writer)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def fill_many(self, tier: Tier, fills: list[tuple[int, BlockHeader, object]]) -> list[int | Exception | None]:
        """``tier.fill`` of extents reserved with ``tier.reserve`` (offset, header, payload), in at
        most :attr:`fill_lanes` reader threads at once (:attr:`row_fill_lanes` when every payload is
        a `Gather`, a Put in rows). Per fill, in order: its checksum, the exception its copy raised,
        or None for one not copied after an earlier copy of its lane failed. Returns or raises only
        once every copy has ended, even when cancelled (then it raises CancelledError), since the
        caller frees or indexes the extents after."""
        in_rows = all(isinstance(payload, Gather) for _, _, payload in fills)
        lanes = min(self.row_fill_lanes if in_rows else self.fill_lanes, len(fills))
        loop = asyncio.get_running_loop()
        started, refused = [], None
        for lane in range(lanes):
            try:
                started.append(loop.run_in_executor(self._readers, _fill_lane, tier, fills[lane::lanes]))
            except RuntimeError as exc:  # the pool is shut down (the daemon is stopping)
                refused = exc
                break
        copies = asyncio.gather(*started, return_exceptions=True)
        cancelled = False
        while not copies.done():
            try:
                await asyncio.shield(copies)  # a cancelled caller still waits for the threads
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        if refused is not None:
            raise refused
        outcomes: list[int | Exception | None] = [None] * len(fills)
        for lane, lane_outcomes in enumerate(copies.result()):
            if isinstance(lane_outcomes, BaseException):
                raise lane_outcomes
            outcomes[lane::lanes] = lane_outcomes
        return outcomes

    def read_pool(self, tier: Tier) -> Executor:
        """Where a batch of ``tier``'s reads runs: its own pool, or the shared reader threads."""
        return self._pools.get(tier.name, self._readers)

    async def read_whole(self, tier: Tier, key: bytes) -> tuple[BlockHeader, memoryview]:
        """A block's header and payload: a zero-copy view where the tier has one (valid until the
        block is deleted or replaced: callers hold the store lock), else read into a new buffer."""
        header = tier.header(key)
        view = tier.payload_view(key)
        if view is not None:
            return header, view
        buffer = memoryview(bytearray(header.payload_len))
        await self.run(tier, tier.read_payload_into, key, buffer, reader=True)
        return header, buffer

    async def encoded(self, spec, header: BlockHeader, payload: memoryview) -> tuple[BlockHeader, memoryview]:
        """The block re-encoded into codec ``spec`` (in a reader thread), or as it is (None, or its
        codec). ``spec`` may also be a transcoder with the signature of `transcode` less the spec
        (`kvstore.daemon.autocal.AutoCalibrator`: kvtc@auto)."""
        if spec is None or spec == header.codec:
            return header, payload
        loop = asyncio.get_running_loop()
        if not isinstance(spec, str):
            return await loop.run_in_executor(self._readers, spec.transcode, header, payload)
        return await loop.run_in_executor(self._readers, transcode, header, payload, spec)

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        for pool in self._pools.values():
            pool.shutdown(wait=True)


def _fill_lane(tier: Tier, fills: list[tuple[int, BlockHeader, object]]) -> list[int | Exception | None]:
    """Fill reserved extents one after another in a worker thread: per fill its checksum, or the
    exception its copy raised, after which the lane stops (None for the fills it left)."""
    outcomes: list[int | Exception | None] = []
    for offset, header, payload in fills:
        try:
            outcomes.append(tier.fill(offset, header, payload, in_thread=True))
        except Exception as exc:  # noqa: BLE001 - handed to the store, which fails the Put with it
            outcomes.append(exc)
            break
    return outcomes + [None] * (len(fills) - len(outcomes))
