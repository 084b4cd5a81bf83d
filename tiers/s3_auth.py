"""MACs of S3 objects: how a host knows an object in the shared bucket was written by a host that
holds the secret, before it trusts any byte of it.

A block's checksum (xxh3) catches accidents, not intent: anyone who may write to the bucket can
rewrite an object and recompute every checksum with kvstore's own code. So each object also
carries two keyed BLAKE2b MACs under a key every host derives from the server secret they share
(:func:`kvstore.host.s3_mac_key`), in the object's metadata (``x-amz-meta-...``), which S3 returns
with every GET, ranged ones included:

    kvstore-head-mac   BLAKE2b-256(key, person="kvs-s3-head")(header)
    kvstore-mac        BLAKE2b-256(key, person="kvs-s3-block")(payload || header || u64 len(header) || u64 len(payload))

The head MAC lets a host index an object from a ranged GET of its header alone (listing,
discovery), so a forged header is never indexed: it cannot make a Lookup report a hit, nor bind a
namespace to a layout. The block MAC is checked on every read, over the bytes as they arrive, before
the read returns; a read that fails it is a corrupt block (a counted miss, deleted). The payload
comes first so that a writer can hash it in the one pass that also computes the checksum the
header holds; the lengths at the end make the split between payload and header unambiguous.
The object's name needs no MAC of its own: the header names its key and readers compare the two.

The MACs give integrity, not secrecy: whoever may read the bucket reads the KV bytes. With
``s3_encrypt`` objects are sealed instead (tiers/at_rest.py) and carry no MACs: the AEAD tags
authenticate them under a key derived from the same secret.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Mapping

from kvstore.block import CorruptBlockError

#: Bytes of each MAC (sent as 64 hex characters).
MAC_BYTES = 32
#: Object metadata fields (S3 sends them as ``x-amz-meta-<field>`` and lower-cases the names).
HEAD_FIELD = "kvstore-head-mac"
BLOCK_FIELD = "kvstore-mac"


class ObjectMac:
    """The MACs of one bucket's objects under the hosts' shared key."""

    def __init__(self, key: bytes) -> None:
        if not 16 <= len(key) <= 64:
            raise ValueError(f"an S3 MAC key needs 16 to 64 bytes, got {len(key)}")
        self._key = key

    def head(self, packed: bytes | memoryview) -> str:
        """MAC of a packed header, as hex."""
        return hashlib.blake2b(packed, digest_size=MAC_BYTES, key=self._key, person=b"kvs-s3-head").hexdigest()

    def block_hasher(self) -> "hashlib._Hash":
        """A fresh hasher for :meth:`block`: feed it the payload, in order, in any chunks."""
        return hashlib.blake2b(digest_size=MAC_BYTES, key=self._key, person=b"kvs-s3-block")

    @staticmethod
    def block(hasher: "hashlib._Hash", packed: bytes | memoryview, payload_len: int) -> str:
        """The block MAC, as hex, of a hasher that has been fed exactly the payload."""
        hasher.update(packed)
        hasher.update(len(packed).to_bytes(8, "little") + payload_len.to_bytes(8, "little"))
        return hasher.hexdigest()

    def metadata(self, packed: bytes, block_mac: str) -> dict[str, str]:
        """What an object's metadata carries: both MACs."""
        return {HEAD_FIELD: self.head(packed), BLOCK_FIELD: block_mac}

    def check_head(self, packed: bytes | memoryview, metadata: Mapping[str, str]) -> None:
        """Raise CorruptBlockError unless ``metadata`` carries the head MAC of ``packed``."""
        _check(metadata.get(HEAD_FIELD), self.head(packed), "header")

    @staticmethod
    def check_block(block_mac: str, metadata: Mapping[str, str]) -> None:
        """Raise CorruptBlockError unless ``metadata`` carries ``block_mac``."""
        _check(metadata.get(BLOCK_FIELD), block_mac, "block")


def _check(sent: str | None, expected: str, what: str) -> None:
    if not sent:
        raise CorruptBlockError(f"no {what} MAC (written by a daemon older than MACs, or by someone else)")
    if not hmac.compare_digest(sent.encode(), expected.encode()):
        raise CorruptBlockError(f"{what} MAC does not match (forged, or written under another server secret)")
