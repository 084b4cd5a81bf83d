"""One S3 object read back into the caller's memory, for tiers/s3.py: a whole GET whose payload is
hashed (checksum and block MAC) as it streams in, concurrent ranged GETs of a large object, or a
sealed object opened a chunk at a time. The caller (`S3Tier.read_payload_into`) compares the
header with the indexed one and checks the checksum and MAC these return.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import xxhash

from kvstore.block import CorruptBlockError
from tiers import at_rest
from tiers.at_rest import AtRestKey
from tiers.s3_auth import BlockMac, ObjectMac
from tiers.s3_endpoint import STREAM_CHUNK, Endpoint, S3Config, stream_body


class ObjectReads:
    """GETs of one object at a time through ``endpoint`` (its client and its retries), ranged
    parts on ``pool``; ``mac`` makes the block MAC to check, ``at_rest`` opens sealed objects."""

    def __init__(self, endpoint: Endpoint, config: S3Config, pool: concurrent.futures.Executor,
                 mac: ObjectMac, at_rest: AtRestKey | None) -> None:
        self._s3, self._call, self._pool = endpoint.client, endpoint.call, pool
        self._bucket, self._part_bytes = config.bucket, config.part_bytes
        self.mac, self.at_rest = mac, at_rest

    def sealed(self, object_key: str, head: memoryview, payload: memoryview) -> tuple[bytes, int]:
        """Read a sealed object: its head into ``head``, its payload opened into ``payload``; the
        tag checked. Returns the header as packed and the payload's checksum. Nothing is opened
        from, nor hashed in, ``payload`` (a client's memory, maybe): ciphertext is opened from
        the bytes received, a chunk at a time into a small buffer, hashed there, then copied.

            whole GET   body chunks -> open -> scratch -> hash, copy -> payload
            ranged      parts -> a staging buffer of the tier's; then the same from it
        """
        if len(head) + len(payload) <= self._part_bytes:
            opening: list[_Opening] = []

            def attempt() -> None:
                response = self._s3.get_object(Bucket=self._bucket, Key=object_key)
                if response["ContentLength"] != len(head) + len(payload):
                    response["Body"].close()
                    raise CorruptBlockError(f"object is {response['ContentLength']} bytes, index says "
                                            f"{len(head) + len(payload)}")
                opening[:] = [_Opening(self.at_rest, head, payload)]  # afresh on a retry
                stream_body(response["Body"], head, payload, (), sink=opening[0])

            self._call(f"GET {object_key}", attempt)
            return opening[0].finish()
        staging = memoryview(bytearray(len(payload)))
        self.ranged(object_key, head, staging, hashed=False)
        opening_ = _Opening(self.at_rest, head, payload)
        for at in range(0, len(staging), STREAM_CHUNK):
            opening_(staging[at : at + STREAM_CHUNK])
        return opening_.finish()

    def whole(self, object_key: str, head: memoryview, payload: memoryview) -> ObjectRead:
        """One GET of the whole object, its payload hashed (checksum and MAC) as it streams in."""
        total = len(head) + len(payload)
        read: list[ObjectRead] = []

        def attempt() -> None:
            response = self._s3.get_object(Bucket=self._bucket, Key=object_key)
            if response["ContentLength"] != total:
                response["Body"].close()
                raise CorruptBlockError(f"object is {response['ContentLength']} bytes, index says {total}")
            metadata = response.get("Metadata", {})
            try:
                mac = self.mac.block_hasher(metadata)
            except CorruptBlockError:
                response["Body"].close()
                raise
            got = ObjectRead(xxhash.xxh3_64(), mac, metadata)
            stream_body(response["Body"], head, payload, (got.checksum, got.mac))
            read[:] = [got]

        self._call(f"GET {object_key}", attempt)
        return read[0]

    def ranged(self, object_key: str, head: memoryview, payload: memoryview, hashed: bool = True) -> ObjectRead | None:
        """Concurrent ranged GETs of ``part_bytes`` each, then (when ``hashed``; else None) one pass
        over the payload that makes both its checksum and its MAC (each ``STREAM_CHUNK`` hashed twice while
        in cache).

            object: | header | payload ........................................... |
            ranges: |<-- part 0 -->|<-- part 1 -->|<-- part 2 -->| ... |<- last ->|
        """
        total, part = len(head) + len(payload), self._part_bytes

        def fetch(start: int) -> dict[str, str]:
            end = min(start + part, total)
            h = head[start:min(end, len(head))] if start < len(head) else head[0:0]
            p_start, p_end = max(start, len(head)) - len(head), end - len(head)
            p = payload[p_start:p_end]

            def attempt() -> dict[str, str]:
                response = self._s3.get_object(Bucket=self._bucket, Key=object_key,
                                               Range=f"bytes={start}-{end - 1}")
                if response["ContentLength"] != end - start:
                    response["Body"].close()
                    raise CorruptBlockError(f"range {start}-{end - 1} came back with {response['ContentLength']} bytes")
                stream_body(response["Body"], h, p, ())
                return response.get("Metadata", {})

            return self._call(f"GET {object_key} [{start}:{end}]", attempt)

        futures = [self._pool.submit(fetch, start) for start in range(0, total, part)]
        metadata = [future.result() for future in futures]
        if any(m != metadata[0] for m in metadata):
            raise CorruptBlockError("object was replaced while its parts were read")
        if not hashed:  # a sealed object: its tags, opened afterwards, authenticate it; no MAC
            return None
        got = ObjectRead(xxhash.xxh3_64(), self.mac.block_hasher(metadata[0]), metadata[0])
        for at in range(0, len(payload), STREAM_CHUNK):
            chunk = payload[at : at + STREAM_CHUNK]
            got.checksum.update(chunk)
            got.mac.update(chunk)
        return got


@dataclasses.dataclass
class ObjectRead:
    """A GET of a whole block: hashers fed its payload as it arrived, and the object's metadata."""

    checksum: "xxhash.xxh3_64"
    mac: BlockMac
    metadata: dict[str, str]


class _Opening:
    """A sealed payload opened as it arrives, in order: each piece opened into a small buffer,
    hashed there, then copied to its place in ``payload``. The head is opened at the first piece
    (it is whole by then) or at :meth:`finish`."""

    def __init__(self, key: AtRestKey, head: memoryview, payload: memoryview) -> None:
        self._key, self._head, self._payload = key, head, payload
        self._opened: at_rest.OpenedHead | None = None
        self._scratch = memoryview(bytearray(min(STREAM_CHUNK, len(payload))))
        self._hasher = xxhash.xxh3_64()
        self._pos = 0

    def _open_head(self) -> at_rest.OpenedHead:
        if self._opened is None:
            self._opened = self._key.open_head(self._head)
        return self._opened

    def __call__(self, piece: memoryview) -> None:
        opened = self._open_head()
        if self._pos + len(piece) > len(self._payload):
            raise CorruptBlockError("object is longer than its header says")
        for at in range(0, len(piece), STREAM_CHUNK):
            sealed = piece[at : at + STREAM_CHUNK]
            out = self._scratch[: len(sealed)]
            opened.payload.open_into(sealed, out)
            self._hasher.update(out)
            self._payload[self._pos : self._pos + len(out)] = out
            self._pos += len(out)

    def finish(self) -> tuple[bytes, int]:
        """The header as packed and the payload's checksum, once the tag checks (CorruptBlockError)."""
        opened = self._open_head()
        if self._pos != len(self._payload):
            raise CorruptBlockError(f"sealed payload of {self._pos} bytes, header says {len(self._payload)}")
        opened.payload.finish()
        return opened.packed, self._hasher.intdigest()
