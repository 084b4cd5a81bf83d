"""The daemon's arenas: who holds which, what each may use, and the socket that hands them out.

See kvstore/arena.py for the protocol and why arenas are sealed memfds. Here:

- ``ArenaRegistry``: arena id -> (arena, tenant, peer pid). A slice is resolved only for the
  tenant that registered the arena; any other caller gets exactly the "not registered" error of an
  unknown id (so an id's existence tells nobody anything). Caps: ``max_arena_bytes`` per arena,
  ``max_arenas_per_client`` per peer process (from SO_PEERCRED), ``max_arena_total_bytes`` in all
  and, with named tenants, an equal share of it per tenant (a process that forks to get around the
  per-process cap still cannot starve another tenant), and ``MAX_ARENAS`` in all (each holds two
  fds). Refusals name the caller's own cap, never what others hold.
- ``ArenaSocket``: a unix socket beside the gRPC one (mode 0600), on the daemon's event loop. A
  request is one JSON line; the reply one JSON line with the memfd attached. The connection then
  stays open: when it closes (the client exited or crashed), the arena is unmapped. A client that
  closes in order sends a byte first and waits for EOF: the daemon unmaps the arena before it
  closes the connection, so the client's mapping goes last and the client, not the daemon, pays
  for freeing the pages (~10 ms of CPU per 118 MB here, once taken from other clients' Gets).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvstore.arena import MAX_LINE, Arena
from kvstore.auth import Tenant, TenantDirectory

log = logging.getLogger("kvstore.arenas")

#: Arenas registered at once, all clients together (each holds the connection's fd and the mapping's).
MAX_ARENAS = 256
#: Connections still sending their request (a client that connects and says nothing is dropped).
MAX_PENDING = 256
#: Seconds a connection may take to send its request (a local client sends it at once).
REQUEST_TIMEOUT_S = 1.0


class ArenaNotFound(ValueError):
    """The id names no arena of the caller's (unknown, released, or another tenant's)."""


@dataclass
class _Entry:
    arena: Arena
    tenant: str
    pid: int
    released: asyncio.Event = field(default_factory=asyncio.Event)
    #: Released, its unmapping under way: resolves for nobody, still counts against every cap.
    closing: bool = False
    #: The unmapping in its worker thread, once released.
    unmapped: asyncio.Future | None = None


class ArenaRegistry:
    def __init__(self, max_arena_bytes: int, max_arenas_per_client: int, max_total_bytes: int = 0,
                 tenants: int = 1) -> None:
        self.max_arena_bytes = max_arena_bytes
        self.max_arenas_per_client = max_arenas_per_client
        self.max_total_bytes = max_total_bytes or max_arena_bytes * max_arenas_per_client
        #: Bytes one tenant may hold: an equal share of the total when tenants are named.
        self.max_tenant_bytes = self.max_total_bytes // max(1, tenants)
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, tenant: str) -> int:
        return sum(e.tenant == tenant for e in self._entries.values())

    def _entry(self, arena_id: int, tenant: Tenant) -> _Entry:
        entry = self._entries.get(arena_id)
        if entry is None or entry.closing or not secrets.compare_digest(entry.tenant.encode(), tenant.name.encode()):
            raise ArenaNotFound(f"arena {arena_id} is not registered (arenas come from the arena socket)")
        return entry

    def view(self, arena_id: int, tenant: Tenant, offset: int, length: int) -> memoryview:
        """The bytes ``[offset, offset + length)`` of the caller's arena ``arena_id``."""
        return self._entry(arena_id, tenant).arena.view(offset, length)

    def size(self, arena_id: int, tenant: Tenant) -> int:
        return self._entry(arena_id, tenant).arena.size

    def check(self, size: int, pid: int, tenant: Tenant) -> None:
        """Raise PermissionError naming the cap a new ``size``-byte arena of ``tenant``'s process
        ``pid`` would break."""
        if not 0 < size <= self.max_arena_bytes:
            raise PermissionError(f"an arena of {size} bytes is outside 1..{self.max_arena_bytes} "
                                  f"(max_arena_bytes)")
        held = sum(e.arena.size for e in self._entries.values() if e.tenant == tenant.name)
        if held + size > self.max_tenant_bytes:
            raise PermissionError(f"your arenas would hold {held + size} bytes; your share is "
                                  f"{self.max_tenant_bytes} (max_arena_total_bytes)")
        if len(self._entries) >= MAX_ARENAS or \
                sum(e.arena.size for e in self._entries.values()) + size > self.max_total_bytes:
            raise PermissionError("the daemon has no room for another arena now; try again later")
        if sum(e.pid == pid for e in self._entries.values()) >= self.max_arenas_per_client:
            raise PermissionError(f"process {pid} holds {self.max_arenas_per_client} arenas already "
                                  f"(max_arenas_per_client)")

    def add(self, arena: Arena, tenant: Tenant, pid: int) -> tuple[int, _Entry]:
        """Register a new arena of ``tenant``'s process ``pid`` (caps checked again: another
        registration may have landed while this one was being made)."""
        self.check(arena.size, pid, tenant)
        arena_id = 0
        while arena_id == 0 or arena_id in self._entries:
            arena_id = secrets.randbits(64)
        entry = _Entry(arena, tenant.name, pid)
        self._entries[arena_id] = entry
        return arena_id, entry

    def remove(self, arena_id: int, tenant: Tenant | None = None) -> None:
        """Unmap an arena; ``tenant`` given: only if it is theirs (else ArenaNotFound)."""
        entry = self._detach(arena_id, tenant)
        if entry is not None:
            entry.arena.close()
            del self._entries[arena_id]

    async def release(self, arena_id: int, tenant: Tenant | None = None) -> None:
        """:meth:`remove`, with the unmapping in a worker thread. The id resolves for nobody from
        the call on; the arena counts against the caps until its pages are gone. (When the
        daemon's mapping is the last, unmapping frees the pages: ~25 ms per 100 MB, without the
        GIL; on the event loop that stalled every other call, e.g. the Puts of other clients.)"""
        entry = self._detach(arena_id, tenant)
        if entry is None:
            pending = self._entries.get(arena_id) if tenant is None else None
            unmapped = pending.unmapped if pending is not None else None
            if unmapped is None:
                return
        else:
            loop = asyncio.get_running_loop()
            try:
                unmapped = entry.unmapped = loop.run_in_executor(None, entry.arena.close)
            except RuntimeError:  # the executor is shut down (the daemon is stopping)
                entry.arena.close()
                del self._entries[arena_id]
                return
            unmapped.add_done_callback(lambda _: self._entries.pop(arena_id, None))
        try:  # (an unmapping already under way, e.g. from UnregisterArena: waited for as well)
            await asyncio.shield(unmapped)  # a cancelled caller leaves the unmapping to finish
        except Exception:  # noqa: BLE001 - the arena is gone from the registry either way
            log.exception("arena %d: unmapping failed", arena_id)

    def _detach(self, arena_id: int, tenant: Tenant | None) -> _Entry | None:
        entry = self._entry(arena_id, tenant) if tenant is not None else self._entries.get(arena_id)
        if entry is None or entry.closing:
            return None
        entry.closing = True
        entry.released.set()
        return entry

    def close(self) -> None:
        for arena_id in list(self._entries):
            self.remove(arena_id)




