"""The daemon's arena registry: who holds which arena, what each may use, and the socket that hands them out.

See kvstore/arena.py for the protocol and why arenas are sealed memfds. Here:

- ``ArenaRegistry``: arena id -> (arena, tenant, peer pid). A slice is resolved only for the
  tenant that registered the arena; any other caller gets exactly the "not registered" error of an
  unknown id (so an id's existence tells nobody anything). Caps: ``max_arena_bytes`` per arena,
  one arena per arena-socket connection (the protocol), ``max_arenas_per_client`` per peer process
  (from SO_PEERCRED), ``max_arena_total_bytes`` and ``MAX_ARENAS`` (each holds two fds) in all
  and, with named tenants, an equal share of both per tenant: a tenant that forks to get around
  the per-process cap, or holds many small arenas, still cannot leave another tenant without one.
  An arena counts against every cap from the check that admits it, while its pages are still
  being allocated, so requests in flight together cannot overshoot a cap. Refusals name the
  caller's own cap, never what others hold; the daemon logs each tenant's first refusal per cap.
- ``ArenaSocket``: a unix socket beside the gRPC one (mode 0600), on the daemon's event loop. A
  request is one JSON line; the reply one JSON line with the memfd attached. The connection then
  stays open: when it closes (the client exited or crashed), the arena is unmapped. A client that
  closes in order sends a byte first and waits for EOF: the daemon unmaps the arena before it
  closes the connection, so the client's mapping goes last and the client, not the daemon, pays
  for freeing the pages (~10 ms of CPU per 118 MB here, once taken from other clients' Gets).
  Connections that have not sent their request yet are bounded: ``MAX_PENDING`` in all,
  ``MAX_PENDING_PER_PEER`` per process, each dropped after ``REQUEST_TIMEOUT_S``; when all are
  taken, a new connection displaces the oldest of the process holding the most. A client sends its
  request as it connects, so it is read at once: idle connections, however many a local process
  opens, cannot keep a tenant's client from its arena.
"""

from __future__ import annotations

import asyncio
import collections
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
from kvstore.daemon.auth import Tenant, TenantDirectory

log = logging.getLogger("kvstore.daemon.arena_registry")

#: Arenas registered at once, all clients together (each holds the connection's fd and the mapping's).
MAX_ARENAS = 256
#: Connections still sending their request, all peers together and per peer process (a client
#: that connects and says nothing is dropped after REQUEST_TIMEOUT_S, or displaced: see the module doc).
MAX_PENDING = 64
MAX_PENDING_PER_PEER = 4
#: Seconds a connection may take to send its request (a local client sends it at once).
REQUEST_TIMEOUT_S = 1.0


class ArenaNotFound(ValueError):
    """The id names no arena of the caller's (unknown, released, or another tenant's)."""


class ArenaRefused(PermissionError):
    """A new arena would break ``cap`` (a setting's name, or "arenas"); the message names the
    caller's own limit."""

    def __init__(self, cap: str, message: str) -> None:
        super().__init__(message)
        self.cap = cap


