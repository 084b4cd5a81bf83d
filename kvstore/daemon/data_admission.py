"""Who may hold the data channel's connections and bytes (kvstore/daemon/data_channel.py).

Against a peer with or without a token: at most ``max_connections`` at once (more are turned away
with one error frame), of which at most half wait for their HELLO (past that, or at the cap, a new
connection closes the one that waited longest: a flood of peers without a token churns among
itself, while a client that sends its token at once gets in; each waits at most HELLO_TIMEOUT_S
from accept, however slowly its bytes or TLS handshake trickle in). With named tenants, at most a
quarter of the connections are one tenant's. A tenant's share of the bytes in flight is the byte
budget's (kvstore/daemon/budget.py), shared with inline gRPC Gets.

``DataAdmission`` is called from the channel's threads (its accept loop and one per connection),
never from the event loop; its own lock guards all of its state.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import grpc

from kvstore.daemon.log_limit import LogLimit
from kvstore.wire import error_frame

log = logging.getLogger(__name__)

#: From accept to a known token (TLS handshake included), all of it: the accept loop closes later ones.
HELLO_TIMEOUT_S = 5.0


class Refused(Exception):
    """An error frame to send; ``close``: the stream is out of step (or the peer is unwelcome)."""

    def __init__(self, code: grpc.StatusCode, message: str, close: bool) -> None:
        super().__init__(message)
        self.code, self.close = code, close


def _shut(sock: socket.socket) -> None:
    """End a connection its own thread serves: that thread's read or send fails at once, and it
    closes the socket and frees the slot itself."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class DataAdmission:
    """The connection slots, the HELLO waiting list and each named tenant's share of slots and
    bytes. ``closed`` is the channel's: once set, no transfer waits for its share any longer."""

    def __init__(self, max_connections: int, closed: threading.Event) -> None:
        self.max_connections, self._closed = max_connections, closed
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        #: Connections waiting for their HELLO, oldest first, and each named tenant's (under _lock).
        self._waiting: dict[socket.socket, float] = {}  # accept time
        self._per_tenant: dict[str, int] = {}
        self._logs = LogLimit()
        #: Connections turned away at the cap.
        self.refused = 0

    def __len__(self) -> int:
        return len(self._connections)

    def live(self) -> list[tuple[socket.socket, threading.Thread]]:
        """Every connection with its thread, for the channel's close."""
        with self._lock:
            return list(self._connections.items())

    # -- connections --------------------------------------------------------------------------

    def enter(self, raw: socket.socket, thread: threading.Thread) -> bool:
        """Take a slot for a connection just accepted, to be served by ``thread`` (not started
        yet), on the HELLO waiting list; False at the cap (the caller turns it away)."""
        oldest = None
        with self._lock:
            full = len(self._connections) >= self.max_connections
            if self._waiting and (full or len(self._waiting) >= max(1, self.max_connections // 2)):
                oldest = next(iter(self._waiting))  # its thread ends, and with it its slot
                del self._waiting[oldest]
                full = False
            if not full:
                self._waiting[raw] = time.monotonic()
                self._connections[raw] = thread
        if oldest is not None:
            _shut(oldest)
        return not full

    def close_late_hellos(self) -> None:
        """Close connections that have waited HELLO_TIMEOUT_S for a known token, however slowly
        their bytes (or TLS handshake) trickle in."""
        late = time.monotonic() - HELLO_TIMEOUT_S
        with self._lock:
            stale = [sock for sock, since in self._waiting.items() if since < late]
            for sock in stale:
                del self._waiting[sock]
        for sock in stale:
            _shut(sock)

    def turn_away(self, raw: socket.socket, peer, plaintext: bool) -> None:
        """Close a connection over the cap; in ``plaintext`` with one error frame, sent without waiting."""
        self.refused += 1
        if self._logs.admit("cap") is not None:
            log.warning("data channel: %d connections open (data_max_connections): closed one from %s",
                        self.max_connections, peer)
        if plaintext:
            raw.setblocking(False)
            try:
                raw.send(error_frame(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                     f"the daemon serves {self.max_connections} data-channel connections at once "
                                     f"(data_max_connections); try again later"))
            except OSError:
                pass
        raw.close()

    def greeted(self, raw: socket.socket) -> None:
        """Off the waiting list: the connection's HELLO came (or it failed); it keeps its slot."""
        with self._lock:
            self._waiting.pop(raw, None)

    def admit(self, tenant) -> None:
        """Count a named tenant's connection; Refused past its share, so one tenant cannot hold
        every connection the others need."""
        if not tenant.name:
            return
        share = max(1, self.max_connections // 4)
        with self._lock:
            held = self._per_tenant.get(tenant.name, 0)
            if held < share:
                self._per_tenant[tenant.name] = held + 1
                return
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant {tenant.name!r} holds {held} data-channel "
                      f"connections, its share of data_max_connections={self.max_connections}", close=True)

    def leave(self, raw: socket.socket, admitted) -> None:
        """Free the slot of a connection that ended, and its tenant's count when it was ``admitted``."""
        with self._lock:
            self._connections.pop(raw, None)
            if admitted is not None and admitted.name:
                self._per_tenant[admitted.name] -= 1
