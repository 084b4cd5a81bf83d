"""Tier residency for `bench/cache_policy.py`: one class per eviction policy behind `SimTier`, and
the frequency sketch that TinyLFU admission reads.

    lru                  least recently used block first (the daemon today)
    prefix-lru           least recently used leaf first: a block none of whose children the tier holds
    prefix-tinylfu       prefix-lru behind TinyLFU admission: a block that would force an eviction is
                         stored only if it was asked for more often than the victim (incumbents win
                         ties), so on a loop larger than the tier a stable subset stays
    prefix-tinylfu-duel  prefix-tinylfu that admits everything (is prefix-lru) unless key-only shadows of
                         both policies show, over the last requests, that filtering hits more, and
                         the tier itself is not falling behind the prefix-lru shadow
    segmented            S3-FIFO's idea in LRU segments: new blocks enter a probation LRU (half the
                         tier), a block used again moves to a protected LRU; a block probation evicted
                         is remembered (keys only, a tier-ful) and goes straight to protected if it
                         comes back
    arc                  ARC (Megiddo and Modha): recency and frequency LRUs whose split adapts to hits
                         in the ghosts of each, in bytes
    prefix-arc           arc that knows chains as the daemon's prefix-lru does: a block stored or used
                         moves its held ancestors to the recent end of their own segment
    adaptive             prefix-lru or prefix-arc, whichever key-only shadows of both (a hashed sample
                         of the keys, in a tier of the sample's share of the bytes) hit more lately:
                         the daemon's ``eviction = "adaptive"``

All are deterministic; each operation costs O(log n) at most (heaps with stale entries skipped).
"""

from __future__ import annotations

import hashlib
import heapq
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from typing import Callable

from cache_trace import Block, Request


_HALVED = bytes(count >> 1 for count in range(256))


class FrequencySketch:
    """Count-min sketch of how many requests named each key lately (TinyLFU's), shared by the tiers
    of one replay. `DEPTH` rows of ``width`` 4-bit counters capped at `MAX`, ``width`` the power of
    two >= `WIDTH_PER_KEY` x ``keys`` (the blocks the tiers can hold): in a daemon 4 rows x 4 bits =
    2 bytes a column, 8 to 16 bytes per block the tiers can hold (here a byte a counter). Aging: every
    ``period`` = max(`MIN_PERIOD`, `AGING` x ``keys``) increments all counters are halved, so a count
    says how often a key was asked for while about a quarter of a tier-ful of blocks was asked for:
    short memory, which is what lets a new popular set in fast. Collisions only overcount. Slots come
    from blake2b of the key: deterministic across runs."""
    DEPTH = 4
    MAX = 15
    WIDTH_PER_KEY = 4
    AGING = 0.25
    MIN_PERIOD = 16

    def __init__(self, keys: int) -> None:
        if keys < 1:
            raise ValueError(f"a sketch needs keys >= 1 (blocks the tiers can hold), got {keys}")
        self.width = 1 << max(6, (self.WIDTH_PER_KEY * keys - 1).bit_length())
        self.period = max(self.MIN_PERIOD, round(self.AGING * keys))
        self.rows = [bytearray(self.width) for _ in range(self.DEPTH)]
        self.added = 0
        self.halvings = 0   # aging steps so far: inherited estimates halve with them
        self._memo: dict[str, list[int]] = {}

    def _slots(self, key: str) -> list[int]:
        if (slots := self._memo.get(key)) is None:  # (a simulator speed-up, emptied at each aging step)
            digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
            h1, h2, mask = digest & 0xFFFFFFFF, (digest >> 32) | 1, self.width - 1
            slots = self._memo[key] = [(h1 + i * h2) & mask for i in range(self.DEPTH)]  # double hashing
        return slots

    def record(self, request: Request) -> None:
        """Count each block of ``request``'s chain once, hit or miss (at lookup)."""
        for block in request.blocks:
            for row, slot in zip(self.rows, self._slots(block.key)):
                if row[slot] < self.MAX:
                    row[slot] += 1
            self.added += 1
            if self.added >= self.period:
                self.rows = [row.translate(_HALVED) for row in self.rows]
                self.added = 0
                self._memo.clear()
                self.halvings += 1

    def estimate(self, key: str) -> int:
        return min(row[slot] for row, slot in zip(self.rows, self._slots(key)))


