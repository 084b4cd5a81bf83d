"""Shared-memory arenas: the same-host data plane.

The client creates a file in ``/dev/shm`` (mode 0600, so only its own user can map it) and
registers it with the daemon, which maps the same pages. A Get or Put then carries only
``(arena_id, offset, length)``; the daemon copies block bytes straight between its tier and the
client's memory, and the gRPC message stays a few hundred bytes.

Every slice is bounds-checked before use: a bad offset is a ValueError (INVALID_ARGUMENT), never a
write outside the arena.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from pathlib import Path

from tiers.memory import prefault

SHM_DIR = Path("/dev/shm")

_NAME = re.compile(r"kvstore-[A-Za-z0-9_.-]{1,128}")


class Arena:
    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self._owner = owner
        self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.buffer = memoryview(self._mmap)

    def prefault(self) -> None:
        """Fault in this process's mapping now (blocking), so copies never stall on first touch."""
        prefault(self._mmap, background=False)

    @classmethod
    def create(cls, size: int, prefix: str = "kvstore") -> "Arena":
        """A new arena owned by this process (the client side); unlinked by :meth:`close`."""
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        if not SHM_DIR.is_dir():
            raise OSError(f"{SHM_DIR} is missing: the shared-memory data plane needs Linux tmpfs")
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        arena = cls(name, fd, size, owner=True)
        arena.prefault()
        return arena

    @classmethod
    def attach(cls, name: str, size: int) -> "Arena":
        """Map a client's arena (the daemon side). Raises ValueError on a bad name or size."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"arena name {name!r} must match {_NAME.pattern} (a file in {SHM_DIR})")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ValueError(f"arena {name!r} does not exist in {SHM_DIR}") from None
        except OSError as exc:
            raise ValueError(f"arena {name!r} cannot be opened: {exc}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            raise ValueError(f"arena {name!r} must be a regular file owned by the daemon's user")
        if st.st_size != size or size <= 0:
            os.close(fd)
            raise ValueError(f"arena {name!r} is {st.st_size} bytes, the request says {size}")
        return cls(name, fd, size, owner=False)

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"slice [{offset}, {offset + length}) is outside the {self.size}-byte arena {self.name!r}")
        return self.buffer[offset : offset + length]

    def unlink(self) -> None:
        """Remove the file name; both processes' mappings stay valid. The client calls this once the
        daemon has mapped the arena, so a client that crashes leaks no file in /dev/shm: the pages
        are freed when the last mapping goes."""
        if self._owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self._owner = False

    def close(self) -> None:
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            # A view is still exported (e.g. a tensor over the arena); the mapping lives until it goes.
            pass
        if self._owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self._owner = False
