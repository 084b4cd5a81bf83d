"""The key index in shared memory: same-host clients answer Lookup without a round trip.

A Lookup over gRPC costs the daemon about 0.2 ms of CPU in Python's gRPC stack, and with many
engine processes on few cores the queueing behind it is most of the latency. Which tiers hold a key
is a few bytes, so the daemon also publishes that map in a file in ``/dev/shm`` (mode 0600) that
clients registered for the shared-memory data plane map read-only and probe themselves.

The daemon is the only writer (its event-loop thread); clients only read. The answer is a hint,
exactly as an RPC Lookup's is: a block may be evicted the moment after either answers, and a Get
verifies the block's key and checksum whatever the index said.

Layout (little-endian)::

    0    magic      8s   b"KVSIDX01"
    8    seq        u64  seqlock: odd while the daemon writes; readers retry when it moved
    16   state      u32  1 live, 2 closed (daemon stopped), 3 moved (see next_name)
    20   nslots     u32  a power of two
    24   heartbeat  u64  daemon's time.monotonic_ns(), refreshed every TICK_S; stale = daemon gone
    32   available  u32  bit i set while tier i can be read
    36   flags      u32  bit 0: a shared tier (S3) may hold keys not indexed yet: ask the daemon on a miss
    40   ntiers     u32
    44   pid        u32  the daemon's pid (stale files of dead daemons are removed at start)
    48   next_name  64s  the file that replaced this one (state 3)
    112  tier names 8 x 16s
    256  slots      nslots x 32 bytes: key 16s, mask u32 (bit i: tier i holds the key), 12 bytes pad

Slots are open-addressed by the key's first 8 bytes (keys are uniform hashes), probed linearly.
An all-zero key marks a never-used slot and ends a probe; a slot whose mask dropped to 0 keeps its
key (a tombstone) so probes pass it, and an insert reuses the first tombstone on its path. When
used slots pass half the table, the daemon writes a new file four times its live keys, unlinks the
old one and marks every earlier one moved to it (they stay mapped by the daemon until it stops, so
any of them still names the current file); readers follow next_name.

Ordering: the daemon bumps seq, writes, bumps seq again; a reader reads seq, the slots, then seq.
On x86-64 stores and loads are not reordered with each other, so a reader that saw the same even
seq twice read a consistent table. On weaker memory models a torn read is possible in principle;
it can only make the hint wrong, never a Get's data.

Counting: a Lookup answered here never reaches the daemon; the client tallies it and reports it
on a later call (kvstore/lookup_report.py).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import struct
import time
from pathlib import Path
from typing import Iterable, Sequence

from kvstore.keys import KEY_BYTES

SHM_DIR = Path("/dev/shm")
MAGIC = b"KVSIDX01"
HEADER_BYTES = 256
SLOT_BYTES = 32
MAX_TIERS = 8
TIER_NAME_BYTES = 16
MIN_SLOTS = 4096
#: How often the daemon refreshes the heartbeat and tier availability.
TICK_S = 0.1
#: A heartbeat older than this means the daemon is gone or stalled: clients ask it over gRPC.
STALE_S = 2.0
#: Probe passes a reader tries when writes race it before giving up (and asking the daemon); after
#: the first two it yields the CPU, so a daemon preempted mid-write (odd seq) can finish.
READ_RETRIES = 64
LIVE, CLOSED, MOVED = 1, 2, 3
FLAG_SHARED_TIER = 1

_NAME = re.compile(r"kvstore-index-[0-9]+-[0-9a-f]{12}")
_SEQ = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_HEARTBEAT = struct.Struct("<Q")
_STATE_AT, _TIER_NAMES_AT = 16, 112  # header offsets (see the layout above)
_STATE = struct.Struct("<IIQII")  # state, nslots, heartbeat, available, flags at _STATE_AT
_ZERO_KEY = bytes(KEY_BYTES)

log = logging.getLogger(__name__)


def _home(key: bytes, nslots: int) -> int:
    return int.from_bytes(key[:8], "little") & (nslots - 1)


def _slots_for(live: int) -> int:
    n = MIN_SLOTS
    while n < 4 * live:
        n *= 2
    return n


def remove_stale_files() -> int:
    """Unlink index files left by daemons that died without closing them. Returns how many."""
    removed = 0
    for path in SHM_DIR.glob("kvstore-index-*"):
        match = _NAME.fullmatch(path.name)
        if not match:
            continue
        pid = int(path.name.split("-")[2])
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        path.unlink(missing_ok=True)
        removed += 1
    return removed


class KeyIndexWriter:
    """The daemon's side: mirrors which tiers hold each key into a shared-memory table."""

    def __init__(self, tier_names: Sequence[str], shared_tier: bool = False) -> None:
        if len(tier_names) > MAX_TIERS:
            raise ValueError(f"at most {MAX_TIERS} tiers fit the index, got {len(tier_names)}")
        if any(len(n.encode()) > TIER_NAME_BYTES for n in tier_names):
            raise ValueError(f"tier names must be at most {TIER_NAME_BYTES} bytes: {list(tier_names)}")
        self.tier_names = list(tier_names)
        self.flags = FLAG_SHARED_TIER if shared_tier else 0
        self.available = (1 << len(tier_names)) - 1
        self._masks: dict[bytes, int] = {}  # the daemon's own copy: key -> tier bitmask
        self._slot: dict[bytes, int] = {}   # key -> its slot in the current table
        self._tombstones = 0
        self._seq = 0
        self.name = ""
        self._mm: mmap.mmap | None = None
        #: Tables this one replaced, kept mapped (unlinked) so that they can always name the current
        #: one; together they are smaller than it (each was at most half its successor).
        self._replaced: list[mmap.mmap] = []
        self._nslots = 0
        self._open(MIN_SLOTS)

    # -- file ---------------------------------------------------------------------------------

    def _open(self, nslots: int) -> None:
        """Write the whole table into a new file; the previous one (if any) is marked moved."""
        name = f"kvstore-index-{os.getpid()}-{secrets.token_hex(6)}"
        size = HEADER_BYTES + nslots * SLOT_BYTES
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a store into a sparse tmpfs page when /dev/shm is full would
            # be a SIGBUS in the daemon; this fails cleanly with ENOSPC instead.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        mm[0:8] = MAGIC
        _SEQ.pack_into(mm, 8, 0)
        _STATE.pack_into(mm, _STATE_AT, LIVE, nslots, time.monotonic_ns(), self.available, self.flags)
        _U32.pack_into(mm, 40, len(self.tier_names))
        _U32.pack_into(mm, 44, os.getpid() & 0xFFFFFFFF)
        for i, tier in enumerate(self.tier_names):
            mm[_TIER_NAMES_AT + TIER_NAME_BYTES * i : _TIER_NAMES_AT + TIER_NAME_BYTES * (i + 1)] = tier.encode().ljust(TIER_NAME_BYTES, b"\0")
        slots: dict[bytes, int] = {}
        for key, mask in self._masks.items():
            slot = _home(key, nslots)
            while mm[HEADER_BYTES + slot * SLOT_BYTES : HEADER_BYTES + slot * SLOT_BYTES + KEY_BYTES] != _ZERO_KEY:
                slot = (slot + 1) & (nslots - 1)
            self._write_slot(mm, slot, key, mask)
            slots[key] = slot
        if self._mm is not None:
            (SHM_DIR / self.name).unlink(missing_ok=True)  # no new client finds it; mapped ones follow
            self._replaced.append(self._mm)
        self._mm, self.name, self._nslots, self._slot, self._tombstones = mm, name, nslots, slots, 0
        self._seq = 0
        # Every earlier table (a client may still map any of them) points at this one.
        for old in self._replaced:
            old[48:112] = name.encode().ljust(64, b"\0")
            _U32.pack_into(old, _STATE_AT, MOVED)

    @staticmethod
    def _write_slot(mm: mmap.mmap, slot: int, key: bytes, mask: int) -> None:
        offset = HEADER_BYTES + slot * SLOT_BYTES
        mm[offset : offset + KEY_BYTES] = key
        _U32.pack_into(mm, offset + KEY_BYTES, mask)

    def _begin(self) -> None:
        self._seq += 1
        _SEQ.pack_into(self._mm, 8, self._seq)

    def _end(self) -> None:
        self._seq += 1
        _SEQ.pack_into(self._mm, 8, self._seq)

    # -- changes ------------------------------------------------------------------------------

    def add(self, key: bytes, level: int) -> None:
        """Tier ``level`` now holds ``key``."""
        self._set(key, self._masks.get(key, 0) | (1 << level))

    def remove(self, key: bytes, level: int) -> None:
        """Tier ``level`` no longer holds ``key``."""
        if key in self._masks:
            self._set(key, self._masks[key] & ~(1 << level))

    def _set(self, key: bytes, mask: int) -> None:
        if self._mm is None or len(key) != KEY_BYTES or key == _ZERO_KEY:
            return
        slot = self._slot.get(key)
        if slot is None:
            if not mask:
                return
            if len(self._slot) + self._tombstones + 1 > self._nslots // 2:
                self._masks[key] = mask
                try:
                    self._open(_slots_for(len(self._masks)))
                except OSError as exc:
                    log.warning("key index disabled: cannot grow it (%s); clients will Lookup over gRPC", exc)
                    self.close()
                return
            slot, reused = self._free_slot(key)
            self._tombstones -= reused
        self._begin()
        self._write_slot(self._mm, slot, key, mask)
        self._end()
        if mask:
            self._masks[key] = mask
            self._slot[key] = slot
        else:
            del self._masks[key], self._slot[key]
            self._tombstones += 1

    def _free_slot(self, key: bytes) -> tuple[int, bool]:
        """First tombstone or empty slot on ``key``'s probe path, and whether it was a tombstone."""
        slot = _home(key, self._nslots)
        while True:
            offset = HEADER_BYTES + slot * SLOT_BYTES
            stored = self._mm[offset : offset + KEY_BYTES]
            if stored == _ZERO_KEY:
                return slot, False
            if _U32.unpack_from(self._mm, offset + KEY_BYTES)[0] == 0:
                return slot, True
            slot = (slot + 1) & (self._nslots - 1)

    def tick(self, available: Iterable[bool]) -> None:
        """Refresh the heartbeat and which tiers can be read (called every TICK_S)."""
        if self._mm is None:
            return
        self.set_available(available)
        _HEARTBEAT.pack_into(self._mm, 24, time.monotonic_ns())

    def set_available(self, available: Iterable[bool]) -> None:
        """Publish which tiers can be read now (a tier's circuit breaker opened or closed)."""
        mask = 0
        for i, ok in enumerate(available):
            mask |= int(bool(ok)) << i
        if mask != self.available and self._mm is not None:
            self.available = mask
            _U32.pack_into(self._mm, 32, mask)

    def close(self) -> None:
        """Mark the file closed (clients fall back to gRPC) and unlink it."""
        if self._mm is None:
            return
        for mm in (*self._replaced, self._mm):
            _U32.pack_into(mm, _STATE_AT, CLOSED)
            mm.close()
        self._replaced.clear()
        self._mm = None
        (SHM_DIR / self.name).unlink(missing_ok=True)

    # -- checks -------------------------------------------------------------------------------

    def check_integrity(self, expected: dict[bytes, int]) -> None:
        """The table says exactly ``expected`` (key -> tier mask); raise RuntimeError otherwise.
        A disabled index (closed after a failure) publishes nothing, so there is nothing to check."""
        if self._mm is None:
            return
        if self._masks != expected:
            extra = {k for k in self._masks.keys() ^ expected.keys()} | {
                k for k in self._masks.keys() & expected.keys() if self._masks[k] != expected[k]}
            raise RuntimeError(f"key index disagrees with the tiers on {len(extra)} keys")
        reader = KeyIndexReader.attach(self.name)
        try:
            for key, mask in expected.items():
                if reader.mask(key) != mask:
                    raise RuntimeError(f"key index file has mask {reader.mask(key)} for {key.hex()}, "
                                       f"the tiers say {mask}")
        finally:
            reader.close()


