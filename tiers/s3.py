"""S3 tier: one object per block in any S3-compatible bucket (AWS S3, MinIO, Ceph RGW).

Layout: ``s3://BUCKET/PREFIX/ab/abcdef....kvb`` (the key in hex, fanned out by its first byte so
AWS can partition request rates across 256 prefixes). An object holds the whole block, header then
payload: the same bytes as a disk file, so any host can validate and decode any object alone.

Why one object per block and not packed objects: a block is already large (5.9 MB for one 256-token
SmolLM2-135M chunk in fp16, tens of MB for bigger models), well past the size where per-request
overhead matters (bench/s3_throughput.py: one S3-tier GET of a 5.9 MB block runs near a plain
boto3 get_object of the same bytes). Packing would add an index of offsets that every host must
share, rewrites to reclaim space, and read amplification or ranged reads for every hit, and would
break the property that makes sharing across hosts free: a key names exactly one object.

Reads and writes::

    read   GET object (or concurrent ranged GETs of ``part_bytes`` when larger), streamed into the
           caller's buffer, header compared byte for byte with the indexed one, payload xxh3 and
           the object's block MAC checked before the read returns
    write  PUT object (or a multipart upload with concurrent parts when larger than ``part_bytes``)
           with both MACs in its metadata (tiers/s3_auth.py)
    index  in memory; filled in the background at start by listing PREFIX and reading each
           object's header with a ranged GET (indexed only when its head MAC checks); keys other
           hosts store later are found by :meth:`S3Tier.discover` (ranged GETs of headers, in key
           order, a few at a time, for a Lookup none after the first absent key; absent keys
           negatively cached for a few seconds)

Trust: the bucket is not trusted. Every object carries keyed MACs under a key the hosts derive from
their shared server secret (tiers/s3_auth.py); an object without them, or whose MACs do not check,
is never indexed or served: it is a counted miss.

Secrecy (``s3_encrypt``, ``at_rest``): each object is a sealed block instead (tiers/at_rest.py:
AEGIS-256X4 under a key derived from the same secret, header and payload both ciphertext), and its
tags stand in for the MACs: the head that listing and discovery read opens only under the key
(else the object is refused, as an unMAC'd one is), and a read opens the payload a chunk at a time
and checks its tag and checksum before it returns. Every host on a bucket and prefix must agree
on ``s3_encrypt``: a sealed host refuses plain objects and a plain one sealed objects.

    s3.py            the tier: index, put, read, delete (this file)
    s3_endpoint.py   settings, the boto3 client, retries, backoff and the circuit breaker
    s3_auth.py       the objects' MACs
    s3_reads.py      one object read back: a whole GET, ranged GETs, a sealed object opened
    s3_discovery.py  asking about keys other hosts stored, bounded per call
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from typing import Callable

import xxhash

from kvstore.block import FIXED_BYTES, MAX_HEADER_BYTES, BlockHeader, CorruptBlockError
from kvstore.keys import KEY_BYTES
from tiers.at_rest import AtRestKey
from tiers.base import HeaderIndex, Tier, TierError, TierFullError
from tiers.breaker import CircuitBreaker  # noqa: F401  (callers import it from here, as S3Config)
from tiers.s3_auth import ObjectMac
from tiers.s3_discovery import DISCOVER_THREADS, Discovery
from tiers.s3_endpoint import STREAM_CHUNK, Endpoint, S3Config
from tiers.s3_reads import ObjectReads

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
#: Bytes of an object's start read to learn its header (headers are 128 bytes unless a codec has
#: long params; a longer header costs a second ranged GET).
HEADER_PROBE_BYTES = 2048


class S3Tier(HeaderIndex, Tier):
    blocking_io = True
    durable = True
    #: Several daemons may write the same bucket: keys may appear that this one did not put.
    shared = True

    def __init__(self, config: S3Config, name: str = "s3", list_on_start: bool = True,
                 mac_key: bytes | None = None, at_rest: AtRestKey | None = None) -> None:
        """``mac_key``: the key objects' MACs are made and checked under, shared by every host
        using the bucket (the daemon derives it from its server secret: kvstore.host.s3_mac_key);
        None: derived from this user's default server secret file. ``at_rest``: seal every object
        under this key instead (tiers/at_rest.py); None: plain objects with MACs."""
        if mac_key is None:
            from kvstore.host import s3_mac_key

            mac_key = s3_mac_key("")
        self.mac = ObjectMac(mac_key)
        self.at_rest = at_rest
        self.config = config
        self.name = name
        self.capacity_bytes = config.capacity_bytes
        self.io_threads = config.concurrency
        self._prefix = config.key_prefix
        self.endpoint = Endpoint(config, name, connections=config.concurrency + DISCOVER_THREADS + 4)
        self._s3 = self.endpoint.client
        self._call = self.endpoint.call
        self.breaker = self.endpoint.breaker
        self._lock = threading.Lock()  # guards the index below
        self._blocks: dict[bytes, BlockHeader] = {}
        self._packed: dict[bytes, bytes] = {}
        self._used = 0
        self._new_keys: list[bytes] = []  # indexed by listing/discovery, not yet taken by the store
        self._pool = concurrent.futures.ThreadPoolExecutor(config.concurrency, thread_name_prefix=f"kvstore-{name}")
        self._reads = ObjectReads(self.endpoint, config, self._pool, self.mac, at_rest)
        self._discovery = Discovery(self._index_remote, self.__contains__, config.negative_ttl_s, name)
        self._closed = threading.Event()
        #: Deletes that failed at the endpoint (the object may linger).
        self.delete_errors = 0
        #: Objects refused while listing: unreadable, or without a valid MAC (skipped, not deleted:
        #: another host may own them); reported to the store through take_refused too.
        self.corrupt_on_start = 0
        self._refused_listing = 0
        self.listed = threading.Event()
        self.endpoint.check_bucket()  # TierError saying what to fix
        if list_on_start:
            threading.Thread(target=self._list_prefix, name=f"kvstore-{name}-list", daemon=True).start()
        else:
            self.listed.set()

    # -- start ------------------------------------------------------------------------------

    def _where(self) -> str:
        return self.endpoint.where()

    def _list_prefix(self) -> None:
        """Index every block object under the prefix (background thread at start)."""
        try:
            paginator = self._s3.get_paginator("list_objects_v2")
            pending: list[concurrent.futures.Future] = []
            for page in paginator.paginate(Bucket=self.config.bucket, Prefix=self._prefix):
                for entry in page.get("Contents", []):
                    key = self._key_of(entry["Key"])
                    if key is not None and key not in self._blocks:
                        pending.append(self._pool.submit(self._index_listed, key, entry["Size"]))
                if self._closed.is_set():
                    return
            for future in pending:
                future.result()
            log.info("%s: indexed %d blocks (%.2f GiB) under %s", self.name, len(self), self._used / 2**30, self._where())
        except Exception as exc:  # the tier still works; it just does not know older blocks
            log.warning("%s: listing %s failed: %s; older blocks are found on lookup instead", self.name, self._where(), exc)
        finally:
            self.listed.set()

    def _key_of(self, object_key: str) -> bytes | None:
        name = object_key[len(self._prefix):]
        if not name.endswith(SUFFIX) or "/" not in name:
            return None
        try:
            key = bytes.fromhex(name.rsplit("/", 1)[1][: -len(SUFFIX)])
        except ValueError:
            return None
        return key if len(key) == KEY_BYTES else None

    def _object_key(self, key: bytes) -> str:
        hexkey = key.hex()
        return f"{self._prefix}{hexkey[:2]}/{hexkey}{SUFFIX}"

    def _index_listed(self, key: bytes, size: int) -> None:
        """Index a listed object of ``size`` bytes, or count and skip it when it is refused."""
        try:
            self._index_remote(key, size)
        except CorruptBlockError as exc:
            log.warning("%s: skipping object %s: %s", self.name, self._object_key(key), exc)
            with self._lock:
                self.corrupt_on_start += 1
                self._refused_listing += 1

    def _index_remote(self, key: bytes, size: int | None = None) -> bool:
        """Read the header of ``key``'s object, check its head MAC and index it. False if absent;
        CorruptBlockError when refused (unreadable, MAC missing or wrong, ``size`` not the
        header's); raises TierError on endpoint trouble."""
        try:
            head, metadata = self._get_range(key, 0, HEADER_PROBE_BYTES)
        except KeyError:
            return False
        header = self._parse_header(key, head, metadata)
        if size is not None and size != self._stored_len(header):
            raise CorruptBlockError(f"{size} bytes, header says {self._stored_len(header)}")
        with self._lock:
            if key not in self._blocks:
                self._blocks[key] = header
                self._packed[key] = header.pack()
                self._used += header.block_len
                self._new_keys.append(key)
        return True

    def _parse_header(self, key: bytes, head: bytes, metadata: dict[str, str]) -> BlockHeader:
        """The header at the start of ``head`` (read further when longer), once the head MAC in
        ``metadata`` checks. Raises CorruptBlockError."""
        if self.at_rest is not None:  # sealed: the head opens under the key, or it is refused
            need = self.at_rest.sealed_head_len(head)
            if need > len(head):
                head, metadata = self._get_range(key, 0, need)
            header = self.at_rest.open_head(memoryview(head)[:need]).header
            if header.key != key:
                raise CorruptBlockError(f"object name says key {key.hex()}, header says {header.key.hex()}")
            return header
        if len(head) < FIXED_BYTES:
            raise CorruptBlockError(f"object of {len(head)} bytes is shorter than a header")
        header_len = int.from_bytes(head[6:8], "little")
        if header_len > MAX_HEADER_BYTES:
            raise CorruptBlockError(f"header of {header_len} bytes is longer than any header")
        if header_len > len(head):
            head, metadata = self._get_range(key, 0, header_len)
        self.mac.check_head(memoryview(head)[:header_len], metadata)  # nothing of it is trusted before
        header = BlockHeader.unpack(head)
        if header.key != key:
            raise CorruptBlockError(f"object name says key {key.hex()}, header says {header.key.hex()}")
        return header

    def _get_range(self, key: bytes, start: int, length: int) -> tuple[bytes, dict[str, str]]:
        return self.endpoint.get_range(self._object_key(key), start, length)

    # -- Tier -------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.breaker.state != "open"

    def on_availability_change(self, callback: Callable[[], None]) -> None:
        self.breaker.on_change = callback

    def take_new_keys(self) -> list[bytes]:
        with self._lock:
            keys, self._new_keys = self._new_keys, []
        return [k for k in keys if k in self._blocks]

    def take_refused(self) -> int:
        """Objects the listing or discover() refused since the last call (forged, unMAC'd, sealed
        under another key or unreadable), for the store to count as corrupt. Thread-safe."""
        with self._lock:
            listed, self._refused_listing = self._refused_listing, 0
        return listed + self._discovery.take_refused()

    @property
    def _absent_until(self) -> dict[bytes, float]:
        return self._discovery.absent_until

    def _stored_len(self, header: BlockHeader) -> int:
        """Bytes of ``header``'s object: the block, sealed or not."""
        return header.block_len if self.at_rest is None else self.at_rest.stored_len(header)

    def _head_len(self, header: BlockHeader) -> int:
        """Bytes of ``header``'s object before its payload."""
        return header.header_len if self.at_rest is None else self.at_rest.head_len(header.header_len)

    def put(self, header: BlockHeader, payload: memoryview) -> None:
        self._put(header, memoryview(payload).cast("B"), hash_payload=False)

    def put_checksummed(self, header: BlockHeader, payload: memoryview) -> BlockHeader:
        return self._put(header, memoryview(payload).cast("B"), hash_payload=True)

    def _put(self, header: BlockHeader, payload: memoryview, hash_payload: bool) -> BlockHeader:
        """PUT the block (sealed with ``at_rest``: :meth:`_put_sealed`), then index it.

        Plain, ``header || payload`` with both MACs in its metadata. One pass over the payload
        makes the block MAC (and the checksum when ``hash_payload``) and, for a single PUT, copies
        it into the body, each chunk hashed from the copy just made:

            body  | header (packed last: it holds the checksum) | payload: copy, hash | copy, hash | ... |
        """
        if len(payload) != header.payload_len:
            raise ValueError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
        previous = self._blocks.get(header.key)
        growth = header.block_len - (previous.block_len if previous else 0)
        if self.capacity_bytes and self._used + growth > self.capacity_bytes:
            raise TierFullError(f"{self.name}: {header.block_len} bytes do not fit")
        if self.at_rest is not None:
            header = self._put_sealed(header, payload, hash_payload)
        else:
            header = self._put_plain(header, payload, hash_payload)
        with self._lock:
            self._packed[header.key] = header.pack()
            self._blocks[header.key] = header
            self._used += growth
            self._discovery.forget(header.key)
        return header

    def _put_plain(self, header: BlockHeader, payload: memoryview, hash_payload: bool) -> BlockHeader:
        """PUT the plain block, its MACs in the metadata (see :meth:`_put`); returns its header."""
        hlen = header.header_len
        body = bytearray(header.block_len) if header.block_len <= self.config.part_bytes else None
        mac = self.mac.block_hasher()
        checksum = xxhash.xxh3_64() if hash_payload else None
        for at in range(0, len(payload), STREAM_CHUNK):
            chunk = payload[at : at + STREAM_CHUNK]
            if body is not None:
                body[hlen + at : hlen + at + len(chunk)] = chunk
                chunk = memoryview(body)[hlen + at : hlen + at + len(chunk)]
            mac.update(chunk)
            if checksum is not None:
                checksum.update(chunk)
        if checksum is not None:
            header = dataclasses.replace(header, checksum=checksum.intdigest())
        packed = header.pack()
        metadata = self.mac.metadata(packed, mac, self.mac.block(mac, packed, len(payload)))
        object_key = self._object_key(header.key)
        if body is None:
            self._put_multipart(object_key, packed, payload, metadata)
        else:
            body[:hlen] = packed
            self._call(f"PUT {object_key}", lambda: self._s3.put_object(Bucket=self.config.bucket, Key=object_key,
                                                                        Body=body, Metadata=metadata))
        return header

    def _put_sealed(self, header: BlockHeader, payload: memoryview, hash_payload: bool) -> BlockHeader:
        """PUT the sealed block (tiers/at_rest.py), made in one buffer: each ``STREAM_CHUNK`` of
        the payload copied into a small buffer, hashed there (when ``hash_payload``: the checksum
        is of the bytes sealed, even if the caller rewrites its memory meanwhile), sealed into the
        body; the head last. Larger than ``part_bytes``: that buffer goes up in parts.

            body  | head (sealed header, tags) | sealed chunk 0 | sealed chunk 1 | ... |
        """
        sealer = self.at_rest.sealer(header.header_len)
        head_len = self._head_len(header)
        body = bytearray(head_len + len(payload))
        out = memoryview(body)
        scratch = memoryview(bytearray(min(STREAM_CHUNK, len(payload))))
        checksum = xxhash.xxh3_64() if hash_payload else None
        for at in range(0, len(payload), STREAM_CHUNK):
            chunk = payload[at : at + STREAM_CHUNK]
            if checksum is not None:
                copy = scratch[: len(chunk)]
                copy[:] = chunk
                checksum.update(copy)
                chunk = copy
            sealer.seal_into(chunk, out[head_len + at : head_len + at + len(chunk)])
        if checksum is not None:
            header = dataclasses.replace(header, checksum=checksum.intdigest())
        out[:head_len] = sealer.seal_head(header.pack())
        object_key = self._object_key(header.key)
        if len(body) > self.config.part_bytes:
            self._put_multipart(object_key, b"", memoryview(body), {})
        else:
            self._call(f"PUT {object_key}", lambda: self._s3.put_object(Bucket=self.config.bucket, Key=object_key,
                                                                        Body=body))
        return header

    def _put_multipart(self, object_key: str, packed: bytes, payload: memoryview, metadata: dict[str, str]) -> None:
        """Upload ``packed || payload`` in ``part_bytes`` parts, in parallel; abort on failure."""
        bucket, part = self.config.bucket, self.config.part_bytes
        total = len(packed) + len(payload)
        upload_id = self._call(f"start multipart {object_key}", lambda: self._s3.create_multipart_upload(
            Bucket=bucket, Key=object_key, Metadata=metadata)["UploadId"])

        def body_of(start: int) -> bytes:
            # object bytes [start, start + part): the header only ever falls in part 1
            end = min(start + part, total)
            if start == 0:
                return b"".join((packed, payload[: end - len(packed)]))
            return bytes(payload[start - len(packed) : end - len(packed)])

        def send(number: int, start: int) -> dict:
            body = body_of(start)
            etag = self._call(f"PUT {object_key} part {number}", lambda: self._s3.upload_part(
                Bucket=bucket, Key=object_key, UploadId=upload_id, PartNumber=number, Body=body)["ETag"])
            return {"PartNumber": number, "ETag": etag}

        try:
            futures = [self._pool.submit(send, i + 1, start) for i, start in enumerate(range(0, total, part))]
            parts = [f.result() for f in futures]
            self._call(f"complete multipart {object_key}", lambda: self._s3.complete_multipart_upload(
                Bucket=bucket, Key=object_key, UploadId=upload_id, MultipartUpload={"Parts": parts}))
        except BaseException:
            try:
                self._s3.abort_multipart_upload(Bucket=bucket, Key=object_key, UploadId=upload_id)
            except Exception as exc:  # a lifecycle rule cleans up what this leaves
                log.warning("%s: aborting multipart upload of %s failed: %s", self.name, object_key, exc)
            raise

    def read_payload_into(self, key: bytes, dest: memoryview) -> BlockHeader:
        """Read ``key``'s payload into ``dest``; the header, checksum and block MAC are checked
        before it returns (CorruptBlockError otherwise: the bytes in ``dest`` are not the block's)."""
        header = self._blocks[key]
        packed = self._packed[key]
        if len(dest) < header.payload_len:
            raise ValueError(f"destination of {len(dest)} bytes is smaller than the {header.payload_len}-byte payload")
        object_key = self._object_key(key)
        head = bytearray(self._head_len(header))
        payload = memoryview(dest).cast("B")[: header.payload_len]
        plain = self.at_rest is None
        try:
            if not plain:
                on_bucket, checksum = self._reads.sealed(object_key, memoryview(head), payload)
                if on_bucket != packed:
                    raise CorruptBlockError("header differs from the indexed one")
                if checksum != header.checksum:
                    raise CorruptBlockError("payload checksum mismatch")
                return header
            if self._stored_len(header) <= self.config.part_bytes:
                got = self._reads.whole(object_key, memoryview(head), payload)
            else:
                got = self._reads.ranged(object_key, memoryview(head), payload)
            if bytes(head) != packed:
                raise CorruptBlockError("header differs from the indexed one")
            elif got.checksum.intdigest() != header.checksum:
                raise CorruptBlockError("payload checksum mismatch")
            else:
                self.mac.check_block(self.mac.block(got.mac, head, len(payload)), got.metadata)
        except KeyError:
            self._forget(key)  # deleted underneath us (another host, a lifecycle rule)
            raise KeyError(key) from None
        except CorruptBlockError as exc:
            raise CorruptBlockError(f"{self.name}: {object_key}: {exc}") from None
        return header

    def _forget(self, key: bytes) -> None:
        with self._lock:
            header = self._blocks.pop(key, None)
            if header is not None:
                self._packed.pop(key, None)
                self._used -= header.block_len

    def delete(self, key: bytes) -> int:
        header = self._blocks.get(key)
        if header is None:
            return 0
        object_key = self._object_key(key)
        try:
            self._call(f"DELETE {object_key}", lambda: self._s3.delete_object(Bucket=self.config.bucket, Key=object_key))
        except TierError as exc:
            # The index forgets it anyway: a leftover object is found again by discover() or
            # expired by a bucket lifecycle rule; failing the eviction would wedge the tier above.
            self.delete_errors += 1
            log.warning("%s: %s; forgetting the block here anyway", self.name, exc)
        self._forget(key)
        return header.block_len

    def discover(self, keys: list[bytes], timeout_s: float, stop_at_absent: bool = False) -> list[bytes]:
        """Look in the bucket for ``keys`` this daemon has not indexed (stored by another host):
        in order, at most ``DISCOVER_MAX_KEYS`` a call and a window of requests at once; with
        ``stop_at_absent`` (a Lookup's hit run) none after the first absent one
        (tiers/s3_discovery.py). Each request is a ranged GET of the object's first bytes: it
        proves the object exists and yields the header and its MAC in one round trip (a HEAD would
        need a second request for the header). Returns the keys found; never raises for endpoint
        trouble."""
        if not self.available:
            return []
        return self._discovery.ask(keys, timeout_s, stop_at_absent)

    def check_integrity(self) -> None:
        with self._lock:
            indexed = dict(self._blocks)
        if sum(h.block_len for h in indexed.values()) != self._used:
            raise RuntimeError(f"{self.name}: used bytes {self._used} != sum of indexed blocks")
        if set(indexed) != set(self._packed):
            raise RuntimeError(f"{self.name}: headers and packed headers index different keys")
        if not self.available:
            return  # the listing below needs the endpoint
        listed: dict[bytes, int] = {}
        paginator = self._s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.config.bucket, Prefix=self._prefix):
            for entry in page.get("Contents", []):
                key = self._key_of(entry["Key"])
                if key is not None:
                    listed[key] = entry["Size"]
        for key, header in indexed.items():
            if listed.get(key) != self._stored_len(header):
                raise RuntimeError(f"{self.name}: indexed block {key.hex()} is missing from the bucket or has "
                                   f"{listed.get(key)} bytes, not {self._stored_len(header)}")

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._discovery.close()
