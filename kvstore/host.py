"""What every floor of kvstore knows about this host: where a daemon listens and keeps its files by
default, whether an address is loopback, whether others may read a file of secrets, and the server
secret the daemon derives tenants' keys, the S3 objects' MAC key and the tiers' at-rest keys from.

The daemon (``kvstore/daemon/``), its clients (``engine_adapter/``, the CLI) and the tiers import
these; this module imports nothing of kvstore's.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path

#: Bytes of a generated server secret; a given one must have at least this many.
SECRET_BYTES = 32


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstore"


def default_listen() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) if runtime else default_cache_dir()
    return f"unix:{folder / 'kvstore.sock'}"


def is_loopback_host(host: str) -> bool:
    """True when ``host`` is a loopback IP address (``127.0.0.1``, ``[::1]``), or a name every
    address of which is loopback: decided by the addresses, so ``localhost.example.com`` is not
    loopback unless it resolves there. ``*``, ``0.0.0.0`` and names that do not resolve are not."""
    import ipaddress
    import socket

    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, ValueError):
        return False
    return bool(found) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in found)


def readable_by_others(path: str | os.PathLike) -> str | None:
    """A warning when group or others may read ``path`` (a file of tokens), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if not mode & (stat.S_IRGRP | stat.S_IROTH):
        return None
    return f"{path}: group or others may read it (mode {stat.S_IMODE(mode):04o}), tokens included: chmod 600 it"


def refuse_non_socket(path: str | os.PathLike) -> None:
    """OSError when something other than a unix socket is at ``path`` (a stale socket may be
    replaced by whoever holds its lock; any other file someone put there is kept)."""
    try:
        found = os.lstat(path).st_mode
    except OSError:
        return
    if not stat.S_ISSOCK(found):
        raise OSError(f"{path} exists and is not a socket")


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


def s3_mac_key(secret_file: str | os.PathLike) -> bytes:
    """The key S3 objects' MACs are made under (tiers/s3_auth.py), from the server secret in
    ``secret_file`` ("": the default one, created when missing): every host sharing a bucket must
    share the file. Derived apart from tenants' keys (its own personalisation), so neither tells
    anything about the other."""
    secret = load_secret(secret_file or default_cache_dir() / "tenant-secret")
    return hashlib.blake2b(b"s3 object mac", digest_size=32, key=secret[:64], person=b"kvstore-s3-mac").digest()


#: The tiers whose blocks may be sealed at rest (tiers/at_rest.py), each with its own key.
AT_REST_TIERS = ("disk", "s3")


def at_rest_key(tier: str, secret_file: str | os.PathLike) -> bytes:
    """The 256-bit key blocks of ``tier`` ("disk" or "s3") are sealed under at rest, from the
    server secret in ``secret_file`` ("": the default one, created when missing): hosts sharing a
    bucket must share the file. One derivation per purpose (its own personalisation per tier,
    apart from the S3 MAC key and tenants' keys), so no key tells anything about another, and a
    disk file copied into the bucket does not open there."""
    if tier not in AT_REST_TIERS:
        raise ValueError(f"no at-rest key for tier {tier!r}; tiers sealed at rest: {AT_REST_TIERS}")
    secret = load_secret(secret_file or default_cache_dir() / "tenant-secret")
    return hashlib.blake2b(b"at-rest key " + tier.encode(), digest_size=32, key=secret[:64],
                           person=b"kvs-at-rest-" + tier.encode()).digest()