class SimTier(ABC):
    """One tier's residency under a byte capacity. `insert` takes a block the tier lacks and evicts
    until it fits, unless `_admits` turns the block away in favour of the victim: then the block is
    rejected (counted in ``rejections``, not written) and returned like a victim, so the caller
    demotes or drops it the same way. ``on_evict(tier, victim)`` is called with the tier still
    holding the victim (tests check policies' invariants there)."""

    needs_frequency = False  # whether `simulate` must build a FrequencySketch and record requests in it

    def __init__(self, name: str, capacity: int, on_evict: Callable[[SimTier, Block], None] | None = None,
                 frequency: FrequencySketch | None = None, reach: int | None = None):
        """``frequency``: the sketch every tier of one replay shares; ``reach``: bytes of this tier and
        the tiers above it (``capacity`` for the top)."""
        self.name, self.capacity, self.on_evict, self.frequency = name, capacity, on_evict, frequency
        self.reach = capacity if reach is None else reach
        self.blocks: OrderedDict[str, Block] = OrderedDict()
        self.used = self.bytes_written = self.evictions = self.rejections = 0

    def __contains__(self, key: str) -> bool:
        return key in self.blocks

    def insert(self, block: Block) -> list[Block]:
        if block.nbytes > self.capacity:
            return [block]  # never fits: passes through to the caller as if evicted at once
        self.blocks[block.key] = block
        self.used += block.nbytes
        self._add(block)
        victims = []
        while self.used > self.capacity:
            victim = self._victim()
            if victim is not block and not self._admits(block, victim):
                self._remove(block)  # rejected: the tier is as before, less the victims already gone
                del self.blocks[block.key]
                self.used -= block.nbytes
                self.rejections += 1
                return [*victims, block]
            if self.on_evict is not None:
                self.on_evict(self, victim)
            self._remove(victim)
            del self.blocks[victim.key]
            self.used -= victim.nbytes
            self.evictions += 1
            victims.append(victim)
        self.bytes_written += block.nbytes
        return victims

    @abstractmethod
    def touch(self, block: Block) -> None:
        """``block``, held, was just used."""

    @abstractmethod
    def _victim(self) -> Block:
        """The held block to evict next."""

    def see(self, request: Request, hit_tokens: int) -> None:
        """``request`` was just looked up (and counted in ``frequency``); its puts follow.
        ``hit_tokens``: what this tier and the tiers above it served of it."""

    def _admits(self, block: Block, victim: Block) -> bool:
        """Whether ``block``, just added, may evict ``victim``; no: ``block`` is rejected."""
        return True

    def _add(self, block: Block) -> None:
        """``block`` is held now (in ``blocks`` and ``used``)."""

    def _remove(self, block: Block) -> None:
        """``block`` leaves (still in ``blocks``)."""

    def check_integrity(self) -> None:
        held = sum(b.nbytes for b in self.blocks.values())
        if self.used != held or self.used > self.capacity:
            raise RuntimeError(f"{self.name}: {self.used} bytes used, blocks hold {held}, capacity {self.capacity}")


class LRUTier(SimTier):
    """The daemon's eviction: ``blocks`` kept in use order, least recent first."""

    def touch(self, block: Block) -> None:
        self.blocks.move_to_end(block.key)

    def _victim(self) -> Block:
        return next(iter(self.blocks.values()))


