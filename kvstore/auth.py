"""Tenants: who is calling, which blocks they may see, and how many bytes they may hold.

Isolation is by key derivation, not by ownership tables. The daemon stores a tenant's block under

    stored_key = blake2b-128(person="kvstore-tenant", key=tenant name, data=client key)

and the empty tenant (a daemon without a tenants file) under the client key itself. A client of
tenant A can only ever name A's stored keys, so it cannot look up, read, delete or pin B's blocks,
even when it knows B's client keys (which are already salted by B's namespace). Because the
mapping is deterministic, isolation survives restarts and holds across hosts sharing a bucket.

Tenants come from a TOML file (``tenants_file``)::

    [[tenant]]
    name = "team-a"
    token = "long random secret"
    quota = "4GiB"        # bytes this tenant may hold in the top tier (optional)

With a tenants file every call must carry ``authorization: Bearer TOKEN`` of a known tenant; with
only ``auth_token`` set, that token names the empty tenant. Tokens are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from dataclasses import dataclass, field
from typing import Iterable

from kvstore.config import parse_size
from kvstore.keys import KEY_BYTES


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str = field(default="", repr=False)
    quota_bytes: int = 0  # 0: no quota

    def stored_key(self, key: bytes) -> bytes:
        if not self.name:
            return key
        return hashlib.blake2b(key, digest_size=KEY_BYTES, key=self.name.encode()[:64],
                               person=b"kvstore-tenant").digest()


ANONYMOUS = Tenant("")


class TenantDirectory:
    """Maps bearer tokens to tenants. ``required`` is False only for an open daemon."""

    def __init__(self, tenants: Iterable[Tenant], required: bool) -> None:
        self.tenants = list(tenants)
        self.required = required
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique: {names}")
        tokens = [t.token for t in self.tenants]
        if required and (not all(tokens) or len(set(tokens)) != len(tokens)):
            raise ValueError("every tenant needs its own non-empty token")

    @classmethod
    def from_config(cls, tenants_file: str, auth_token: str) -> "TenantDirectory":
        if tenants_file:
            with open(tenants_file, "rb") as f:
                table = tomllib.load(f)
            entries = table.get("tenant", [])
            if not entries:
                raise ValueError(f"{tenants_file}: no [[tenant]] entries")
            tenants = []
            for i, entry in enumerate(entries):
                unknown = set(entry) - {"name", "token", "quota"}
                if unknown or not entry.get("name") or not entry.get("token"):
                    raise ValueError(f"{tenants_file}: tenant #{i + 1} needs name and token "
                                     f"(and optionally quota); unknown keys: {sorted(unknown)}")
                tenants.append(Tenant(str(entry["name"]), str(entry["token"]),
                                      parse_size(entry.get("quota", 0))))
            return cls(tenants, required=True)
        if auth_token:
            return cls([Tenant("", auth_token)], required=True)
        return cls([ANONYMOUS], required=False)

    def resolve(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant | None:
        """The caller's tenant, or None when a token is required and missing or unknown."""
        if not self.required:
            return ANONYMOUS
        sent = dict(metadata or ()).get("authorization", "")
        sent = sent.encode() if isinstance(sent, str) else sent
        found = None
        for tenant in self.tenants:  # compare against every token: no early exit to time
            if hmac.compare_digest(sent, f"Bearer {tenant.token}".encode()):
                found = tenant
        return found
