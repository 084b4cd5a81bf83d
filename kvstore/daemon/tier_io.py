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
from kvstore.transcode import transcode
from tiers.base import Tier

T = TypeVar("T")

#: Worker threads for blocking-tier reads (promotions, demotions and Gets).
READER_THREADS = 4


class TierIO:
    def __init__(self, tiers: list[Tier]) -> None:
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-writer")
        self._readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvstore-reader")
        #: Tiers that want many requests in flight (S3) get threads of their own for reads and writes.
        self._pools = {t.name: ThreadPoolExecutor(t.io_threads, thread_name_prefix=f"kvstore-{t.name}")
                       for t in tiers if t.io_threads}
        #: Executor calls one batched Get splits its blocking reads into: one per core, since a
        #: disk read from the page cache is a CPU-bound copy and hash (more would only contend).
        self.read_lanes = max(1, min(READER_THREADS, os.cpu_count() or 1))

    async def run(self, tier: Tier, fn: Callable[..., T], *args, reader: bool = False) -> T:
        """Call a tier: directly for memory tiers, else in the tier's own pool, the reader pool
        (``reader``) or the single writer thread (which keeps a disk's puts and deletes in order)."""
        if not tier.blocking_io:
            return fn(*args)
        pool = self._pools.get(tier.name) or (self._readers if reader else self._writer)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

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
