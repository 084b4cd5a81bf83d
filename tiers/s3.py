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
           caller's buffer, header compared byte for byte with the indexed one, payload xxh3 checked
    write  PUT object (or a multipart upload with concurrent parts when larger than ``part_bytes``)
    index  in memory; filled in the background at start by listing PREFIX and reading each
           object's header with a ranged GET; keys other hosts store later are found by
           :meth:`S3Tier.discover` (a ranged GET of the header, negatively cached for a few seconds)

Faults: every request has connect and read timeouts and is retried with jittered exponential
backoff; connection errors, timeouts and 5xx answers feed a :class:`CircuitBreaker`. While it is
open every call fails at once with :class:`TierUnavailableError` (the store turns that into a miss),
so a dead endpoint costs the engine misses, never stalls; after ``breaker_cooldown_s`` one request
is let through as a probe and its outcome closes or reopens the breaker.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import xxhash

from kvstore.block import FIXED_BYTES, MAX_PARAMS_BYTES, BlockHeader, CorruptBlockError
from kvstore.keys import KEY_BYTES
from tiers.base import Tier, TierError, TierFullError, TierUnavailableError
from tiers.breaker import CircuitBreaker

log = logging.getLogger(__name__)
T = TypeVar("T")

SUFFIX = ".kvb"
#: Bytes of an object's start read to learn its header (headers are 128 bytes unless a codec has
#: long params; a longer header costs a second ranged GET).
HEADER_PROBE_BYTES = 512
#: Chunk size while streaming a GET body into the destination (hashed while still in cache).
STREAM_CHUNK = 256 * 1024
#: S3's smallest multipart part (all but the last).
MIN_PART_BYTES = 5 * 2**20


@dataclass(frozen=True)
class S3Config:
    bucket: str
    #: Key prefix inside the bucket; several caches (or tenants) may share a bucket under different prefixes.
    prefix: str = "kvstore"
    #: ``http(s)://host:port`` of an S3-compatible service; "" for AWS S3 itself.
    endpoint_url: str = ""
    #: "" takes the region from boto3's chain (AWS_REGION, ~/.aws/config), else us-east-1.
    region: str = ""
    #: Bytes this daemon may keep in the bucket; 0 = unbounded (use a bucket lifecycle rule).
    capacity_bytes: int = 0
    #: Objects larger than this are written as multipart uploads and read as concurrent ranged GETs.
    part_bytes: int = 8 * 2**20
    #: Requests in flight at once (connection pool size; ranged parts, probes and uploads share it).
    concurrency: int = 16
    #: Seconds a request may take to connect / between bytes of a response.
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 5.0
    #: Retries after a failed attempt (connection error, timeout, 5xx); backoff starts at 50 ms.
    retries: int = 2
    #: Consecutive failed attempts that open the breaker, and seconds it stays open.
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0
    #: Seconds a key found absent by discover() is not asked about again.
    negative_ttl_s: float = 3.0

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("s3 bucket name is empty: set s3_bucket (--s3-bucket)")
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"s3 endpoint must start with http:// or https://, got {self.endpoint_url!r}")
        if self.capacity_bytes < 0:
            raise ValueError(f"s3 capacity must be 0 (unbounded) or positive, got {self.capacity_bytes}")
        if self.part_bytes < MIN_PART_BYTES:
            raise ValueError(f"s3 part size must be at least {MIN_PART_BYTES} bytes (S3's multipart minimum), "
                             f"got {self.part_bytes}")
        if self.concurrency < 1 or self.retries < 0 or self.breaker_failures < 1:
            raise ValueError("s3 concurrency and breaker_failures must be >= 1 and retries >= 0")
        if min(self.connect_timeout_s, self.read_timeout_s, self.breaker_cooldown_s) <= 0:
            raise ValueError("s3 timeouts and breaker cooldown must be positive seconds")

    @property
    def key_prefix(self) -> str:
        return self.prefix.strip("/") + "/" if self.prefix.strip("/") else ""


