"""The one interface every storage tier implements.

A tier stores blocks (``header || payload`` as defined in :mod:`kvstore.block`) by 16-byte key. It
knows bytes only: no codecs, no placement policy, no LRU (those live in :mod:`kvstore.daemon.placement`).
Tiers are not thread-safe by themselves; the store calls ``put``/``delete`` from one thread at a
time and may call ``read_payload_into`` from worker threads for tiers with ``blocking_io``.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from typing import Callable, Iterator

from kvstore.block import BlockHeader, payload_checksum


class TierError(RuntimeError):
    """A tier could not do what was asked (I/O error, misconfiguration)."""


class TierFullError(TierError):
    """No room for the block without eviction; the store evicts and retries."""


class TierUnavailableError(TierError):
    """The tier cannot be reached now (network down, circuit breaker open). For a read this is a
    miss, not corruption: the block is kept and the store tries the tiers below."""


class Tier(ABC):
    name: str
    capacity_bytes: int
    #: True when reads/writes touch a device (disk, network) and belong off the event loop.
    blocking_io: bool = False
    #: Threads the store gives this tier's reads and writes (a network tier wants many requests in
    #: flight); 0: the store's shared reader threads and its single writer thread.
    io_threads: int = 0
    #: True when an acknowledged put survives a crash of the daemon and of the host (fsynced disk,
    #: S3); durable Puts return only once a durable tier holds the block.
    durable: bool = False
    #: True when ``read_payload_into`` may run in a worker thread while the store's thread deletes
    #: and puts (memory tiers whose copy releases the GIL); the store then copies large Gets off
    #: its event loop. Such a tier reports blocks being read as :meth:`busy`.
    threadsafe_reads: bool = False
    #: True when the tier puts in three steps, ``reserve(header, payload) -> offset`` and
    #: ``commit(offset, header, checksum) -> header`` on the store's thread and ``fill(offset, header,
    #: payload, in_thread) -> checksum`` (the copy and its hash) in any thread, with ``unreserve(offset)`` for
    #: a fill that failed: the store then copies the blocks of a large Put in worker threads, several
    #: at once (host-memory tiers whose copy releases the GIL). See ``TierIO.fill_many``.
    threadsafe_fills: bool = False
    #: True when ``read_payload_into`` also takes a :class:`kvstore.scatter.Scatter` (copies a raw
    #: payload in rows, raising ``Unfit`` before any copy for one that is not whole rows); the
    #: store reads the other tiers' payloads into a buffer first (``reads.read_payload``). Its
    #: ``put_checksummed`` then also takes a :class:`kvstore.scatter.Gather` (a Put in rows); the
    #: store gives other tiers such payloads in one run.
    scatters: bool = False
    #: True when other daemons write the same storage (S3): keys may appear that this daemon did
    #: not put; see :meth:`take_new_keys` and :meth:`discover`.
    shared: bool = False
    #: Blocks found corrupt (and deleted) while the tier opened its storage (a disk's index rebuild).
    corrupt_on_start: int = 0
    #: The device tensor every payload lives in, for tiers that clients may map (a GPU pool handed
    #: out by CUDA IPC); None for the others. See :meth:`payload_offset`.
    pool: object | None = None
    #: The key a tier that stores blocks outside the process seals them under at rest
    #: (tiers/at_rest.py: disk_encrypt, s3_encrypt); None: stored plain.
    at_rest: object | None = None

    @abstractmethod
    def __contains__(self, key: bytes) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Keys currently stored (a snapshot is fine)."""

    @abstractmethod
    def header(self, key: bytes) -> BlockHeader:
        """Header of a stored block, from the tier's in-memory index. Raises KeyError."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes held by stored blocks (header + payload), excluding allocator slack."""

    @abstractmethod
    def can_fit(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` fits now without evicting anything."""

    @abstractmethod
    def put(self, header: BlockHeader, payload: memoryview) -> None:
        """Store a block, replacing any block under the same key.

        Raises TierFullError when it does not fit (nothing is changed then) and TierError on I/O
        failure. The payload's checksum is the caller's promise; tiers do not recompute it.
        """

    def put_checksummed(self, header: BlockHeader, payload: memoryview) -> BlockHeader:
        """:meth:`put` of a block whose payload checksum is computed here (``header.checksum`` is
        ignored); returns the header stored. Host-memory tiers hash each chunk as they copy it
        (:func:`kvstore.block.copy_checksummed`, one read of the payload); others hash, then put."""
        header = dataclasses.replace(header, checksum=payload_checksum(payload))
        self.put(header, payload)
        return header

    @abstractmethod
    def read_payload_into(self, key: bytes, dest: memoryview) -> BlockHeader:
        """Copy the payload of ``key`` into ``dest[:payload_len]`` and return its header.

        Tiers that can be corrupted underneath (disk, S3) verify the checksum and raise
        :class:`kvstore.block.CorruptBlockError`; a missing block raises KeyError. ``dest`` must be
        at least ``payload_len`` bytes; on error its contents are unspecified.
        """

    @abstractmethod
    def delete(self, key: bytes) -> int:
        """Remove a block; returns the bytes freed (0 if absent)."""

    def read_many_into(self, requests: list[tuple[bytes, memoryview]]) -> list[BlockHeader]:
        """:meth:`read_payload_into` for several blocks, headers in request order; the store calls
        it for memory tiers (no ``blocking_io``), once per Get. Tiers that copy adjacent blocks in
        one go (GPU) or all of them in one call (CPU) override it; raises as
        :meth:`read_payload_into` does."""
        return [self.read_payload_into(key, dest) for key, dest in requests]

    def payload_view(self, key: bytes) -> memoryview | None:
        """A zero-copy host view of a stored payload, valid until the block is deleted or replaced
        (host-memory tiers); None: the store reads the block into a buffer instead."""
        return None

    def payload_offset(self, key: bytes) -> int | None:
        """Byte offset of a stored payload in :attr:`pool`; None for tiers without a pool."""
        return None

    def payload_source(self, key: bytes) -> object | None:
        """A zero-copy view of a stored payload (host memoryview or device tensor) that stays
        valid until the block is deleted or replaced, for tiers that hold blocks in memory; None
        for tiers that must read (the store then reads the whole block)."""
        return None

    def busy(self, key: bytes) -> bool:
        """Whether a read in a worker thread is copying ``key`` now (eviction then picks another)."""
        return False

    @property
    def reads_in_flight(self) -> int:
        """Reads in worker threads now; space their blocks hold is freed when they end."""
        return 0

    @property
    def available(self) -> bool:
        """False while the tier is known to be unreachable (its blocks then count as misses)."""
        return True

    def on_availability_change(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called, from any thread, when `available` changes on a request's
        outcome (a tier with a circuit breaker: it opened or closed); a change by time alone (the
        breaker's cooldown over) calls nothing. Tiers that are always available ignore it."""

    def take_new_keys(self) -> list[bytes]:
        """Keys the tier indexed by itself (a background listing, :meth:`discover`) since the last
        call, for the store to adopt into its LRU. Thread-safe."""
        return []

    def discover(self, keys: list[bytes], timeout_s: float, stop_at_absent: bool = False) -> list[bytes]:
        """Find ``keys`` that other writers stored since this tier's index was built, waiting at
        most about ``timeout_s``; index and return those found (``stop_at_absent``: none after the
        first key absent, as a Lookup's hit run needs). Called from a worker thread. Never raises
        for an unreachable tier (it finds nothing then)."""
        return []

    def take_refused(self) -> int:
        """Objects the tier refused to index since the last call (a shared tier: forged, or made
        under another secret), for the store to count as corrupt. Thread-safe."""
        return 0

    def clear(self) -> None:
        for key in list(self.keys()):
            self.delete(key)

    @abstractmethod
    def check_integrity(self) -> None:
        """Verify internal invariants for real; raise RuntimeError naming the first violation."""

    def close(self) -> None:
        """Release resources (files, arenas). Idempotent."""


class KeyIndex:
    """The key index a tier keeps in memory: ``_blocks`` (key -> what the tier keeps of a block)
    and ``_used``, the bytes its blocks hold, kept by the tier as blocks come and go."""

    _blocks: dict
    _used: int

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._blocks))

    @property
    def used_bytes(self) -> int:
        return self._used


class ExtentIndex(KeyIndex):
    """A tier whose blocks live at offsets of one arena (CPU, GPU): each key's offset and header;
    ``can_fit`` asks the tier's allocator."""

    _blocks: dict[bytes, tuple[int, BlockHeader]]

    def header(self, key: bytes) -> BlockHeader:
        return self._blocks[key][1]


class HeaderIndex(KeyIndex):
    """A tier that stores each block apart (a file, an object: disk, S3): each key's header, read
    under ``_lock`` where another thread indexes too, within ``capacity_bytes`` (0: unbounded)."""

    _blocks: dict[bytes, BlockHeader]
    _lock: threading.Lock
    capacity_bytes: int

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._blocks))

    def header(self, key: bytes) -> BlockHeader:
        return self._blocks[key]

    def can_fit(self, nbytes: int) -> bool:
        return self.capacity_bytes == 0 or self._used + nbytes <= self.capacity_bytes
