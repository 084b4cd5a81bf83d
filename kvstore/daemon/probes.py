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
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
import time
from typing import Callable

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
        sock.listen(128)
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
        self._server: asyncio.AbstractServer | None = None
        #: Open connections, oldest first (writer -> the task serving it).
        self._open: collections.OrderedDict = collections.OrderedDict()

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
                self._server = loop.run_until_complete(asyncio.start_server(
                    self._serve, sock=self._sock, limit=MAX_HEAD_BYTES, backlog=128))
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
                if self._server is not None:
                    self._server.close()
                tasks = list(self._open.values())
                for writer, task in list(self._open.items()):
                    writer.transport.abort()
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                loop.stop()

            try:
                asyncio.run_coroutine_threadsafe(shut(), loop)
            except RuntimeError:  # the loop closed meanwhile
                pass
            thread.join(timeout=5)
        self._sock.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[writer] = asyncio.current_task()
        while len(self._open) > self.max_connections:
            oldest, _ = self._open.popitem(last=False)
            oldest.transport.abort()  # its task ends at once: its read sees the connection lost
        try:
            reply = await self._read(reader)
            if reply is None:
                return
            writer.write(reply)
            await asyncio.wait_for(writer.drain(), self.read_timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception:  # never let one request take the server down
            log.exception("probe request failed")
        finally:
            self._open.pop(writer, None)
            if writer.transport.get_write_buffer_size():  # a peer that reads nothing gets no more time
                writer.transport.abort()
            else:
                writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> bytes | None:
        """The reply to the connection's request, or None to close it unanswered (timeout, EOF)."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
        except asyncio.LimitOverrunError:
            return _reply(431, _TEXT, b"request line and headers too large\n")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
            return None
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


def _reply(status: int, content_type: str, body: bytes, head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + (b"" if head_only else body)
