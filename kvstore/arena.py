"""Shared-memory arenas: the same-host data plane.

The daemon creates every arena and hands it out; no client names a file for the daemon to map.

    client                                   daemon (kvstore/daemon/arena_registry.py)
      connect SOCKET.arena ────────────────►  peer = SO_PEERCRED (pid, uid): never a name
      {"size": N, "token": T}\\n ───────────►  tenant from T; caps per peer and per arena
                                              fd = memfd (pages allocated, sealed: no shrink, no grow)
      mmap(fd) ◄──────── {"arena_id": ...}\\n + fd (SCM_RIGHTS)
      ... Get/Put over gRPC name (arena_id, offset, length) ...
      close: "\\n" ────────────────────────►  release: the daemon unmaps the arena, then
      unmap ◄─────────────────────────── EOF  closes the connection; the client's mapping goes
                                              last, so the client frees the pages, not the daemon
      exit, or crash ──────────────────────►  EOF: the daemon unmaps the arena at once

Why sealed memfds: a client can do nothing to the pages' file that hurts the daemon. It cannot
shrink it (a daemon copy past the end would die of SIGBUS) or grow it, and the size is the
daemon's choice within its caps, so whatever pages the daemon ever fills in are bounded. The
daemon allocates and maps every page when it creates the arena, in a worker thread and without
the GIL (``kvstore.memory.populate``: MADV_POPULATE_WRITE through ctypes), so its event loop keeps
serving while the pages are zeroed (~200 ms per 118 MB arena here). Neither ``mmap.madvise`` nor,
on CPython 3.11, ``mmap.mmap(..., MAP_POPULATE)`` drops the GIL: either stalled every other
client's Put for the whole zeroing, 8 clients' Puts measured 20-30% slower; not faulting them in
at all left the faults to the copies on the event loop. There is no name in
/dev/shm to unlink, replace or leak, and no file the daemon did not create can become an arena.
The arena id is a random 64-bit number given only to the registering connection, and the daemon
checks it against the caller's tenant on every call.

Every slice is bounds-checked before use: a bad offset is a ValueError (INVALID_ARGUMENT), never a
copy outside the arena.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import time
from pathlib import Path

from kvstore.memory import populate, prefault

#: Seals every arena carries: its size is fixed for good.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: mmap flag that allocates and maps every page inside the mmap call: only for kernels without
#: MADV_POPULATE_WRITE (before 5.14), since CPython 3.11 holds the GIL through that call.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
#: Longest request or reply line on the arena socket.
MAX_LINE = 4096
#: Seconds a client's close waits for the daemon to unmap its arena before unmapping its own.
RELEASE_TIMEOUT_S = 2.0


def arena_socket_path(socket_path: str | os.PathLike) -> Path:
    """The arena socket beside a daemon's gRPC unix socket (``unix:`` prefix allowed)."""
    text = str(socket_path)
    return Path((text[len("unix:"):] if text.startswith("unix:") else text) + ".arena")


class Arena:
    """A mapping of an arena's pages, on either side."""

    def __init__(self, fd: int, size: int, populate: bool = False) -> None:
        self.size = size
        flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
        self._mmap = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buffer = memoryview(self._mmap)

    @classmethod
    def create_sealed(cls, size: int) -> tuple["Arena", int]:
        """A new arena (the daemon side): its mapping, every page allocated and mapped (slow for a
        large arena: call it off the event loop), and the fd to hand out (caller closes it)."""
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        fd = os.memfd_create("kvstore-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            arena = cls(fd, size)
            try:
                populated = populate(arena._mmap)
            except BaseException:
                arena.close()
                raise
            if not populated:  # an old kernel: MAP_POPULATE (holding the GIL) rather than faults in the copies
                arena.close()
                arena = cls(fd, size, populate=True)
        except BaseException:
            os.close(fd)
            raise
        return arena, fd

    @classmethod
    def from_fd(cls, fd: int, size: int) -> "Arena":
        """Map an arena handed over by the daemon (the client side); takes ownership of ``fd``."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if os.fstat(fd).st_size != size or seals & SEALS != SEALS:
                raise ValueError(f"the daemon's arena is not a sealed {size}-byte memfd")
            return cls(fd, size)
        finally:
            os.close(fd)

    def prefault(self) -> None:
        """Fault in this process's mapping now (blocking), so copies never stall on first touch."""
        prefault(self._mmap, background=False)

    def close(self) -> None:
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            # A view is still exported (e.g. a tensor over the arena); the mapping lives until it goes.
            pass


def _connect(path: str | os.PathLike, timeout: float) -> socket.socket:
    """A connection to the arena socket ``path`` (timeout set). A full accept queue (others
    flooding the socket with connections, which the daemon drops) is waited out, up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(timeout)
        try:
            connection.connect(str(path))
            return connection
        except BlockingIOError:
            connection.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)
        except BaseException:
            connection.close()
            raise


class ArenaLease:
    """The client side of one arena: its mapping, its id, and the connection that keeps it alive
    (closing it, or exiting, releases the arena in the daemon)."""

    def __init__(self, arena: Arena, arena_id: int, index_name: str, connection: socket.socket) -> None:
        self.arena, self.arena_id, self.index_name = arena, arena_id, index_name
        self._connection = connection

    @classmethod
    def request(cls, path: str | os.PathLike, size: int, token: str | None = None,
                timeout: float = 30.0) -> "ArenaLease":
        """Ask the daemon at arena socket ``path`` for a ``size``-byte arena. Raises ConnectionError
        with the daemon's reason when it refuses, OSError when it cannot be reached."""
        connection = _connect(path, timeout)
        try:
            connection.sendall(json.dumps({"size": size, "token": token or ""}).encode() + b"\n")
            data, fds, _, _ = socket.recv_fds(connection, MAX_LINE, 1)
            try:
                reply = json.loads(data.decode()) if data.endswith(b"\n") else \
                    {"error": "it closed the connection without a reply"}
                if "error" in reply or len(fds) != 1:
                    raise ConnectionError(f"the daemon refused an arena: {reply.get('error', 'no memory handed over')}")
                arena = Arena.from_fd(fds.pop(), size)
            finally:
                for fd in fds:
                    os.close(fd)
            connection.settimeout(None)
            return cls(arena, int(reply["arena_id"]), str(reply.get("index_name", "")), connection)
        except BaseException:
            connection.close()
            raise

    def held(self) -> bool:
        """Whether the daemon still holds this arena: its connection has not ended (a daemon that
        exited, restarted or released the arena has closed it). Never blocks."""
        try:
            return self._connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True  # open, nothing sent: held
        except OSError:
            return False

    def close(self) -> None:
        """Release the arena: ask the daemon to unmap it, wait until it has (it then closes the
        connection), and only then unmap ours. The last mapping to go frees the pages, so this
        process, not the daemon, pays for freeing them (~10 ms of CPU per 118 MB here; in the
        daemon that was taken from other clients' Gets). A daemon that does not answer within
        ``RELEASE_TIMEOUT_S`` is not waited for."""
        connection = self._connection
        try:
            connection.settimeout(RELEASE_TIMEOUT_S)
            connection.sendall(b"\n")  # any byte after the reply: release
            while connection.recv(MAX_LINE):
                pass
        except OSError:  # gone, refused, or too slow: the pages are freed by whoever unmaps last
            pass
        finally:
            connection.close()
        self.arena.close()
