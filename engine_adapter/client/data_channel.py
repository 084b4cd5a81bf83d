"""The client's side of the daemon's data channel (kvstore/daemon/data_channel.py): Put and Get payloads as
raw bytes on TCP, or on the unix socket beside the daemon's, for clients without shared memory.
`KVStoreClient` uses it when the daemon offers one (its port in Stats) and falls back to inline gRPC
otherwise.

    pool = DataChannelPool(locate, token, tls, timeout=60, max_message_bytes=256 << 20)
    stored = pool.put(put_request, payload_views)      # items carry meta.payload_len, no data
    conn = pool.take()
    response, payloads = conn.get(get_request)         # payloads: views into conn's buffer
    ...                                                # valid until the connection is given back
    pool.give_back(conn)

A connection carries one request at a time; the pool keeps one per thread that uses it at once.
A connection that met any error is closed, never reused (its stream may be out of step).

Identity: the token goes only to the daemon the client reached over gRPC. ``locate`` asks that
daemon (Stats, over the gRPC channel already authenticated by its socket or TLS) where its channel
is: `DataEndpoint.advertised` turns the answer into the unix socket beside the daemon's (its peer
checked to run as the socket's owner, SO_PEERCRED) or the TCP host and port the daemon names (TLS
checked against the name gRPC checks). The pool asks again whenever a connection it kept fails or a
dial fails, so a daemon restarted on another port is found there, never the old port's new owner.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import grpc

from kvstore.connect import ClientTLS, _host_port, is_unix
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import (ERROR, GET, GET_REPLY, HELLO, PUT, PUT_REPLY, READY, data_socket_path, frame,
                          parse_error, recv_frame_head, recv_into_exactly)

_STATUS = {status.value[0]: status for status in grpc.StatusCode}
#: Socket buffers, as the daemon's (kvstore/daemon/data_channel.py).
SOCKET_BUFFER_BYTES = 4 * 2**20


class DataChannelError(grpc.RpcError):
    """The daemon's ERROR frame: its status and message, read like a failed gRPC call's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ImpostorError(ConnectionError):
    """The endpoint dialled is not the daemon the client reached over gRPC: nothing was sent to it."""