def _network_errors() -> tuple[type[BaseException], ...]:
    from botocore import exceptions as bx
    from urllib3 import exceptions as ux

    return (bx.EndpointConnectionError, bx.ConnectionError, bx.HTTPClientError, bx.ReadTimeoutError,
            bx.ConnectTimeoutError, bx.ResponseStreamingError, bx.IncompleteReadError,
            ux.HTTPError, ConnectionError, socket.timeout, TimeoutError)


class _Retryable(Exception):
    """An attempt failed in a way another attempt might not (network, timeout, 5xx)."""


class S3Tier(Tier):
    blocking_io = True
    durable = True
    #: Several daemons may write the same bucket: keys may appear that this one did not put.
    shared = True

    def __init__(self, config: S3Config, name: str = "s3", list_on_start: bool = True) -> None:
        import boto3
        from botocore.config import Config

        self.config = config
        self.name = name
        self.capacity_bytes = config.capacity_bytes
        self.io_threads = config.concurrency
        self._prefix = config.key_prefix
        region = config.region or boto3.session.Session().region_name or "us-east-1"
        client_config = Config(
            region_name=region,
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            retries={"total_max_attempts": 1},  # retries are ours: they must see the breaker
            max_pool_connections=config.concurrency + 4,
            tcp_keepalive=True,
            # Every block carries its own xxh3 checksum, verified on each read; S3's CRCs would
            # hash every byte a second time.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # MinIO and Ceph serve path-style by default; AWS accepts both.
            s3={"addressing_style": "path"} if config.endpoint_url else {},
        )
        self._s3 = boto3.session.Session().client("s3", endpoint_url=config.endpoint_url or None, config=client_config)
        self._network_errors = _network_errors()
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, name="s3 endpoint")
        self._lock = threading.Lock()  # guards the index below
        self._blocks: dict[bytes, BlockHeader] = {}
        self._packed: dict[bytes, bytes] = {}
        self._used = 0
        self._new_keys: list[bytes] = []  # indexed by listing/discovery, not yet taken by the store
        self._absent_until: dict[bytes, float] = {}  # negative cache of discover()
        self._pool = concurrent.futures.ThreadPoolExecutor(config.concurrency, thread_name_prefix=f"kvstore-{name}")
        self._closed = threading.Event()
        #: Deletes that failed at the endpoint (the object may linger).
        self.delete_errors = 0
        #: Objects found unreadable while listing (skipped, not deleted: another host may own them).
        self.corrupt_on_start = 0
        self.listed = threading.Event()
        self._check_bucket()
        if list_on_start:
            threading.Thread(target=self._list_prefix, name=f"kvstore-{name}-list", daemon=True).start()
        else:
            self.listed.set()

    # -- start ------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"s3://{self.config.bucket}/{self._prefix} at {self.config.endpoint_url or 'AWS S3'}"

    def _check_bucket(self) -> None:
        """Fail at start, with what to fix, when the bucket is missing, unreachable or not ours to write."""
        from botocore.exceptions import ClientError, NoCredentialsError

        probe_key = f"{self._prefix}.probe-{socket.gethostname()}-{os.getpid()}"
        try:
            self._s3.head_bucket(Bucket=self.config.bucket)
            self._s3.put_object(Bucket=self.config.bucket, Key=probe_key, Body=b"")
            self._s3.delete_object(Bucket=self.config.bucket, Key=probe_key)
        except NoCredentialsError:
            raise TierError(f"{self.name}: no AWS credentials found for {self._where()}: set AWS_ACCESS_KEY_ID and "
                            f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance/pod role") from None
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("404", "NoSuchBucket") or status == 404:
                raise TierError(f"{self.name}: bucket {self.config.bucket!r} does not exist at "
                                f"{self.config.endpoint_url or 'AWS S3'}: create it (e.g. `aws s3 mb "
                                f"s3://{self.config.bucket}`) or fix --s3-bucket / --s3-endpoint") from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden") \
                    or status in (401, 403):
                raise TierError(f"{self.name}: access to {self._where()} denied ({code or status}): check the "
                                f"credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and that "
                                f"they may list, read, write and delete in the bucket") from None
            raise TierError(f"{self.name}: checking {self._where()} failed: {exc}") from None
        except self._network_errors as exc:
            raise TierError(f"{self.name}: cannot reach {self.config.endpoint_url or 'AWS S3'} ({exc}): "
                            f"check --s3-endpoint and that the service is up") from None

    def _list_prefix(self) -> None:
        """Index every block object under the prefix (background thread at start)."""
        try:
            paginator = self._s3.get_paginator("list_objects_v2")
            pending: list[concurrent.futures.Future] = []
            for page in paginator.paginate(Bucket=self.config.bucket, Prefix=self._prefix):
                for entry in page.get("Contents", []):
                    key = self._key_of(entry["Key"])
                    if key is not None and key not in self._blocks:
                        pending.append(self._pool.submit(self._index_remote, key, entry["Size"]))
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

    def _index_remote(self, key: bytes, size: int | None = None) -> bool:
        """Read the header of ``key``'s object and index it. False if absent; raises on endpoint trouble."""
        try:
            head = self._get_range(key, 0, HEADER_PROBE_BYTES)
        except KeyError:
            return False
        try:
            header = self._parse_header(key, head)
        except CorruptBlockError as exc:
            log.warning("%s: skipping unreadable object %s: %s", self.name, self._object_key(key), exc)
            self.corrupt_on_start += 1
            return False
        if size is not None and size != header.block_len:
            log.warning("%s: skipping %s: %d bytes, header says %d", self.name, self._object_key(key), size,
                        header.block_len)
            self.corrupt_on_start += 1
            return False
        with self._lock:
            if key not in self._blocks:
                self._blocks[key] = header
                self._packed[key] = header.pack()
                self._used += header.block_len
                self._new_keys.append(key)
        return True

    def _parse_header(self, key: bytes, head: bytes) -> BlockHeader:
        if len(head) >= FIXED_BYTES:
            header_len = int.from_bytes(head[6:8], "little")
            if header_len > len(head) and header_len <= FIXED_BYTES + MAX_PARAMS_BYTES + 64:
                head = self._get_range(key, 0, header_len)
        header = BlockHeader.unpack(head)
        if header.key != key:
            raise CorruptBlockError(f"object name says key {key.hex()}, header says {header.key.hex()}")
        return header

    # -- requests ---------------------------------------------------------------------------

    def _call(self, what: str, attempt_fn: Callable[[], T]) -> T:
        """Run one request with retries, backoff and the breaker. KeyError for a missing object."""
        from botocore.exceptions import ClientError

        last: BaseException | None = None
        for attempt in range(self.config.retries + 1):
            if not self.breaker.allow():
                raise TierUnavailableError(f"{self.name}: {what} skipped: {self.config.endpoint_url or 'S3'} is failing "
                                           f"(circuit open; retried every {self.config.breaker_cooldown_s:g}s)")
            try:
                result = attempt_fn()
            except ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if status >= 500 or code in ("SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError"):
                    self.breaker.record_failure()
                    last = exc
                else:
                    self.breaker.record_success()  # the endpoint answered
                    if status == 404 or code in ("404", "NoSuchKey", "NotFound"):
                        raise KeyError(what) from None
                    if status == 416 or code == "InvalidRange":
                        raise CorruptBlockError(f"{self.name}: {what}: object shorter than its index says") from None
                    raise TierError(f"{self.name}: {what}: {code or status}: {exc}") from None
            except self._network_errors as exc:
                self.breaker.record_failure()
                last = exc
            except _Retryable as exc:
                self.breaker.record_failure()
                last = exc
            else:
                self.breaker.record_success()
                return result
            if attempt < self.config.retries:
                time.sleep(min(0.05 * 2**attempt, 1.0) * random.uniform(0.5, 1.0))
        raise TierUnavailableError(f"{self.name}: {what} failed after {self.config.retries + 1} attempts: {last}")

    def _get_range(self, key: bytes, start: int, length: int) -> bytes:
        object_key = self._object_key(key)

        def attempt() -> bytes:
            response = self._s3.get_object(Bucket=self.config.bucket, Key=object_key,
                                           Range=f"bytes={start}-{start + length - 1}")
            return response["Body"].read()

        return self._call(f"GET {object_key} [{start}:{start + length}]", attempt)

    # -- Tier -------------------------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._blocks))

    def header(self, key: bytes) -> BlockHeader:
        return self._blocks[key]

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def available(self) -> bool:
        return self.breaker.state != "open"

    def can_fit(self, nbytes: int) -> bool:
        return self.capacity_bytes == 0 or self._used + nbytes <= self.capacity_bytes

    def take_new_keys(self) -> list[bytes]:
        with self._lock:
            keys, self._new_keys = self._new_keys, []
        return [k for k in keys if k in self._blocks]

    def put(self, header: BlockHeader, payload: memoryview) -> None:
        if len(payload) != header.payload_len:
            raise ValueError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
        previous = self._blocks.get(header.key)
        growth = header.block_len - (previous.block_len if previous else 0)
        if self.capacity_bytes and self._used + growth > self.capacity_bytes:
            raise TierFullError(f"{self.name}: {header.block_len} bytes do not fit")
        packed = header.pack()
        object_key = self._object_key(header.key)
        if header.block_len > self.config.part_bytes:
            self._put_multipart(object_key, packed, memoryview(payload).cast("B"))
        else:
            body = b"".join((packed, memoryview(payload).cast("B")))
            self._call(f"PUT {object_key}", lambda: self._s3.put_object(Bucket=self.config.bucket, Key=object_key,
                                                                        Body=body))
        with self._lock:
            self._packed[header.key] = packed
            self._blocks[header.key] = header
            self._used += growth
            self._absent_until.pop(header.key, None)

    def _put_multipart(self, object_key: str, packed: bytes, payload: memoryview) -> None:
        """Upload ``packed || payload`` in ``part_bytes`` parts, in parallel; abort on failure."""
        bucket, part = self.config.bucket, self.config.part_bytes
        total = len(packed) + len(payload)
        upload_id = self._call(f"start multipart {object_key}", lambda: self._s3.create_multipart_upload(
            Bucket=bucket, Key=object_key)["UploadId"])

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
        header = self._blocks[key]
        packed = self._packed[key]
        if len(dest) < header.payload_len:
            raise ValueError(f"destination of {len(dest)} bytes is smaller than the {header.payload_len}-byte payload")
        object_key = self._object_key(key)
        head = bytearray(header.header_len)
        payload = memoryview(dest).cast("B")[: header.payload_len]
        try:
            if header.block_len <= self.config.part_bytes:
                checksum = self._get_whole(object_key, memoryview(head), payload)
            else:
                checksum = self._get_ranged(object_key, memoryview(head), payload)
        except KeyError:
            self._forget(key)  # deleted underneath us (another host, a lifecycle rule)
            raise KeyError(key) from None
        except CorruptBlockError as exc:
            raise CorruptBlockError(f"{self.name}: {object_key}: {exc}") from None
        if bytes(head) != packed:
            raise CorruptBlockError(f"{self.name}: header of {object_key} differs from the indexed one")
        if checksum != header.checksum:
            raise CorruptBlockError(f"{self.name}: {object_key}: payload checksum mismatch")
        return header

    def _get_whole(self, object_key: str, head: memoryview, payload: memoryview) -> int:
        """One GET of the whole object; returns the payload checksum computed while streaming."""
        total = len(head) + len(payload)
        digest: list[int] = []

        def attempt() -> None:
            response = self._s3.get_object(Bucket=self.config.bucket, Key=object_key)
            if response["ContentLength"] != total:
                response["Body"].close()
                raise CorruptBlockError(f"object is {response['ContentLength']} bytes, index says {total}")
            digest[:] = [_stream_body(response["Body"], head, payload, hashed=True)]

        self._call(f"GET {object_key}", attempt)
        return digest[0]

    def _get_ranged(self, object_key: str, head: memoryview, payload: memoryview) -> int:
        """Concurrent ranged GETs of ``part_bytes`` each, then one hash pass over the payload.

            object: | header | payload ........................................... |
            ranges: |<-- part 0 -->|<-- part 1 -->|<-- part 2 -->| ... |<- last ->|
        """
        total, part = len(head) + len(payload), self.config.part_bytes

        def fetch(start: int) -> None:
            end = min(start + part, total)
            h = head[start:min(end, len(head))] if start < len(head) else head[0:0]
            p_start, p_end = max(start, len(head)) - len(head), end - len(head)
            p = payload[p_start:p_end]

            def attempt() -> None:
                response = self._s3.get_object(Bucket=self.config.bucket, Key=object_key,
                                               Range=f"bytes={start}-{end - 1}")
                if response["ContentLength"] != end - start:
                    response["Body"].close()
                    raise CorruptBlockError(f"range {start}-{end - 1} came back with {response['ContentLength']} bytes")
                _stream_body(response["Body"], h, p, hashed=False)

            self._call(f"GET {object_key} [{start}:{end}]", attempt)

        futures = [self._pool.submit(fetch, start) for start in range(0, total, part)]
        for future in futures:
            future.result()
        return xxhash.xxh3_64_intdigest(payload)

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

    def discover(self, keys: list[bytes], timeout_s: float) -> list[bytes]:
        """Look in the bucket for ``keys`` this daemon has not indexed (stored by another host).

        One ranged GET of each object's first bytes, all in parallel, waiting at most ``timeout_s``:
        it proves the object exists and yields the header the index needs in the same round trip
        (a HEAD would need a second request for the header). Keys found absent are not asked about
        again for ``negative_ttl_s``. Returns the keys found; never raises for endpoint trouble.
        """
        now = time.monotonic()
        ask = [k for k in dict.fromkeys(keys) if k not in self._blocks and self._absent_until.get(k, 0.0) <= now]
        if not ask or not self.available:
            return []

        def probe(key: bytes) -> bool:
            found = self._index_remote(key)
            if not found:
                self._absent_until[key] = time.monotonic() + self.config.negative_ttl_s
            return found

        futures = {self._pool.submit(probe, key): key for key in ask}
        done, _ = concurrent.futures.wait(futures, timeout=timeout_s)
        found = []
        for future in done:
            try:
                if future.result():
                    found.append(futures[future])
            except (TierError, CorruptBlockError) as exc:
                log.debug("%s: discover %s: %s", self.name, futures[future].hex(), exc)
        if len(self._absent_until) > 65536:  # forget expired entries now and then
            self._absent_until = {k: t for k, t in self._absent_until.items() if t > now}
        return found

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
            if listed.get(key) != header.block_len:
                raise RuntimeError(f"{self.name}: indexed block {key.hex()} is missing from the bucket or has "
                                   f"{listed.get(key)} bytes, not {header.block_len}")

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _stream_body(body, head: memoryview, payload: memoryview, hashed: bool) -> int:
    """Copy a GET body into ``head`` then ``payload`` (chunk by chunk, hashing payload chunks while
    they are in cache when ``hashed``); returns the payload checksum (0 unless ``hashed``).

        body:  | head (len(head)) | payload (len(payload)) |
    """
    hasher = xxhash.xxh3_64() if hashed else None
    total, pos, hlen = len(head) + len(payload), 0, len(head)
    try:
        for chunk in body.iter_chunks(STREAM_CHUNK):
            n = len(chunk)
            if pos + n > total:
                raise CorruptBlockError("object is longer than its header says")
            chunk = memoryview(chunk)
            split = max(0, min(hlen - pos, n))  # leading bytes of this chunk that are header
            if split:
                head[pos : pos + split] = chunk[:split]
            if split < n:
                at = pos + split - hlen
                payload[at : at + n - split] = chunk[split:]
                if hasher is not None:
                    hasher.update(chunk[split:])
            pos += n
    finally:
        body.close()
    if pos != total:
        raise _Retryable(f"connection closed after {pos} of {total} bytes")
    return hasher.intdigest() if hasher is not None else 0
