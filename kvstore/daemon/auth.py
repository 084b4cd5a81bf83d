"""Tenants: who is calling, which blocks they may see, and how many bytes they may hold.

Isolation is by key derivation, not by ownership tables. The daemon stores a tenant's block under

    tenant_key = blake2b-256(person="kvs-tenant-key", key=server secret, data=whole tenant name)
    stored_key = blake2b-128(person="kvstore-tenant", key=tenant_key, data=client key)

and its namespace ids the same way (so namespaces, and the layout each one is bound to, are per
tenant), while the empty tenant (a daemon without a tenants file) uses the client's key itself.
A client of tenant A can only ever name A's stored keys, so it cannot look up, read, delete or pin
B's blocks, even when it knows B's client keys (which are already salted by B's namespace). The
server secret (``tenant_secret_file``: generated, 32 random bytes, mode 0600, on first start) means
nobody who lacks it can compute a tenant's stored keys from its name and model: not from file
names in the disk folder, nor from object names in a shared bucket. Because the mapping is
deterministic, isolation survives restarts and holds across hosts that share the bucket and the
secret file.

Tenants come from a TOML file (``tenants_file``)::

    [[tenant]]
    name = "team-a"
    token = "long random secret"
    quota = "4GiB"        # bytes this tenant may hold in the top tier (optional)

With a tenants file every call must carry ``authorization: Bearer TOKEN`` of a known tenant; with
only ``auth_token`` set, that token names the empty tenant. The operator's ``admin_token`` (or
``admin_token_file``) is no tenant: a call carrying it may Clear and read the daemon-wide Stats,
which no tenant may, and every other call with it is PERMISSION_DENIED (it names no blocks of its
own; the arena socket does not know it). Tokens are compared in constant time
and have at least ``MIN_TOKEN_CHARS`` (16) characters. A tenants file others may read is used,
with a warning at start (a Kubernetes secret is mounted 0644 unless told otherwise).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass, field
from typing import Iterable

from kvstore.host import load_secret, readable_by_others
from kvstore.keys import KEY_BYTES
from kvstore.user_input import parse_size, read_toml


log = logging.getLogger("kvstore.daemon.auth")

#: Fewest characters of a bearer token (a tenant's, or the single auth_token).
MIN_TOKEN_CHARS = 16
#: Keys of a ``[[tenant]]`` table.
TENANT_KEYS = ("name", "token", "quota")


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str = field(default="", repr=False)
    quota_bytes: int = 0  # 0: no quota
    #: blake2b of the whole name under the server secret (see the module doc); "" for the empty tenant.
    key: bytes = field(default=b"", repr=False)
    #: The operator (``admin_token``): may Clear and read the daemon-wide Stats; no tenant, so it
    #: stores, reads and holds no blocks (the server refuses those calls).
    operator: bool = False

    def stored_key(self, key: bytes) -> bytes:
        """The key this tenant's block or namespace ``key`` is stored under."""
        if not self.name:
            return key
        return hashlib.blake2b(key, digest_size=KEY_BYTES, key=self.key, person=b"kvstore-tenant").digest()


def tenant_key(secret: bytes, name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=32, key=secret[:64], person=b"kvs-tenant-key").digest()


ANONYMOUS = Tenant("")


def token_too_short(token: str) -> str | None:
    """Why ``token`` may not be a bearer token, or None (the message never shows the token)."""
    if len(token) >= MIN_TOKEN_CHARS:
        return None
    return (f"the token has {len(token)} characters; tokens need at least {MIN_TOKEN_CHARS} "
            f"(make one with: openssl rand -hex 16)")


def admin_token_clash(admin_token: str, tenants: Iterable[tuple[str, str, int]], where: str | os.PathLike) -> str | None:
    """Why ``admin_token`` cannot be the operator's beside the tenants (``read_tenants``) of the
    file ``where``: a tenant holding it would be the operator. None when it can (or is "")."""
    if not admin_token:
        return None
    for name, token, _ in tenants:
        if hmac.compare_digest(token.encode(), admin_token.encode()):
            return (f"tenants file {where}: tenant {name!r} has the admin token as its token; the admin token must "
                    f"be the operator's alone")
    return None


