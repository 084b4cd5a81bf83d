"""Block keys: namespaces, prefix keys and position-independent chunk keys.

Keys are content addresses. They are computed in the engine's process from token ids; the daemon
only ever sees the 16-byte keys. Everything here is deterministic across processes and hosts:
blake2b over explicit little-endian bytes, never Python's ``hash()`` or a random seed.

Chunking (chunk_tokens = 4 in this picture; the default is 256)::

    tokens   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 t10 t11 | t12 t13
             '-chunk 0--' '-chunk 1--' '---chunk 2---'  '-tail-'
    prefix   k0 = H(ns, ROOT, chunk 0)
    keys     k1 = H(ns, k0,   chunk 1)
             k2 = H(ns, k1,   chunk 2)         the tail (2 tokens) has no key: it is not stored

A prefix key names a chunk *and everything before it*, so a hit on k2 implies the same KV as a
full prefill of t0..t11. A chunk key (for CacheBlend) names the chunk's tokens alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Hashable, Mapping, Sequence, TypeVar

import numpy as np

KEY_BYTES = 16
_ROOT = b"\x00" * KEY_BYTES
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")  # KVLayout.dtype names; torch dtypes: kvstore/dtypes.py


@dataclass(frozen=True)
class KVLayout:
    """Shape of one chunk's KV: ``[num_layers, 2, num_kv_heads, tokens, head_dim]`` in ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16" | "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value < 65536:
                raise ValueError(f"KVLayout.{name} must be an int in 1..65535, got {value!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def block_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)

    def block_bytes(self, tokens: int) -> int:
        """Raw (uncompressed) payload size of a block of ``tokens`` tokens."""
        return self.num_layers * 2 * self.num_kv_heads * tokens * self.head_dim * self.itemsize


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two KV caches incompatible.

    Two models, two dtypes, two RoPE settings or two tenants never share a key: all of them are
    hashed into :attr:`id`, which seeds every key of this namespace.
    """

    model_id: str
    layout: KVLayout
    rope: tuple[tuple[str, str], ...] = ()  # sorted (name, value) pairs, e.g. (("theta", "100000"),)
    tenant: str = ""
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("Namespace.model_id must be a non-empty string (e.g. 'SmolLM2-135M-Instruct')")
        if not 1 <= self.chunk_tokens <= 65536:
            raise ValueError(f"Namespace.chunk_tokens must be in 1..65536, got {self.chunk_tokens}")

    @staticmethod
    def rope_params(**params: object) -> tuple[tuple[str, str], ...]:
        """Canonical form of RoPE parameters for :attr:`rope` (values JSON-encoded, keys sorted)."""
        return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in params.items()))

    @cached_property
    def id(self) -> bytes:
        canonical = json.dumps(
            {
                "v": 1,
                "model": self.model_id,
                "layers": self.layout.num_layers,
                "kv_heads": self.layout.num_kv_heads,
                "head_dim": self.layout.head_dim,
                "dtype": self.layout.dtype,
                "rope": [list(p) for p in self.rope],
                "tenant": self.tenant,
                "chunk_tokens": self.chunk_tokens,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        return hashlib.blake2b(canonical, digest_size=KEY_BYTES, person=b"kvstore-ns").digest()


def _tokens_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    array = np.asarray(tokens, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ids, got shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must fit in int32 (0 .. 2**31-1)")
    return array.astype("<i4").tobytes()


def prefix_key(namespace: Namespace, parent: bytes | None, chunk: Sequence[int] | np.ndarray) -> bytes:
    """Key of ``chunk`` given the key of the chunk before it (``None`` for the first chunk)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvstore-prefix")
    h.update(namespace.id)
    h.update(parent if parent is not None else _ROOT)
    h.update(_tokens_bytes(chunk))
    return h.digest()


def prefix_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
    """Chained keys of every *full* chunk of ``tokens`` (a trailing partial chunk gets none)."""
    array = np.asarray(tokens, dtype=np.int64)
    n = namespace.chunk_tokens
    keys: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(array) - n + 1, n):
        parent = prefix_key(namespace, parent, array[start : start + n])
        keys.append(parent)
    return keys


def tail_key(namespace: Namespace, parent: bytes | None, tail: Sequence[int] | np.ndarray) -> bytes:
    """Key of a *partial* chunk (1 .. chunk_tokens-1 tokens) after the chunk keyed ``parent``.

    An engine whose cache works in pages smaller than a chunk stores the tokens after a prompt's last
    full chunk, cut down to a whole number of its pages, as one short block under this key, so a
    repeat of the prompt hits up to its last page boundary instead of its last chunk boundary. The
    key is in its own hash domain: no full chunk's key ever equals a tail's.
    """
    count = len(tail)
    if not 0 < count < namespace.chunk_tokens:
        raise ValueError(f"a tail holds 1..{namespace.chunk_tokens - 1} tokens, got {count}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvstore-tail")
    h.update(namespace.id)
    h.update(parent if parent is not None else _ROOT)
    h.update(_tokens_bytes(tail))
    return h.digest()


def paged_prefix_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray,
                      page_tokens: int) -> tuple[list[bytes], int]:
    """:func:`prefix_keys` of ``tokens``, then (if any) the :func:`tail_key` of the tokens after the
    last full chunk up to the last multiple of ``page_tokens``; and that tail's length (0: no tail).

    Full chunks are keyed as for every engine, so they stay shared; a tail is shared by engines with
    the same page size. ``page_tokens`` = 1 gives a tail of every remaining token.
    """
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be positive, got {page_tokens}")
    keys = prefix_keys(namespace, tokens)
    start = len(keys) * namespace.chunk_tokens
    tail = len(tokens) // page_tokens * page_tokens - start  # up to the last page boundary (< one chunk)
    if tail <= 0:
        return keys, 0
    array = np.asarray(tokens, dtype=np.int64)
    keys.append(tail_key(namespace, keys[-1] if keys else None, array[start : start + tail]))
    return keys, tail


def chunk_key(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> bytes:
    """Position-independent key of a chunk (CacheBlend): the tokens alone, not what precedes them."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvstore-chunk")
    h.update(namespace.id)
    h.update(_tokens_bytes(tokens))
    return h.digest()


@dataclass(frozen=True)
class LookupResult:
    """A Lookup's answer, the daemon's and the client's alike."""

    hits: int               # keys[0:hits] are stored
    tiers: tuple[str, ...]  # highest tier of each hit


@dataclass(frozen=True)
class ChunkSpan:
    """Token range ``[start, end)`` of chunk ``index`` in a prompt."""

    index: int
    start: int
    end: int
    key: bytes = field(repr=False)


def chunk_spans(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[ChunkSpan]:
    """Prefix keys with the token range each one covers."""
    n = namespace.chunk_tokens
    return [ChunkSpan(i, i * n, (i + 1) * n, k) for i, k in enumerate(prefix_keys(namespace, tokens))]


_Node = TypeVar("_Node", bound=Hashable)


def parents_first(parent_of: Mapping[_Node, _Node | None]) -> list[_Node]:
    """The keys of ``parent_of`` (key -> the key before it in its chain, or None/b"") in its order,
    except that each comes after its parent where ``parent_of`` holds that too: routers drop a
    block whose parent they have not seen, so announcements of held blocks go in this order."""
    ordered: list[_Node] = []
    done: set[_Node] = set()
    for key in parent_of:
        chain = []
        while key in parent_of and key not in done:  # up to the first ancestor already out
            done.add(key)
            chain.append(key)
            key = parent_of[key]
        ordered.extend(reversed(chain))
    return ordered
