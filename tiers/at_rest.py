"""Encryption at rest: a block sealed with AEGIS-256X4 before it leaves the process (disk, S3).

KV bytes can be turned back into the prompt they were computed from, and a header may hold the
prompt's token ids themselves, so a sealed block hides both: the header and the payload are each
sealed (AEAD), under a key the daemon derives from its server secret, one key per tier
(:func:`kvstore.host.at_rest_key`). Who can read the folder or the bucket reads only ciphertext,
the key id and the lengths.

A sealed block, as a file or an object (little-endian)::

    off   size
      0      4  magic b"KVE1"
      4      1  format version (2)
      5      1  0
      6      2  header_len (of the plain header inside)
      8      8  key id (which key sealed it: :attr:`AtRestKey.key_id`)
     16     32  header nonce (random)
     48     32  payload nonce (random)
     80     16  payload tag
     96     16  header tag
    112         the header, sealed (header_len bytes)
    112+hl      the payload, sealed (payload_len bytes)

The payload is sealed first, with bytes 0..80 as associated data; the header then, with bytes
0..96, the payload's tag included, so a header opens only beside the payload it was sealed with,
and the payload only in the object whose nonces it was sealed under. The header inside is the
block's own (kvstore/block.py), checksums included: a reader compares it with the one it indexed.
Anything that does not open (another key, a flipped byte, a block swapped for another's) raises
CorruptBlockError: the tier's read fails, the store counts a corrupt miss and deletes the copy
(kvstore/daemon/reads.py).

The cipher is AEGIS-256X4 (the CFRG's AEGIS family, draft-irtf-cfrg-aegis-aead; libaegis through
the ``aeg`` binding): a 256-bit key, a 256-bit nonce and a 128-bit tag, built on the AES round
function, so it runs on the AES instructions every server CPU has (VAES where there is one). Why
not AES-GCM, which format 1 used: on the development host AES-256-GCM opened 7 GB/s, about the
speed of a whole plain read from the page cache, and ``cryptography`` holds the GIL while it runs,
so a sealed disk read cost two plain ones; AEGIS-256X4 opens 30 GB/s there and ``aeg`` releases the
GIL (cffi), so the daemon's reader threads open in parallel (docs/benchmarks.md, "Encryption at
rest"). Nonces are random, 256 bits, two per block: no bound on blocks per key worth stating.

Blocks sealed by format 1 (AES-256-GCM, 96-bit nonces) are not read: :func:`format_of` tells them
apart, the disk tier drops them at start and S3 listings refuse them (both counted), as blocks of
another kind; the cache refills.
"""

from __future__ import annotations

import hashlib
import os
import struct

import aeg.aegis256x4 as aegis

from kvstore.block import MAX_HEADER_BYTES, BlockHeader, CorruptBlockError

MAGIC = b"KVE1"
VERSION = 2
NONCE_BYTES = aegis.NONCEBYTES  # 32
TAG_BYTES = 16
KEY_ID_BYTES = 8
#: magic, version, 0, header_len, key id, header nonce, payload nonce
_PREFIX = struct.Struct(f"<4sBBH8s{NONCE_BYTES}s{NONCE_BYTES}s")
#: The bytes a sealed block adds to the plain one: the prefix and both tags.
OVERHEAD = _PREFIX.size + 2 * TAG_BYTES  # 112
_PAYLOAD_AAD_END = _PREFIX.size  # 80: the payload's associated data, tags excluded
_HEADER_AAD_END = _PREFIX.size + TAG_BYTES  # 96: the header's, the payload's tag included


def format_of(start: bytes | memoryview) -> str:
    """What a tier's file or object starting with ``start`` (its first 5 bytes or more) holds:
    "sealed" (this format), "sealed-old" (an earlier format of sealed block, not read), or "plain"
    (anything else: a plain block, or bytes the plain reader will refuse)."""
    if bytes(start[:4]) != MAGIC:
        return "plain"
    return "sealed" if len(start) > 4 and start[4] == VERSION else "sealed-old"


