"""Which tier holds which key: one LRU per tier, and the one path by which a block enters or leaves
a tier.

    Residency.put / put_checksummed / record / touch / delete / forget / clear / adopt_shared
        ├─► the tier itself (put, delete)             what a read finds
        ├─► TierLRU of that tier                      eviction order, owners' bytes
        ├─► KeyIndexWriter.add / remove (shm_index)   same-host clients' Lookup
        └─► EventPublisher.stored / removed (events)  routers' KV events

Every change goes through here (put, demotion, promotion, write-behind copy, eviction, delete,
clear, a shared tier's adopted keys), so neither mirror can miss one. A tier's own index is what
reads ask (``key in tier``): a shared tier (S3) may index keys by itself (background listing,
discovery) before :meth:`Residency.adopt_shared` takes them in here.

Runs on the store's event loop; callers hold the store lock for changes (a read's ``touch`` needs
none: no await).

Eviction order (``eviction``, docs/policy.md): ``lru`` keeps each tier's keys in the order they were
last used. ``prefix-lru`` knows chains: a Put names the key before each block (its parent), and
whenever a block enters or is used in a tier its ancestors there are used right after it, so a
chain's first blocks are always more recent than its last and a tier evicts a chain from its end:
what stays is a prefix, still a hit (a Lookup's run may span tiers). Walks are bounded (`MAX_WALK` ancestors), so a forged chain costs its tenant's own Put.
``adaptive`` keeps prefix-lru's order and, beside it, ARC's (`kvstore/daemon/adaptive.py`) in each
bounded tier, and evicts by whichever of the two that tier's `EvictionDuel` chooses now; the
store reports each Get's hit and each Put's block to `Residency.note_use`, which feeds the duels.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from kvstore.block import BlockHeader
from kvstore.keys import parents_first
from kvstore.daemon.adaptive import ArcOrder, EvictionDuel
from kvstore.daemon.config import EVICTION_POLICIES
from kvstore.shm_index import KeyIndexWriter
from kvstore.daemon.tier_io import TierIO
from tiers.base import Tier

if TYPE_CHECKING:
    from kvstore.daemon.events import EventPublisher

#: Most ancestors one use refreshes: a chain of 1,024 blocks is 256k tokens of 256-token chunks.
MAX_WALK = 1024
#: Keys reported as looked up whose next Get or Put a duel does not count again (`Residency.note_lookup`).
LOOKED_UP_KEYS = 4096


@dataclass
class WalkBudget:
    """Ancestor steps one call may still take, all its blocks together: a Put of thousands of
    blocks naming deep parents costs at most this many, not thousands of walks."""

    left: int = 8 * MAX_WALK


class TierLRU:
    """One tier's keys, least recently used first, and for blocks of a named tenant their owner and
    the bytes each owner holds, kept as blocks come and go (no scan per put). With ``arc`` (an
    `ArcOrder`, eviction ``adaptive``) it keeps ARC's order too, and iterates in it while
    ``by_arc`` is set."""

    def __init__(self, arc: ArcOrder | None = None) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()
        self.arc = arc
        self.by_arc = False
        self._owner: dict[bytes, str] = {}                      # key -> owner
        self._owned: dict[str, OrderedDict[bytes, int]] = {}    # owner -> its keys (LRU first) -> bytes
        self._owned_bytes: dict[str, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[bytes]:
        """Keys in eviction order."""
        if self.by_arc and self.arc is not None:
            return iter(self.arc)
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def add(self, key: bytes, oldest: bool = False, nbytes: int = 0) -> bool:
        """Record ``key`` of ``nbytes`` as most recently used (``oldest``: least); True if it was not
        here (recorded again, a copy rewritten, it is refreshed, not used again)."""
        new = key not in self._order
        self._order[key] = None
        self._order.move_to_end(key, last=not oldest)
        if not new:
            self._touch_owned(key)
            if self.arc is not None:
                self.arc.refresh(key)
        elif self.arc is not None:
            self.arc.add(key, nbytes, oldest)
        return new

    def touch(self, key: bytes) -> None:
        """Used now, if recorded: most recently used, and in ARC's order used again."""
        if key in self._order:
            self._order.move_to_end(key)
            self._touch_owned(key)
            if self.arc is not None:
                self.arc.use(key)

    def refresh(self, key: bytes) -> None:
        """An ancestor of a block used now, if recorded: most recently used; in ARC's order moved to
        the recent end of its own segment, not used again (prefix-lru's walk, docs/policy.md)."""
        if key in self._order:
            self._order.move_to_end(key)
            self._touch_owned(key)
            if self.arc is not None:
                self.arc.refresh(key)

    def remove(self, key: bytes) -> bool:
        """Forget ``key`` (and its owner); True if it was here."""
        if key not in self._order:
            return False
        del self._order[key]
        self._disown(key)
        if self.arc is not None:
            self.arc.remove(key)
        return True

    def set_owner(self, key: bytes, owner: str, nbytes: int) -> None:
        """``owner`` holds the recorded ``key`` of ``nbytes`` now (a put by another owner takes it over)."""
        self._disown(key)
        self._owner[key] = owner
        self._owned.setdefault(owner, OrderedDict())[key] = nbytes
        self._owned_bytes[owner] = self._owned_bytes.get(owner, 0) + nbytes

    def owner_of(self, key: bytes) -> str:
        return self._owner.get(key, "")

    def owned_bytes(self, owner: str) -> int:
        return self._owned_bytes.get(owner, 0)

    def owned(self, owner: str) -> Iterator[bytes]:
        """``owner``'s keys, least recently used first (do not change the LRU while iterating)."""
        return iter(self._owned.get(owner, ()))

    def _touch_owned(self, key: bytes) -> None:
        owner = self._owner.get(key)
        if owner is not None:
            self._owned[owner].move_to_end(key)

    def _disown(self, key: bytes) -> None:
        owner = self._owner.pop(key, None)
        if owner is None:
            return
        nbytes = self._owned[owner].pop(key)
        self._owned_bytes[owner] -= nbytes
        if not self._owned[owner]:
            del self._owned[owner], self._owned_bytes[owner]

    def check_integrity(self) -> None:
        for owner, keys in self._owned.items():
            if any(self._owner.get(k) != owner or k not in self._order for k in keys):
                raise RuntimeError(f"owner {owner!r} is recorded for keys the LRU lacks or gives another owner")
            if sum(keys.values()) != self._owned_bytes[owner]:
                raise RuntimeError(f"owner {owner!r}: kept byte count {self._owned_bytes[owner]} "
                                   f"differs from its blocks' {sum(keys.values())}")
        if len(self._owner) != sum(map(len, self._owned.values())):
            raise RuntimeError("owners of keys and keys of owners disagree")
        if self.arc is not None:
            self.arc.check_integrity(set(self._order))


