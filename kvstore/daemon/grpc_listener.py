"""Where and to whom the daemon's gRPC server listens: its address, TLS, and the token interceptor.

``Daemon.start`` (``kvstore/daemon/process.py``) calls these in order: ``grpc_server`` (message
limits, no port sharing, ``BearerToken`` when tokens are required), ``claim_socket`` for a unix
socket or ``refuse_busy_port`` for TCP, ``server_credentials`` for TLS, then ``bind``. Every
failure a user can fix is an OSError of one line naming the address or file.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from kvstore.daemon.auth import TenantDirectory
from kvstore.daemon.server import SERVICE_NAME
from kvstore.host import refuse_non_socket
from kvstore.instance_lock import InstanceLock


#: Health Watch streams open at once: in all, of peers without a token (a share of all, so token
#: holders always find room), and of one TCP connection. Each costs the daemon ~18 KiB; Check, which
#: holds nothing, stays unbounded.
MAX_WATCHES, MAX_ANONYMOUS_WATCHES, MAX_WATCHES_PER_CONNECTION = 128, 64, 4


def _too_many_watches() -> str:
    return (f"health Watch: at most {MAX_WATCHES_PER_CONNECTION} streams a connection, {MAX_WATCHES} in all; "
            f"poll Check instead")


class BoundedHealth(health.aio.HealthServicer):
    """``grpc.health.v1`` whose Watch streams are bounded (``MAX_WATCHES`` in all, and
    ``MAX_WATCHES_PER_CONNECTION`` per TCP connection): 30,000 streams on 301 connections took
    545 MiB. Past a bound a Watch ends at once with RESOURCE_EXHAUSTED. On the event loop only."""

    def __init__(self) -> None:
        super().__init__()
        self.watches = 0
        self._per_connection: dict[str, int] = {}  # peer ("ipv4:host:port") -> its streams, while > 0
        #: Watch streams refused at a bound.
        self.refused = 0

    async def Watch(self, request, context) -> None:
        peer = context.peer() or ""
        counted = not peer.startswith("unix")  # one user's own socket (0600): the total bounds it
        if self.watches >= MAX_WATCHES or (counted and self._per_connection.get(peer, 0) >= MAX_WATCHES_PER_CONNECTION):
            self.refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _too_many_watches())
        self.watches += 1
        if counted:
            self._per_connection[peer] = self._per_connection.get(peer, 0) + 1
        try:
            await super().Watch(request, context)
        finally:
            self.watches -= 1
            if counted:
                left = self._per_connection.pop(peer) - 1
                if left:
                    self._per_connection[peer] = left


class BearerToken(grpc.aio.ServerInterceptor):
    """Refuse every call without a known tenant's bearer token before reading its request.

    The refusing handlers take the request as a stream they never read: gRPC then fetches no
    message, HTTP/2 flow control holds the rest in the sender, and a peer without a token makes the
    daemon buffer its metadata and at most a flow-control window per call, never a message (a
    unary refusal received and parsed the whole message first: four 200 MiB Puts without a token
    took 1.3 GB). Health checks stay open without a token, answered the same way: for the kvstore
    service as a whole, whatever service the unread request names; Watch streams without a token
    are at most ``MAX_ANONYMOUS_WATCHES`` of the ``BoundedHealth`` servicer's bound."""

    def __init__(self, tenants: TenantDirectory) -> None:
        self._tenants = tenants
        self.anonymous_watches = 0

        async def deny(unread, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.stream_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if self._tenants.resolve(details.invocation_metadata, operator=True) is not None:  # the admin token too
            return await continuation(details)
        if details.method == "/grpc.health.v1.Health/Check":
            check = (await continuation(details)).unary_unary

            async def answer(unread, context):
                return await check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), context)

            return grpc.stream_unary_rpc_method_handler(
                answer, response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        if details.method == "/grpc.health.v1.Health/Watch":
            watch = (await continuation(details)).unary_stream

            async def updates(unread, context):
                if self.anonymous_watches >= MAX_ANONYMOUS_WATCHES:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _too_many_watches())
                self.anonymous_watches += 1
                try:
                    await watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), context)
                finally:
                    self.anonymous_watches -= 1

            return grpc.stream_stream_rpc_method_handler(
                updates, response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        return self._deny


def grpc_server(max_message_bytes: int, tenants: TenantDirectory) -> grpc.aio.Server:
    """The gRPC server, not yet listening: messages up to ``max_message_bytes`` each way, and every
    call's token checked first when ``tenants`` requires one."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               # gRPC's default SO_REUSEPORT would let a second daemon share a busy port.
               ("grpc.so_reuseport", 0)]
    interceptors = [BearerToken(tenants)] if tenants.required else []
    return grpc.aio.server(options=options, interceptors=interceptors)


def claim_socket(address: str, socket_path: Path) -> InstanceLock:
    """The lock of the unix socket at ``socket_path``, held by this daemon, with any stale socket
    file there removed. OSError naming ``address``: a file there that is not a socket (kept), a
    folder that cannot be made or written; LockError (``InstanceLock``): another daemon holds it."""
    # A file someone put at the socket path is never removed. Checked before the lock, so
    # that a failed start (which removes the socket path) never holds it.
    try:
        refuse_non_socket(socket_path)
    except OSError as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from None
    # One daemon per socket: only the lock's holder may remove a stale socket file.
    try:
        lock = InstanceLock(socket_path.with_name(socket_path.name + ".lock"), f"unix socket {socket_path}")
    except OSError as exc:  # its folder cannot be created or written
        raise OSError(f"cannot listen on {address}: {exc.filename}: {exc.strerror}") from None
    socket_path.unlink(missing_ok=True)
    return lock


def refuse_busy_port(address: str) -> None:
    """OSError when TCP ``address`` is in use by someone else. Checked before gRPC binds: gRPC's
    own refusal ("Failed to bind") says no why, and logs a C++ line."""
    reason = why_cannot_listen(address, busy_only=True)
    if reason:
        raise OSError(f"cannot listen on {address}: {reason}")


def server_credentials(tls_cert: str, tls_key: str) -> grpc.ServerCredentials:
    """TLS with the PEM certificate chain and key in these files; OSError naming one unreadable."""
    try:
        return grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
    except OSError as exc:
        raise OSError(f"cannot read the TLS key or certificate {exc.filename}: {exc.strerror}") from None


def bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None, unix: bool) -> int:
    """Listen on ``address`` (TLS with ``credentials``); the port bound. A unix socket is born
    0600. OSError saying why the address cannot be bound (for TCP, found by binding it ourselves)."""
    old_umask = os.umask(0o177)  # the socket is born 0600
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # "Failed to bind to address": find out why
        port = 0
    finally:
        os.umask(old_umask)
    if port == 0:
        reason = None if unix else why_cannot_listen(address, busy_only=False)
        raise OSError(f"cannot listen on {address}: {reason or 'gRPC could not bind it'}")
    return port


def why_cannot_listen(address: str, busy_only: bool) -> str | None:
    """Why TCP ``host:port`` cannot be bound, found by binding it as gRPC does (SO_REUSEADDR, no
    SO_REUSEPORT); None if it can. ``busy_only``: report only "address in use" (a host name may
    resolve to an address family this host lacks, which gRPC skips)."""
    host, _, port = address.rpartition(":")
    try:
        candidates = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)
    except (socket.gaierror, ValueError) as exc:
        return None if busy_only else f"cannot resolve it: {exc}"
    for family, kind, proto, _, sockaddr in candidates:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return "address in use"
                if not busy_only:
                    return (exc.strerror or str(exc)).lower()
    return None
