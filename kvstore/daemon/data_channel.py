"""The data channel: Put and Get payloads for clients without shared memory, as raw bytes on TCP.

Inline gRPC copies every payload into and out of protobuf messages and HTTP/2 frames (a remote Get
ran at 0.07x memcpy). Here a request is one small frame holding the existing ``kvstore.v1``
message, and the payloads follow as they are (frames: kvstore/wire.py):

    client                                  daemon (a thread per connection)
    HELLO(token)                    ->      TenantDirectory.resolve, as the gRPC interceptor
                                    <-      READY, or ERROR and close
    PUT(PutRequest) || payloads     ->      bound the lengths, charge the ByteBudget, recv_into one
                                            buffer, KVStoreService.put_blocks on the daemon's loop
                                    <-      PUT_REPLY(PutResponse) | ERROR
    GET(GetRequest)                 ->      KVStoreService.get_blocks on the loop (it charges the
                                            ByteBudget for the reply's buffers, as a gRPC Get)
                                    <-      GET_REPLY(GetResponse) || payloads (sendall of views) | ERROR

Validation, tenants' keys and the store calls are the gRPC handlers' own (kvstore/daemon/server.py); an
error answers with the code `server.status_of` maps it to. After an error the connection stays
open when the stream is still in step (a refused Get; a Put whose payloads were read), and is
closed otherwise (bad framing, a refused token, a Put refused before its payloads).

Bounds, against a peer with or without a token: ``max_connections`` at once (more are closed at
once), of which at most half wait for their HELLO (past that, or at the cap, a new connection
closes the one that waited longest: a flood of peers without a token churns among itself, while a
client that sends its token at once gets in; each waits at most HELLO_TIMEOUT_S in all) and, with
named tenants, at most a quarter are one tenant's; a named tenant's transfers hold at most a
quarter of the byte budget beyond its one largest (more wait for its own to end), so one tenant
cannot keep the others' inline Gets waiting; HELLO within ``HELLO_TIMEOUT_S``; a request's head within ``IDLE_TIMEOUT_S``; each read
within ``READ_TIMEOUT_S`` and a request's payloads, or a reply's sending, at ``MIN_RATE`` at least; a
message at most MAX_REQUEST_BYTES; a Put's payloads at most max_message_bytes, and every payload
byte held in the daemon's ``ByteBudget`` until stored or sent.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
from google.protobuf.message import DecodeError

from kvstore.limits import MAX_ITEMS_PER_CALL
from kvstore.daemon.log_limit import LogLimit
from kvstore.proto import kvstore_pb2 as pb
from kvstore.daemon.server import INLINE_WAIT_S, KVStoreService, status_of
from kvstore.wire import (GET, GET_REPLY, HELLO, MAX_REQUEST_BYTES, MAX_TOKEN_BYTES, PUT, PUT_REPLY, READY,
                          error_frame, frame, recv_frame_head, recv_into_exactly)

log = logging.getLogger("kvstore.daemon.data_channel")

#: From accept to a known token (TLS handshake included), all of it: the accept loop closes later ones.
HELLO_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 300.0
READ_TIMEOUT_S = 10.0
#: A request's payloads, or a reply, move within max(TRANSFER_MIN_S, bytes / MIN_RATE): a peer that
#: trickles holds the byte budget seconds, not minutes.
TRANSFER_MIN_S = 5.0
MIN_RATE = 8e6
#: Longest a connection's thread waits for the event loop to run its store call.
CALL_TIMEOUT_S = 120.0
#: Socket buffers: large enough that a multi-MB payload moves in few system calls.
SOCKET_BUFFER_BYTES = 4 * 2**20


class _Refused(Exception):
    """An error frame to send; ``close``: the stream is out of step (or the peer is unwelcome)."""

    def __init__(self, code: grpc.StatusCode, message: str, close: bool) -> None:
        super().__init__(message)
        self.code, self.close = code, close


class _Abandoned(_Refused):
    """A store call that outlived CALL_TIMEOUT_S: it may still use the request's buffers."""


def tune(sock: socket.socket) -> None:
    """No Nagle (a request's head must not wait for an ACK) and large buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def server_tls(cert: str, key: str) -> ssl.SSLContext:
    """The daemon's TLS for the data channel: the gRPC listener's certificate and key."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


