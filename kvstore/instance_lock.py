"""One daemon per unix socket and per disk folder: an flock held for the daemon's lifetime.

The lock file holds the holder's pid, so a second daemon's refusal names it. The kernel drops
the lock when the holder exits, however it exits (kill -9 included): a stale socket or lock file
never blocks a restart, and only the lock's holder may remove a stale socket. Within one process
the lock is shared (tests reopen a tier on the same folder to stand for a restart).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

from tiers.base import TierError

_held: dict[str, list[int]] = {}  # real path -> [fd, holders in this process]
_guard = threading.Lock()


HOLDER_WAIT_S = 2.0  # how long a refused daemon waits for the holder to write its pid


def _holder(fd: int) -> str:
    """The pid in the lock file of a lock someone else holds. Two daemons started at once: the
    winner takes the lock, then truncates the file and writes its pid, so the loser may read it
    empty, or a dead former holder's pid, for a moment; it waits for a live pid."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isascii() and text.isdigit() and _alive(int(text)):
            return text
        if time.monotonic() > deadline:  # another pid namespace's holder, or a file someone wrote
            return f"unknown; the lock file says {text!r}" if text else "unknown"
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's process
    except (ProcessLookupError, OverflowError):
        return False
    return True


class InstanceLock:
    def __init__(self, path: Path, what: str) -> None:
        """Take the lock at ``path`` or raise TierError naming ``what`` and the holder's pid."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = os.path.realpath(path)
        self._released = False
        with _guard:
            if self.path in _held:
                _held[self.path][1] += 1
                return
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                taken = False
            else:
                taken = True
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                _held[self.path] = [fd, 1]
        if not taken:  # waits for the holder's pid outside the guard: other locks are not held up
            try:
                holder = _holder(fd)
            finally:
                os.close(fd)
            raise TierError(f"{what} is in use by a running daemon (pid {holder})")

    def release(self) -> None:
        with _guard:
            if self._released or self.path not in _held:
                return
            self._released = True
            entry = _held[self.path]
            entry[1] -= 1
            if entry[1] == 0:
                os.close(entry[0])
                del _held[self.path]