class PrefixLRUTier(SimTier):
    """A parent is held back by the children the tier holds; when the last leaves it is a leaf again."""

    def __init__(self, name: str, capacity: int, on_evict: Callable[[SimTier, Block], None] | None = None,
                 frequency: FrequencySketch | None = None, reach: int | None = None):
        super().__init__(name, capacity, on_evict, frequency, reach)
        self._clock = 0
        self._used_at: dict[str, int] = {}
        self._children: dict[str, int] = {}          # key -> held blocks whose parent it is (held or not)
        self._leaves: list[tuple[int, str]] = []     # heap of (used at, key); stale entries skipped

    def touch(self, block: Block) -> None:
        self._clock += 1
        self._used_at[block.key] = self._clock
        if not self._children.get(block.key):
            self._push_leaf(block.key)

    def _add(self, block: Block) -> None:
        if block.parent is not None:
            self._children[block.parent] = self._children.get(block.parent, 0) + 1
        self.touch(block)

    def _victim(self) -> Block:
        while True:
            used_at, key = self._leaves[0]
            if self._used_at.get(key) == used_at and not self._children.get(key):
                return self.blocks[key]
            heapq.heappop(self._leaves)

    def _remove(self, block: Block) -> None:
        del self._used_at[block.key]
        if (parent := block.parent) is not None:
            self._children[parent] -= 1
            if not self._children[parent]:
                del self._children[parent]
                if parent in self.blocks:
                    self._push_leaf(parent)

    def _push_leaf(self, key: str) -> None:
        heapq.heappush(self._leaves, (self._used_at[key], key))
        if len(self._leaves) > 4 * len(self.blocks) + 1024:  # stale entries outnumber live ones: rebuild
            self._leaves = [(at, k) for k, at in self._used_at.items() if not self._children.get(k)]
            heapq.heapify(self._leaves)

    def check_integrity(self) -> None:
        super().check_integrity()
        held_children = Counter(b.parent for b in self.blocks.values() if b.parent is not None)
        if held_children != Counter(self._children) or self._used_at.keys() != self.blocks.keys():
            raise RuntimeError(f"{self.name}: child counts or use times disagree with the held blocks")
        entries = set(self._leaves)
        stranded = [k for k, at in self._used_at.items() if not self._children.get(k) and (at, k) not in entries]
        if stranded:
            raise RuntimeError(f"{self.name}: leaves missing from the heap: {stranded[:3]}")


class PrefixTinyLFUTier(PrefixLRUTier):
    """prefix-lru eviction behind TinyLFU admission. A block that would force an eviction is stored
    only if its estimate beats the victim's, incumbents winning ties: on a loop larger than the tier
    every key has the same count, so the blocks held stay and the newcomers are turned away (Belady
    keeps a fixed subset there too; LRU keeps none). Estimates leave out the request being served
    (the sketch counted it at lookup), so a round's blocks and a victim not yet asked for this round
    compare equal.

    Chains: a block stored while its parent is held and has no other held child (the next round of
    one conversation) inherits the parent's estimate at that moment, halved with each aging step
    since; estimate = max(own count, inherited). Without it a round's new blocks (count 0) would
    lose to every victim and a held conversation could not grow. Per held block: the inherited
    estimate and the aging step it was taken at."""
    needs_frequency = True

    def __init__(self, name: str, capacity: int, on_evict: Callable[[SimTier, Block], None] | None = None,
                 frequency: FrequencySketch | None = None, reach: int | None = None):
        if frequency is None:
            raise ValueError(f"{name}: prefix-tinylfu needs the replay's FrequencySketch (frequency=...)")
        super().__init__(name, capacity, on_evict, frequency, reach)
        self.frequency: FrequencySketch = frequency
        self._inherited: dict[str, tuple[int, int]] = {}   # key -> (estimate, sketch halvings then)
        self._asked: set[str] = set()                      # keys of the request being served

    def see(self, request: Request, hit_tokens: int) -> None:
        self._asked = {block.key for block in request.blocks}

    def estimate(self, key: str) -> int:
        """Requests that named ``key`` lately, the one being served left out; inherited if larger."""
        own = max(0, self.frequency.estimate(key) - (key in self._asked))
        if (inherited := self._inherited.get(key)) is None:
            return own
        value, halvings = inherited
        return max(own, value >> (self.frequency.halvings - halvings))

    def _add(self, block: Block) -> None:
        super()._add(block)
        parent = block.parent
        if parent is not None and parent in self.blocks and self._children[parent] == 1:
            self._inherited[block.key] = (self.estimate(parent), self.frequency.halvings)

    def _remove(self, block: Block) -> None:
        super()._remove(block)
        self._inherited.pop(block.key, None)

    def _admits(self, block: Block, victim: Block) -> bool:
        return self.estimate(block.key) > self.estimate(victim.key)

    def check_integrity(self) -> None:
        super().check_integrity()
        if not self._inherited.keys() <= self.blocks.keys():
            raise RuntimeError(f"{self.name}: inherited estimates of blocks it does not hold")


