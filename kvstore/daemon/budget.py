"""Bytes in flight: what requests may make the daemon hold in memory at once, beyond its tiers.

    ByteBudget(total, what, shared=True)
        acquire(n, wait_s, owner)   wait (in arrival order) until n more bytes fit, at most wait_s;
                                    RESOURCE_EXHAUSTED-worthy BudgetExhausted after that
        release(n, owner)           when the buffers are gone (for a reply: once gRPC has sent it)

A request larger than the whole budget waits until nothing else is in flight and then runs alone,
so no valid request is refused for its size alone (its size is bounded elsewhere: the message
limit); except a gRPC inline Get, which ``Transfers.get_blocks`` refuses before asking when its
copies exceed the whole budget (the budget would not hold what it really costs; large reads have
shared memory and the data channel). Runs on the daemon's event loop; no lock.

Fair shares (``shared``, when tenants are named): a named owner holds at most a quarter of the
budget (``share``) beyond its one call in flight; a call of an owner past its share waits without
holding up anyone else's. And since one call may be larger than a share (up to the whole budget, as
a slow peer can make it last), bytes an owner holds beyond its share do not count against other
owners' calls within theirs: those fit as if the excess were not there. So a tenant that trickles a
call as large as the budget starves nobody, at the price of the daemon holding up to twice the
budget (the excess, plus the others' calls). Who holds how much is never said in a refusal.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class BudgetExhausted(Exception):
    """The bytes a request needs did not become free within its wait."""


class ByteBudget:
    def __init__(self, total: int, what: str, shared: bool = False) -> None:
        if total <= 0:
            raise ValueError(f"{what}: a byte budget must be positive, got {total}")
        self.total, self.what = total, what
        #: Most a named owner holds beyond its one call (None: no shares; one owner, or anonymous).
        self.share = max(1, total // 4) if shared else None
        self.in_flight = 0
        #: Peak of ``in_flight`` since start (tests and Stats read it).
        self.peak = 0
        self._held: dict[str, int] = {}  # named owner -> bytes it holds, while > 0
        self._excess = 0  # sum over owners of what they hold beyond their share
        self._waiters: deque[tuple[int, str, asyncio.Future]] = deque()

    def held(self, owner: str) -> int:
        return self._held.get(owner, 0)

    def _over_share(self, nbytes: int, owner: str) -> bool:
        """Would this call take ``owner`` past its share beyond its one call?"""
        held = self._held.get(owner, 0)
        return self.share is not None and bool(owner) and held > 0 and held + nbytes > self.share

    def _fits(self, nbytes: int, owner: str) -> bool:
        if self.in_flight == 0:
            return True
        counted = self.in_flight
        if self.share is not None and owner and self._held.get(owner, 0) + nbytes <= self.share:
            counted -= self._excess  # others' calls beyond their share do not crowd out this one
        return counted + nbytes <= self.total

    async def acquire(self, nbytes: int, wait_s: float, owner: str = "") -> None:
        if not self._waiters and not self._over_share(nbytes, owner) and self._fits(nbytes, owner):
            self._take(nbytes, owner)
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (nbytes, owner, waiter)
        self._waiters.append(entry)
        self._wake()
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), wait_s)
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():  # granted just as the wait ended: keep it
                return
            self._waiters.remove(entry)
            self._wake()
            raise BudgetExhausted(f"{self.what}: {nbytes} bytes did not fit within {time.monotonic() - started:.1f} s "
                                  f"(the daemon's budget for them is full); try again later") from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release(nbytes, owner)
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, nbytes: int, owner: str = "") -> None:
        self._count(-nbytes, owner)
        self._wake()

    def _take(self, nbytes: int, owner: str) -> None:
        self._count(nbytes, owner)
        self.peak = max(self.peak, self.in_flight)

    def _count(self, nbytes: int, owner: str) -> None:
        self.in_flight += nbytes
        if self.share is None or not owner:
            return
        before = self._held.get(owner, 0)
        after = before + nbytes
        self._excess += max(0, after - self.share) - max(0, before - self.share)
        if after:
            self._held[owner] = after
        else:
            self._held.pop(owner, None)

    def _wake(self) -> None:
        """Grant waiters in arrival order while the first one fits (no overtaking: a large
        request is not starved by a stream of small ones); a waiter held back by its own owner's
        share holds up nobody."""
        for entry in list(self._waiters):
            nbytes, owner, waiter = entry
            if waiter.done():
                self._waiters.remove(entry)
                continue
            if self._over_share(nbytes, owner):
                continue
            if not self._fits(nbytes, owner):
                return
            self._waiters.remove(entry)
            self._take(nbytes, owner)
            waiter.set_result(None)
