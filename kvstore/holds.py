"""What keeps a block from eviction and demotion: pins, leases and the holds of layer-wise reads.

    pin      until unpinned (Pin RPC)
    lease    until its expiry: a client copies the block by reference (gpu_direct) or will load
             it soon (a Lookup's lease_ms); a longer lease already there stays
    hold     while a layer-wise read streams the block, renewed at each layer, STREAM_HOLD_S at most
    busy     the tier's own: a worker thread is copying the block now (``Tier.busy``)

Runs on the store's event loop; no lock (no await anywhere here).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from tiers.base import Tier

#: A layer-wise read keeps its blocks from eviction while it streams, renewed at each layer; a
#: reader that stalls longer loses that hold (its stream ends with an error if a block then goes).
STREAM_HOLD_S = 10.0


class Holds:
    def __init__(self) -> None:
        self.pinned: set[bytes] = set()
        #: Blocks handed to a client by reference (gpu_direct Get) -> lease expiry (monotonic s).
        self._leases: dict[bytes, float] = {}
        #: Blocks layer-wise reads are streaming -> [streams, expiry of the hold (monotonic s)].
        self._streaming: dict[bytes, list] = {}

    def evictable(self, tier: Tier, key: bytes) -> bool:
        """Not pinned, not handed out by reference, not being streamed or copied by a reader."""
        return key not in self.pinned and not self._leased(key) and not self._held(key) and not tier.busy(key)

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> int:
        before = len(self.pinned)
        self.pinned.update(keys)
        return len(self.pinned) - before

    def unpin(self, keys: Iterable[bytes]) -> int:
        before = len(self.pinned)
        self.pinned.difference_update(keys)
        return before - len(self.pinned)

    def keep_pins_of(self, stored: Callable[[bytes], bool]) -> None:
        """Drop the pins of keys no tier holds any more."""
        self.pinned = {k for k in self.pinned if stored(k)}

    # -- leases -------------------------------------------------------------------------------

    def lease(self, key: bytes, seconds: float, blocks: int) -> None:
        """Lease ``key`` for ``seconds``; ``blocks`` stored now bounds the leases kept (those of
        keys deleted while leased are dropped once expired)."""
        now = time.monotonic()
        if len(self._leases) > 4 * max(blocks, 1024):
            self._leases = {k: t for k, t in self._leases.items() if t > now}
        self._leases[key] = max(self._leases.get(key, 0.0), now + seconds)

    def release(self, keys: Iterable[bytes]) -> int:
        return sum(self._leases.pop(k, None) is not None for k in keys)

    def _leased(self, key: bytes) -> bool:
        expiry = self._leases.get(key)
        if expiry is None:
            return False
        if expiry < time.monotonic():
            del self._leases[key]
            return False
        return True

    # -- layer-wise reads ---------------------------------------------------------------------

    def hold(self, key: bytes) -> None:
        entry = self._streaming.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] = time.monotonic() + STREAM_HOLD_S

    def renew(self, key: bytes) -> None:
        entry = self._streaming.get(key)
        if entry is not None:
            entry[1] = time.monotonic() + STREAM_HOLD_S

    def unhold(self, key: bytes) -> None:
        entry = self._streaming.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] <= 0:
                del self._streaming[key]

    def _held(self, key: bytes) -> bool:
        entry = self._streaming.get(key)
        return entry is not None and entry[1] > time.monotonic()
