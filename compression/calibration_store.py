"""Where calibrations live, and how a codec finds one by id.

A block encoded with the transform codec names its calibration by id (SHA-256 hex) in its codec
params; decoding calls `resolve(id)`, which looks in this order:

1. calibrations already loaded in this process (`register`);
2. the calibration directory: ``$KVSTORE_CALIBRATION_DIR``, default ``~/.cache/kvstore/calibrations``,
   one file ``<id>.kvcal`` each (written by ``kvstore calibrate``);
3. the sources added with `add_source`, e.g. `client_source(client)`, which Gets the calibration
   block from a kvstore daemon, so every tier (and another host sharing the S3 bucket) serves it.

A calibration is stored in the cache as raw float16 blocks of the namespace
`calibration_namespace()`, its bytes cut in parts of `PART_BYTES` (the last zero-padded to whole
256-byte "tokens", [1, 2, 1, tokens, 64] float16): part 0's key is the first KEY_BYTES (16) bytes of
its id, part i's the first 16 bytes of SHA-256 of "<id>:<i>" (`part_key`). A part fits any daemon's
inline Get with its reply's copies (kvstore/limits.py GRPC_GET_COPIES), where a calibration whole
(Llama-3-8B's: 128 MiB) would be refused. `fetch_calibration` reads the parts in order until one
is short or missing. The bytes are checked against the id on every load, so a wrong, damaged or
incomplete copy is never used.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Callable

from compression.calibration import Calibration

CALIBRATION_DIR_ENV = "KVSTORE_CALIBRATION_DIR"
SUFFIX = ".kvcal"
CALIBRATION_MODEL_ID = "kvstore-calibration"
_TOKEN_BYTES = 2 * 64 * 2  # one "token" of the [1, 2, 1, T, 64] float16 carrier block
MAX_FETCH_BYTES = 256 << 20  # largest calibration block a source Gets (inline: the daemon's max_message_bytes)
#: Bytes of one stored part of a calibration (whole "tokens"): with its inline reply's three copies,
#: 48 MiB of a daemon's inline budget (default 256 MiB).
PART_BYTES = 16 << 20

Source = Callable[[str], bytes | None]  # full id -> calibration bytes (possibly padded), or None

_lock = threading.Lock()
_loaded: dict[str, Calibration] = {}
_sources: list[Source] = []


def calibration_dir() -> Path:
    return Path(os.environ.get(CALIBRATION_DIR_ENV) or Path.home() / ".cache" / "kvstore" / "calibrations")


def register(calibration: Calibration) -> str:
    """Make a calibration resolvable in this process; returns its id."""
    with _lock:
        _loaded[calibration.id] = calibration
    return calibration.id


def add_source(source: Source) -> None:
    """Consult ``source(id)`` when an id is neither loaded nor in the calibration directory."""
    with _lock:
        if source not in _sources:
            _sources.append(source)


def remove_source(source: Source) -> None:
    with _lock:
        if source in _sources:
            _sources.remove(source)


def write_file(path: Path, data: bytes) -> None:
    """Write ``path`` in the calibration folder atomically (a reader sees all of it or none), its
    folders made 0700: a calibration is statistics of someone's KV."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save(calibration: Calibration, folder: Path | None = None) -> Path:
    """Write ``<id>.kvcal`` into the calibration directory (atomically); returns the path."""
    path = (folder or calibration_dir()) / f"{calibration.id}{SUFFIX}"
    if not path.exists():
        write_file(path, calibration.to_bytes)
    return path


def _checked(raw: bytes, calibration_id: str) -> Calibration:
    calibration = Calibration.from_bytes(raw)
    if calibration.id != calibration_id:
        raise ValueError(f"calibration bytes hash to {calibration.id[:16]}..., not the requested {calibration_id[:16]}...")
    return calibration


def load(calibration_id: str, folder: Path) -> Calibration:
    """``<folder>/<calibration_id>.kvcal``, checked against its id and registered in this process
    (OSError if missing, ValueError if its bytes are not that calibration)."""
    calibration = _checked((folder / f"{calibration_id}{SUFFIX}").read_bytes(), calibration_id)
    register(calibration)
    return calibration