class SegmentedTier(SimTier):
    """Probation and protected LRUs (module docstring). Victims come from probation while it holds more
    than `PROBATION` of the capacity (or protected is empty), else from protected's least recent
    block. Probation's victims enter the ghost, at most as many keys as the tier holds blocks."""
    PROBATION = 0.5

    def __init__(self, name: str, capacity: int, on_evict: Callable[[SimTier, Block], None] | None = None,
                 frequency: FrequencySketch | None = None, reach: int | None = None):
        super().__init__(name, capacity, on_evict, frequency, reach)
        self.probation: OrderedDict[str, Block] = OrderedDict()
        self.protected: OrderedDict[str, Block] = OrderedDict()
        self.probation_bytes = 0
        self.ghost: OrderedDict[str, None] = OrderedDict()

    def _add(self, block: Block) -> None:
        if block.key in self.ghost:
            del self.ghost[block.key]
            self.protected[block.key] = block
        else:
            self.probation[block.key] = block
            self.probation_bytes += block.nbytes

    def touch(self, block: Block) -> None:
        if block.key in self.probation:
            del self.probation[block.key]
            self.probation_bytes -= block.nbytes
            self.protected[block.key] = block
        else:
            self.protected.move_to_end(block.key)

    def _victim(self) -> Block:
        if self.probation and (self.probation_bytes > self.PROBATION * self.capacity or not self.protected):
            return next(iter(self.probation.values()))
        return next(iter(self.protected.values()))

    def _remove(self, block: Block) -> None:
        if block.key in self.probation:
            del self.probation[block.key]
            self.probation_bytes -= block.nbytes
            self.ghost[block.key] = None
            while len(self.ghost) > len(self.blocks):
                self.ghost.popitem(last=False)
        else:
            del self.protected[block.key]

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.probation.keys() | self.protected.keys() != self.blocks.keys() or \
                self.probation_bytes != sum(b.nbytes for b in self.probation.values()):
            raise RuntimeError(f"{self.name}: segments disagree with the held blocks")


class ARCTier(SimTier):
    """ARC in bytes: ``recent`` (T1) holds blocks used once since they entered, ``frequent`` (T2) those
    used again; the ghosts B1 and B2 remember their victims' keys and bytes, a tier-ful in all. A put
    of a B1 key grows T1's target ``p`` (recency would have hit), of a B2 key shrinks it; either
    enters T2. Victims come from T1 while it holds more than ``p`` bytes, else from T2."""

    def __init__(self, name: str, capacity: int, on_evict: Callable[[SimTier, Block], None] | None = None,
                 frequency: FrequencySketch | None = None, reach: int | None = None):
        super().__init__(name, capacity, on_evict, frequency, reach)
        self.recent: OrderedDict[str, Block] = OrderedDict()
        self.frequent: OrderedDict[str, Block] = OrderedDict()
        self.ghost_recent: OrderedDict[str, int] = OrderedDict()     # key -> bytes
        self.ghost_frequent: OrderedDict[str, int] = OrderedDict()
        self.recent_bytes = self.ghost_recent_bytes = self.ghost_frequent_bytes = 0
        self.p = 0.0

    def _add(self, block: Block) -> None:
        key, size = block.key, block.nbytes
        if key in self.ghost_recent:
            self.p = min(self.capacity, self.p + max(size, size * self.ghost_frequent_bytes / self.ghost_recent_bytes))
            self.ghost_recent_bytes -= self.ghost_recent.pop(key)
            self.frequent[key] = block
        elif key in self.ghost_frequent:
            self.p = max(0.0, self.p - max(size, size * self.ghost_recent_bytes / self.ghost_frequent_bytes))
            self.ghost_frequent_bytes -= self.ghost_frequent.pop(key)
            self.frequent[key] = block
        else:
            self.recent[key] = block
            self.recent_bytes += size

    def touch(self, block: Block) -> None:
        if block.key in self.recent:
            del self.recent[block.key]
            self.recent_bytes -= block.nbytes
            self.frequent[block.key] = block
        else:
            self.frequent.move_to_end(block.key)

    def _victim(self) -> Block:
        if self.recent and (self.recent_bytes > self.p or not self.frequent):
            return next(iter(self.recent.values()))
        return next(iter(self.frequent.values()))

    def _remove(self, block: Block) -> None:
        if block.key in self.recent:
            del self.recent[block.key]
            self.recent_bytes -= block.nbytes
            self.ghost_recent[block.key] = block.nbytes
            self.ghost_recent_bytes += block.nbytes
        else:
            del self.frequent[block.key]
            self.ghost_frequent[block.key] = block.nbytes
            self.ghost_frequent_bytes += block.nbytes
        while self.ghost_recent_bytes + self.ghost_frequent_bytes > self.capacity:
            if self.ghost_recent_bytes > self.ghost_frequent_bytes or not self.ghost_frequent:
                self.ghost_recent_bytes -= self.ghost_recent.popitem(last=False)[1]
            else:
                self.ghost_frequent_bytes -= self.ghost_frequent.popitem(last=False)[1]

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.recent.keys() | self.frequent.keys() != self.blocks.keys() or \
                self.recent_bytes != sum(b.nbytes for b in self.recent.values()):
            raise RuntimeError(f"{self.name}: T1 and T2 disagree with the held blocks")


