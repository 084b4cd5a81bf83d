"""CPU tier: one pre-allocated arena in host memory (pinned when CUDA is present).

No allocation per block: each block (header and payload, contiguous) lives in an extent of the
arena handed out by :class:`tiers.allocator.ExtentAllocator`.

Reads may run in worker threads (``threadsafe_reads``): the store copies large Gets off its event
loop, where numpy's copy releases the GIL. A block deleted or replaced while a read copies it
leaves the index at once, but its extent is freed only when the last such read ends, so a read
never sees bytes of a block put in its place.

Puts may copy in worker threads too (``threadsafe_fills``): a put is reserve (an extent, not yet
indexed), fill (the copy and its hash, in any thread) and commit (indexed), so the store copies the
blocks of a large Put in worker threads while its event loop serves others.
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
from pathlib import Path

import numpy as np

from kvstore.block import CHECKSUM_STEP, BlockHeader, CorruptBlockError, copy_checksummed, native_copies
from kvstore.scatter import Gather, Scatter, Unfit, copy_streamed_many
from tiers.allocator import ExtentAllocator
from tiers.base import ExtentIndex, Tier, TierError, TierFullError
from kvstore.memory import prefault

#: A cgroup memory limit at or above this is "no limit" (cgroup v1 writes 2**63 - page size).
_UNLIMITED = 2**62


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (what can be allocated without swapping), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_memory_limit() -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors in bytes (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``), or None when there is none or it cannot be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2
            base, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):  # v1
            base, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        folder = base / path.lstrip("/")
        while True:  # the cgroup and its ancestors (in a container its own may show as the root)
            candidates.append(folder / name)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    limits = []
    for file in candidates:
        try:
            value = file.read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < _UNLIMITED:
            limits.append(int(value))
    return min(limits) if limits else None


def memory_shortfall(capacity: int) -> str | None:
    """Why an arena of ``capacity`` bytes cannot be had here ("64.0 GiB is more than this machine's
    available memory (22.9 GiB; cgroup limit 16.0 GiB)"), or None when it fits (or nothing is known)."""
    available, limit = available_memory(), cgroup_memory_limit()
    known = [n for n in (available, limit) if n is not None]
    if not known or capacity <= min(known):
        return None
    what = [_gib(available)] if available is not None else []
    if limit is not None:
        what.append(f"cgroup limit {_gib(limit)}")
    return f"{_gib(capacity)} is more than this machine's available memory ({'; '.join(what)})"


def _host_arena(capacity: int, pin: bool) -> np.ndarray:
    """A uint8 array of ``capacity`` bytes; page-locked through torch when CUDA is present."""
    if pin:
        import torch

        if torch.cuda.is_available():
            pinned = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            return pinned.numpy()
    region = mmap.mmap(-1, capacity)
    prefault(region)  # in the background: puts never pay first-touch page faults for long
    return np.frombuffer(region, dtype=np.uint8)


class CpuTier(ExtentIndex, Tier):
    blocking_io = False
    threadsafe_reads = True
    threadsafe_fills = True
    scatters = True

    def __init__(self, capacity_bytes: int, name: str = "cpu", pin: bool = True) -> None:
        if capacity_bytes < 4096:
            raise ValueError(f"cpu tier capacity must be at least 4096 bytes, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        try:
            self._arena = _host_arena(capacity_bytes, pin)
        except (OSError, MemoryError, RuntimeError) as exc:  # ENOMEM, or torch's pinned allocation
            reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
            available = available_memory()
            if available is not None:
                reason += f"; {_gib(available)} available"
            raise TierError(f"cannot allocate the {name} tier's {_gib(capacity_bytes)} arena ({reason}): lower "
                            f"cpu_capacity (--cpu-capacity)") from None
        self._allocator = ExtentAllocator(capacity_bytes)
        native = native_copies()  # the copy kernels compiled now (once per machine), not in a Put on the loop
        if native is not None:
            native.native_library()
        self._blocks: dict[bytes, tuple[int, BlockHeader]] = {}  # key -> (offset, header)
        #: Guards the allocator and the two maps below against reads in worker threads.
        self._lock = threading.Lock()
        self._reading: dict[int, int] = {}  # extent offset -> reads in flight
        self._doomed: set[int] = set()      # extents deleted while read: freed by the last reader
        self._reserved: set[int] = set()    # extents reserved for puts whose copies are under way
        self._used = 0                      # block_len of the indexed blocks (Tier.used_bytes)

    def can_fit(self, nbytes: int) -> bool:
        with self._lock:
            return self._allocator.can_allocate(nbytes)

    def busy(self, key: bytes) -> bool:
        entry = self._blocks.get(key)
        return entry is not None and entry[0] in self._reading

    @property
    def reads_in_flight(self) -> int:
        return len(self._reading)

    def payload_view(self, key: bytes) -> memoryview:
        """Zero-copy view of a stored payload; valid until the block is deleted or replaced."""
        offset, header = self._blocks[key]
        start = offset + header.header_len
        return memoryview(self._arena[start : start + header.payload_len])

    def payload_source(self, key: bytes) -> memoryview:
        return self.payload_view(key)

    def put(self, header: BlockHeader, payload: memoryview) -> None:
        offset = self._allocate(header, payload)
        start = offset + header.header_len
        self._arena[start : start + header.payload_len] = np.frombuffer(payload, dtype=np.uint8)
        self._index(offset, header)

    def put_checksummed(self, header: BlockHeader, payload: memoryview | Gather) -> BlockHeader:
        offset = self.reserve(header, payload)
        try:
            checksum = self.fill(offset, header, payload)
        except BaseException:
            self.unreserve(offset)
            raise
        return self.commit(offset, header, checksum)

    # A put in three steps, so that the copies of several blocks can run at once in worker threads
    # (``threadsafe_fills``): reserve and commit on the store's thread, fill in any thread.

    def reserve(self, header: BlockHeader, payload: memoryview | Gather) -> int:
        """An extent for the block, not yet indexed (no read finds it, eviction cannot take it):
        its offset. Raises TierFullError (nothing reserved) when no free extent is large enough."""
        offset = self._allocate(header, payload)
        with self._lock:
            self._reserved.add(offset)
        return offset

    def fill(self, offset: int, header: BlockHeader, payload: memoryview | Gather, in_thread: bool = False) -> int:
        """Copy the payload into the reserved extent and return the checksum of what it now holds:
        in one pass by the C kernel where it applies, one call without the GIL. Where it does not,
        on the event loop each chunk is hashed from cache just after its copy, and ``in_thread`` (a
        worker thread) the payload is copied whole and then hashed, two calls without the GIL (see
        `kvstore.block.copy_checksummed`). Any thread; no lock."""
        start = offset + header.header_len  # header_len does not depend on the checksum
        dest = memoryview(self._arena[start : start + header.payload_len])
        step = 0 if in_thread else CHECKSUM_STEP
        if isinstance(payload, Gather):  # rows out of a client's KV cache (kvstore/scatter.py)
            return payload.copy_checksummed(dest, step)
        return copy_checksummed(dest, payload, step)

    def commit(self, offset: int, header: BlockHeader, checksum: int) -> BlockHeader:
        """Index a filled extent under its key (replacing any block there): the header stored."""
        header = dataclasses.replace(header, checksum=checksum)
        with self._lock:
            self._reserved.discard(offset)
        self._index(offset, header)
        return header

    def unreserve(self, offset: int) -> None:
        """Free a reserved extent that will not be committed (its copy failed or was abandoned)."""
        with self._lock:
            self._reserved.discard(offset)
            self._allocator.free(offset)

    def _allocate(self, header: BlockHeader, payload: memoryview) -> int:
        """An extent for the block (its header and payload); raises before anything is written."""
        if len(payload) != header.payload_len:
            raise ValueError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
        with self._lock:
            offset = self._allocator.allocate(header.block_len)
        if offset is None:
            raise TierFullError(f"{self.name}: no free extent of {header.block_len} bytes")
        return offset

    def _index(self, offset: int, header: BlockHeader) -> None:
        """Write the header of a block whose payload is in place, and index it (replacing any
        block under its key)."""
        packed = header.pack()
        self._arena[offset : offset + len(packed)] = np.frombuffer(packed, dtype=np.uint8)
        self.delete(header.key)
        self._blocks[header.key] = (offset, header)
        self._used += header.block_len

    def read_payload_into(self, key: bytes, dest: memoryview | Scatter) -> BlockHeader:
        return self.read_many_into([(key, dest)])[0]

    def read_many_into(self, requests: list[tuple[bytes, memoryview | Scatter]]) -> list[BlockHeader]:
        """Every block's payload into its destination: the extents marked as read under the lock,
        then every copy in one call (`copy_streamed_many`), then the marks dropped. Raises as
        ``read_payload_into`` for the first block that cannot be read (KeyError; Unfit, ValueError
        for a destination it does not fit), once the blocks before it are copied."""
        held: list[tuple[int, BlockHeader]] = []  # (extent offset, header) of each block read
        failure: Exception | None = None
        with self._lock:
            for key, dest in requests:
                try:
                    offset, header = self._blocks[key]
                    if isinstance(dest, Scatter):
                        if not dest.fits(header.payload_len):
                            raise Unfit(f"a {header.payload_len}-byte payload is not whole rows of the destination")
                    elif len(dest) < header.payload_len:
                        raise ValueError(f"destination of {len(dest)} bytes is smaller than the "
                                         f"{header.payload_len}-byte payload")
                except (KeyError, ValueError) as exc:
                    failure = exc
                    break
                self._reading[offset] = self._reading.get(offset, 0) + 1
                held.append((offset, header))
        try:
            pairs = []
            for (_, dest), (offset, header) in zip(requests, held):
                start = offset + header.header_len
                source = self._arena[start : start + header.payload_len]
                pairs.append(dest.pair(source) if isinstance(dest, Scatter)
                             else (np.frombuffer(dest, dtype=np.uint8, count=header.payload_len), source))
            copy_streamed_many(pairs)
        finally:
            with self._lock:
                for offset, _ in held:
                    left = self._reading.pop(offset) - 1
                    if left:
                        self._reading[offset] = left
                    elif offset in self._doomed:
                        self._doomed.discard(offset)
                        self._allocator.free(offset)
        if failure is not None:
            raise failure
        return [header for _, header in held]

    def delete(self, key: bytes) -> int:
        with self._lock:
            entry = self._blocks.pop(key, None)
            if entry is None:
                return 0
            self._used -= entry[1].block_len
            if entry[0] in self._reading:
                self._doomed.add(entry[0])  # the last reader frees it
            else:
                self._allocator.free(entry[0])
        return entry[1].block_len

    def verify(self, key: bytes) -> None:
        """Re-check a stored block's header and payload checksum (used by integrity checks)."""
        offset, header = self._blocks[key]
        stored = BlockHeader.unpack(memoryview(self._arena[offset : offset + header.header_len]))
        if stored != header:
            raise CorruptBlockError(f"{self.name}: header in arena differs from the index for {key.hex()}")
        header.verify_payload(self.payload_view(key))

    def check_integrity(self) -> None:
        with self._lock:
            self._allocator.check_integrity()
            extents = self._allocator.used_extents()
            unindexed = self._doomed | self._reserved  # extents read after deletion, or being filled
        indexed = sorted([offset for offset, _ in self._blocks.values()] + list(unindexed))
        if indexed != sorted(extents):
            raise RuntimeError(f"{self.name}: index offsets do not match allocated extents")
        if self._used != sum(h.block_len for _, h in self._blocks.values()):
            raise RuntimeError(f"{self.name}: used-bytes count {self._used} does not match the index")
        for key, (offset, header) in self._blocks.items():
            if header.key != key:
                raise RuntimeError(f"{self.name}: block at {offset} is indexed under another key")
            if extents[offset] < header.block_len:
                raise RuntimeError(f"{self.name}: block {key.hex()} overruns its extent")
            try:
                self.verify(key)
            except CorruptBlockError as exc:
                raise RuntimeError(str(exc)) from exc

    def close(self) -> None:
        self._blocks.clear()
        self._used = 0