def peer_credentials(connection: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of a unix socket's peer, from the kernel."""
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class ArenaSocket:
    """Hands out arenas on ``path`` (see the module doc)."""

    def __init__(self, path: Path, registry: ArenaRegistry, tenants: TenantDirectory,
                 index_name: Callable[[], str]) -> None:
        self.path = path
        self.registry = registry
        self.tenants = tenants
        self._index_name = index_name
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self._pending = 0

    def start(self) -> None:
        """Bind and listen (the caller holds the socket's lock file: a stale file is ours to remove)."""
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # born 0600
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._accept_task = asyncio.get_running_loop().create_task(self._accept())

    async def stop(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, *(t for t in [self._accept_task] if t), return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self.path.unlink(missing_ok=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and the like: back off, keep serving
                log.warning("arena socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if self._pending >= MAX_PENDING:
                connection.close()
                continue
            task = loop.create_task(self._serve(connection))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        arena_id = None
        try:
            connection.setblocking(False)
            pid, uid, _ = peer_credentials(connection)
            self._pending += 1
            try:
                request = await asyncio.wait_for(self._read_line(connection), REQUEST_TIMEOUT_S)
            finally:
                self._pending -= 1
            fd = -1
            try:
                arena_id, fd, entry = await self._register(request, pid, uid)
                await self._send(connection, {"arena_id": arena_id, "size": entry.arena.size,
                                              "index_name": self._index_name()}, fd)
            except (PermissionError, ValueError, MemoryError) as exc:
                await self._send(connection, {"error": str(exc)})
                return
            finally:
                if fd >= 0:
                    os.close(fd)
            # The arena lives as long as this connection: wait for its end (or an unregister).
            eof = loop.create_task(loop.sock_recv(connection, 1))
            released = loop.create_task(entry.released.wait())
            await asyncio.wait({eof, released}, return_when=asyncio.FIRST_COMPLETED)
            for task in (eof, released):
                task.cancel()
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            log.debug("arena socket: connection ended: %s", exc)
        except Exception:  # noqa: BLE001 - one client's connection never takes the socket down
            log.exception("arena socket: connection failed")
        finally:
            try:
                if arena_id is not None:  # unmapped before the client sees EOF: it unmaps last (arena.py)
                    await self.registry.release(arena_id)
            finally:
                connection.close()

    async def _register(self, raw: bytes, pid: int, uid: int) -> tuple[int, int, _Entry]:
        if uid not in (os.getuid(), 0):
            raise PermissionError(f"uid {uid} may not map this daemon's memory")
        try:
            request = json.loads(raw.decode())
            size, token = request["size"], request.get("token", "")
            if type(size) is not int or not isinstance(token, str):
                raise TypeError
        except Exception:  # noqa: BLE001 - any malformed request (deep nesting, 1e400, ...) gets this answer
            raise ValueError('the request must be one JSON line {"size": BYTES, "token": TOKEN}') from None
        tenant = self.tenants.resolve([("authorization", f"Bearer {token}")] if token else [])
        if tenant is None:
            raise PermissionError("missing or wrong bearer token")
        self.registry.check(size, pid, tenant)
        try:  # allocating the pages takes a while: in a worker thread (without the GIL, see arena.py)
            arena, fd = await asyncio.get_running_loop().run_in_executor(None, Arena.create_sealed, size)
        except OSError as exc:
            raise MemoryError(f"no memory for a {size}-byte arena: {exc}") from None
        try:
            arena_id, entry = self.registry.add(arena, tenant, pid)
        except PermissionError:
            arena.close()
            os.close(fd)
            raise
        return arena_id, fd, entry

    @staticmethod
    async def _read_line(connection: socket.socket) -> bytes:
        loop = asyncio.get_running_loop()
        data = b""
        while not data.endswith(b"\n"):
            chunk = await loop.sock_recv(connection, MAX_LINE)
            if not chunk:
                raise ConnectionError("closed before its request")
            data += chunk
            if len(data) > MAX_LINE:
                raise ConnectionError("request line too long")
        return data

    @staticmethod
    async def _send(connection: socket.socket, reply: dict, fd: int | None = None) -> None:
        data = json.dumps(reply).encode() + b"\n"
        for _ in range(1000):  # a fresh connection's buffer takes a short line at once
            try:
                if fd is None:
                    connection.send(data)
                else:
                    socket.send_fds(connection, [data], [fd])
                return
            except BlockingIOError:
                await asyncio.sleep(0.005)
        raise ConnectionError("the client does not read its reply")
