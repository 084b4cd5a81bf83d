"""``eviction = "adaptive"`` (docs/policy.md): each tier keeps ARC's order beside prefix-lru's, and
evicts by the one that key-only shadows of both, following a hashed sample of the keys, show
hitting more lately.

    a Get's hit, a Put's block (BlockStore.note_read / put)
      └─► Residency.note_use(key, bytes)
            └─► EvictionDuel.use per tier         1 key in `rate`: a use of its ARC and LRU shadows
                  └─► ``arc``: ARC's hits beat LRU's by MARGIN of the sampled uses, lately
    TierLRU (residency.py) iterates victims in ArcOrder's order while its tier's duel says ``arc``,
    else in its own (prefix-lru)

`ArcOrder` is ARC (Megiddo and Modha, FAST'03) in bytes: ``recent`` holds blocks used once since
they entered a tier, ``frequent`` blocks used again; each segment's victims are remembered (keys and
bytes, a tier-ful in all) so that a put of a remembered key moves the split ``target`` towards the
segment that would have kept it. Under chains, a block's ancestors are refreshed in their own
segment (moved to its recent end, not promoted), so each segment evicts a chain from its end.

The model of all of it, with the same constants, is `bench/cache_tiers.py` `AdaptiveTier`;
tests/test_policy.py holds the daemon to the simulator's hit ratio.

Costs: per tier, two ordered key maps and two ghost maps (keys of at most a tier-ful of bytes and
`GHOST_SLACK` more keys than the tier holds); per tier, two shadows of at most `SHADOW_KEYS` keys;
per use, two dictionary lookups, and on 1 key in ``rate`` the shadows' updates. Tenants: a tenant's
Gets and Puts name its own stored keys only (derived from its name), so it can promote or age no
other tenant's block; it does move the duel's choice for every tenant, as its traffic moves LRU's
order for everyone: both choices bound what it can take to what LRU would give it.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from typing import Iterator

#: Sampled uses a score remembers (its decay time constant), in uses of all keys: divided by the rate.
WINDOW_BLOCKS = 1024
#: ARC is chosen while its shadow hits more than LRU's by this fraction of the sampled uses.
MARGIN = 0.02
#: Blocks a shadow should hold: the sample rate is the tier's blocks / this, within 1..MAX_RATE.
SHADOW_BLOCKS = 512
MAX_RATE = 64
#: Most keys a shadow holds whatever its blocks' sizes (tiny blocks cannot grow it past this).
SHADOW_KEYS = 4 * SHADOW_BLOCKS
#: Most ancestors one shadow use refreshes: unbudgeted, a use costs at most this many steps per shadow
#: (a tier's own walks are budgeted per call, `residency.WalkBudget`); chains longer than this in a
#: tier small enough to be followed unsampled (under 1,024 blocks) are ordered in the shadows only
#: near their end.
SHADOW_WALK = 64
#: Ghost keys beyond the keys the tier holds.
GHOST_SLACK = 1024


class ArcOrder:
    """ARC's segments and ghosts over the keys of one tier of ``capacity`` bytes; the caller decides
    what is held (`add`, `remove`) and takes victims in `__iter__`'s order."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"ARC needs a bounded tier, got capacity {capacity}")
        self.capacity = capacity
        self.recent: OrderedDict[bytes, int] = OrderedDict()            # key -> bytes, least recent first
        self.frequent: OrderedDict[bytes, int] = OrderedDict()
        self.ghost_recent: OrderedDict[bytes, int] = OrderedDict()
        self.ghost_frequent: OrderedDict[bytes, int] = OrderedDict()
        self.recent_bytes = self.ghost_recent_bytes = self.ghost_frequent_bytes = 0
        self.target = 0.0   # bytes ``recent`` may hold before it gives the victims

    def __contains__(self, key: bytes) -> bool:
        return key in self.recent or key in self.frequent

    def __len__(self) -> int:
        return len(self.recent) + len(self.frequent)

    def __iter__(self) -> Iterator[bytes]:
        """Keys in eviction order: ``recent`` first while it holds more than its target."""
        if self.recent and (self.recent_bytes > self.target or not self.frequent):
            return chain(self.recent, self.frequent)
        return chain(self.frequent, self.recent)

    def add(self, key: bytes, nbytes: int, oldest: bool = False) -> None:
        """The tier holds ``key`` now (not held before): into ``frequent`` if a ghost remembers it
        (the target moves towards the segment that lost it), else into ``recent``; ``oldest``: as its
        least recently used block (keys adopted, not used)."""
        if key in self.ghost_recent:
            self.target = min(self.capacity, self.target + max(nbytes, nbytes * self.ghost_frequent_bytes
                                                                / max(1, self.ghost_recent_bytes)))
            self.ghost_recent_bytes -= self.ghost_recent.pop(key)
            segment = self.frequent
        elif key in self.ghost_frequent:
            self.target = max(0.0, self.target - max(nbytes, nbytes * self.ghost_recent_bytes
                                                      / max(1, self.ghost_frequent_bytes)))
            self.ghost_frequent_bytes -= self.ghost_frequent.pop(key)
            segment = self.frequent
        else:
            segment = self.recent
            self.recent_bytes += nbytes
        segment[key] = nbytes
        if oldest:
            segment.move_to_end(key, last=False)

    def use(self, key: bytes) -> None:
        """``key``, held, was used: into (the recent end of) ``frequent``."""
        if key in self.recent:
            nbytes = self.recent.pop(key)
            self.recent_bytes -= nbytes
            self.frequent[key] = nbytes
        elif key in self.frequent:
            self.frequent.move_to_end(key)

    def refresh(self, key: bytes) -> None:
        """``key``, held, is an ancestor of a block used: to the recent end of its own segment."""
        if key in self.recent:
            self.recent.move_to_end(key)
        elif key in self.frequent:
            self.frequent.move_to_end(key)

    def remove(self, key: bytes) -> None:
        """The tier no longer holds ``key``: remembered in its segment's ghost."""
        if key in self.recent:
            nbytes = self.recent.pop(key)
            self.recent_bytes -= nbytes
            self.ghost_recent[key] = nbytes
            self.ghost_recent_bytes += nbytes
        elif key in self.frequent:
            nbytes = self.frequent.pop(key)
            self.ghost_frequent[key] = nbytes
            self.ghost_frequent_bytes += nbytes
        else:
            return
        most_keys = len(self) + GHOST_SLACK
        while self.ghost_recent_bytes + self.ghost_frequent_bytes > self.capacity or \
                len(self.ghost_recent) + len(self.ghost_frequent) > most_keys:
            if self.ghost_recent_bytes > self.ghost_frequent_bytes or not self.ghost_frequent:
                self.ghost_recent_bytes -= self.ghost_recent.popitem(last=False)[1]
            else:
                self.ghost_frequent_bytes -= self.ghost_frequent.popitem(last=False)[1]

    def forget_ghosts(self) -> None:
        """A tier cleared: nothing it evicted says anything about what comes next."""
        self.ghost_recent.clear()
        self.ghost_frequent.clear()
        self.ghost_recent_bytes = self.ghost_frequent_bytes = 0

    def check_integrity(self, held: set[bytes]) -> None:
        if set(self.recent) | set(self.frequent) != held or self.recent.keys() & self.frequent.keys():
            raise RuntimeError("ARC's segments do not hold exactly the tier's keys")
        if self.recent_bytes != sum(self.recent.values()) or \
                self.ghost_recent_bytes != sum(self.ghost_recent.values()) or \
                self.ghost_frequent_bytes != sum(self.ghost_frequent.values()):
            raise RuntimeError("ARC's byte counts differ from its keys'")
        if not 0 <= self.target <= self.capacity:
            raise RuntimeError(f"ARC's target {self.target} is outside 0..{self.capacity}")