class AtRestKey:
    """One tier's key: seals blocks for writing (:meth:`sealer`), opens them for reading
    (:meth:`open_head`). Thread-safe: every block gets its own cipher contexts."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError(f"an at-rest key has 32 bytes, got {len(key)}")
        self._key = key
        #: Names the key without revealing it: a block sealed under another is told apart at once.
        self.key_id = hashlib.blake2b(key, digest_size=KEY_ID_BYTES, person=b"kvs-at-rest-id").digest()

    @classmethod
    def derived(cls, tier: str, secret_file: str | os.PathLike) -> "AtRestKey":
        """``tier``'s key ("disk", "s3"), derived from the server secret in ``secret_file``
        (kvstore.host.at_rest_key: one derivation per purpose)."""
        from kvstore.host import at_rest_key

        return cls(at_rest_key(tier, secret_file))

    @staticmethod
    def stored_len(header: BlockHeader) -> int:
        """Bytes the sealed block takes in the tier: the plain block's and :data:`OVERHEAD`."""
        return header.block_len + OVERHEAD

    @staticmethod
    def head_len(header_len: int) -> int:
        """Bytes before the sealed payload: the prefix, both tags and the sealed header."""
        return OVERHEAD + header_len

    @staticmethod
    def sealed_head_len(start: bytes | memoryview) -> int:
        """:meth:`head_len` of the sealed block that ``start`` (at least its first 8 bytes) begins;
        CorruptBlockError when it is no sealed block (a plain one: sealing was off when written)."""
        if len(start) < 8 or bytes(start[:4]) != MAGIC:
            raise CorruptBlockError("not an encrypted block (written with encryption off, or by someone else)")
        header_len = int.from_bytes(start[6:8], "little")
        if header_len > MAX_HEADER_BYTES:
            raise CorruptBlockError(f"sealed header of {header_len} bytes is longer than any header")
        return OVERHEAD + header_len

    def sealer(self, header_len: int) -> "BlockSealer":
        """Seal one block whose header packs to ``header_len`` bytes (fresh nonces)."""
        return BlockSealer(self, header_len)

    def open_head(self, head: bytes | memoryview) -> "OpenedHead":
        """Open the head of a sealed block (at least :meth:`head_len` bytes): the plain header,
        authenticated, and the opener of its payload. Raises CorruptBlockError when the head is
        not a sealed block, was sealed under another key, or does not open."""
        head = memoryview(head).cast("B")
        need = self.sealed_head_len(head)
        if len(head) < need:
            raise CorruptBlockError(f"sealed head of {len(head)} bytes, its prefix says {need}")
        magic, version, _, header_len, key_id, nonce_h, nonce_p = _PREFIX.unpack_from(head, 0)
        if version != VERSION:
            raise CorruptBlockError(f"encrypted block of format {version}, this kvstore reads format {VERSION}")
        if key_id != self.key_id:
            raise CorruptBlockError("encrypted under another key (another server secret, or another tier's)")
        tag_p = bytes(head[_PAYLOAD_AAD_END:_HEADER_AAD_END])
        tag_h = bytes(head[_HEADER_AAD_END:OVERHEAD])
        try:
            packed = bytes(aegis.decrypt_detached(self._key, nonce_h, head[OVERHEAD:need], tag_h,
                                                  head[:_HEADER_AAD_END]))
        except ValueError:
            raise CorruptBlockError("header does not decrypt (altered, or not this block's)") from None
        decryptor = aegis.Decryptor(self._key, nonce_p, head[:_PAYLOAD_AAD_END])
        return OpenedHead(packed, PayloadOpener(decryptor, tag_p))