@dataclass
class _Entry:
    size: int
    tenant: str
    pid: int
    #: None while its pages are being allocated: it counts against every cap, resolves for nobody.
    arena: Arena | None = None
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
        self.tenants = max(1, tenants)
        #: Bytes and arenas one tenant may hold: equal shares of the totals when tenants are named.
        self.max_tenant_bytes = self.max_total_bytes // self.tenants
        self.max_tenant_arenas = MAX_ARENAS // self.tenants
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, tenant: str) -> int:
        return sum(e.tenant == tenant for e in self._entries.values())

    def _entry(self, arena_id: int, tenant: Tenant) -> _Entry:
        entry = self._entries.get(arena_id)
        if entry is None or entry.closing or entry.arena is None or \
                not secrets.compare_digest(entry.tenant.encode(), tenant.name.encode()):
            raise ArenaNotFound(f"arena {arena_id} is not registered (arenas come from the arena socket)")
        return entry

    def view(self, arena_id: int, tenant: Tenant, offset: int, length: int) -> memoryview:
        """The bytes ``[offset, offset + length)`` of the caller's arena ``arena_id``; ValueError
        for a slice outside it."""
        arena = self._entry(arena_id, tenant).arena
        if offset < 0 or length < 0 or offset + length > arena.size:
            raise ValueError(f"slice [{offset}, {offset + length}) is outside the {arena.size}-byte arena")
        return arena.buffer[offset : offset + length]

    def size(self, arena_id: int, tenant: Tenant) -> int:
        return self._entry(arena_id, tenant).arena.size

    def views(self, slices: list[tuple[int, int, int]], tenant: Tenant) -> tuple[list[memoryview], int]:
        """:meth:`view` of each ``(arena_id, offset, length)`` (a call's slices, in one call), and
        the bytes of the arenas they name, each counted once: the most the call may copy through
        shared memory."""
        views = [self.view(arena_id, tenant, offset, length) for arena_id, offset, length in slices]
        return views, self.bytes_of({arena_id for arena_id, _, _ in slices}, tenant)

    def bytes_of(self, arena_ids: set[int], tenant: Tenant) -> int:
        """The bytes of the caller's arenas ``arena_ids`` together."""
        return sum(self.size(arena_id, tenant) for arena_id in arena_ids)

    def check(self, size: int, pid: int, tenant: Tenant) -> None:
        """Raise ArenaRefused naming the cap a new ``size``-byte arena of ``tenant``'s process
        ``pid`` would break."""
        if not 0 < size <= self.max_arena_bytes:
            raise ArenaRefused("max_arena_bytes", f"an arena of {size} bytes is outside 1..{self.max_arena_bytes} "
                                                  f"(max_arena_bytes)")
        mine = [e for e in self._entries.values() if e.tenant == tenant.name]
        held = sum(e.size for e in mine)
        if held + size > self.max_tenant_bytes:
            raise ArenaRefused("max_arena_total_bytes", f"your arenas would hold {held + size} bytes; your share is "
                                                        f"{self.max_tenant_bytes} (max_arena_total_bytes)")
        if len(mine) >= self.max_tenant_arenas:
            limit = f"your share is {self.max_tenant_arenas} ({MAX_ARENAS} split among {self.tenants} tenants)" \
                if self.tenants > 1 else f"the daemon holds at most {MAX_ARENAS}"
            raise ArenaRefused("arenas", f"you hold {len(mine)} arenas; {limit}: close some clients")
        if len(self._entries) >= MAX_ARENAS or \
                sum(e.size for e in self._entries.values()) + size > self.max_total_bytes:
            raise ArenaRefused("daemon", "the daemon has no room for another arena now; try again later")
        if sum(e.pid == pid for e in self._entries.values()) >= self.max_arenas_per_client:
            raise ArenaRefused("max_arenas_per_client", f"process {pid} holds {self.max_arenas_per_client} arenas "
                                                        f"already (max_arenas_per_client)")

    def reserve(self, size: int, tenant: Tenant, pid: int) -> tuple[int, _Entry]:
        """Admit a new ``size``-byte arena of ``tenant``'s process ``pid`` (ArenaRefused if a cap
        forbids it): from now on it counts against every cap. Give it its pages with
        :meth:`attach`, or take it back with :meth:`cancel`."""
        self.check(size, pid, tenant)
        arena_id = 0
        while arena_id == 0 or arena_id in self._entries:
            arena_id = secrets.randbits(64)
        entry = _Entry(size, tenant.name, pid)
        self._entries[arena_id] = entry
        return arena_id, entry

    def attach(self, arena_id: int, arena: Arena) -> bool:
        """The reserved arena's pages: it resolves for its tenant from now on. False when the
        reservation is gone (its connection closed while the pages were made): the caller drops them."""
        entry = self._entries.get(arena_id)
        if entry is None:
            return False
        entry.arena = arena
        return True

    def cancel(self, arena_id: int) -> None:
        """Forget a reservation that got no pages."""
        entry = self._entries.get(arena_id)
        if entry is not None and entry.arena is None:
            del self._entries[arena_id]

    def remove(self, arena_id: int, tenant: Tenant | None = None) -> None:
        """Unmap an arena; ``tenant`` given: only if it is theirs (else ArenaNotFound)."""
        entry = self._detach(arena_id, tenant)
        if entry is not None:
            if entry.arena is not None:
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
        elif entry.arena is None:  # reserved, never mapped
            del self._entries[arena_id]
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
        #: Connections whose request has not arrived yet, oldest first: task -> peer pid.
        self._pending: dict[asyncio.Task, int] = {}
        #: (tenant, cap) pairs whose first refusal was logged.
        self._refusals_logged: set[tuple[str, str]] = set()

    def start(self) -> None:
        """Bind and listen (the caller holds the socket's lock file: a stale file is ours to remove)."""
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # born 0600
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        listener.listen(1024)  # a flood of connections (dropped at once) leaves room for clients' own
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
            try:
                pid, uid, _ = peer_credentials(connection)
            except OSError:
                connection.close()
                continue
            if not self._admit(pid):
                connection.close()
                continue
            task = loop.create_task(self._serve(connection, pid, uid))
            self._pending[task] = pid
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
            task.add_done_callback(lambda _, c=connection: c.close())  # also when dropped before it ran
            await asyncio.sleep(0)  # the task reads a request already sent before the next accept

    def _admit(self, pid: int) -> bool:
        """Whether a new connection of process ``pid`` may wait for its request: not beyond
        MAX_PENDING_PER_PEER of its own; beyond MAX_PENDING in all, the oldest connection of the
        process holding the most is dropped to make room (module doc)."""
        held = collections.Counter(self._pending.values())
        if held[pid] >= MAX_PENDING_PER_PEER:
            return False
        if len(self._pending) >= MAX_PENDING:
            most = max(held.values())
            oldest = next(task for task, peer in self._pending.items() if held[peer] == most)
            del self._pending[oldest]
            oldest.cancel()
        return True

    async def _serve(self, connection: socket.socket, pid: int, uid: int) -> None:
        loop = asyncio.get_running_loop()
        arena_id = None
        try:
            connection.setblocking(False)
            try:
                request = await asyncio.wait_for(self._read_line(connection), REQUEST_TIMEOUT_S)
            finally:
                self._pending.pop(asyncio.current_task(), None)
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
        try:
            arena_id, entry = self.registry.reserve(size, tenant, pid)
        except ArenaRefused as exc:
            if (tenant.name, exc.cap) not in self._refusals_logged:
                self._refusals_logged.add((tenant.name, exc.cap))
                log.warning("arena refused to %s (process %d): %s; its clients move block bytes inline "
                            "(logged once per tenant and cap)", f"tenant {tenant.name!r}" if tenant.name else "a client",
                            pid, exc)
            raise
        try:  # allocating the pages takes a while: in a worker thread (without the GIL, see arena.py)
            arena, fd = await asyncio.get_running_loop().run_in_executor(None, Arena.create_sealed, size)
        except OSError as exc:
            self.registry.cancel(arena_id)
            raise MemoryError(f"no memory for a {size}-byte arena: {exc}") from None
        except BaseException:
            self.registry.cancel(arena_id)
            raise
        if not self.registry.attach(arena_id, arena):
            arena.close()
            os.close(fd)
            raise ConnectionError("the connection closed while its arena was made")
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