class _Shadow:
    """Keys only, no data: a tier of ``capacity`` bytes (and at most `SHADOW_KEYS` keys) under ARC
    or LRU, for the duel; given parents (unsampled), a use refreshes the key's held ancestors as a
    tier under chains does (at most `SHADOW_WALK`)."""

    def __init__(self, capacity: int, arc: bool) -> None:
        self.capacity = capacity
        self.arc = ArcOrder(capacity) if arc else None
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        self.parents: dict[bytes, bytes] = {}   # held key -> the parent its use named
        self.used = 0

    def use(self, key: bytes, nbytes: int, parent: bytes | None = None) -> int:
        """One use of ``key``: 1 if the shadow held it (a hit), else 0, and it holds it now."""
        hit = key in self.lru
        if hit:
            self.lru.move_to_end(key)
            if self.arc is not None:
                self.arc.use(key)
        else:
            self.lru[key] = nbytes
            self.used += nbytes
            if self.arc is not None:
                self.arc.add(key, nbytes)
        if parent:
            self.parents[key] = parent
        self._refresh_ancestors(key)
        while self.used > self.capacity or len(self.lru) > SHADOW_KEYS:
            victim = next(iter(self.arc)) if self.arc is not None else next(iter(self.lru))
            self.used -= self.lru.pop(victim)
            self.parents.pop(victim, None)
            if self.arc is not None:
                self.arc.remove(victim)
        return int(hit)

    def _refresh_ancestors(self, key: bytes) -> None:
        parent, walked = self.parents.get(key), 0
        while parent is not None and parent in self.lru and walked < SHADOW_WALK:
            self.lru.move_to_end(parent)
            if self.arc is not None:
                self.arc.refresh(parent)
            parent, walked = self.parents.get(parent), walked + 1


class EvictionDuel:
    """Which order one tier evicts by: ``arc`` while a shadow ARC of the tier (and the tiers above
    it: ``reach`` bytes) hits more than a shadow LRU lately, on 1 key in ``rate``."""

    def __init__(self, reach: int) -> None:
        self.reach = reach
        self.rate = 0           # set at the first use, from its block's bytes
        self._arc = self._lru = None
        self.score = self.uses = 0.0
        self.arc = False

    def use(self, key: bytes, nbytes: int, parent: bytes | None = None) -> None:
        """A Get's hit or a Put's block (whatever tier serves or takes it), and the key before it in
        its chain if known: the shadows follow chains when they see every key (rate 1)."""
        if not self.rate:
            self.rate = max(1, min(MAX_RATE, self.reach // max(1, nbytes) // SHADOW_BLOCKS))
            self._arc = _Shadow(self.reach // self.rate, arc=True)
            self._lru = _Shadow(self.reach // self.rate, arc=False)
        if self.rate > 1 and int.from_bytes(key[-8:], "little") % self.rate:
            return
        window = max(16, WINDOW_BLOCKS // self.rate)
        parent = parent if self.rate == 1 else None
        self.score += self._arc.use(key, nbytes, parent) - self._lru.use(key, nbytes, parent) - self.score / window
        self.uses += 1 - self.uses / window
        self.arc = self.score > MARGIN * self.uses
