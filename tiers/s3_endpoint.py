"""The S3 endpoint as the S3 tier calls it: settings, the boto3 client, every request's retries,
backoff and circuit breaker, and GET bodies streamed into a caller's buffers.

Faults: every request has connect and read timeouts and is retried with jittered exponential
backoff; connection errors, timeouts and 5xx answers feed a :class:`CircuitBreaker`. While it is
open every call fails at once with :class:`TierUnavailableError` (the store turns that into a miss),
so a dead endpoint costs the engine misses, never stalls; after ``breaker_cooldown_s`` one request
is let through as a probe and its outcome closes or reopens the breaker.
"""

from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from kvstore.block import CorruptBlockError
from tiers.base import TierError, TierUnavailableError
from tiers.breaker import CircuitBreaker

T = TypeVar("T")

#: Chunk size while streaming a GET body into the destination (hashed while still in this host's
#: 1 MiB of L2 per core). 1 MiB against 256 KiB in alternating runs of bench/s3_throughput.py
#: (2-core VM, quiet): Gets 1.17x against 1.04x boto3 with one request at a time (two runs each),
#: 0.93x against 0.84x with 8 (medians of four): fewer, larger calls into the hashers.
STREAM_CHUNK = 1 << 20
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
    #: Requests in flight at once for reads and writes (ranged parts and uploads share them; discovery
    #: has threads of its own, tiers/s3_discovery.py).
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


class Retryable(Exception):
    """An attempt failed in a way another attempt might not (network, timeout, 5xx)."""


class Endpoint:
    """One bucket at one endpoint: the boto3 client (``client``), the breaker, and :meth:`call`."""

    def __init__(self, config: S3Config, name: str, connections: int) -> None:
        import boto3
        from botocore.config import Config

        self.config = config
        self.name = name
        region = config.region or boto3.session.Session().region_name or "us-east-1"
        client_config = Config(
            region_name=region,
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            retries={"total_max_attempts": 1},  # retries are ours: they must see the breaker
            max_pool_connections=connections,
            tcp_keepalive=True,
            # Every block carries its own xxh3 checksum and MAC, verified on each read; S3's CRCs
            # would hash every byte again.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # MinIO and Ceph serve path-style by default; AWS accepts both.
            s3={"addressing_style": "path"} if config.endpoint_url else {},
        )
        self.client = boto3.session.Session().client("s3", endpoint_url=config.endpoint_url or None,
                                                     config=client_config)
        self._network_errors = _network_errors()
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, name="s3 endpoint")

    def where(self) -> str:
        return f"s3://{self.config.bucket}/{self.config.key_prefix} at {self.config.endpoint_url or 'AWS S3'}"

    def check_bucket(self) -> None:
        """Fail at start, with what to fix, when the bucket is missing, unreachable or not ours to write."""
        from botocore.exceptions import ClientError, NoCredentialsError

        probe_key = f"{self.config.key_prefix}.probe-{socket.gethostname()}-{os.getpid()}"
        try:
            self.client.head_bucket(Bucket=self.config.bucket)
            self.client.put_object(Bucket=self.config.bucket, Key=probe_key, Body=b"")
            self.client.delete_object(Bucket=self.config.bucket, Key=probe_key)
        except NoCredentialsError:
            raise TierError(f"{self.name}: no AWS credentials found for {self.where()}: set AWS_ACCESS_KEY_ID and "
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
                raise TierError(f"{self.name}: access to {self.where()} denied ({code or status}): check the "
                                f"credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and that "
                                f"they may list, read, write and delete in the bucket") from None
            raise TierError(f"{self.name}: checking {self.where()} failed: {exc}") from None
        except self._network_errors as exc:
            raise TierError(f"{self.name}: cannot reach {self.config.endpoint_url or 'AWS S3'} ({exc}): "
                            f"check --s3-endpoint and that the service is up") from None

    def call(self, what: str, attempt_fn: Callable[[], T]) -> T:
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
            except Retryable as exc:
                self.breaker.record_failure()
                last = exc
            else:
                self.breaker.record_success()
                return result
            if attempt < self.config.retries:
                time.sleep(min(0.05 * 2**attempt, 1.0) * random.uniform(0.5, 1.0))
        raise TierUnavailableError(f"{self.name}: {what} failed after {self.config.retries + 1} attempts: {last}")

    def get_range(self, object_key: str, start: int, length: int) -> tuple[bytes, dict[str, str]]:
        """Bytes ``[start, start + length)`` of an object (fewer at its end) and its metadata."""

        def attempt() -> tuple[bytes, dict[str, str]]:
            response = self.client.get_object(Bucket=self.config.bucket, Key=object_key,
                                              Range=f"bytes={start}-{start + length - 1}")
            return response["Body"].read(), response.get("Metadata", {})

        return self.call(f"GET {object_key} [{start}:{start + length}]", attempt)


def stream_body(body, head: memoryview, payload: memoryview, hashers: tuple,
                sink: Callable[[memoryview], None] | None = None) -> None:
    """Copy a GET body into ``head`` then ``payload``, chunk by chunk, feeding each payload chunk
    to every one of ``hashers`` while it is in cache; with ``sink``, each payload chunk goes to it
    instead, in order (it puts the bytes in ``payload`` itself: a sealed payload, opened).

        body:  | head (len(head)) | payload (len(payload)) |
    """
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
            if split < n and sink is not None:
                sink(chunk[split:])
            elif split < n:
                at = pos + split - hlen
                payload[at : at + n - split] = chunk[split:]
                for hasher in hashers:
                    hasher.update(chunk[split:])
            pos += n
    finally:
        body.close()
    if pos != total:
        raise Retryable(f"connection closed after {pos} of {total} bytes")
