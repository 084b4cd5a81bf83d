"""Which layout each namespace's blocks have: the table a Put checks its block against, bounded.

A namespace id is caller input (for a named tenant, mapped into the tenant's own space by
``Tenant.stored_key``), so the table is bounded and charged to whoever fills it: at most ``limit``
namespaces in all, and at most a quarter of them (``per_owner``) a named tenant's; past either
bound the least recently put namespace is forgotten (the caller's own first, when it is over its
share). A Put refreshes its namespace.

What forgetting costs: nothing but the check. A forgotten namespace's next Put binds it again, to
that Put's layout, so a client that Puts a second layout under a namespace it has not used for
``limit`` other namespaces' Puts is not refused (its blocks carry their own layout in their header,
which every reader checks). A hostile tenant that Puts under a million namespaces only churns its
own quarter of the table, and memory stays at ``limit`` entries (about 300 bytes each).
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.block import BlockHeader
from kvstore.keys import KVLayout

#: Namespaces the daemon remembers by default (``max_namespaces``): 65,536 (about 20 MiB).
DEFAULT_LIMIT = 1 << 16


class NamespaceLayouts:
    """namespace -> layout, least recently put first, each entry charged to an owner (a tenant's
    name; "" for the daemon's anonymous tenant and blocks found in tiers at start)."""

    def __init__(self, limit: int = DEFAULT_LIMIT, named_share: float = 0.25) -> None:
        if limit < 1:
            raise ValueError(f"the namespace limit must be at least 1, got {limit}")
        self.limit = limit
        self.per_owner = max(1, int(limit * named_share))
        self._layouts: OrderedDict[bytes, tuple[KVLayout, str]] = OrderedDict()  # LRU first
        self._owned: dict[str, OrderedDict[bytes, None]] = {}  # owner -> its namespaces, LRU first
        #: Namespaces forgotten to stay within the bounds (for Stats and tests).
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._layouts)

    def owned(self, owner: str) -> int:
        return len(self._owned.get(owner, ()))

    def check(self, header: BlockHeader) -> None:
        """ValueError when ``header``'s layout contradicts the one its namespace is bound to."""
        known = self._layouts.get(header.namespace)
        if known is not None and known[0] != header.layout:
            raise ValueError(f"layout {header.layout} does not match namespace {header.namespace.hex()}, "
                             f"whose blocks have layout {known[0]}")

    def note(self, header: BlockHeader, owner: str = "") -> None:
        """Bind ``header``'s namespace to its layout (kept if bound already) and mark it used, charged
        to ``owner`` unless another owner holds it; forget the least recently used beyond the bounds."""
        namespace = header.namespace
        known = self._layouts.get(namespace)
        if known is not None:
            self._layouts.move_to_end(namespace)
            self._owned[known[1]].move_to_end(namespace)
            return
        self._layouts[namespace] = (header.layout, owner)
        mine = self._owned.setdefault(owner, OrderedDict())
        mine[namespace] = None
        if owner and len(mine) > self.per_owner:
            self._forget(next(iter(mine)))
        while len(self._layouts) > self.limit:
            self._forget(next(iter(self._layouts)))

    def _forget(self, namespace: bytes) -> None:
        _, owner = self._layouts.pop(namespace)
        mine = self._owned[owner]
        del mine[namespace]
        if not mine:
            del self._owned[owner]
        self.forgotten += 1

    def check_integrity(self) -> None:
        """Every entry charged to exactly one owner, within the bounds (ValueError if not)."""
        charged = sum(len(owned) for owned in self._owned.values())
        if charged != len(self._layouts) or len(self._layouts) > self.limit:
            raise ValueError(f"namespace table: {len(self._layouts)} entries, {charged} charged, limit {self.limit}")
        for owner, owned in self._owned.items():
            if not owned or (owner and len(owned) > self.per_owner):
                raise ValueError(f"namespace table: owner {owner!r} holds {len(owned)}, share {self.per_owner}")
            for namespace in owned:
                if self._layouts[namespace][1] != owner:
                    raise ValueError(f"namespace {namespace.hex()} charged to {owner!r}, owned by another")