class KeyIndexReader:
    """A client's read-only view of the daemon's key index."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm = mm
        self._nslots = _U32.unpack_from(mm, 20)[0]
        ntiers = _U32.unpack_from(mm, 40)[0]
        self.tier_names = [mm[_TIER_NAMES_AT + TIER_NAME_BYTES * i : _TIER_NAMES_AT + TIER_NAME_BYTES * (i + 1)].rstrip(b"\0").decode() for i in range(ntiers)]

    @classmethod
    def attach(cls, name: str) -> "KeyIndexReader":
        """Map a daemon's index file. Raises ValueError when it is not one (name, owner, magic)."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"index name {name!r} must match {_NAME.pattern}")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ValueError(f"index {name!r} cannot be opened: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < HEADER_BYTES:
                raise ValueError(f"index {name!r} must be a regular file of this user, at least {HEADER_BYTES} bytes")
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        if mm[0:8] != MAGIC or HEADER_BYTES + _U32.unpack_from(mm, 20)[0] * SLOT_BYTES > len(mm):
            mm.close()
            raise ValueError(f"{name!r} is not a kvstore key index of this version")
        return cls(name, mm)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def mask(self, key: bytes) -> int:
        """Tier bitmask of ``key`` in the table as it is now (no seqlock; for tests and checks)."""
        return self._probe(self._mm, key)

    def _probe(self, mm: mmap.mmap, key: bytes) -> int:
        nslots = self._nslots
        slot = _home(key, nslots)
        for _ in range(nslots):
            offset = HEADER_BYTES + slot * SLOT_BYTES
            stored = mm[offset : offset + KEY_BYTES]
            if stored == key:
                return _U32.unpack_from(mm, offset + KEY_BYTES)[0]
            if stored == _ZERO_KEY:
                return 0
            slot = (slot + 1) & (nslots - 1)
        return 0

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, tuple[str, ...]] | None:
        """``(hits, tiers)`` like the Lookup RPC: the longest run of leading keys some readable tier
        holds, and the highest such tier of each. None: ask the daemon instead (it stopped or
        stalled, a write kept racing this read, or a miss that a shared tier may still answer)."""
        for attempt in range(READ_RETRIES):
            if attempt >= 2:
                os.sched_yield()
            mm = self._mm
            if mm is None:
                return None
            seq = _SEQ.unpack_from(mm, 8)[0]
            if seq & 1:
                continue
            state, nslots, heartbeat, available, flags = _STATE.unpack_from(mm, _STATE_AT)
            if state == MOVED:
                if not self._follow():
                    return None
                continue
            if state != LIVE or time.monotonic_ns() - heartbeat > STALE_S * 1e9:
                return None
            tiers: list[str] = []
            for key in keys:
                mask = self._probe(mm, key) & available
                if not mask:
                    break
                tiers.append(self.tier_names[(mask & -mask).bit_length() - 1])
            if _SEQ.unpack_from(mm, 8)[0] != seq:
                continue
            if len(tiers) < len(keys) and flags & FLAG_SHARED_TIER:
                return None
            return len(tiers), tuple(tiers)
        return None

    def _follow(self) -> bool:
        """Switch to the file that replaced this one; False if it is gone too."""
        name = self._mm[48:112].rstrip(b"\0").decode(errors="replace")
        try:
            replacement = KeyIndexReader.attach(name)
        except ValueError:
            return False
        self.close()
        self.name, self._mm, self._nslots = replacement.name, replacement._mm, replacement._nslots
        self.tier_names = replacement.tier_names
        return True