class _Buffers:
    """Put buffers kept for reuse: a fresh multi-MB buffer in a thread costs a page fault per page
    (glibc gives threads' large allocations fresh mmaps), more than the transfer itself. At most
    ``keep_bytes`` are kept idle (the ByteBudget's total); buffers in use are charged to it."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._idle: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            fits = [b for b in self._idle if len(b) >= nbytes]
            if fits:
                best = min(fits, key=len)
                self._idle.remove(best)
                return best
        return bytearray(nbytes)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            self._idle.append(buffer)
            self._idle.sort(key=len)
            while sum(map(len, self._idle)) > self.keep_bytes:
                self._idle.pop(0)  # the smallest: large requests find theirs


class DataChannel:
    """The listener and its connections' threads. ``start`` binds (OSError when it cannot) and
    returns the port; ``close`` stops accepting, ends every connection and joins the threads."""

    def __init__(self, address: str, service: KVStoreService, loop: asyncio.AbstractEventLoop,
                 tls: ssl.SSLContext | None = None, max_connections: int = 32,
                 max_message_bytes: int = 256 * 2**20) -> None:
        self.address, self.service, self._loop, self._tls = address, service, loop, tls
        self.max_connections, self.max_message_bytes = max_connections, max_message_bytes
        self.port = 0
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        #: Connections waiting for their HELLO, oldest first, and each named tenant's (under _lock).
        self._waiting: dict[socket.socket, float] = {}  # accept time
        self._held: dict[str, int] = {}  # a named tenant's payload bytes in flight here
        self._held_changed = threading.Condition(self._lock)
        self._per_tenant: dict[str, int] = {}
        self._closed = threading.Event()
        self._logs = LogLimit()
        self._buffers = _Buffers(service.inline.total)
        #: Connections turned away at the cap, and ended by an error frame (tests read them).
        self.refused = self.errors = 0

    @property
    def connections(self) -> int:
        return len(self._connections)

    def start(self) -> int:
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, int(port)), family=family, backlog=128)
        self._listener.settimeout(0.5)  # accept wakes to see close()
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvstore-data-accept", daemon=True)
        self._acceptor.start()
        return self.port

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            live = list(self._connections.items())
        for sock, _ in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its thread's recv or send returns at once
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for _, thread in live:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- connections --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            self._close_late_hellos()
            try:
                raw, peer = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                if self._logs.admit("accept") is not None:
                    log.warning("data channel: accept failed: %s", exc)
                time.sleep(0.1)  # out of fds: let connections end
                continue
            oldest = None
            with self._lock:
                full = len(self._connections) >= self.max_connections
                if self._waiting and (full or len(self._waiting) >= max(1, self.max_connections // 2)):
                    oldest = next(iter(self._waiting))  # its thread ends, and with it its slot
                    del self._waiting[oldest]
                    full = False
                if not full:
                    self._waiting[raw] = time.monotonic()
                    thread = threading.Thread(target=self._serve, args=(raw,), name="kvstore-data", daemon=True)
                    self._connections[raw] = thread
            if oldest is not None:  # its thread's read fails at once, and it ends
                try:
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if full:
                self._turn_away(raw, peer)
            else:
                thread.start()

    def _close_late_hellos(self) -> None:
        """Close connections that have waited HELLO_TIMEOUT_S for a known token, however slowly
        their bytes (or TLS handshake) trickle in."""
        late = time.monotonic() - HELLO_TIMEOUT_S
        with self._lock:
            stale = [sock for sock, since in self._waiting.items() if since < late]
            for sock in stale:
                del self._waiting[sock]
        for sock in stale:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _turn_away(self, raw: socket.socket, peer) -> None:
        """Close a connection over the cap; in plaintext with one error frame, sent without waiting."""
        self.refused += 1
        if self._logs.admit("cap") is not None:
            log.warning("data channel: %d connections open (data_max_connections): closed one from %s",
                        self.max_connections, peer)
        if self._tls is None:
            raw.setblocking(False)
            try:
                raw.send(error_frame(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                     f"the daemon serves {self.max_connections} data-channel connections at once "
                                     f"(data_max_connections); try again later"))
            except OSError:
                pass
        raw.close()

    def _serve(self, raw: socket.socket) -> None:
        sock, admitted = raw, None
        try:
            tune(raw)
            raw.settimeout(HELLO_TIMEOUT_S)
            if self._tls is not None:
                sock = self._tls.wrap_socket(raw, server_side=True)  # the handshake, within the timeout
            try:
                tenant = self._hello(sock)
            finally:
                with self._lock:
                    self._waiting.pop(raw, None)
            self._admit(tenant)
            admitted = tenant
            sock.sendall(frame(READY))
            while not self._closed.is_set():
                sock.settimeout(IDLE_TIMEOUT_S)
                head = recv_frame_head(sock)
                if head is None:
                    return  # the client closed between requests
                sock.settimeout(READ_TIMEOUT_S)
                kind, length = head
                if kind not in (GET, PUT):
                    raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {kind}; expected GET "
                                   f"({GET}) or PUT ({PUT})", close=True)
                body = self._body(sock, length, MAX_REQUEST_BYTES)
                try:
                    (self._get if kind == GET else self._put)(sock, tenant, body)
                except _Refused as exc:
                    if exc.close:
                        raise
                    self._send_error(sock, exc)
        except _Refused as exc:
            self._send_error(sock, exc)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            if self._logs.admit("io") is not None:
                log.info("data channel: a connection ended: %s", exc)
        except Exception as exc:  # noqa: BLE001 - a bug ends this connection, never the daemon
            log.error("data channel: connection failed", exc_info=exc)
        finally:
            try:
                sock.close()
            except OSError:
                pass
            with self._lock:
                self._connections.pop(raw, None)
                if admitted is not None and admitted.name:
                    self._per_tenant[admitted.name] -= 1

    def _admit(self, tenant) -> None:
        """Count a named tenant's connection; refused past its share, so one tenant cannot hold
        every connection the others need."""
        if not tenant.name:
            return
        share = max(1, self.max_connections // 4)
        with self._lock:
            held = self._per_tenant.get(tenant.name, 0)
            if held < share:
                self._per_tenant[tenant.name] = held + 1
                return
        raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant {tenant.name!r} holds {held} data-channel "
                       f"connections, its share of data_max_connections={self.max_connections}", close=True)

    def _send_error(self, sock, exc: _Refused) -> None:
        self.errors += 1
        try:
            sock.settimeout(1.0)
            sock.sendall(error_frame(exc.code.value[0], str(exc)))
        except (OSError, ssl.SSLError):
            pass

    @staticmethod
    def _body(sock, length: int, most: int) -> bytes:
        if length > most:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"a frame of {length} bytes; at most {most}", close=True)
        body = bytearray(length)
        recv_into_exactly(sock, memoryview(body), DataChannel._deadline(length))
        return bytes(body)

    def _hello(self, sock):
        """The caller's tenant from the first frame, exactly as the gRPC interceptor resolves it
        (READY follows once the connection is admitted)."""
        head = recv_frame_head(sock)
        if head is None:
            raise ConnectionError("closed before HELLO")
        kind, length = head
        if kind != HELLO:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, f"the first frame must be HELLO ({HELLO}) with the "
                           f"bearer token, got kind {kind}", close=True)
        token = self._body(sock, length, MAX_TOKEN_BYTES).decode("utf-8", "replace")
        try:
            tenant = self.service.tenant_of((("authorization", f"Bearer {token}"),) if token else ())
        except Exception as exc:  # noqa: BLE001 - BadRequest: no token, a wrong one, the admin's
            raise _Refused(*status_of("DataHello", exc), close=True) from None
        return tenant

    # -- requests -----------------------------------------------------------------------------

    def _call(self, method: str, coroutine, abandoned=None):
        """Run a store coroutine on the daemon's loop (the store is confined to it) and wait;
        its error as a _Refused that keeps the connection. Past CALL_TIMEOUT_S the connection ends
        and ``abandoned(result)`` runs on the loop when the call finishes after all (the store may
        still be reading into the request's buffers: they must never be reused)."""
        if self._closed.is_set():
            coroutine.close()
            raise _Refused(grpc.StatusCode.UNAVAILABLE, "the daemon is stopping", close=True)
        future = asyncio.run_coroutine_threadsafe(self._timed(method, coroutine), self._loop)
        try:
            return future.result(CALL_TIMEOUT_S)
        except FutureTimeout:
            if abandoned is not None:
                future.add_done_callback(lambda f: f.cancelled() or f.exception() or abandoned(f.result()))
            future.cancel()
            raise _Abandoned(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: the daemon did not answer within "
                             f"{CALL_TIMEOUT_S:.0f} s", close=True) from None
        except Exception as exc:  # noqa: BLE001 - every error becomes a status, as in server._rpc
            raise _Refused(*status_of(method, exc), close=False) from None

    async def _timed(self, method: str, coroutine):
        started = time.perf_counter()
        try:
            return await coroutine
        finally:
            self.service.store.publish_availability()
            self.service.store.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    def _release(self, nbytes: int) -> None:
        if nbytes:
            try:
                self._loop.call_soon_threadsafe(self.service.inline.release, nbytes)
            except RuntimeError:  # the loop is closed: the daemon is gone, and its budget with it
                pass

    @staticmethod
    def _deadline(nbytes: int) -> float:
        return time.monotonic() + max(TRANSFER_MIN_S, nbytes / MIN_RATE)

    def _hold(self, tenant, nbytes: int) -> None:
        """Count a named tenant's payload bytes in flight here; past a quarter of the byte budget
        its next transfer waits (at most INLINE_WAIT_S) until its own earlier ones end."""
        if not tenant.name:
            return
        share = max(1, self.service.inline.total // 4)
        deadline = time.monotonic() + INLINE_WAIT_S
        with self._held_changed:
            while self._held.get(tenant.name, 0) and self._held[tenant.name] + nbytes > share:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant {tenant.name!r} has "
                                   f"{self._held[tenant.name]} payload bytes in flight on the data channel, its "
                                   f"share of the daemon's inline budget; try again later", close=True)
                self._held_changed.wait(min(left, 0.5))
            self._held[tenant.name] = self._held.get(tenant.name, 0) + nbytes

    def _unhold(self, tenant, nbytes: int) -> None:
        if tenant.name and nbytes:
            with self._held_changed:
                self._held[tenant.name] -= nbytes
                self._held_changed.notify_all()

    def _put(self, sock, tenant, body: bytes) -> None:
        try:
            request = pb.PutRequest.FromString(body)
        except DecodeError:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "PUT does not hold a PutRequest", close=True) from None
        if len(request.items) > MAX_ITEMS_PER_CALL:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.items)} items in one Put; at most "
                           f"{MAX_ITEMS_PER_CALL}", close=True)
        lengths = [item.meta.payload_len for item in request.items]
        total = sum(lengths)
        if total > self.max_message_bytes:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this Put would carry {total} payload bytes; at most "
                           f"{self.max_message_bytes} (max_message_bytes): send fewer blocks per call", close=True)
        self._hold(tenant, total)  # refused before any payload byte is read: the stream is out of step
        try:
            if total:
                try:
                    self._call("DataPut", self.service.inline.acquire(total, INLINE_WAIT_S))
                except _Refused as exc:
                    exc.close = True
                    raise
            kept, reusable = None, True
            try:
                kept = self._buffers.take(total)
                buffer = memoryview(kept)[:total]
                recv_into_exactly(sock, buffer, self._deadline(total))
                payloads, at = [], 0
                for n in lengths:
                    payloads.append(buffer[at : at + n])
                    at += n
                # the store copies each payload into its top tier and keeps no view of it (reused after)
                stored = self._call("DataPut", self.service.put_blocks(tenant, request, payloads),
                                    abandoned=lambda _: None)
            except _Abandoned:
                reusable = False  # the store may still read it
                raise
            finally:
                buffer = payloads = None  # no view of the buffer outlives the request
                if kept is not None and reusable:
                    self._buffers.give(kept)
                self._release(total)
        finally:
            self._unhold(tenant, total)
        sock.sendall(frame(PUT_REPLY, pb.PutResponse(stored=stored).SerializeToString()))

    def _get(self, sock, tenant, body: bytes) -> None:
        try:
            request = pb.GetRequest.FromString(body)
        except DecodeError:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "GET does not hold a GetRequest", close=True) from None
        if request.gpu_direct or any(item.HasField("dest") for item in request.items):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "a data-channel Get returns payloads on the connection: "
                           "set no dest and no gpu_direct", close=False)
        taken: list[bytearray] = []

        def allocate(nbytes: int) -> bytearray:  # called on the loop, as the tiers read
            taken.append(self._buffers.take(nbytes))
            return taken[-1]

        def abandoned(result) -> None:  # on the loop: the reply's bytes, which nobody will send
            self.service.inline.release(result[1])

        self._hold(tenant, 0)  # waits while the tenant holds its share
        try:
            replies, inline = self._call("DataGet", self.service.get_blocks(tenant, request, allocate), abandoned)
        except _Abandoned:
            raise  # its buffers may still be written: dropped, never reused
        except _Refused:
            for kept in taken:
                self._buffers.give(kept)
            raise
        finally:
            self._unhold(tenant, 0)
        self._hold_sent(tenant, inline)
        try:
            reply = pb.GetResponse(results=[result for result, _ in replies]).SerializeToString()
            deadline = self._deadline(inline)  # the whole reply: a reader that stalls holds no budget long
            for piece in [frame(GET_REPLY, reply)] + [p for _, p in replies if p is not None]:
                sock.settimeout(max(0.001, deadline - time.monotonic()))  # bounds all of one sendall
                sock.sendall(piece)
        finally:
            replies = None
            for kept in taken:
                self._buffers.give(kept)
            self._release(inline)
            self._unhold(tenant, inline)

    def _hold_sent(self, tenant, nbytes: int) -> None:
        """A Get's reply bytes, counted to its tenant while they are sent (never waits: they are read)."""
        if tenant.name and nbytes:
            with self._held_changed:
                self._held[tenant.name] = self._held.get(tenant.name, 0) + nbytes
