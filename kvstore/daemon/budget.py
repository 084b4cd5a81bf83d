"""Bytes in flight: what requests may make the daemon hold in memory at once, beyond its tiers.

    ByteBudget(total)
        acquire(n, wait_s)   wait (in arrival order) until n more bytes fit, at most wait_s;
                             RESOURCE_EXHAUSTED-worthy BudgetExhausted after that
        release(n)           when the buffers are gone (for a reply: once gRPC has sent it)

A request larger than the whole budget waits until nothing else is in flight and then runs alone,
so no valid request is refused for its size alone (its size is bounded elsewhere: the message
limit). Runs on the daemon's event loop; no lock.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class BudgetExhausted(Exception):
    """The bytes a request needs did not become free within its wait."""


class ByteBudget:
    def __init__(self, total: int, what: str) -> None:
        if total <= 0:
            raise ValueError(f"{what}: a byte budget must be positive, got {total}")
        self.total, self.what = total, what
        self.in_flight = 0
        #: Peak of ``in_flight`` since start (tests and Stats read it).
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    def _fits(self, nbytes: int) -> bool:
        return self.in_flight + nbytes <= self.total or self.in_flight == 0

    async def acquire(self, nbytes: int, wait_s: float) -> None:
        if not self._waiters and self._fits(nbytes):
            self._take(nbytes)
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), wait_s)
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():  # granted just as the wait ended: keep it
                return
            self._waiters.remove(entry)
            self._wake()
            raise BudgetExhausted(f"{self.what}: {self.in_flight} bytes in flight (budget {self.total}); "
                                  f"{nbytes} more did not fit within {time.monotonic() - started:.1f} s") from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release(nbytes)
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, nbytes: int) -> None:
        self.in_flight -= nbytes
        self._wake()

    def _take(self, nbytes: int) -> None:
        self.in_flight += nbytes
        self.peak = max(self.peak, self.in_flight)

    def _wake(self) -> None:
        """Grant waiters in arrival order while the first one fits (no overtaking: a large
        request is not starved by a stream of small ones)."""
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, waiter = self._waiters.popleft()
            if not waiter.done():
                self._take(nbytes)
                waiter.set_result(None)
