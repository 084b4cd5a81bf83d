"""What keeps a block from eviction and demotion: pins, leases and the holds of layer-wise reads.

    pin      until unpinned (Pin RPC)
    lease    until its expiry: a client copies the block by reference (gpu_direct) or will load
             it soon (a Lookup's lease_ms); a longer lease already there stays
    hold     while a layer-wise read streams the block, renewed at each layer, STREAM_HOLD_S at most
    busy     the tier's own: a worker thread is copying the block now (``Tier.busy``)

Pins, leases and stream holds belong to the tenant that took them, and each tenant's held bytes are
bounded (``bound(owner)``, set by the store from quotas and the tiers' sizes): a pin or lease past
the bound is refused, so what every tenant holds together always leaves room for anyone's Put::

    owner's held bytes = sum of block_len over its keys pinned, leased or streamed (each key once)
    pin(keys)   all or nothing: HoldRefused when held + new > bound
    lease(key)  False (not leased) when held + its bytes > bound, after dropping expired leases
    hold(key)   the same for a layer-wise read's hold (the read goes on without it)

Runs on the store's event loop; no lock (no await anywhere here).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from tiers.base import Tier

#: A layer-wise read keeps its blocks from eviction while it streams, renewed at each layer; a
#: reader that stalls longer loses that hold (its stream ends with an error if a block then goes).
STREAM_HOLD_S = 10.0


class HoldRefused(Exception):
    """A pin that would take its tenant past its bound of pinned and leased bytes."""


class Holds:
    def __init__(self, bound: Callable[[str], int] | None = None) -> None:
        #: Most bytes ``owner`` may hold pinned or leased (None: no bound).
        self.bound = bound
        #: Pinned key -> its owner (tenant name, "" for the anonymous tenant).
        self.pinned: dict[bytes, str] = {}
        #: Leased key -> (expiry, monotonic s; owner).
        self._leases: dict[bytes, tuple[float, str]] = {}
        self._prune_at = 4096
        #: Owner -> its keys pinned or leased -> block bytes counted for it; and their sum.
        self._held: dict[str, dict[bytes, int]] = {}
        self._held_bytes: dict[str, int] = {}
        #: Blocks layer-wise reads are streaming -> [streams, expiry of the hold (monotonic s)].
        self._streaming: dict[bytes, list] = {}

    def evictable(self, tier: Tier, key: bytes) -> bool:
        """Not pinned, not handed out by reference, not being streamed or copied by a reader."""
        return key not in self.pinned and not self._leased(key) and not self._held_stream(key) \
            and not tier.busy(key)

    def held_bytes(self, owner: str) -> int:
        """Bytes ``owner`` holds pinned or leased (leases seen expired are no longer counted)."""
        return self._held_bytes.get(owner, 0)

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, blocks: Iterable[tuple[bytes, int]], owner: str = "") -> int:
        """Pin ``(key, block bytes)`` for ``owner``, all or none; returns how many were not pinned
        before. HoldRefused, pinning nothing, when the owner would pass its bound."""
        new = {key: size for key, size in blocks if key not in self.pinned}
        adding = sum(size for key, size in new.items() if key not in self._held.get(owner, ()))
        if not self._fits(owner, adding):
            raise HoldRefused(f"{_who(owner)} would hold {self.held_bytes(owner) + adding} bytes pinned or "
                              f"leased; its bound is {self.bound(owner)} (unpin some first)")
        for key, size in new.items():
            self.pinned[key] = owner
            self._count(owner, key, size)
        return len(new)

    def unpin(self, keys: Iterable[bytes]) -> int:
        unpinned = 0
        for key in keys:
            owner = self.pinned.pop(key, None)
            if owner is not None:
                unpinned += 1
                self._uncount(owner, key)
        return unpinned

    def forget(self, key: bytes) -> None:
        """``key`` is stored nowhere any more (deleted, dropped): its pin goes; a lease stays
        until it expires (a client may be reading it)."""
        self.unpin([key])

    def keep_pins_of(self, stored: Callable[[bytes], bool]) -> None:
        """Drop the pins of keys no tier holds any more."""
        self.unpin([k for k in self.pinned if not stored(k)])

    # -- leases -------------------------------------------------------------------------------

    def lease(self, key: bytes, seconds: float, size: int, owner: str = "") -> bool:
        """Lease ``key`` (``size`` bytes) for ``seconds``; an existing longer lease stays. False,
        and nothing leased, when ``owner`` would pass its bound."""
        now = time.monotonic()
        if len(self._leases) > self._prune_at:  # leases of keys nobody evicts or reads again
            self.release([k for k, (expiry, _) in self._leases.items() if expiry < now])
            self._prune_at = max(4096, 2 * len(self._leases))
        if key not in self._held.get(owner, ()) and not self._fits(owner, size):
            return False
        expiry, _ = self._leases.get(key, (0.0, owner))
        self._leases[key] = (max(expiry, now + seconds), owner)
        self._count(owner, key, size)
        return True

    def release(self, keys: Iterable[bytes]) -> int:
        released = 0
        for key in keys:
            lease = self._leases.pop(key, None)
            if lease is not None:
                released += 1
                self._uncount(lease[1], key)
        return released

    def _leased(self, key: bytes) -> bool:
        lease = self._leases.get(key)
        if lease is None:
            return False
        if lease[0] < time.monotonic():
            self.release([key])
            return False
        return True

    # -- accounting ---------------------------------------------------------------------------

    def _fits(self, owner: str, nbytes: int) -> bool:
        """``nbytes`` more fit in ``owner``'s bound; expired leases are dropped before saying no."""
        if self.bound is None or nbytes == 0:
            return True
        bound = self.bound(owner)
        if self.held_bytes(owner) + nbytes <= bound:
            return True
        now = time.monotonic()
        self.release([k for k in self._held.get(owner, ()) if k in self._leases and self._leases[k][0] < now])
        return self.held_bytes(owner) + nbytes <= bound

    def _count(self, owner: str, key: bytes, size: int) -> None:
        held = self._held.setdefault(owner, {})
        if key not in held:
            held[key] = size
            self._held_bytes[owner] = self._held_bytes.get(owner, 0) + size

    def _uncount(self, owner: str, key: bytes) -> None:
        """``owner`` no longer holds ``key`` one way: uncounted unless it still does another."""
        held = self._held.get(owner)
        if held is None or key not in held or key in self.pinned or key in self._leases \
                or key in self._streaming:
            return
        self._held_bytes[owner] -= held.pop(key)
        if not held:
            del self._held[owner], self._held_bytes[owner]

    def check_integrity(self) -> None:
        for owner, held in self._held.items():
            if sum(held.values()) != self._held_bytes[owner]:
                raise RuntimeError(f"holds of {owner!r}: kept byte count {self._held_bytes[owner]} differs "
                                   f"from its keys' {sum(held.values())}")
            stray = [k for k in held if self.pinned.get(k) != owner and self._leases.get(k, (0, None))[1] != owner
                     and self._streaming.get(k, [0, 0, None])[2] != owner]
            if stray:
                raise RuntimeError(f"holds of {owner!r}: {len(stray)} keys counted that it neither pins nor leases")
        for key, owner in self.pinned.items():
            if key not in self._held.get(owner, ()):
                raise RuntimeError(f"a pin of {owner!r} is not counted in its held bytes")

    # -- layer-wise reads ---------------------------------------------------------------------

    def hold(self, key: bytes, size: int = 0, owner: str = "") -> bool:
        """Keep ``key`` (``size`` bytes) while a layer-wise read of ``owner`` streams it; False, and
        no hold, when ``owner`` would pass its bound (the read goes on, and ends ABORTED if the
        block is evicted meanwhile)."""
        if key not in self._streaming and key not in self._held.get(owner, ()) and not self._fits(owner, size):
            return False
        entry = self._streaming.setdefault(key, [0, 0.0, owner])
        entry[0] += 1
        entry[1] = time.monotonic() + STREAM_HOLD_S
        self._count(owner, key, size)
        return True

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
                self._uncount(entry[2], key)

    def _held_stream(self, key: bytes) -> bool:
        entry = self._streaming.get(key)
        return entry is not None and entry[1] > time.monotonic()


def _who(owner: str) -> str:
    return f"tenant {owner!r}" if owner else "this daemon's clients"