@dataclass(frozen=True)
class DataEndpoint:
    """Where one daemon's data channel is, as that daemon advertised it over gRPC.

    ``unix_path``: the socket beside the daemon's unix socket, and ``owner_uid`` the user its
    listener must run as (the owner of the daemon's gRPC socket); else TCP ``host``:``port``, with
    ``tls_host`` the name the daemon's certificate is checked against (the one gRPC checks)."""

    host: str = ""
    port: int = 0
    tls_host: str = ""
    unix_path: str = ""
    owner_uid: int = -1

    @classmethod
    def advertised(cls, grpc_address: str, port: int, host: str) -> "DataEndpoint | None":
        """The endpoint of the daemon at ``grpc_address`` whose Stats said ``port`` and ``host``
        (``data_port``, ``data_host``); None when it offers none, or none this client may use (an
        abstract unix socket has no file beside it)."""
        if not port:
            return None
        if is_unix(grpc_address):
            if not grpc_address.startswith("unix:"):
                return None
            path = data_socket_path(grpc_address)
            return cls(unix_path=str(path), owner_uid=os.stat(grpc_address[len("unix:"):]).st_uid)
        reached = _host_port(grpc_address)[0]
        return cls(host=host or reached, port=port, tls_host=reached)

    def __str__(self) -> str:
        if self.unix_path:
            return f"unix:{self.unix_path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def dial(self, tls: ClientTLS | None, timeout: float) -> socket.socket:
        """A socket to the daemon's channel, its identity checked (ImpostorError: someone else's)."""
        if self.unix_path:
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                raw.settimeout(timeout)
                raw.connect(self.unix_path)
                uid = struct.unpack("3i", raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                if uid != self.owner_uid:
                    raise ImpostorError(f"{self} is served by user {uid}, not by the daemon's user {self.owner_uid}")
            except BaseException:
                raw.close()
                raise
            return raw
        raw = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                return tls.ssl_context().wrap_socket(raw, server_hostname=tls.server_hostname(self.tls_host))
        except BaseException:
            raw.close()
            raise
        return raw


class DataConnection:
    """One authenticated connection (HELLO answered READY when built)."""

    def __init__(self, endpoint: DataEndpoint, token: str | None, tls: ClientTLS | None, timeout: float,
                 max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._sock = endpoint.dial(tls, timeout)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self._sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        #: Where Get payloads land (recv_into); grown to the largest reply, reused after.
        self._buffer = bytearray(0)
        try:
            self._sock.sendall(frame(HELLO, (token or "").encode()))
            self._reply(READY)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def _reply(self, expected: int) -> bytes:
        head = recv_frame_head(self._sock)
        if head is None:
            raise ConnectionError("the daemon closed the data channel")
        kind, length = head
        if length > self.max_message_bytes:
            raise ConnectionError(f"the daemon sent a frame of {length} bytes, over max_message_bytes")
        body = bytearray(length)
        recv_into_exactly(self._sock, memoryview(body))
        if kind == ERROR:
            code, message = parse_error(bytes(body))
            raise DataChannelError(_STATUS.get(code, grpc.StatusCode.UNKNOWN), message)
        if kind != expected:
            raise ConnectionError(f"the daemon answered frame kind {kind}, expected {expected}")
        return bytes(body)

    def put(self, request: pb.PutRequest, payloads: list[memoryview]) -> int:
        """Send the request (items without data; meta.payload_len = len of each payload), then the payloads."""
        try:
            self._sock.sendall(frame(PUT, request.SerializeToString()))
            for payload in payloads:
                self._sock.sendall(payload)
        except OSError:
            # the daemon may have refused the Put before its payloads, said why and closed
            self._sock.settimeout(1.0)
            self._reply(PUT_REPLY)  # its ERROR frame if it sent one
            raise
        return pb.PutResponse.FromString(self._reply(PUT_REPLY)).stored

    def get(self, request: pb.GetRequest) -> tuple[pb.GetResponse, list[memoryview | None]]:
        """The reply and each found result's payload, a view into this connection's buffer."""
        self._sock.sendall(frame(GET, request.SerializeToString()))
        response = pb.GetResponse.FromString(self._reply(GET_REPLY))
        lengths = [r.meta.payload_len if r.found else None for r in response.results]
        total = sum(n for n in lengths if n is not None)
        if total > self.max_message_bytes:
            raise ConnectionError(f"the daemon announced {total} payload bytes, over max_message_bytes")
        if len(self._buffer) < total:
            self._buffer = bytearray(total)
        view = memoryview(self._buffer)
        recv_into_exactly(self._sock, view[:total])
        payloads, at = [], 0
        for n in lengths:
            payloads.append(None if n is None else view[at : at + n])
            at += n or 0
        return response, payloads


class DataChannelPool:
    """Connections to one daemon's data channel: idle ones are reused, a thread that finds none opens
    one. ``locate`` asks the daemon over gRPC where its channel is (None: it offers none now)."""

    def __init__(self, locate: Callable[[], DataEndpoint | None], token: str | None, tls: ClientTLS | None,
                 timeout: float, max_message_bytes: int, max_idle: int = 4, endpoint: DataEndpoint | None = None) -> None:
        self._locate, self._token, self._tls = locate, token, tls
        self._timeout, self._max_message_bytes, self._max_idle = timeout, max_message_bytes, max_idle
        self._endpoint = endpoint  # as last advertised; None: ask again
        self._idle: list[DataConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def endpoint(self) -> DataEndpoint:
        """Where the channel is, asked of the daemon when not known (ConnectionError: it offers none)."""
        endpoint = self._endpoint
        if endpoint is None:
            endpoint = self._locate()
            if endpoint is None:
                raise ConnectionError("the daemon offers no data channel now")
            self._endpoint = endpoint
        return endpoint

    def forget(self) -> None:
        """Ask the daemon again before the next dial (a kept connection or a dial failed: it may
        have restarted elsewhere); the idle connections to the old endpoint are closed."""
        with self._lock:
            self._endpoint = None
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _dial(self) -> DataConnection:
        known = self._endpoint is not None
        try:
            return DataConnection(self.endpoint, self._token, self._tls, self._timeout, self._max_message_bytes)
        except ImpostorError:
            self.forget()
            raise
        except (ConnectionError, OSError):
            if not known:
                raise
        self.forget()  # the port it knew is gone (a restart?): ask where it is now, once
        return DataConnection(self.endpoint, self._token, self._tls, self._timeout, self._max_message_bytes)

    def take(self) -> DataConnection:
        return self._take()[0]

    def _take(self) -> tuple[DataConnection, bool]:
        """A connection, and whether it was idle in the pool (the daemon may have closed it since)."""
        with self._lock:
            if self._closed:
                raise ValueError("the data channel pool is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._dial(), False

    def _run(self, call):
        """``call(connection)`` on a pooled connection, once more on a new one when the pooled one
        turns out closed (the daemon ends idle connections and restarts): a Get is read-only and a
        Put of the same key replaces it. Returns (connection, result); the caller gives it back."""
        conn, pooled = self._take()
        try:
            return conn, call(conn)
        except (ConnectionError, OSError):
            conn.close()
            if not pooled:
                raise
        except BaseException:
            conn.close()
            raise
        self.forget()  # a kept connection was closed: the daemon may have restarted on another port
        conn = self.take()
        try:
            return conn, call(conn)
        except BaseException:
            conn.close()
            raise

    def get(self, request: pb.GetRequest) -> tuple[DataConnection, pb.GetResponse, list[memoryview | None]]:
        """:meth:`DataConnection.get` on a pooled connection; its payloads view the connection's
        buffer until it is given back."""
        conn, (response, payloads) = self._run(lambda c: c.get(request))
        return conn, response, payloads

    def give_back(self, conn: DataConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def put(self, request: pb.PutRequest, payloads: list[memoryview]) -> int:
        conn, stored = self._run(lambda c: c.put(request, payloads))
        self.give_back(conn)
        return stored

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def open_pool(endpoint: DataEndpoint, locate: Callable[[], DataEndpoint | None], token: str | None,
              tls: ClientTLS | None, timeout: float, max_message_bytes: int) -> DataChannelPool:
    """A pool whose first connection to ``endpoint`` is open (and idle): the endpoint, TLS and token work."""
    pool = DataChannelPool(locate, token, tls, timeout, max_message_bytes, endpoint=endpoint)
    pool.give_back(pool.take())
    return pool
