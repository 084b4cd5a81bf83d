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
only ``auth_token`` set, that token names the empty tenant. Tokens are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from kvstore.config import parse_size
from kvstore.keys import KEY_BYTES


#: Bytes of a generated server secret; a given one must have at least this many.
SECRET_BYTES = 32


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str = field(default="", repr=False)
    quota_bytes: int = 0  # 0: no quota
    #: blake2b of the whole name under the server secret (see the module doc); "" for the empty tenant.
    key: bytes = field(default=b"", repr=False)

    def stored_key(self, key: bytes) -> bytes:
        """The key this tenant's block or namespace ``key`` is stored under."""
        if not self.name:
            return key
        return hashlib.blake2b(key, digest_size=KEY_BYTES, key=self.key, person=b"kvstore-tenant").digest()


def tenant_key(secret: bytes, name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=32, key=secret[:64], person=b"kvs-tenant-key").digest()


def load_secret(path: str | os.PathLike) -> bytes:
    """The server secret in ``path``, created (32 random bytes, mode 0600) when missing. Raises
    ValueError naming the file when it is too short or others may read it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        secret = f.read(4096)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path}: the tenant secret may be read by others (mode {stat.S_IMODE(mode):04o}); "
                         f"chmod 600 it")
    if len(secret) < SECRET_BYTES:
        raise ValueError(f"{path}: the tenant secret has {len(secret)} bytes; it needs at least {SECRET_BYTES}")
    return secret


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
    def from_config(cls, tenants_file: str, auth_token: str, secret_file: str = "") -> "TenantDirectory":
        """Tenants of a daemon. ``secret_file`` (needed with a tenants file): see :func:`load_secret`."""
        if tenants_file:
            if not secret_file:
                raise ValueError("a tenants_file needs a tenant_secret_file (created when missing)")
            secret = load_secret(secret_file)
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
                name = str(entry["name"])
                tenants.append(Tenant(name, str(entry["token"]), parse_size(entry.get("quota", 0)),
                                      tenant_key(secret, name)))
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