def held_parents_first(tier: Tier) -> list[bytes]:
    """The keys a tier holds (found at start), each after the parent its header names where the
    tier holds that too (`kvstore.keys.parents_first`), so KV events announce them in that order."""
    parent_of = {}
    for key in tier.keys():
        try:
            parent_of[key] = tier.header(key).parent
        except (KeyError, ValueError):  # gone, or unreadable: its reads will say so
            parent_of[key] = b""
    return parents_first(parent_of)


class Residency:
    """The LRU of every tier (level 0 = top), mirrored into the key index and the event stream."""

    def __init__(self, tiers: list[Tier], io: TierIO, key_index: KeyIndexWriter | None = None,
                 events: EventPublisher | None = None, eviction: str = EVICTION_POLICIES[0]) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        self.tiers = tiers
        self._io = io
        self._index, self._events = key_index, events
        adaptive = eviction == "adaptive"
        #: per tier, the duel that picks its order (adaptive, bounded tiers a daemon alone fills)
        self._duels: list[EvictionDuel | None] = []
        reach = 0
        for tier in tiers:
            reach += tier.capacity_bytes
            bounded = adaptive and tier.capacity_bytes > 0 and not tier.shared
            self._duels.append(EvictionDuel(reach) if bounded else None)
        self._lru = [TierLRU(ArcOrder(tier.capacity_bytes) if duel else None) for tier, duel in zip(tiers, self._duels)]
        self._chains = eviction in ("prefix-lru", "adaptive")
        self._adaptive = any(self._duels)
        #: key -> the key before it in its chain, while some tier holds it (prefix-lru only)
        self._parent: dict[bytes, bytes] = {}
        #: keys a reported local Lookup counted as used, until their Get or Put (adaptive only; `note_lookup`)
        self._looked_up: OrderedDict[bytes, None] = OrderedDict()
        #: keys read since they were stored (lower-tier admission ``reused``), while some tier holds them
        self._reused: set[bytes] = set()
        for level, tier in enumerate(tiers):
            for key in held_parents_first(tier):
                self._added(level, key, oldest=False)

    def __getitem__(self, level: int) -> TierLRU:
        return self._lru[level]

    @property
    def blocks(self) -> int:
        """Blocks recorded, all tiers together (a block in two tiers counts twice)."""
        return sum(map(len, self._lru))

    def locate(self, key: bytes) -> int | None:
        """Index of the highest tier holding ``key``."""
        for level, tier in enumerate(self.tiers):
            if key in tier:
                return level
        return None

    def header(self, key: bytes) -> BlockHeader | None:
        """The header of ``key`` in the highest tier holding it; None: no tier does."""
        level = self.locate(key)
        return None if level is None else self.tiers[level].header(key)

    # -- changes ------------------------------------------------------------------------------

    async def put(self, level: int, header: BlockHeader, payload: memoryview, owner: str | None = None) -> None:
        """Write a block into tier ``level`` and record it as most recently used, charged to
        ``owner`` (None: whoever owns the key in another tier). Raises what the tier's ``put``
        raises (TierFullError, TierError), recording nothing then."""
        tier = self.tiers[level]
        await self._io.run(tier, tier.put, header, payload)
        self.record(level, header.key, owner)

    async def put_checksummed(self, level: int, header: BlockHeader, payload: memoryview,
                              owner: str | None = None) -> BlockHeader:
        """:meth:`put` with the checksum computed as the tier stores the payload; returns the header stored."""
        tier = self.tiers[level]
        header = await self._io.run(tier, tier.put_checksummed, header, payload)
        self.record(level, header.key, owner)
        return header

    def record(self, level: int, key: bytes, owner: str | None = None) -> None:
        """Tier ``level`` holds ``key`` now (most recently used, then its ancestors there): a copy
        written outside the lock. Its bytes there are charged to ``owner`` (None: the key's owner
        in another tier, if any)."""
        if owner is None:
            owner = self.owner(key)
        self._added(level, key, oldest=False)
        if owner:
            self._lru[level].set_owner(key, owner, self.tiers[level].header(key).block_len)
        self._touch_ancestors(level, key)

    def link(self, key: bytes, parent: bytes, level: int, budget: WalkBudget) -> None:
        """``parent`` is the key before ``key`` in its chain (a Put's hint, kept while a tier holds
        ``key``): ``key`` was just stored in tier ``level``, so its ancestors there are used now,
        within what ``budget`` (the whole call's) has left."""
        if not self._chains or not parent or parent == key or not any(key in lru for lru in self._lru):
            return
        self._parent[key] = parent
        budget.left -= len(self._touch_ancestors(level, key, budget.left))

    def note_lookup(self, key: bytes, nbytes: int) -> None:
        """A client's local Lookup found ``key`` (its report; eviction ``adaptive``, nothing
        otherwise): used again in ARC's order of each tier holding it (its LRU order, as under a
        Lookup RPC, unchanged), and a use for the duels as `note_use`, whose next call for the key,
        a Get's hit or a Put, is then not counted again (the connector reads what it looked up: one
        request, one use) unless LOOKED_UP_KEYS later lookups came first."""
        if not self._adaptive:
            return
        for lru in self._lru:
            if lru.arc is not None and key in lru:
                lru.arc.use(key)
        self._looked_up[key] = None
        self._looked_up.move_to_end(key)
        while len(self._looked_up) > LOOKED_UP_KEYS:
            self._looked_up.popitem(last=False)
        self._use(key, nbytes)

    def note_looked_up(self, keys: list[bytes]) -> int:
        """`note_lookup` of each of ``keys`` a tier holds (its copy's size from the highest such
        tier); how many were held."""
        used = 0
        for key in keys:
            header = self.header(key)
            if header is not None:
                self.note_lookup(key, header.block_len)
                used += 1
        return used

    def note_hit(self, level: int, key: bytes) -> None:
        """A Get found ``key`` in tier ``level``: `note_use` of that copy, if the tier still holds
        it (a read in a worker thread may end after an eviction took the block)."""
        tier = self.tiers[level]
        if key in tier:
            self.note_use(key, tier.header(key).block_len)

    def note_use(self, key: bytes, nbytes: int) -> None:
        """A Get hit ``key`` or a Put stored it (``nbytes`` a copy): a use for the duels, each of
        which sets its tier's order (eviction ``adaptive``; nothing otherwise), unless a reported
        local Lookup counted it already (`note_lookup`)."""
        if not self._adaptive or self._looked_up.pop(key, 0) is None:
            return
        self._use(key, nbytes)

    def _use(self, key: bytes, nbytes: int) -> None:
        parent = self._parent.get(key)
        for lru, duel in zip(self._lru, self._duels):
            if duel is not None:
                duel.use(key, nbytes, parent)
                lru.by_arc = duel.arc

    def mark_reused(self, key: bytes) -> None:
        self._reused.add(key)

    def reused(self, key: bytes) -> bool:
        """Was ``key`` read since it was stored?"""
        return key in self._reused

    def owner(self, key: bytes) -> str:
        """The tenant ``key``'s bytes are charged to ("": none known, e.g. found on disk at start)."""
        for lru in self._lru:
            owner = lru.owner_of(key)
            if owner:
                return owner
        return ""

    def claim(self, key: bytes, owner: str) -> None:
        """``owner`` named ``key`` (only its tenant can: stored keys are derived from the tenant's
        name): charge its copies that nobody is charged for yet (blocks found at start)."""
        if not owner:
            return
        for level, lru in enumerate(self._lru):
            if key in lru and not lru.owner_of(key):
                lru.set_owner(key, owner, self.tiers[level].header(key).block_len)

    def touch(self, level: int, key: bytes) -> None:
        self.touch_chain(level, [key])

    def touch_chain(self, level: int, keys: list[bytes]) -> None:
        """``keys`` (of one read, in request order) were used, in that order; under ``prefix-lru``
        then each one's ancestors in the tier, last key first, so that every block ends more recent
        than the blocks after it in its chain (one walk per chain: a Get names a prompt's blocks
        first to last)."""
        lru = self._lru[level]
        for key in keys:
            lru.touch(key)
        if not self._chains:
            return
        walked: set[bytes] = set()
        for key in reversed(keys):
            if key not in walked:
                walked.update(self._touch_ancestors(level, key))

    def _touch_ancestors(self, level: int, key: bytes, most: int = MAX_WALK) -> list[bytes]:
        """Use ``key``'s ancestors in tier ``level``, nearest first (at most ``most``, and never
        more than `MAX_WALK`); returns them."""
        lru, parent, touched = self._lru[level], self._parent.get(key), []
        most = min(most, MAX_WALK)
        while parent is not None and parent in lru and len(touched) < most:
            lru.refresh(parent)
            touched.append(parent)
            parent = self._parent.get(parent)
        return touched

    async def delete(self, level: int, key: bytes) -> None:
        """Remove ``key`` from tier ``level`` and forget it there."""
        tier = self.tiers[level]
        await self._io.run(tier, tier.delete, key)
        self.forget(level, key)

    def forget(self, level: int, key: bytes) -> None:
        """Tier ``level`` no longer holds ``key`` (deleted, or gone underneath: another host)."""
        if self._lru[level].remove(key):
            self._removed(level, key)
            if not any(key in lru for lru in self._lru):
                self._parent.pop(key, None)
                self._reused.discard(key)

    async def clear(self, level: int) -> int:
        """Delete every recorded block of tier ``level``; returns how many."""
        tier, lru = self.tiers[level], self._lru[level]
        keys = list(lru)
        for key in keys:
            await self._io.run(tier, tier.delete, key)
        for key in keys:
            self.forget(level, key)
        if lru.arc is not None:
            lru.arc.forget_ghosts()
        return len(keys)

    def adopt_shared(self) -> list[tuple[Tier, bytes]]:
        """Take in the keys shared tiers indexed on their own (listing, discovery), as least
        recently used: this daemon has not used them yet. Returns (tier, key) of each adopted."""
        adopted = []
        for level, tier in enumerate(self.tiers):
            if not tier.shared:
                continue
            for key in tier.take_new_keys():
                if key not in self._lru[level] and key in tier:
                    self._added(level, key, oldest=True)
                    adopted.append((tier, key))
        return adopted

    def _added(self, level: int, key: bytes, oldest: bool) -> None:
        tier = self.tiers[level]
        nbytes = tier.header(key).block_len if self._duels[level] is not None and key in tier else 0
        if not self._lru[level].add(key, oldest, nbytes):
            return
        if self._index is not None:
            self._index.add(key, level)
        if self._events is not None:
            tier = self.tiers[level]
            self._events.stored(key, level, tier.header(key) if key in tier else None)

    def _removed(self, level: int, key: bytes) -> None:
        if self._index is not None:
            self._index.remove(key, level)
        if self._events is not None:
            self._events.removed(key, level)

    # -- checks -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Each LRU equals what its tier holds, and the key index says the same."""
        for level, tier in enumerate(self.tiers):
            lru = self._lru[level]
            if set(lru) != set(tier.keys()):
                raise RuntimeError(f"{tier.name}: LRU index ({len(lru)} keys) does not match "
                                   f"the tier ({len(tier)} keys)")
            lru.check_integrity()
        if self._index is not None:
            expected: dict[bytes, int] = {}
            for level, lru in enumerate(self._lru):
                for key in lru:
                    expected[key] = expected.get(key, 0) | (1 << level)
            self._index.check_integrity(expected)
