"""The data channel: Put and Get payloads for clients without shared memory, as raw bytes on TCP.

Inline gRPC copies every payload into and out of protobuf messages and HTTP/2 frames (a remote Get
ran at 0.07x memcpy). Here a request is one small frame holding the existing ``kvstore.v1``
message, and the payloads follow as they are (frames: kvstore/wire.py):

    client                                  daemon (a thread per connection)
    HELLO(token)                    ->      TenantDirectory.resolve, as the gRPC interceptor
                                    <-      READY, or ERROR and close
    PUT(PutRequest) || payloads     ->      bound the lengths, charge the ByteBudget, recv_into one
                                            buffer, Transfers.put_blocks on the daemon's loop
                                    <-      PUT_REPLY(PutResponse) | ERROR
    GET(GetRequest)                 ->      Transfers.get_blocks on the loop (it charges the
                                            ByteBudget for the reply's buffers, as a gRPC Get)
                                    <-      GET_REPLY(GetResponse) || payloads (sendall of views) | ERROR

Validation, tenants' keys and the store calls are the ones the gRPC handlers use
(kvstore/daemon/transfers.py); an error answers with the code `transfers.status_of` maps it to.
After an error the connection stays open when the stream is still in step (a refused Get; a Put
whose payloads were read), and is closed otherwise (bad framing, a refused token, a Put refused
before its payloads).

Bounds, against a peer with or without a token: its connection slots and its tenant's share of
them (kvstore/daemon/data_admission.py) and of the byte budget (kvstore/daemon/budget.py); a
request's first byte within ``IDLE_TIMEOUT_S`` and the rest of its head within ``READ_TIMEOUT_S``;
each read within ``READ_TIMEOUT_S`` and a request's payloads, or a reply's sending, at ``MIN_RATE``
at least; a message at most MAX_REQUEST_BYTES; a Put's payloads at most max_message_bytes, and
every payload byte held in the daemon's ``ByteBudget`` until stored or sent.

Where a client dials it (docs/guarantees.md, "Isolation and access"): a TCP client the host
the daemon advertises (``advertised_host``, in Stats beside the port), with TLS checked against the
daemon's certificate where it has one; a client on the daemon's unix socket the unix socket beside
it (``SOCKET.data``, 0600, made under the gRPC socket's lock), whose peer it checks is the socket's
owner. No client guesses a loopback port another local user could hold.

A ``DataChannel`` runs on its own threads; the only state it shares with the event loop is reached
through the loop (``run_coroutine_threadsafe``, ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from kvstore.daemon.data_admission import HELLO_TIMEOUT_S, DataAdmission, Refused
from kvstore.daemon.log_limit import LogLimit
from kvstore.host import refuse_non_socket
from kvstore.daemon.transfers import INLINE_WAIT_S, Transfers, status_of
from kvstore.limits import MAX_ITEMS_PER_CALL
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import (GET, GET_REPLY, HELLO, MAX_REQUEST_BYTES, MAX_TOKEN_BYTES, PUT, PUT_REPLY, READY,
                          error_frame, frame, recv_frame_head, recv_into_exactly)

log = logging.getLogger("kvstore.daemon.data_channel")

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


class _Abandoned(Refused):
    """A store call that outlived CALL_TIMEOUT_S: it may still use the request's buffers."""


def tune(sock: socket.socket) -> None:
    """No Nagle on TCP (a request's head must not wait for an ACK) and large buffers."""
    if sock.family != socket.AF_UNIX:
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


def advertised_host(address: str) -> str:
    """The host a client should dial for a data channel on ``address`` (``host:port``): that host,
    or "" when it binds every address (the client then uses the host it reached gRPC at)."""
    host = address.rpartition(":")[0].strip("[]")
    return "" if host in ("", "0.0.0.0", "::") else host


def listen_unix(path: Path) -> socket.socket:
    """A listening unix socket at ``path``, born 0600; a stale socket there is replaced (the caller
    holds the gRPC socket's lock), any other file refused (OSError)."""
    refuse_non_socket(path)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(old_umask)
    listener.listen(128)
    return listener


