"""The block format: one chunk's KV for all layers, with a self-describing header.

A stored block is ``header || payload``, contiguous, identical in every tier (CPU arena, disk file,
S3 object), so any reader can validate and decode any block without outside state.

Payload (codec "raw"): the tensor ``[num_layers, 2, num_kv_heads, tokens, head_dim]`` in the
namespace's dtype, C-contiguous, little-endian; index 0 of dim 1 is K (after RoPE, at the chunk's
absolute positions), index 1 is V. Other codecs describe their payload in ``codec_params``.

Header layout (little-endian, 112 fixed bytes, then ``params_len`` bytes of JSON, then zero
padding to a multiple of 64 so the payload is aligned)::

    off  size  field
      0     4  magic  b"KVB1"
      4     2  format version (1)
      6     2  header_len (fixed + params + padding)
      8    16  key
     24    16  namespace id
     40     2  num_layers        42  2  num_kv_heads     44  2  head_dim
     46     1  dtype code        47  1  flags (bit 0: a parent follows the params, bit 1: token ids)
     48     4  tokens
     52    32  codec spec (ASCII, NUL padded), e.g. "raw" or "int4-g32+shuffle+zstd"
     84     4  params_len
     88     8  payload_len
     96     8  payload checksum  (xxh3-64)
    104     8  header checksum   (xxh3-64 of bytes 0..104, the params JSON and the chain)

The chain, after the params (a daemon that publishes KV events keeps it, docs/operations.md): with
flag bit 0, the key before this block in its prefix chain (16 bytes); with bit 1, the block's token
ids, ``tokens`` little-endian uint32s. Routers match prompts by their tokens, so
KV events carry both; a block keeps them so that every tier, and a restart, can say them again.

A block whose header or payload checksum fails is corrupt: readers raise
:class:`CorruptBlockError`, and the store turns that into a counted miss and deletes the block.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import xxhash

from kvstore.keys import KEY_BYTES, KVLayout

MAGIC = b"KVB1"
FORMAT_VERSION = 1
ALIGN = 64
_FIXED = struct.Struct("<4sHH16s16sHHHBBI32sIQQ")
_HEADER_CHECKSUM = struct.Struct("<Q")
FIXED_BYTES = _FIXED.size + _HEADER_CHECKSUM.size  # 112
MAX_PARAMS_BYTES = 4096
CODEC_BYTES = 32
#: Most token ids a header keeps (a longer block keeps its parent alone): 16 KiB.
MAX_CHAIN_TOKENS = 4096
FLAG_PARENT, FLAG_TOKENS = 1, 2

DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3}
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


class CorruptBlockError(ValueError):
    """A block failed validation: bad magic, version, checksum or inconsistent lengths."""


#: Bytes :func:`copy_checksummed` hashes and then copies at a time: a quarter of a core's L2, so
#: the copy reads what the hash just brought into cache.
CHECKSUM_STEP = 256 * 1024


def payload_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@functools.lru_cache(maxsize=1)
def native_copies() -> ModuleType | None:
    """`kernels.copy_hash` (a Put's copy and checksum in one pass, a Get's copy with streamed
    stores, in C), loaded on first use; None where it cannot be (the kernels need torch, which a
    daemon has). The one loader of it for `copy_checksummed`, `kvstore.scatter` and the CPU tier."""
    try:
        from kvstore import kernels_path

        kernels_path.claim()
        from kernels import copy_hash
    except ImportError:
        return None
    return copy_hash


def copy_checksummed(dest: memoryview, payload: bytes | memoryview, step: int = CHECKSUM_STEP) -> int:
    """Copy ``payload`` into ``dest`` (as long) and return the :func:`payload_checksum` of what
    ``dest`` now holds. The hash is of the copy, not of the source: a payload rewritten during the
    call (a client's arena) cannot leave stored bytes that differ from their checksum.

    Where the C kernel applies (`native_copies`: x86-64 with AVX2, payloads over 240 bytes) each byte
    is read once into registers that are both stored and hashed, the stores streamed: a 5.9 MB
    payload between two memfds copies and hashes at 1.3x the speed of a numpy memcpy alone, where
    the Python paths below took 1.5-1.7x its time. Its GIL is released for the whole call.

    Elsewhere, read from memory once: each ``step`` chunk is copied, then hashed from cache
    (XXH3's streaming digest equals the one-shot one); ``step`` 0: one copy of the whole payload,
    then one hash of it (from the last-level cache rather than L2), two calls without the GIL where
    a step per chunk takes the GIL back twice per 256 KiB.

        payload  |<- step ->|<- step ->| ... |<- rest ->|
                   copy,hash  copy,hash        copy,hash
    """
    source = memoryview(payload).cast("B")
    if len(dest) != len(source):
        raise ValueError(f"destination of {len(dest)} bytes for a {len(source)}-byte payload")
    native = native_copies()
    if native is not None:
        digest = native.copy_rows_checksummed(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(source, dtype=np.uint8))
        if digest is not None:
            return digest
    if not step or len(source) <= step:
        dest[:] = source
        return xxhash.xxh3_64_intdigest(dest)
    digest = xxhash.xxh3_64()
    for start in range(0, len(source), step):
        end = min(start + step, len(source))
        dest[start:end] = source[start:end]
        digest.update(dest[start:end])
    return digest.intdigest()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


#: The longest header: params and a chain of MAX_CHAIN_TOKENS, padded (what a tier reads to learn a
#: block's header_len).
MAX_HEADER_BYTES = _align(FIXED_BYTES + MAX_PARAMS_BYTES + KEY_BYTES + 4 * MAX_CHAIN_TOKENS)


def pack_token_ids(token_ids) -> bytes:
    """Token ids as a header keeps them (`BlockHeader.token_ids`): little-endian uint32 each."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


@dataclass(frozen=True)
class BlockHeader:
    key: bytes
    namespace: bytes
    layout: KVLayout
    tokens: int
    payload_len: int
    checksum: int
    codec: str = "raw"
    codec_params: dict[str, Any] = field(default_factory=dict)
    #: The key before this block in its prefix chain, or b"" (unknown, or the chain's first).
    parent: bytes = b""
    #: The block's token ids, packed little-endian uint32 (`pack_token_ids`), or b"" (not kept).
    token_ids: bytes = b""

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES or len(self.namespace) != KEY_BYTES:
            raise ValueError(f"key and namespace must be {KEY_BYTES} bytes")
        if not 0 < self.tokens < 2**32:
            raise ValueError(f"tokens must be positive, got {self.tokens}")
        if not self.codec or not self.codec.isascii() or len(self.codec) > CODEC_BYTES:
            raise ValueError(f"codec spec must be 1..{CODEC_BYTES} ASCII characters, got {self.codec!r}")
        if self.codec == "raw" and self.payload_len != self.layout.block_bytes(self.tokens):
            raise ValueError(
                f"raw payload of {self.tokens} tokens in layout {self.layout} must be "
                f"{self.layout.block_bytes(self.tokens)} bytes, got {self.payload_len}"
            )
        if self.parent and len(self.parent) != KEY_BYTES:
            raise ValueError(f"parent must be {KEY_BYTES} bytes, got {len(self.parent)}")
        if self.token_ids and (len(self.token_ids) != 4 * self.tokens or self.tokens > MAX_CHAIN_TOKENS):
            raise ValueError(f"token_ids must hold the block's {self.tokens} tokens (at most {MAX_CHAIN_TOKENS}), "
                             f"got {len(self.token_ids)} bytes")

    # The lengths below are asked on every read and write of the block: each is computed once per
    # header (a header is immutable: a changed one is a new object, `dataclasses.replace`).
    @functools.cached_property
    def chain(self) -> bytes:
        """The chain's bytes after the params: the parent and the token ids, each where kept."""
        return self.parent + self.token_ids

    def token_id_list(self) -> list[int]:
        """The block's token ids ([] when not kept)."""
        return np.frombuffer(self.token_ids, dtype="<u4").tolist()

    @functools.cached_property
    def params_json(self) -> bytes:
        if not self.codec_params:  # raw blocks: a Put asks each one's lengths a handful of times
            return b"{}"
        return json.dumps(self.codec_params, sort_keys=True, separators=(",", ":")).encode()

    @functools.cached_property
    def header_len(self) -> int:
        return _align(FIXED_BYTES + len(self.params_json) + len(self.chain))

    @functools.cached_property
    def block_len(self) -> int:
        """Bytes of header plus payload: what a tier stores."""
        return self.header_len + self.payload_len

    def pack(self) -> bytes:
        params, chain = self.params_json, self.chain
        if len(params) > MAX_PARAMS_BYTES:
            raise ValueError(f"codec params take {len(params)} bytes; at most {MAX_PARAMS_BYTES} fit a header")
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            self.header_len,
            self.key,
            self.namespace,
            self.layout.num_layers,
            self.layout.num_kv_heads,
            self.layout.head_dim,
            DTYPE_CODES[self.layout.dtype],
            (FLAG_PARENT if self.parent else 0) | (FLAG_TOKENS if self.token_ids else 0),
            self.tokens,
            self.codec.encode().ljust(CODEC_BYTES, b"\x00"),
            len(params),
            self.payload_len,
            self.checksum,
        )
        digest = xxhash.xxh3_64_intdigest(fixed + params + chain)
        out = fixed + _HEADER_CHECKSUM.pack(digest) + params + chain
        return out.ljust(self.header_len, b"\x00")

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> "BlockHeader":
        """Parse and validate a header from the start of ``buf`` (which may hold more bytes)."""
        if len(buf) < FIXED_BYTES:
            raise CorruptBlockError(f"block of {len(buf)} bytes is shorter than a header")
        fields = _FIXED.unpack_from(buf, 0)
        (magic, version, header_len, key, namespace, layers, heads, head_dim, dtype_code, flags,
         tokens, codec, params_len, payload_len, checksum) = fields
        if magic != MAGIC:
            raise CorruptBlockError(f"bad magic {magic!r}")
        if version != FORMAT_VERSION:
            raise CorruptBlockError(f"unsupported block format version {version}")
        if params_len > MAX_PARAMS_BYTES or FIXED_BYTES + params_len > len(buf):
            raise CorruptBlockError(f"params length {params_len} out of range")
        if flags & ~(FLAG_PARENT | FLAG_TOKENS):
            raise CorruptBlockError(f"unknown header flags {flags:#x}")
        (stored_digest,) = _HEADER_CHECKSUM.unpack_from(buf, _FIXED.size)
        params = bytes(buf[FIXED_BYTES : FIXED_BYTES + params_len])
        start = FIXED_BYTES + params_len
        parent_len = KEY_BYTES if flags & FLAG_PARENT else 0
        ids_len = 4 * tokens if flags & FLAG_TOKENS else 0
        if ids_len > 4 * MAX_CHAIN_TOKENS or start + parent_len + ids_len > min(len(buf), header_len):
            raise CorruptBlockError(f"chain of {parent_len + ids_len} bytes out of range")
        chain = bytes(buf[start : start + parent_len + ids_len])
        if xxhash.xxh3_64_intdigest(bytes(buf[: _FIXED.size]) + params + chain) != stored_digest:
            raise CorruptBlockError("header checksum mismatch")
        try:
            header = cls(
                key=bytes(key),
                namespace=bytes(namespace),
                layout=KVLayout(layers, heads, head_dim, DTYPE_NAMES[dtype_code]),
                tokens=tokens,
                payload_len=payload_len,
                checksum=checksum,
                codec=codec.rstrip(b"\x00").decode("ascii"),
                codec_params=json.loads(params) if params else {},
                parent=chain[:parent_len],
                token_ids=chain[parent_len:],
            )
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise CorruptBlockError(f"inconsistent header: {exc}") from exc
        if header.header_len != header_len:
            raise CorruptBlockError(f"header length {header_len} != computed {header.header_len}")
        return header

    def verify_payload(self, payload: bytes | memoryview) -> None:
        if len(payload) != self.payload_len:
            raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {self.payload_len}")
        if payload_checksum(payload) != self.checksum:
            raise CorruptBlockError("payload checksum mismatch")


def parse_block(block: bytes | memoryview) -> tuple[BlockHeader, memoryview]:
    """Validate a whole stored block; return its header and a view of its payload."""
    view = memoryview(block).cast("B")
    header = BlockHeader.unpack(view)
    payload = view[header.header_len : header.header_len + header.payload_len]
    header.verify_payload(payload)
    if len(view) != header.block_len:
        raise CorruptBlockError(f"block is {len(view)} bytes, header says {header.block_len}")
    return header, payload
