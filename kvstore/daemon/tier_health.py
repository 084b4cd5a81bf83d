"""Which tiers are failing now, for ``/readyz`` and ``kvstore_tier_degraded`` (docs/operations.md, "Probes").

A tier is **degraded** while it keeps failing:

- ``ERRORS`` failed writes into it (write-behind copies, demotions: ``BlockStore.count_write_error``)
  within the last ``WINDOW_S`` seconds; it recovers ``WINDOW_S`` after its last such burst, or
- it says it is unreachable (``Tier.available`` False: S3's circuit breaker is open).

What that does to readiness depends on the tier. The top tier is where every Put lands and most
Gets are served: unavailable, the daemon serves nothing, and ``/readyz`` is 503. A lower tier only
holds copies: the daemon still answers every call from the tiers above (a failing disk costs hits,
never a wrong answer), so ``/readyz`` stays 200 and names the tier in its body (``degraded: ...``).
A 503 there would take the whole pod out of its Service (kvstore's readiness gates vLLM's in the
sidecar example) for a loss of hit ratio; the gauge and the alert rules (docs/deploy/) page someone
instead.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Sequence

from tiers.base import Tier

log = logging.getLogger(__name__)

#: Failed writes into one tier, within WINDOW_S seconds, that make it degraded.
ERRORS = 3
WINDOW_S = 60.0


class TierHealth:
    """Write errors per tier over a sliding window, and each tier's own availability. Thread-safe:
    errors are noted from writer threads, read from the probe server's thread and by scrapes."""

    def __init__(self, tiers: Sequence[Tier], degraded_gauge=None, errors: int = ERRORS, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if errors < 1 or window_s <= 0:
            raise ValueError(f"errors must be >= 1 and window_s > 0, got {errors} and {window_s}")
        self.tiers, self.errors, self.window_s, self._clock = list(tiers), errors, window_s, clock
        self._lock = threading.Lock()
        #: tier name -> the times of its last ``errors`` failed writes, and the last one's text.
        self._failed: dict[str, collections.deque[float]] = {t.name: collections.deque(maxlen=errors) for t in tiers}
        self._last_error: dict[str, str] = {}
        self._reported: set[str] = set()  # tiers whose degradation was logged, until they recover
        if degraded_gauge is not None:  # computed at each scrape, so it is right without a /readyz call
            for tier in self.tiers:
                degraded_gauge.labels(tier.name).set_function(lambda name=tier.name: float(name in self.degraded()))

    def note_write_error(self, tier_name: str, exc: BaseException) -> None:
        """A write into ``tier_name`` failed (``BlockStore.count_write_error`` calls this)."""
        with self._lock:
            self._failed.setdefault(tier_name, collections.deque(maxlen=self.errors)).append(self._clock())
            self._last_error[tier_name] = _what_failed(exc)
        self.degraded()  # logs the change, once

    def degraded(self) -> dict[str, str]:
        """{tier name: why} for every tier failing now, top first; a change is logged once (the
        daemon's log has each error in full: ``BlockStore.count_write_error``)."""
        now = self._clock()
        reasons: dict[str, str] = {}
        with self._lock:
            for tier in self.tiers:
                failed = self._failed.get(tier.name, ())
                if not tier.available:
                    reasons[tier.name] = "unavailable (circuit open)" if tier.shared else "unavailable"
                elif len(failed) == self.errors and now - failed[0] <= self.window_s:
                    reasons[tier.name] = (f"{self.errors}+ write errors in {self.window_s:g} s, last "
                                          f"{now - failed[-1]:.0f} s ago: {self._last_error.get(tier.name, '')}")
            for name in reasons.keys() - self._reported:
                log.error("tier %s degraded: %s; blocks are served from the other tiers", name, reasons[name])
            for name in self._reported - reasons.keys():
                log.warning("tier %s recovered", name)
            self._reported = set(reasons)
        return reasons

    def not_ready(self) -> str | None:
        """Why ``/readyz`` is 503 (the top tier cannot serve), or None."""
        top = self.tiers[0] if self.tiers else None
        reason = self.degraded().get(top.name) if top is not None else None
        return f"tier {top.name} {reason}" if reason and not top.available else None

    def degraded_text(self) -> str | None:
        """``/readyz``'s 200 body while some tier is degraded: one line per tier, or None."""
        reasons = self.degraded()
        if not reasons:
            return None
        return "degraded: " + "; ".join(f"tier {name} {why}" for name, why in reasons.items())


def _what_failed(exc: BaseException) -> str:
    """An error as /readyz may show it to whoever reaches the metrics port: its kind and the
    system's reason, never its text (a tier's message names the block's file, i.e. its key)."""
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    reason = getattr(cause, "strerror", None) if isinstance(cause, OSError) else None
    return f"{type(exc).__name__} ({reason})" if reason else type(exc).__name__
