"""The scheduler's block access trace: one JSON line per request lookup, the input of
``bench/cache_policy.py``.

    {"t": 1733450000.12, "request": "cmpl-..", "local_tokens": 512,
     "blocks": [{"key": "ab..", "parent": null, "tokens": 256, "bytes": 5898240}, ...],
     "hits": 3, "tiers": ["cpu", "cpu", "disk"], "lookup_s": 0.00021}

``blocks`` is the request's whole chain (full chunks, then the tail block), each with the key before
it; ``hits`` the run of them the daemon held, ``tiers`` where; ``local_tokens`` what vLLM's own
prefix cache had; ``lookup_s`` what the connector's Lookup (and lease) cost the scheduler for this
request. Keys are the namespace's prefix keys, which name no tokens, so a trace can be shared.

Opt-in (``kv_connector_extra_config["trace_file"]``): a line is written per lookup, line-buffered,
so a killed server loses at most the line being written. The file is this user's alone (0600):
request ids and prefix keys say who asked what and when. A symlink there, or a file another user
owns, is refused (OSError): it could be someone else's to read.
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Sequence

from kvstore.keys import KVLayout


class AccessTrace:
    def __init__(self, path: str, layout: KVLayout, chunk_tokens: int) -> None:
        self._file = open(open_private_append(path), "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._layout = layout
        self._chunk_tokens = chunk_tokens

    def record(self, request_id: str, keys: Sequence[bytes], tail_tokens: int, local_tokens: int,
               hits: int, tiers: Sequence[str], lookup_s: float) -> None:
        """One request's lookup: ``keys`` its chain, the last one ``tail_tokens`` long if nonzero."""
        blocks, parent = [], None
        for i, key in enumerate(keys):
            tokens = tail_tokens if tail_tokens and i == len(keys) - 1 else self._chunk_tokens
            blocks.append({"key": key.hex(), "parent": parent, "tokens": tokens,
                           "bytes": self._layout.block_bytes(tokens)})
            parent = key.hex()
        line = {"t": round(time.time(), 6), "request": request_id, "local_tokens": local_tokens,
                "blocks": blocks, "hits": hits, "tiers": list(tiers), "lookup_s": round(lookup_s, 7)}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def open_private_append(path: str) -> int:
    """A descriptor appending to ``path``, created 0600; OSError for a symlink there (never
    followed) or a file that is not a regular file of this user's. One this user made readable by
    others (before the trace was private) is made 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            raise OSError(f"trace_file {path}: not a regular file of this user's; refusing to write the trace there")
        if stat.S_IMODE(found.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd
