"""The report of same-host Lookups: a client's tally of what it answered from the daemon's key
index (kvstore/shm_index.py), the metadata that carries it, and the daemon's parse of it.

A Lookup answered from the key index never reaches the daemon, yet its keys, hits and misses belong in
the daemon's metrics. The map is read-only to clients, so a client keeps a tally (keys asked, hits,
calls) and hands it over on its next call to the daemon, as gRPC metadata (``REPORT_HEADER``,
``format_report``), or with an empty Lookup of its own when it made no call for ``REPORT_S``. The
daemon adds a report as if those Lookups had been RPCs (kvstore/daemon/server.py), at most ``MAX_REPORT``
of each per call and only while it publishes the index (never with tenants). A tally travels
once: a call that fails loses it, and a client that dies loses what it had not sent yet.

Beside the counts, the keys of the hit runs (``REPORT_KEYS_HEADER``, ``format_report_keys``: the keys
end to end, each once, at most ``MAX_REPORT_KEYS`` a call; a client drops what it cannot send rather
than queue it), so eviction ``adaptive`` counts a local Lookup's hits as uses as it counts a Get's
(kvstore/daemon/residency.py ``note_lookup``). The daemon bounds them again: per call, and
``MAX_REPORTED_KEYS_PER_S`` for all clients together, counting what it drops; keys no tier holds
count nothing.

The format (`format_report`, `format_report_keys`) and its parse (`parse_report`,
`parse_report_keys`, kvstore/daemon/transfers.py) live here together, with the client's
`LookupTally` that keeps what is not sent yet and the daemon's bound on the keys it counts (`KeyRate`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Callable, Sequence

from kvstore.keys import KEY_BYTES

log = logging.getLogger(__name__)

#: gRPC metadata that carries a client's tally of local Lookups: "KEYS,HITS,CALLS" (ASCII decimals).
REPORT_HEADER = "kvstore-local-lookups"
#: A client with an unsent tally and no call to carry it sends one this often.
REPORT_S = 1.0
#: Most keys (and calls) one report adds: a larger tally goes in several calls.
MAX_REPORT = 1 << 24
#: gRPC metadata (binary) that carries the keys of a client's local Lookups' hit runs, end to end.
REPORT_KEYS_HEADER = "kvstore-local-keys-bin"
#: Most keys one call reports (2 KiB of metadata, within gRPC's 8 KiB of headers a call).
MAX_REPORT_KEYS = 128
#: Most reported keys the daemon counts a second, all clients together (the rest counted as dropped):
#: a million 256-token blocks' worth of lookups a minute, more than a host's engines load.
MAX_REPORTED_KEYS_PER_S = 4096
#: Longest wait for a report of local Lookups (the reporter thread's call, and the client's close).
REPORT_TIMEOUT_S = 2.0
#: Hit keys kept for the next reports; past this, new ones are dropped (and counted) until a call sends some.
MAX_PENDING_KEYS = 4 * MAX_REPORT_KEYS


class LookupTally:
    """Keys asked, hits and calls of local Lookups not yet reported to the daemon, and the hit keys
    themselves (each once, at most MAX_PENDING_KEYS; ``dropped_keys`` counts those that found no room).

    The client's next call to the daemon carries the tally as metadata (`take`), or the reporter
    thread (started by the first `count`) sends it when no call did within REPORT_S. Any thread
    may call any method: the counts change only under the tally's lock; truth (``bool(tally)``)
    reads them without it, a hint that the next call or the reporter corrects.
    """

    def __init__(self) -> None:
        self.unreported = [0, 0, 0]  # keys asked, hits, calls
        self.hit_keys: dict[bytes, None] = {}  # hit keys not yet reported, oldest first
        self.dropped_keys = 0
        self.reporter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()

    def __bool__(self) -> bool:
        return bool(self.unreported[0] or self.unreported[2] or self.hit_keys)

    def count(self, keys: int, hits: int, report: Callable[[float], None], hit_keys: Sequence[bytes] = ()) -> None:
        """Count a local Lookup of ``keys`` keys with ``hits`` hits (an empty one counts nothing),
        and keep its hit run ``hit_keys`` for the report (each key once while unreported).
        The first, an empty one included (a warm-up), starts the reporter: a thread that calls
        ``report(timeout)`` every REPORT_S until `stop`. It holds a weak reference to ``report``
        (a client's method), so an unclosed client is collected."""
        with self._lock:
            if keys:
                self.unreported[0] += keys
                self.unreported[1] += hits
                self.unreported[2] += 1
            if len(hit_keys) <= MAX_PENDING_KEYS - len(self.hit_keys):  # room for all: one C-level update
                self.hit_keys.update(dict.fromkeys(hit_keys))  # a key already waiting keeps its place
                hit_keys = ()
            for key in hit_keys:
                if key in self.hit_keys:
                    continue
                if len(self.hit_keys) >= MAX_PENDING_KEYS:
                    self.dropped_keys += 1
                else:
                    self.hit_keys[key] = None
            if self.reporter is None:
                self.reporter = threading.Thread(target=_report_loop, args=(weakref.WeakMethod(report), self._closing),
                                                 name="kvstore-lookup-report", daemon=True)
                self.reporter.start()

    def take(self) -> tuple[tuple[str, str], ...]:
        """The tally as metadata for one call (at most MAX_REPORT of each count and MAX_REPORT_KEYS
        keys, the oldest; the rest waits for the next call). Taken once: if the call fails, the
        daemon never counts it."""
        with self._lock:
            tally = self.unreported
            keys, calls = min(tally[0], MAX_REPORT), min(tally[2], MAX_REPORT)
            hits = min(tally[1], keys)
            sent = [key for key, _ in zip(self.hit_keys, range(MAX_REPORT_KEYS))]
            for key in sent:
                del self.hit_keys[key]
            if not keys and not calls and not sent:
                return ()
            tally[0] -= keys
            tally[1] -= hits
            tally[2] -= calls
        metadata = ((REPORT_HEADER, format_report(keys, hits, calls)),)
        return metadata + ((REPORT_KEYS_HEADER, format_report_keys(sent)),) if sent else metadata

    def stop(self) -> None:
        """Stop the reporter, waiting up to REPORT_TIMEOUT_S for a report it is sending."""
        self._closing.set()
        if self.reporter is not None:
            self.reporter.join(timeout=REPORT_TIMEOUT_S)


def _report_loop(report_ref: weakref.WeakMethod[Callable[[float], None]], closing: threading.Event) -> None:
    """Every REPORT_S, have the client send its unreported tally unless another call carried it."""
    while not closing.wait(REPORT_S):
        report = report_ref()
        if report is None:
            return
        try:
            report(REPORT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the tally is lost (at most once), the thread goes on
            log.debug("report of local Lookups failed: %s", exc)
        del report


def format_report(keys: int, hits: int, calls: int) -> str:
    """The metadata value of a tally of local Lookups (each at most ``MAX_REPORT``; hits <= keys)."""
    return f"{keys},{hits},{calls}"


def format_report_keys(keys: Sequence[bytes]) -> bytes:
    """The metadata value of reported keys: at most ``MAX_REPORT_KEYS`` keys of ``KEY_BYTES``, end to end."""
    if len(keys) > MAX_REPORT_KEYS or any(len(k) != KEY_BYTES for k in keys):
        raise ValueError(f"a report carries at most {MAX_REPORT_KEYS} keys of {KEY_BYTES} bytes")
    return b"".join(keys)


def parse_report_keys(value: bytes) -> list[bytes] | None:
    """The distinct keys of a keys report, in order; None when it is not one (not bytes, not whole
    keys, more than ``MAX_REPORT_KEYS``)."""
    if not isinstance(value, bytes) or len(value) % KEY_BYTES or len(value) > MAX_REPORT_KEYS * KEY_BYTES:
        return None
    return list(dict.fromkeys(value[i : i + KEY_BYTES] for i in range(0, len(value), KEY_BYTES)))


def parse_report(value: str) -> tuple[int, int, int] | None:
    """``(keys, hits, calls)`` from a report's value; None when it is not a well-formed tally (more
    than ``MAX_REPORT`` of any, hits above keys, anything but three ASCII decimals)."""
    parts = value.split(",")
    if len(parts) != 3 or not all(0 < len(p) <= 9 and p.isascii() and p.isdigit() for p in parts):
        return None
    keys, hits, calls = map(int, parts)
    if keys > MAX_REPORT or calls > MAX_REPORT or hits > keys:
        return None
    return keys, hits, calls


class KeyRate:
    """A token bucket of ``per_s`` keys a second (a second's worth at most banked): how many of the
    keys offered now may count (the daemon's, ``MAX_REPORTED_KEYS_PER_S`` for all clients together)."""

    def __init__(self, per_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s, self._clock = per_s, clock
        self._left, self._at = float(per_s), clock()

    def admit(self, keys: int) -> int:
        now = self._clock()
        self._left = min(float(self.per_s), self._left + (now - self._at) * self.per_s)
        self._at = now
        admitted = min(keys, int(self._left))
        self._left -= admitted
        return admitted
