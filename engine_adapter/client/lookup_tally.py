"""LookupTally: the Lookups a same-host client answered from the daemon's key index, until the
daemon has counted them (kvstore/shm_index.py, "Counting")."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable, Sequence

from kvstore.shm_index import (
    MAX_REPORT, MAX_REPORT_KEYS, REPORT_HEADER, REPORT_KEYS_HEADER, REPORT_S, format_report, format_report_keys)

log = logging.getLogger(__name__)

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
