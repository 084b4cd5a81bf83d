"""MACs of S3 objects: how a host knows an object in the shared bucket was written by a host that
holds the secret, before it trusts any byte of it.

A block's checksum (xxh3) catches accidents, not intent: anyone who may write to the bucket can
rewrite an object and recompute every checksum with kvstore's own code. So each object also
carries keyed MACs under a key every host derives from the server secret they share
(:func:`kvstore.host.s3_mac_key`), in the object's metadata (``x-amz-meta-...``), which S3 returns
with every GET, ranged ones included:

    kvstore-mac-nonce  32 random bytes, as hex, fresh for each object
    kvstore-head-mac2  BLAKE2b-256(key, person="kvs-s3-head2")(header || nonce)
    kvstore-mac2       AEGIS-256X4-MAC(aegis key, nonce)(payload || header || u64 len(header) || u64 len(payload))

The head MAC lets a host index an object from a ranged GET of its header alone (listing,
discovery), so a forged header is never indexed: it cannot make a Lookup report a hit, nor bind a
namespace to a layout. The block MAC is checked on every read, over the bytes as they arrive, before
the read returns; a read that fails it is a corrupt block (a counted miss, deleted). The payload
comes first so that a writer can hash it in the one pass that also computes the checksum the
header holds; the lengths at the end make the split between payload and header unambiguous.
The object's name needs no MAC of its own: the header names its key and readers compare the two.

The block MAC is AEGIS-256X4's MAC mode (libaegis through ``aeg``, as tiers/at_rest.py seals),
under its own key derived from the shared one and a random nonce per object: it runs at tens of
GB/s and releases the GIL, where keyed BLAKE2b ran at 0.7 GB/s on the development host and made a
Get cost about twice a plain boto3 GET (docs/benchmarks.md, "S3 tier"). Objects written before
(``kvstore-head-mac`` and a BLAKE2b ``kvstore-mac``, no nonce) are still read and checked as
they were; every object written now carries the new fields only, which an older daemon refuses
at listing and discovery (no head MAC it knows: counted, left) rather than indexing a block whose
block MAC it cannot check and then deleting it as corrupt.

The MACs give integrity, not secrecy: whoever may read the bucket reads the KV bytes. With
``s3_encrypt`` objects are sealed instead (tiers/at_rest.py) and carry no MACs: the AEAD tags
authenticate them under a key derived from the same secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Mapping

import aeg.aegis256x4 as aegis

from kvstore.block import CorruptBlockError

#: Bytes of each BLAKE2b MAC (sent as 64 hex characters).
MAC_BYTES = 32
#: Object metadata fields (S3 sends them as ``x-amz-meta-<field>`` and lower-cases the names).
NONCE_FIELD = "kvstore-mac-nonce"
HEAD_FIELD = "kvstore-head-mac2"
BLOCK_FIELD = "kvstore-mac2"
#: The fields of objects written before the block MAC was AEGIS (read, never written).
LEGACY_HEAD_FIELD = "kvstore-head-mac"
LEGACY_BLOCK_FIELD = "kvstore-mac"


class BlockMac:
    """The block MAC of one object, fed its bytes in order (:meth:`update`), as hex
    (:meth:`hexdigest`); ``nonce`` is the object's (None for a legacy BLAKE2b one)."""

    def __init__(self, state, nonce: bytes | None) -> None:
        self._state, self.nonce = state, nonce

    def update(self, data: bytes | memoryview) -> None:
        self._state.update(data)

    def hexdigest(self) -> str:
        return self._state.hexdigest()


class ObjectMac:
    """The MACs of one bucket's objects under the hosts' shared key."""

    def __init__(self, key: bytes) -> None:
        if not 16 <= len(key) <= 64:
            raise ValueError(f"an S3 MAC key needs 16 to 64 bytes, got {len(key)}")
        self._key = key
        #: The block MAC's own key: derived, so no MAC under one algorithm shares a key with another.
        self._aegis_key = hashlib.blake2b(key, digest_size=aegis.KEYBYTES, person=b"kvs-s3-aegis").digest()

    def head(self, packed: bytes | memoryview, nonce: bytes) -> str:
        """MAC of a packed header and its object's nonce, as hex."""
        mac = hashlib.blake2b(packed, digest_size=MAC_BYTES, key=self._key, person=b"kvs-s3-head2")
        mac.update(nonce)
        return mac.hexdigest()

    def block_hasher(self, metadata: Mapping[str, str] | None = None) -> BlockMac:
        """A fresh block MAC to feed the payload, in order, in any chunks: for writing (no
        ``metadata``) under a new nonce; for reading, as the object's ``metadata`` says it was made
        (CorruptBlockError for a nonce that is not 32 bytes of hex)."""
        if metadata is None:
            nonce = os.urandom(aegis.NONCEBYTES)
        elif NONCE_FIELD in metadata:
            nonce = _nonce(metadata[NONCE_FIELD])
        else:  # an object written before the AEGIS block MAC
            return BlockMac(hashlib.blake2b(digest_size=MAC_BYTES, key=self._key, person=b"kvs-s3-block"), None)
        return BlockMac(aegis.Mac(self._aegis_key, nonce, maclen=32), nonce)

    @staticmethod
    def block(hasher: BlockMac, packed: bytes | memoryview, payload_len: int) -> str:
        """The block MAC, as hex, of a hasher that has been fed exactly the payload."""
        hasher.update(packed)
        hasher.update(len(packed).to_bytes(8, "little") + payload_len.to_bytes(8, "little"))
        return hasher.hexdigest()

    def metadata(self, packed: bytes, hasher: BlockMac, block_mac: str) -> dict[str, str]:
        """What an object's metadata carries: its nonce and both MACs (``hasher`` made ``block_mac``)."""
        return {NONCE_FIELD: hasher.nonce.hex(), HEAD_FIELD: self.head(packed, hasher.nonce), BLOCK_FIELD: block_mac}

    def check_head(self, packed: bytes | memoryview, metadata: Mapping[str, str]) -> None:
        """Raise CorruptBlockError unless ``metadata`` carries the head MAC of ``packed``."""
        if NONCE_FIELD in metadata:
            _check(metadata.get(HEAD_FIELD), self.head(packed, _nonce(metadata[NONCE_FIELD])), "header")
        else:  # legacy: BLAKE2b of the header alone
            legacy = hashlib.blake2b(packed, digest_size=MAC_BYTES, key=self._key, person=b"kvs-s3-head")
            _check(metadata.get(LEGACY_HEAD_FIELD), legacy.hexdigest(), "header")

    @staticmethod
    def check_block(block_mac: str, metadata: Mapping[str, str]) -> None:
        """Raise CorruptBlockError unless ``metadata`` carries ``block_mac`` (made by the hasher
        :meth:`block_hasher` gave for this ``metadata``)."""
        _check(metadata.get(BLOCK_FIELD if NONCE_FIELD in metadata else LEGACY_BLOCK_FIELD), block_mac, "block")


def _nonce(sent: str) -> bytes:
    try:
        nonce = bytes.fromhex(sent)
    except ValueError:
        nonce = b""
    if len(nonce) != aegis.NONCEBYTES:
        raise CorruptBlockError(f"object's MAC nonce is not {aegis.NONCEBYTES} bytes of hex")
    return nonce


def _check(sent: str | None, expected: str, what: str) -> None:
    if not sent:
        raise CorruptBlockError(f"no {what} MAC (written by a daemon older than MACs, or by someone else)")
    if not hmac.compare_digest(sent.encode(), expected.encode()):
        raise CorruptBlockError(f"{what} MAC does not match (forged, or written under another server secret)")