def read_tenants(path: str | os.PathLike) -> list[tuple[str, str, int]]:
    """(name, token, quota bytes) of each ``[[tenant]]`` in the tenants file ``path``. Raises
    ValueError naming the file, the tenant and the key: a missing or unknown key, a value of the
    wrong kind, a bad size, a short token, a name or token given twice."""
    where = f"tenants file {path}"
    table = read_toml(path, "tenants file")
    if set(table) - {"tenant"}:
        raise ValueError(f"{where}: unknown keys {sorted(set(table) - {'tenant'})}; it holds [[tenant]] tables only")
    entries = table.get("tenant")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{where}: no [[tenant]] tables (each with name, token and optionally quota)")
    tenants: list[tuple[str, str, int]] = []
    for number, entry in enumerate(entries, 1):
        name = entry.get("name")
        at = f"{where}: tenant #{number}" + (f" ({name!r})" if isinstance(name, str) and name else "")
        unknown = sorted(set(entry) - set(TENANT_KEYS))
        if unknown:
            raise ValueError(f"{at}: unknown keys {unknown}; a tenant has name, token and optionally quota")
        for key in ("name", "token"):
            if key not in entry:
                raise ValueError(f"{at}: {key} is missing")
            if not isinstance(entry[key], str) or not entry[key]:
                raise ValueError(f"{at}: {key} must be a non-empty string, got {entry[key]!r}"
                                 if key == "name" else f"{at}: token must be a non-empty string")
        short = token_too_short(entry["token"])
        if short:
            raise ValueError(f"{at}: token: {short}")
        quota = entry.get("quota", 0)
        try:
            if isinstance(quota, bool) or not isinstance(quota, (int, str)):
                raise ValueError(f"not a size: {quota!r} (use e.g. 512MiB, 2GiB or a byte count)")
            quota = parse_size(quota)
            if quota < 0:
                raise ValueError(f"not a size: {quota!r} (use e.g. 512MiB, 2GiB, a byte count, or 0 for none)")
        except ValueError as exc:
            raise ValueError(f"{at}: quota: {exc}") from None
        for other, (other_name, other_token, _) in enumerate(tenants, 1):
            if other_name == name:
                raise ValueError(f"{where}: tenants #{other} and #{number} are both named {name!r}; names must be unique")
            if hmac.compare_digest(other_token.encode(), entry["token"].encode()):
                raise ValueError(f"{where}: tenants #{other} ({other_name!r}) and #{number} ({name!r}) have the same "
                                 f"token; each needs its own")
        tenants.append((name, entry["token"], quota))
    return tenants


class TenantDirectory:
    """Maps bearer tokens to tenants. ``required`` is False only for an open daemon. ``admin_token``
    (with tokens required): the operator's, resolved only where asked (:meth:`resolve`)."""

    def __init__(self, tenants: Iterable[Tenant], required: bool, admin_token: str = "") -> None:
        self.tenants = list(tenants)
        self.required = required
        #: The operator, apart from the tenants (arena shares and quotas count tenants only).
        self.operator = Tenant("", admin_token, operator=True) if admin_token and required else None
        if self.operator is not None and any(hmac.compare_digest(t.token.encode(), admin_token.encode())
                                             for t in self.tenants):
            raise ValueError("the admin token must differ from every tenant's token and from auth_token")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique: {names}")
        tokens = [t.token for t in self.tenants]
        if required and (not all(tokens) or len(set(tokens)) != len(tokens)):
            raise ValueError("every tenant needs its own non-empty token")

    @classmethod
    def from_config(cls, tenants_file: str, auth_token: str, secret_file: str = "",
                    admin_token: str = "") -> "TenantDirectory":
        """Tenants of a daemon. ``secret_file`` (needed with a tenants file): see :func:`load_secret`.
        ``admin_token``: the operator's (`kvstore.daemon.config.DaemonConfig.operator_token`)."""
        if tenants_file:
            if not secret_file:
                raise ValueError("a tenants_file needs a tenant_secret_file (created when missing)")
            entries = read_tenants(tenants_file)  # first: a bad file is named before the secret is made
            clash = admin_token_clash(admin_token, entries, tenants_file)
            if clash:
                raise ValueError(clash)
            secret = load_secret(secret_file)
            warning = readable_by_others(tenants_file)
            if warning:
                log.warning("tenants file %s", warning)
            return cls([Tenant(name, token, quota, tenant_key(secret, name)) for name, token, quota in entries],
                       required=True, admin_token=admin_token)
        if auth_token:
            short = token_too_short(auth_token)
            if short:
                raise ValueError(f"auth_token: {short}")
            return cls([Tenant("", auth_token)], required=True, admin_token=admin_token)
        return cls([ANONYMOUS], required=False)

    def resolve(self, metadata: Iterable[tuple[str, str | bytes]] | None, operator: bool = False) -> Tenant | None:
        """The caller's tenant, or None when a token is required and missing or unknown. The admin
        token resolves to the operator (``Tenant.operator``) only with ``operator``: elsewhere (the
        arena socket, any caller that does not ask) it is no token at all."""
        if not self.required:
            return ANONYMOUS
        sent = dict(metadata or ()).get("authorization", "")
        sent = sent.encode() if isinstance(sent, str) else sent
        found = None
        for tenant in self.tenants:  # compare against every token: no early exit to time
            if hmac.compare_digest(sent, f"Bearer {tenant.token}".encode()):
                found = tenant
        if self.operator is not None and hmac.compare_digest(sent, f"Bearer {self.operator.token}".encode()):
            found = self.operator if operator else None
        return found