def resolve(id_or_prefix: str) -> Calibration:
    """The calibration with this id (or unique id prefix of >= 8 hex digits); ValueError if none."""
    if not 8 <= len(id_or_prefix) <= 64 or not all(c in "0123456789abcdef" for c in id_or_prefix):
        # (never a glob pattern: a block's params name the id, and a client writes those)
        raise ValueError(f"calibration id {id_or_prefix[:80]!r} must be 8 to 64 lower-case hex digits")
    with _lock:
        matches = [c for i, c in _loaded.items() if i.startswith(id_or_prefix)]
        sources = list(_sources)
    if len(matches) == 1:
        return matches[0]
    folder = calibration_dir()
    files = sorted(folder.glob(f"{id_or_prefix}*{SUFFIX}")) if folder.is_dir() else []
    if len(matches) > 1 or len(files) > 1:
        raise ValueError(f"calibration id prefix {id_or_prefix!r} is ambiguous; give more digits")
    if files:
        return load(files[0].name[: -len(SUFFIX)], folder)
    if len(id_or_prefix) == 64:
        for source in sources:
            raw = source(id_or_prefix)
            if raw is not None:
                calibration = _checked(raw, id_or_prefix)
                register(calibration)
                return calibration
    raise ValueError(f"calibration {id_or_prefix!r} is not loaded, not in {folder} and no source has it; "
                     f"run `kvstore calibrate` (or copy its .kvcal file there), or add the daemon with "
                     f"compression.calibration_store.add_source(client_source(client))")


# -- the calibration as a block in the cache ----------------------------------------------------------


def calibration_namespace(tenant: str = ""):
    """The namespace calibration blocks are stored under (one for all models: ids are content hashes)."""
    from kvstore.keys import KVLayout, Namespace

    return Namespace(CALIBRATION_MODEL_ID, KVLayout(1, 1, 64, "float16"), tenant=tenant, chunk_tokens=65536)


def calibration_key(calibration_id: str) -> bytes:
    from kvstore.keys import KEY_BYTES

    return bytes.fromhex(calibration_id)[:KEY_BYTES]


def part_key(calibration_id: str, part: int) -> bytes:
    """The key of part ``part`` of a calibration's blocks (part 0: `calibration_key`)."""
    from kvstore.keys import KEY_BYTES

    if part == 0:
        return calibration_key(calibration_id)
    return hashlib.sha256(f"{calibration_id}:{part}".encode()).digest()[:KEY_BYTES]


def calibration_blocks(calibration: Calibration) -> list[tuple[bytes, int, bytes]]:
    """``(key, tokens, payload)`` of each part, in order, for `KVStoreClient.put` in `calibration_namespace()`."""
    raw = calibration.to_bytes
    blocks = []
    for part, start in enumerate(range(0, len(raw), PART_BYTES)):
        piece = raw[start : start + PART_BYTES]
        tokens = -(-len(piece) // _TOKEN_BYTES)
        blocks.append((part_key(calibration.id, part), tokens, piece + bytes(tokens * _TOKEN_BYTES - len(piece))))
    return blocks


def put_calibration(client: Any, calibration: Calibration, tenant: str = "", durable: bool = False) -> int:
    """Store a calibration through a `KVStoreClient` (every tier, S3 included); returns blocks stored."""
    # "exact": the daemon never re-encodes this block for a lossy lower tier (compression/transcode.py).
    # Part 0 last: a reader that finds it finds every part.
    return client.put(calibration_namespace(tenant), calibration_blocks(calibration)[::-1], durable=durable,
                      codec_params={"exact": True})


def fetch_calibration(client: Any, calibration_id: str) -> bytes | None:
    """A calibration's bytes (zero-padded) from its parts through a `KVStoreClient`, inline (a
    caller may hold arena space: kvstore_client.fetch), or None when part 0 is missing. Parts are
    read in order until one is shorter than `PART_BYTES` or missing; a part 0 that is longer (a
    calibration stored whole, before parts) is the calibration."""
    parts: list[bytes] = []
    while len(parts) * PART_BYTES < MAX_FETCH_BYTES:
        most = PART_BYTES if parts else MAX_FETCH_BYTES  # a later part is never longer than a part
        (raw,) = client.get([part_key(calibration_id, len(parts))], max_payload_bytes=most, inline=True)
        if raw is None:
            break
        parts.append(bytes(raw))
        if len(raw) != PART_BYTES:
            break
    return b"".join(parts) if parts else None


def client_source(client: Any) -> Source:
    """A source that Gets calibration blocks from a kvstore daemon through `KVStoreClient`."""

    def fetch(calibration_id: str) -> bytes | None:
        return fetch_calibration(client, calibration_id)

    return fetch
