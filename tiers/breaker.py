"""A circuit breaker for a remote tier: after enough failures in a row, requests fail fast for a
cooldown, then one probe decides whether the endpoint is back (used by tiers/s3.py)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class CircuitBreaker:
    """closed --(``failures`` in a row)--> open --(``cooldown_s``)--> half-open --(probe ok)--> closed
                                               ^------------------(probe fails)-------------'

    Thread-safe. :meth:`allow` says whether a request may go out; while half-open exactly one
    request (the probe) is let through and every other one is refused until it reports back.
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 name: str = "endpoint") -> None:
        self.name = name  # what the log lines call the remote end
        self.failures_to_open = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None  # None: closed
        self._probing = False
        #: Times the breaker opened (a metric).
        self.opened = 0
        #: Called (in the thread that reported) when requests stop or start going out: the breaker
        #: opened, or a success closed it (open -> half-open is by time alone and calls nothing).
        self.on_change: Callable[[], None] | None = None

    @property
    def state(self) -> str:
        with self._lock:
            if self._opened_at is None:
                return "closed"
            if self._probing or self._clock() >= self._opened_at + self.cooldown_s:
                return "half-open"
            return "open"

    def allow(self) -> bool:
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() < self._opened_at + self.cooldown_s:
                return False
            self._probing = True  # this caller is the probe
            return True

    def record_success(self) -> None:
        with self._lock:
            changed = self._opened_at is not None
            if changed:
                log.warning("%s answers again: circuit closed", self.name)
            self._failures = 0
            self._opened_at = None
            self._probing = False
        if changed and self.on_change is not None:
            self.on_change()

    def record_failure(self) -> None:
        changed = False
        with self._lock:
            self._failures += 1
            if self._probing or (self._opened_at is None and self._failures >= self.failures_to_open):
                if self._opened_at is None:
                    log.warning("%s failing: circuit open for %.1fs (requests fail fast)", self.name, self.cooldown_s)
                    self.opened += 1
                changed = True  # closed or half-open -> open
                self._opened_at = self._clock()
                self._probing = False
        if changed and self.on_change is not None:
            self.on_change()