class PrefixARCTier(ARCTier):
    """ARC whose blocks stored or used move their held ancestors (nearest first, at most `MAX_WALK`)
    to the recent end of the segment each is in, without promoting them: within a segment a chain's
    first blocks are more recent than its last, so the segment evicts chains from their end."""
    MAX_WALK = 1024

    def _add(self, block: Block) -> None:
        super()._add(block)
        self._refresh_ancestors(block)

    def touch(self, block: Block) -> None:
        super().touch(block)
        self._refresh_ancestors(block)

    def _refresh_ancestors(self, block: Block) -> None:
        parent, walked = block.parent, 0
        while parent is not None and parent in self.blocks and walked < self.MAX_WALK:
            (self.recent if parent in self.recent else self.frequent).move_to_end(parent)
            parent, walked = self.blocks[parent].parent, walked + 1


def sample_rate(reach_blocks: int) -> int:
    """1 in how many keys a shadow of a tier holding ``reach_blocks`` blocks follows: enough for
    `AdaptiveTier.SHADOW_BLOCKS` blocks in it, at most 1 in `AdaptiveTier.MAX_RATE`."""
    return max(1, min(AdaptiveTier.MAX_RATE, reach_blocks // AdaptiveTier.SHADOW_BLOCKS))


class AdaptiveTier(PrefixLRUTier, PrefixARCTier):
    """prefix-lru or prefix-arc, by set dueling on sampled shadows (the daemon's ``adaptive``).

    The tier keeps both orders (prefix-lru's leaves, prefix-arc's segments and ghosts) and takes its
    victim from the one chosen now. Chosen by two key-only shadows, `ARCTier` and `LRUTier`, of
    ``reach`` / rate bytes (this tier and those above it), that follow 1 in ``rate`` keys
    (`sample_rate`, by a hash of the key) through every request, each block a use: a hit where the
    shadow holds it, else a put. Unsampled (rate 1) they know chains: `PrefixARCTier` and
    `PrefixLRUTier` (a sample keeps too few parents for it to matter). ``score`` (ARC's hits - LRU's) and ``uses`` decay by 1 / window a
    sampled use, window = `WINDOW_BLOCKS` / rate; the tier runs prefix-arc while score >
    `MARGIN` x uses. Starts as prefix-lru. Costs two ghost lists (keys of a tier-ful of bytes) and
    two shadows of about `SHADOW_BLOCKS` keys each."""
    WINDOW_BLOCKS = 1024
    MARGIN = 0.02
    SHADOW_BLOCKS = 512
    MAX_RATE = 64
    PREFIX_SHADOWS = True   # (off: plain shadows at rate 1 too, for comparison)

    def __init__(self, name: str, capacity: int, on_evict: Callable[[SimTier, Block], None] | None = None,
                 frequency: FrequencySketch | None = None, reach: int | None = None):
        super().__init__(name, capacity, on_evict, frequency, reach)
        self.rate = 0   # set at the first request, from its first block's bytes
        self.shadow_arc = self.shadow_lru = None
        self.score = self.uses = 0.0
        self.arc = False

    def see(self, request: Request, hit_tokens: int) -> None:
        if not request.blocks:
            return
        if not self.rate:
            self.rate = sample_rate(self.reach // max(1, request.blocks[0].nbytes))
            chains = self.rate == 1 and self.PREFIX_SHADOWS
            self.shadow_arc = (PrefixARCTier if chains else ARCTier)(f"{self.name} shadow arc", self.reach // self.rate)
            self.shadow_lru = (PrefixLRUTier if chains else LRUTier)(f"{self.name} shadow lru", self.reach // self.rate)
        window = max(16, self.WINDOW_BLOCKS // self.rate)
        for block in request.blocks:
            if self.rate > 1 and _sample_hash(block.key) % self.rate:
                continue
            self.score += self._shadow_use(self.shadow_arc, block) - self._shadow_use(self.shadow_lru, block) \
                - self.score / window
            self.uses += 1 - self.uses / window
        self.arc = self.score > self.MARGIN * self.uses

    @staticmethod
    def _shadow_use(shadow: SimTier, block: Block) -> int:
        if block.key in shadow:
            shadow.touch(block)
            return 1
        shadow.insert(block)
        return 0

    def _add(self, block: Block) -> None:
        PrefixLRUTier._add(self, block)
        PrefixARCTier._add(self, block)

    def touch(self, block: Block) -> None:
        PrefixLRUTier.touch(self, block)
        if block.key in self.recent or block.key in self.frequent:  # (prefix-lru's _add touches it first)
            PrefixARCTier.touch(self, block)

    def _remove(self, block: Block) -> None:
        PrefixLRUTier._remove(self, block)
        PrefixARCTier._remove(self, block)

    def _victim(self) -> Block:
        return PrefixARCTier._victim(self) if self.arc else PrefixLRUTier._victim(self)


def _sample_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def replay_alone(tier: SimTier, request: Request) -> int:
    """Replay ``request`` on ``tier`` as the only tier (look up, then put the chain); its hit tokens."""
    hit = 0
    for block in request.blocks:
        if block.key not in tier:
            break
        hit += block.tokens
    tier.see(request, hit)
    for block in request.blocks:
        if block.key in tier:
            tier.touch(block)
        else:
            tier.insert(block)
    return hit


class PrefixTinyLFUDuelTier(PrefixTinyLFUTier):
    """prefix-tinylfu whose filter is on only while it pays, as set dueling picks an insertion policy
    in a CPU cache. Two key-only shadows of one tier of ``reach`` bytes (this tier and those above
    it), one prefix-tinylfu and one prefix-lru, replay every request. Scores, each decayed by
    1 / `WINDOW` a request: ``gain`` = shadow prefix-tinylfu's hit tokens - shadow prefix-lru's,
    ``real`` = the hit tokens of this tier and those above - shadow prefix-lru's, ``asked`` = tokens
    asked. The filter is on while gain > `MARGIN` x asked (filtering would pay) and real > -`MARGIN` x
    asked (this tier, whose contents are not the shadow's, is not losing to prefix-lru); off, every
    block is admitted and the tier is prefix-lru. Starts off. Costs two more key indexes (no data)
    and three index updates a request."""
    WINDOW = 32       # requests: time constant of the decayed scores
    MARGIN = 0.01     # fraction of the tokens asked: the filter must gain this much, the tier may lose this much

    def __init__(self, name: str, capacity: int, on_evict: Callable[[SimTier, Block], None] | None = None,
                 frequency: FrequencySketch | None = None, reach: int | None = None):
        super().__init__(name, capacity, on_evict, frequency, reach)
        self.shadow_filter = PrefixTinyLFUTier(f"{name} shadow prefix-tinylfu", self.reach, None, frequency)
        self.shadow_lru = PrefixLRUTier(f"{name} shadow prefix-lru", self.reach)
        self.gain = self.asked = self.real = 0.0
        self.filtering = False

    def see(self, request: Request, hit_tokens: int) -> None:
        super().see(request, hit_tokens)
        lru = replay_alone(self.shadow_lru, request)
        gain = replay_alone(self.shadow_filter, request) - lru
        self.gain += gain - self.gain / self.WINDOW
        self.real += hit_tokens - lru - self.real / self.WINDOW
        self.asked += request.tokens - self.asked / self.WINDOW
        self.filtering = self.gain > self.MARGIN * self.asked and self.real > -self.MARGIN * self.asked

    def _admits(self, block: Block, victim: Block) -> bool:
        return not self.filtering or super()._admits(block, victim)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.shadow_filter.check_integrity()
        self.shadow_lru.check_integrity()
