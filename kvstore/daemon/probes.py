"""The daemon's HTTP port (``metrics_listen``): Prometheus ``/metrics``, liveness ``/healthz`` and
readiness ``/readyz``; every other path is 404. See docs/operations.md, "Probes".

- ``/healthz``: 200 ``ok`` while the daemon's event loop runs: the loop stamps a heartbeat every
  second (:meth:`ProbeServer.heartbeat`), and a loop that has not stamped it for ``stall_s``
  (10 s) is wedged: 503 saying for how long. Shutdown does not fail liveness.
- ``/readyz``: 503 ``starting`` until the daemon serves gRPC (tiers opened, the disk index rebuilt,
  the store's workers running), then 200 ``ready``; 503 ``stopping`` from the first moment of a
  graceful stop (while queued writes drain); 503 naming the tier while the top tier is unreachable;
  200 ``degraded: tier disk ...`` while a lower tier keeps failing (kvstore/daemon/tier_health.py
  says why 200: the daemon still serves, from the tiers above).
- ``/metrics``: the daemon's registry in the format the scraper asks for (``Accept``), as
  prometheus_client's own server gives it.

The server runs on an asyncio loop of its own, in one daemon thread, so it answers while the
daemon's loop is busy or wedged (that is what liveness reports) and holds no thread per
connection: a connection has ``read_timeout_s`` (2 s) from its accept to send its request line and
headers (at most ``MAX_HEAD_BYTES``), at most ``max_connections`` are open at once (the oldest is
closed to admit a new one), and each is answered once and closed. So a local user opening many
idle or slow connections neither exhausts threads nor keeps a probe from its answer.

A flood of short connections (issue 56: 1.39M in 35 s left /healthz 0 of 10) is a race between
the flooder's connects and this thread's accepts: once the kernel's accept queue is full, a probe's
connection is dropped with the flood's. So a connection costs as little as it can here. Accepting
is this server's own loop over ``accept`` (:meth:`ProbeServer._accept_ready`), and each accepted
connection is read at once: a probe has usually sent its whole request by then and is answered and
closed there, and a flooder's connection, reset or closed already, is closed; only a connection
that has not sent its request yet gets a protocol (:class:`_ProbeConnection`: no stream, no task,
one timer) and waits for it. The listen queue is as long as the system allows (``somaxconn``),
and each wake-up accepts a few (``ACCEPT_BATCH``), so that one accepted early is read and answered
before later ones can close it as the oldest of ``max_connections``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
import time
from typing import Callable

from kvstore.daemon.log_limit import LogLimit

log = logging.getLogger("kvstore.daemon.probes")

#: A daemon loop that has not stamped its heartbeat for this long fails liveness.
LIVENESS_STALL_S = 10.0
#: How often the daemon's loop stamps it.
HEARTBEAT_S = 1.0
#: Seconds a connection has, from its accept, to send its request (line and headers), and a reply to be sent.
READ_TIMEOUT_S = 2.0
#: Largest request line plus headers; more is answered 431 and closed.
MAX_HEAD_BYTES = 8192
#: Connections open at once; one more closes the oldest.
MAX_CONNECTIONS = 256
#: The listen queue: connections the kernel holds until this thread accepts them (the system's
#: ``net.core.somaxconn`` caps it).
LISTEN_BACKLOG = 4096
#: Connections accepted per wake-up, at most: few enough that a probe accepted in one is read and
#: answered in the next, before a flood's later connections could push it out as the oldest.
ACCEPT_BATCH = 32
#: Seconds accepting pauses after accept itself failed (the process out of fds): the queue waits.
ACCEPT_PAUSE_S = 0.1

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"


def bind_listener(address: str) -> socket.socket:
    """A listening TCP socket on ``host:port`` (an empty host is 127.0.0.1; ``[::1]`` for IPv6).
    OSError as bind raises it."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class ProbeServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one address, served from a thread of its own.

    ``not_ready`` (called on the server's thread for each ``/readyz`` once ready) returns why the
    daemon cannot serve now (e.g. "tier cpu unavailable"), or None; ``degraded``, what it serves
    without (e.g. "degraded: tier disk ..."), the body of a 200, or None."""

    def __init__(self, address: str, registry, not_ready: Callable[[], str | None] | None = None,
                 degraded: Callable[[], str | None] | None = None, stall_s: float = LIVENESS_STALL_S, read_timeout_s: float = READ_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.registry = registry
        self.not_ready, self.degraded = not_ready, degraded
        self.stall_s = stall_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        #: "starting", "ready" or "stopping" (what /readyz answers).
        self.state = "starting"
        self._beat = time.monotonic()
        self._sock = bind_listener(address)
        self.port = self._sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._log_limit = LogLimit()
        #: Open connections, oldest first (each mapped to None).
        self._open: collections.OrderedDict[_ProbeConnection, None] = collections.OrderedDict()

    # -- what the daemon tells it ---------------------------------------------------------------

    def beat(self) -> None:
        self._beat = time.monotonic()

    async def heartbeat(self, interval: float = HEARTBEAT_S) -> None:
        """Run on the daemon's loop: stamp the heartbeat every ``interval`` until cancelled."""
        while True:
            self.beat()
            await asyncio.sleep(interval)

    def ready(self) -> None:
        self.state = "ready"

    def stopping(self) -> None:
        self.state = "stopping"

    # -- answers --------------------------------------------------------------------------------

    def answer(self, method: str, path: str, accept: str = "") -> tuple[int, str, bytes]:
        """(status, content type, body) for a request; the same for GET and HEAD (HEAD sends no body)."""
        if path not in ("/metrics", "/healthz", "/readyz"):
            return 404, _TEXT, b"not found: use /metrics, /healthz or /readyz\n"
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"use GET or HEAD\n"
        if path == "/healthz":
            stalled = time.monotonic() - self._beat
            if stalled > self.stall_s:
                return 503, _TEXT, f"event loop stalled for {stalled:.1f} s\n".encode()
            return 200, _TEXT, b"ok\n"
        if path == "/readyz":
            if self.state != "ready":
                return 503, _TEXT, f"{self.state}\n".encode()
            try:
                reason = self.not_ready() if self.not_ready is not None else None
                degraded = self.degraded() if self.degraded is not None and not reason else None
            except Exception as exc:  # a readiness check that fails is not ready
                reason = f"readiness check failed: {exc}"
            if reason:
                return 503, _TEXT, f"{reason}\n".encode()
            return 200, _TEXT, f"{degraded}\n".encode() if degraded else b"ready\n"
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept)
        return 200, content_type, encoder(self.registry)

    # -- serving --------------------------------------------------------------------------------

    def start(self) -> "ProbeServer":
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.add_reader(self._sock, self._accept_ready)
            except BaseException as exc:
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="kvstore-probes", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self

    def close(self) -> None:
        """Stop serving: the port closes and open connections are dropped."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            async def shut() -> None:
                loop.remove_reader(self._sock)
                for connection in list(self._open):
                    connection.abort()
                loop.stop()

            try:
                asyncio.run_coroutine_threadsafe(shut(), loop)
            except RuntimeError:  # the loop closed meanwhile
                pass
            thread.join(timeout=5)
        self._sock.close()

    def _accept_ready(self) -> None:
        """Accept up to ``ACCEPT_BATCH`` queued connections, each answered at once where its
        request is already here (:meth:`_answer_at_once`)."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: the queue waits a moment (no busy loop)
                suppressed = self._log_limit.admit(type(exc).__name__)
                if suppressed is not None:
                    log.warning("probe port: accept failed: %s (%d more in the last minute); pausing %g s",
                                exc, suppressed, ACCEPT_PAUSE_S)
                self._loop.remove_reader(self._sock)
                self._loop.call_later(ACCEPT_PAUSE_S, self._loop.add_reader, self._sock, self._accept_ready)
                return
            self._answer_at_once(conn)

    def _answer_at_once(self, conn: socket.socket) -> None:
        """Read what ``conn`` sent already: a whole request is answered and the connection closed
        here (no protocol, no timer); one reset or closed is closed; any other waits in a
        :class:`_ProbeConnection` for the rest of its request."""
        conn.setblocking(False)
        try:
            head = conn.recv(MAX_HEAD_BYTES + 1)
        except (BlockingIOError, InterruptedError):
            head = b""
        except OSError:  # reset before its request: a flooder's
            conn.close()
            return
        else:
            if not head:  # closed before its request
                conn.close()
                return
        reply = _answer_head(self, head) if head.find(b"\r\n\r\n") >= 0 or len(head) > MAX_HEAD_BYTES else None
        if reply is not None:
            try:
                sent = conn.send(reply)
            except OSError:
                sent = len(reply)  # the peer is gone: nothing left to send
            if sent == len(reply):
                conn.close()
                return
            reply = reply[sent:]  # a peer's full receive buffer: the rest waits in a protocol
        self._loop.create_task(self._adopt(conn, head, reply))

    async def _adopt(self, conn: socket.socket, head: bytes, reply: bytes | None) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: _ProbeConnection(self, head, reply), sock=conn)
        except OSError:
            conn.close()

    def _admit(self, connection: "_ProbeConnection") -> None:
        """Count a new connection in; beyond ``max_connections`` the oldest is closed."""
        self._open[connection] = None
        while len(self._open) > self.max_connections:
            oldest, _ = self._open.popitem(last=False)
            oldest.abort()

    def _forget(self, connection: "_ProbeConnection") -> None:
        self._open.pop(connection, None)

    def respond(self, head: bytes) -> bytes:
        """The reply to a request whose line and headers are ``head`` (up to the blank line)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/") or not parts[1].startswith("/"):
            return _reply(400, _TEXT, b"bad request line\n")
        method, target = parts[0], parts[1]
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        status, content_type, body = self.answer(method, target.split("?", 1)[0], accept)
        return _reply(status, content_type, body, head_only=method == "HEAD")


class _ProbeConnection(asyncio.Protocol):
    """One connection to the probe port, on the server's loop: its request gathered as it
    arrives (at most ``MAX_HEAD_BYTES``), answered as soon as its headers end, then closed. One
    timer bounds it: ``read_timeout_s`` from the accept for the request, as long again for the
    reply to be taken (a peer that reads nothing is then cut off)."""

    def __init__(self, server: ProbeServer, head: bytes = b"", reply: bytes | None = None) -> None:
        """``head``: what the connection sent before; ``reply``: what is left to send of the
        answer already made (then nothing more is read)."""
        self._server = server
        self._head = bytearray(head)
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reply = reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._timer = asyncio.get_running_loop().call_later(self._server.read_timeout_s, self.abort)
        self._server._admit(self)
        if self._reply is not None:
            self._send(self._reply)

    def data_received(self, data: bytes) -> None:
        if self._reply is not None:
            return  # a pipelined second request: each connection is answered once
        self._head += data
        if self._head.find(b"\r\n\r\n") < 0 and len(self._head) <= MAX_HEAD_BYTES:
            return
        reply = _answer_head(self._server, bytes(self._head))
        if reply is None:
            self.abort()
            return
        self._send(reply)

    def _send(self, reply: bytes) -> None:
        self._reply = reply
        self._head = bytearray()
        self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._server.read_timeout_s, self.abort)
        self._transport.write(reply)
        self._transport.close()  # once the reply is flushed; the timer cuts off a peer that reads nothing

    def eof_received(self) -> bool:
        return False  # a peer that half-closes before its request ends gets no answer: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._server._forget(self)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


def _answer_head(server: ProbeServer, head: bytes) -> bytes | None:
    """The reply to what a connection sent, ``head`` (its request line and headers, then a blank
    line; or more than ``MAX_HEAD_BYTES`` without one: 431); None when answering failed."""
    end = head.find(b"\r\n\r\n")
    if end < 0 or end + 4 > MAX_HEAD_BYTES:
        return _reply(431, _TEXT, b"request line and headers too large\n")
    try:
        return server.respond(head[:end])
    except Exception:  # never let one request take the server down
        log.exception("probe request failed")
        return None


def _reply(status: int, content_type: str, body: bytes, head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + (b"" if head_only else body)