class BlockSealer:
    """One block being sealed: its payload in order through :meth:`seal_into`, then its
    header through :meth:`seal_head`, whose bytes go first in the tier::

        tier:  | seal_head(packed) (head_len) | seal_into(chunk 0) | seal_into(chunk 1) | ... |
    """

    def __init__(self, key: AtRestKey, header_len: int) -> None:
        self._key = key
        self._header_len = header_len
        self._nonce_h, self._nonce_p = os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES)
        self._prefix = _PREFIX.pack(MAGIC, VERSION, 0, header_len, key.key_id, self._nonce_h, self._nonce_p)
        self._encryptor = aegis.Encryptor(key._key, self._nonce_p, self._prefix)

    def seal_into(self, chunk: bytes | memoryview, out: memoryview) -> None:
        """Seal the payload's next ``len(chunk)`` bytes into ``out`` (as long)."""
        self._encryptor.update(chunk, into=out)

    def seal_head(self, packed: bytes) -> bytes:
        """The head, once every payload byte went through :meth:`seal_into`."""
        if len(packed) != self._header_len:
            raise ValueError(f"header of {len(packed)} bytes, sealer made for {self._header_len}")
        aad = self._prefix + bytes(self._encryptor.final())
        sealed, tag = aegis.encrypt_detached(self._key._key, self._nonce_h, packed, aad)
        return aad + bytes(tag) + bytes(sealed)


class PayloadOpener:
    """The sealed payload of one block, opened in order; :meth:`finish` says whether it was whole.

    ``out`` may be memory a client can write meanwhile (its arena). AEGIS authenticates the
    plaintext, so the cipher must never read back what it wrote there: a client scribbling on its
    own arena would then make a good block fail its tag, and the daemon delete it. libaegis keeps
    each whole 64-byte block's plaintext in a register; a piece of a block (a call's start or end
    off the 64-byte grid) it accumulates by reading ``out`` back, so those pieces are opened into
    memory of this object's own and copied out."""

    def __init__(self, decryptor: aegis.Decryptor, tag: bytes) -> None:
        self._decryptor, self._tag = decryptor, tag
        self._offset = 0  # payload bytes opened so far
        self._edge = bytearray(aegis.RATE)

    def open_into(self, chunk: bytes | memoryview, out: memoryview) -> None:
        """Open the payload's next ``len(chunk)`` bytes into ``out`` (as long, not
        overlapping ``chunk``). The bytes are not yet authenticated: nothing may use them before :meth:`finish`."""
        chunk, out = memoryview(chunk).cast("B"), memoryview(out).cast("B")
        if len(out) != len(chunk):
            raise ValueError(f"{len(chunk)} sealed bytes, {len(out)} to open them into")
        head = min(-self._offset % aegis.RATE, len(chunk))  # the rest of a block begun before
        whole = (len(chunk) - head) // aegis.RATE * aegis.RATE
        self._open_edge(chunk[:head], out[:head])
        if whole:
            self._decryptor.update(chunk[head : head + whole], into=out[head : head + whole])
        self._open_edge(chunk[head + whole :], out[head + whole :])
        self._offset += len(chunk)

    def _open_edge(self, chunk: memoryview, out: memoryview) -> None:
        """Open a piece of one 64-byte block (under 64 bytes) through ``_edge``, then copy it out."""
        if chunk:
            edge = memoryview(self._edge)[: len(chunk)]
            self._decryptor.update(chunk, into=edge)
            out[:] = edge

    def finish(self) -> None:
        """CorruptBlockError unless the payload opened was the sealed one, whole."""
        try:
            self._decryptor.final(self._tag)
        except ValueError:
            raise CorruptBlockError("payload does not decrypt (altered, truncated, or not this block's)") from None


class OpenedHead:
    """A sealed block's plain header (``packed`` as the block holds it; ``header`` parsed from it
    when first asked: a reader that compares ``packed`` with the header it indexed parses nothing)
    and the opener of its payload."""

    __slots__ = ("packed", "payload", "_header")

    def __init__(self, packed: bytes, payload: PayloadOpener) -> None:
        self.packed, self.payload, self._header = packed, payload, None

    @property
    def header(self) -> BlockHeader:
        """The header, parsed (CorruptBlockError when it is none, or not as long as the prefix said)."""
        if self._header is None:
            header = BlockHeader.unpack(self.packed)
            if header.header_len != len(self.packed):
                raise CorruptBlockError(f"sealed header of {len(self.packed)} bytes holds a header of {header.header_len}")
            self._header = header
        return self._header
