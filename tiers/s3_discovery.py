"""Discovery: asking a shared bucket about keys this daemon has not indexed (another host stored
them since), bounded per call so that one caller's flood of unknown keys delays nobody else.

Keys are asked in order: at most ``DISCOVER_MAX_KEYS`` a call, ``DISCOVER_WINDOW`` requests in
flight at once, on a pool of its own (``DISCOVER_THREADS``: reads and writes never queue behind
discovery, nor it behind them), until the call's deadline. Another caller's probe queues behind at
most a window of each caller's requests. A Lookup's hit run ends at the first key nobody holds, so
a Lookup asks with ``stop_at_absent`` and its asking ends at the first key absent (or refused, or
remembered absent); a Get wants each of its keys (CacheBlend's passages are independent) and asks
about all of them, up to the cap::

    keys    k0  k1  k2  k3  k4  k5  k6 ... k19999     k2 absent, window 4, stop_at_absent
    asked   k0  k1  k2  k3  k4  k5                    k4, k5 sent while k2 was in flight
    found   k0  k1                                    k3.. found are indexed all the same

Keys found absent or refused are remembered as absent for ``negative_ttl_s``: a flood repeated
within it costs no request at all.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Callable

from kvstore.block import CorruptBlockError
from tiers.base import TierError

log = logging.getLogger(__name__)

#: Keys one call asks the bucket about, at most (a Lookup's hit run rarely needs more).
DISCOVER_MAX_KEYS = 128
#: Requests one call has in flight at once: other callers keep their turn in the pool.
DISCOVER_WINDOW = 8
#: Threads of discovery's own pool (two calls' windows at once; a third waits a round trip).
DISCOVER_THREADS = 16
#: Seconds between warnings about refused objects (each one is counted; the first is always logged).
REFUSAL_LOG_S = 60.0
#: Remembered absent keys beyond which expired ones are forgotten.
ABSENT_KEEP = 65536


class Discovery:
    """``probe(key)`` reads one object's header and indexes it: True when found, False when
    absent, CorruptBlockError when refused (unreadable, MAC missing or wrong), TierError on
    endpoint trouble. ``indexed(key)``: whether the tier holds it already."""

    def __init__(self, probe: Callable[[bytes], bool], indexed: Callable[[bytes], bool],
                 negative_ttl_s: float, name: str) -> None:
        self._probe = probe
        self._indexed = indexed
        self.negative_ttl_s = negative_ttl_s
        self.name = name
        #: key -> monotonic time until which it counts as absent.
        self.absent_until: dict[bytes, float] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(DISCOVER_THREADS,
                                                           thread_name_prefix=f"kvstore-{name}-discover")
        self._lock = threading.Lock()  # guards the counts below
        #: Objects refused in all, and not yet taken by :meth:`take_refused`.
        self.refused = 0
        self._refused_untaken = 0
        self._refusal_logged = float("-inf")
        self._closed = False

    def ask(self, keys: list[bytes], timeout_s: float, stop_at_absent: bool = False) -> list[bytes]:
        """Ask about ``keys`` in order (see the module doc), waiting at most ``timeout_s``. Returns
        the keys found, in order (with ``stop_at_absent``, those before the first absent one);
        never raises for endpoint trouble."""
        deadline = time.monotonic() + timeout_s
        now = time.monotonic()
        ask: list[bytes] = []
        for key in keys:
            if len(ask) == DISCOVER_MAX_KEYS:
                break
            if self._indexed(key) or key in ask:
                continue
            if self.absent_until.get(key, 0.0) > now:
                if stop_at_absent:
                    break
                continue
            ask.append(key)
        found: list[bytes] = []
        window: collections.deque[tuple[bytes, concurrent.futures.Future]] = collections.deque()
        unasked = iter(ask)
        while not self._closed:
            while len(window) < DISCOVER_WINDOW and (key := next(unasked, None)) is not None:
                window.append((key, self._pool.submit(self._probe_one, key)))
            if not window:
                break
            key, future = window.popleft()
            try:
                present = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                break
            except TierError as exc:  # the endpoint is failing: the breaker decides when to ask again
                log.debug("%s: discover %s: %s", self.name, key.hex(), exc)
                break
            if present:
                found.append(key)
            elif stop_at_absent:
                break
        for _, future in window:
            future.cancel()  # those not started are never sent
        if len(self.absent_until) > ABSENT_KEEP:
            for key in [k for k, t in list(self.absent_until.items()) if t <= now]:
                self.absent_until.pop(key, None)
        return found

    def forget(self, key: bytes) -> None:
        """``key`` was stored here: it is no longer absent."""
        self.absent_until.pop(key, None)

    def take_refused(self) -> int:
        """Objects refused since the last call, for the store to count as corrupt. Thread-safe."""
        with self._lock:
            refused, self._refused_untaken = self._refused_untaken, 0
        return refused

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _probe_one(self, key: bytes) -> bool:
        """One key's request: True when found and indexed. An absent or refused object is
        remembered as absent; TierError on endpoint trouble."""
        if self._closed:
            return False
        try:
            found = self._probe(key)
        except CorruptBlockError as exc:
            self._refuse(key, exc)
            found = False
        if not found:
            self.absent_until[key] = time.monotonic() + self.negative_ttl_s
        return found

    def _refuse(self, key: bytes, exc: CorruptBlockError) -> None:
        """Count a refused object; log the first, then at most one a minute."""
        with self._lock:
            self.refused += 1
            self._refused_untaken += 1
            now = time.monotonic()
            loud = now - self._refusal_logged >= REFUSAL_LOG_S
            if loud:
                self._refusal_logged = now
            refused = self.refused
        (log.warning if loud else log.debug)("%s: refused the object of key %s (%d refused so far): %s",
                                             self.name, key.hex(), refused, exc)
