"""One daemon per unix socket and per disk folder: an flock held for the daemon's lifetime.

The lock file holds the holder's pid, so a second daemon's refusal names it. The kernel drops
the lock when the holder exits, however it exits (kill -9 included): a stale socket or lock file
never blocks a restart, and only the lock's holder may remove a stale socket. Within one process
the lock is shared (tests reopen a tier on the same folder to stand for a restart).

The file is opened in its folder as given, by name (``dir_fd``), without following a symlink and
without truncating: a symlink, or anything but a plain file with one link, planted at the lock's
name in a shared folder is refused, and the file is truncated and written only once its lock is held.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
from pathlib import Path


class LockError(RuntimeError):
    """The lock cannot be taken: another daemon holds it, or its path is not a plain file."""


_held: dict[tuple[int, int], list[int]] = {}  # (st_dev, st_ino) of the file -> [fd, holders in this process]
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


def _open(path: Path) -> tuple[int, os.stat_result]:
    """The lock file at ``path`` and its stat, opened read-write (created 0600) in its folder as
    given, never through a symlink and never truncated. LockError naming ``path`` when it is a
    symlink or not a plain file of one link; OSError when the folder or file cannot be opened."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(path.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LockError(f"{path} is a symbolic link: refusing to follow it (remove it)") from None
        raise
    finally:
        os.close(folder)
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
        os.close(fd)
        what = "not a plain file" if not stat.S_ISREG(found.st_mode) else f"a file with {found.st_nlink} links"
        raise LockError(f"{path} is {what}: refusing to use it as a lock file (remove it)")
    return fd, found


class InstanceLock:
    def __init__(self, path: Path, what: str) -> None:
        """Take the lock at ``path`` or raise LockError naming ``what`` and the holder's pid (or
        ``path``, when something other than a lock file is there)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self._released = False
        fd, found = _open(path)
        self._id = (found.st_dev, found.st_ino)
        with _guard:
            if self._id in _held:
                os.close(fd)
                _held[self._id][1] += 1
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                taken = False
            else:
                taken = True
                os.ftruncate(fd, 0)  # only now: the lock is ours
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                _held[self._id] = [fd, 1]
        if not taken:  # waits for the holder's pid outside the guard: other locks are not held up
            try:
                holder = _holder(fd)
            finally:
                os.close(fd)
            raise LockError(f"{what} is in use by a running daemon (pid {holder})")

    def release(self) -> None:
        with _guard:
            if self._released or self._id not in _held:
                return
            self._released = True
            entry = _held[self._id]
            entry[1] -= 1
            if entry[1] == 0:
                os.close(entry[0])
                del _held[self._id]