class DataChannel:
    """The listeners and their connections' threads: TCP on ``address``, and with ``unix_path`` a
    unix socket for clients on the daemon's own unix socket (plaintext: no bytes leave the host).
    ``start`` binds (OSError when it cannot) and returns the TCP port; ``close`` stops accepting,
    ends every connection and joins the threads."""

    def __init__(self, address: str, transfers: Transfers, loop: asyncio.AbstractEventLoop,
                 tls: ssl.SSLContext | None = None, max_connections: int = 32,
                 max_message_bytes: int = 256 * 2**20, unix_path: Path | None = None) -> None:
        self.address, self.transfers, self._loop, self._tls = address, transfers, loop, tls
        self.max_connections, self.max_message_bytes = max_connections, max_message_bytes
        self.unix_path = unix_path
        self.port = 0
        #: Each listener with the TLS its connections speak (None: plaintext), and its accept thread.
        self._listeners: list[tuple[socket.socket, ssl.SSLContext | None]] = []
        self._acceptors: list[threading.Thread] = []
        self._closed = threading.Event()
        self.admission = DataAdmission(max_connections, self._closed)
        self._logs = LogLimit()
        self._buffers = _Buffers(transfers.inline.total)
        #: Connections ended by an error frame (those turned away at the cap: ``admission.refused``).
        self.errors = 0

    @property
    def connections(self) -> int:
        return len(self.admission)

    @property
    def host(self) -> str:
        """The host clients over TCP dial (``advertised_host``)."""
        return advertised_host(self.address)

    def start(self) -> int:
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        tcp = socket.create_server((host, int(port)), family=family, backlog=128)
        self._listeners.append((tcp, self._tls))
        self.port = tcp.getsockname()[1]
        if self.unix_path is not None:
            try:
                self._listeners.append((listen_unix(self.unix_path), None))
            except BaseException:
                tcp.close()
                raise
        for listener, tls in self._listeners:
            listener.settimeout(0.5)  # accept wakes to see close()
            acceptor = threading.Thread(target=self._accept_loop, args=(listener, tls), name="kvstore-data-accept",
                                        daemon=True)
            acceptor.start()
            self._acceptors.append(acceptor)
        return self.port

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        for acceptor in self._acceptors:
            acceptor.join(timeout)
        for listener, _ in self._listeners:
            listener.close()
        if self.unix_path is not None:
            self.unix_path.unlink(missing_ok=True)
        live = self.admission.live()
        for sock, _ in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its thread's recv or send returns at once
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for _, thread in live:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- connections --------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket, tls: ssl.SSLContext | None) -> None:
        while not self._closed.is_set():
            self.admission.close_late_hellos()
            try:
                raw, peer = listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                if self._logs.admit("accept") is not None:
                    log.warning("data channel: accept failed: %s", exc)
                time.sleep(0.1)  # out of fds: let connections end
                continue
            thread = threading.Thread(target=self._serve, args=(raw, tls), name="kvstore-data", daemon=True)
            if self.admission.enter(raw, thread):
                thread.start()
            else:
                self.admission.turn_away(raw, peer or "the unix socket", plaintext=tls is None)

    def _serve(self, raw: socket.socket, tls: ssl.SSLContext | None) -> None:
        sock, admitted = raw, None
        try:
            tune(raw)
            raw.settimeout(HELLO_TIMEOUT_S)
            if tls is not None:
                sock = tls.wrap_socket(raw, server_side=True)  # the handshake, within the timeout
            try:
                tenant = self._hello(sock)
            finally:
                self.admission.greeted(raw)
            self.admission.admit(tenant)
            admitted = tenant
            sock.sendall(frame(READY))
            while not self._closed.is_set():
                sock.settimeout(IDLE_TIMEOUT_S)
                head = recv_frame_head(sock, rest_within=READ_TIMEOUT_S)
                if head is None:
                    return  # the client closed between requests
                sock.settimeout(READ_TIMEOUT_S)
                kind, length = head
                if kind not in (GET, PUT):
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {kind}; expected GET "
                                  f"({GET}) or PUT ({PUT})", close=True)
                body = self._body(sock, length, MAX_REQUEST_BYTES)
                try:
                    (self._get if kind == GET else self._put)(sock, tenant, body)
                except Refused as exc:
                    if exc.close:
                        raise
                    self._send_error(sock, exc)
        except Refused as exc:
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
            self.admission.leave(raw, admitted)

    def _send_error(self, sock, exc: Refused) -> None:
        self.errors += 1
        try:
            sock.settimeout(1.0)
            sock.sendall(error_frame(exc.code.value[0], str(exc)))
        except (OSError, ssl.SSLError):
            pass

    @staticmethod
    def _body(sock, length: int, most: int) -> bytes:
        if length > most:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"a frame of {length} bytes; at most {most}", close=True)
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
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"the first frame must be HELLO ({HELLO}) with the "
                          f"bearer token, got kind {kind}", close=True)
        token = self._body(sock, length, MAX_TOKEN_BYTES).decode("utf-8", "replace")
        try:
            tenant = self.transfers.tenant_of((("authorization", f"Bearer {token}"),) if token else ())
        except Exception as exc:  # noqa: BLE001 - BadRequest: no token, a wrong one, the admin's
            raise Refused(*status_of("DataHello", exc), close=True) from None
        return tenant

    # -- requests -----------------------------------------------------------------------------

    def _call(self, method: str, coroutine, abandoned=None):
        """Run a store coroutine on the daemon's loop (the store is confined to it) and wait;
        its error as a Refused that keeps the connection. Past CALL_TIMEOUT_S the connection ends
        and ``abandoned(result)`` runs on the loop when the call finishes after all (the store may
        still be reading into the request's buffers: they must never be reused)."""
        if self._closed.is_set():
            coroutine.close()
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the daemon is stopping", close=True)
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
            raise Refused(*status_of(method, exc), close=False) from None

    async def _timed(self, method: str, coroutine):
        started = time.perf_counter()
        try:
            return await coroutine
        finally:
            self.transfers.store.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    def _release(self, nbytes: int, tenant) -> None:
        if nbytes:
            try:
                self._loop.call_soon_threadsafe(self.transfers.inline.release, nbytes, tenant.name)
            except RuntimeError:  # the loop is closed: the daemon is gone, and its budget with it
                pass

    @staticmethod
    def _deadline(nbytes: int) -> float:
        return time.monotonic() + max(TRANSFER_MIN_S, nbytes / MIN_RATE)

    def _put(self, sock, tenant, body: bytes) -> None:
        try:
            request = pb.PutRequest.FromString(body)
        except DecodeError:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "PUT does not hold a PutRequest", close=True) from None
        if len(request.items) > MAX_ITEMS_PER_CALL:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.items)} items in one Put; at most "
                          f"{MAX_ITEMS_PER_CALL}", close=True)
        lengths = [item.meta.payload_len for item in request.items]
        total = sum(lengths)
        if total > self.max_message_bytes:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this Put would carry {total} payload bytes; at most "
                          f"{self.max_message_bytes} (max_message_bytes): send fewer blocks per call", close=True)
        if total:
            try:
                self._call("DataPut", self.transfers.inline.acquire(total, INLINE_WAIT_S, tenant.name))
            except Refused as exc:
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
            stored = self._call("DataPut", self.transfers.put_blocks(tenant, request, payloads),
                                abandoned=lambda _: None)
        except _Abandoned:
            reusable = False  # the store may still read it
            raise
        finally:
            buffer = payloads = None  # no view of the buffer outlives the request
            if kept is not None and reusable:
                self._buffers.give(kept)
            self._release(total, tenant)
        sock.sendall(frame(PUT_REPLY, pb.PutResponse(stored=stored).SerializeToString()))

    def _get(self, sock, tenant, body: bytes) -> None:
        try:
            request = pb.GetRequest.FromString(body)
        except DecodeError:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "GET does not hold a GetRequest", close=True) from None
        if request.gpu_direct or any(item.HasField("dest") for item in request.items):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a data-channel Get returns payloads on the connection: "
                          "set no dest and no gpu_direct", close=False)
        taken: list[bytearray] = []

        def allocate(nbytes: int) -> bytearray:  # called on the loop, as the tiers read
            taken.append(self._buffers.take(nbytes))
            return taken[-1]

        def abandoned(result) -> None:  # on the loop: the reply's bytes, which nobody will send
            self.transfers.inline.release(result[1], tenant.name)

        try:
            replies, inline = self._call("DataGet", self.transfers.get_blocks(tenant, request, allocate), abandoned)
        except _Abandoned:
            raise  # its buffers may still be written: dropped, never reused
        except Refused:
            for kept in taken:
                self._buffers.give(kept)
            raise
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
            self._release(inline, tenant)
