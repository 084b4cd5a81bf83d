"""The S3 tier against moto's server on 127.0.0.1 (real HTTP, boto3 unchanged): the tier alone,
then daemons as subprocesses: write-behind through cpu -> disk -> s3, the endpoint dying and coming
back, bad buckets and credentials at start, and two daemons sharing one bucket."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.block import BlockHeader, CorruptBlockError, payload_checksum
from kvstore.keys import KVLayout, Namespace
from tests.conftest import ROOT, MotoServer, free_port
from tests.test_daemon import BLOCK, NS, make_blocks
from tiers.base import TierUnavailableError
from tiers.s3 import S3Config, S3Tier


def make_header(i: int, layout: KVLayout, tokens: int) -> tuple[BlockHeader, memoryview]:
    rng = np.random.default_rng(i)
    payload = memoryview(rng.integers(0, 256, layout.block_bytes(tokens), dtype=np.uint8).tobytes())
    key = i.to_bytes(4, "little") * 4
    header = BlockHeader(key=key, namespace=b"n" * 16, layout=layout, tokens=tokens,
                         payload_len=len(payload), checksum=payload_checksum(payload))
    return header, payload


SMALL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")


def s3_tier(moto_server, bucket, **settings) -> S3Tier:
    tier = S3Tier(S3Config(bucket=bucket, endpoint_url=moto_server.url, **settings))
    assert tier.listed.wait(10)
    return tier


def read(tier: S3Tier, header: BlockHeader) -> bytes:
    dest = memoryview(bytearray(header.payload_len))
    assert tier.read_payload_into(header.key, dest) == header
    return bytes(dest)


def test_tier_round_trip_listing_and_corruption(moto_server, s3_bucket):
    tier = s3_tier(moto_server, s3_bucket)
    blocks = [make_header(i, SMALL, 64) for i in range(5)]
    for header, payload in blocks:
        tier.put(header, payload)
    assert all(read(tier, h) == bytes(p) for h, p in blocks)
    assert tier.delete(blocks[4][0].key) == blocks[4][0].block_len and blocks[4][0].key not in tier
    tier.check_integrity()

    # A second tier on the same prefix rebuilds its index by listing the bucket.
    again = s3_tier(moto_server, s3_bucket)
    assert sorted(again.keys()) == sorted(h.key for h, _ in blocks[:4])
    assert sorted(again.take_new_keys()) == sorted(again.keys())
    assert read(again, blocks[0][0]) == bytes(blocks[0][1])

    # A flipped payload byte in the bucket is caught by the checksum on read.
    object_key = tier._object_key(blocks[1][0].key)
    body = bytearray(moto_server.client().get_object(Bucket=s3_bucket, Key=object_key)["Body"].read())
    body[-1] ^= 0xFF
    moto_server.client().put_object(Bucket=s3_bucket, Key=object_key, Body=bytes(body))
    with pytest.raises(CorruptBlockError, match="checksum"):
        read(again, blocks[1][0])
    # discover(): a key stored after the index was built is found; an absent one is cached as absent.
    late, payload = make_header(99, SMALL, 64)
    tier.put(late, payload)
    assert late.key not in again
    assert again.discover([late.key, b"z" * 16], timeout_s=2.0) == [late.key]
    assert read(again, late) == bytes(payload)
    assert b"z" * 16 in again._absent_until
    tier.close()
    again.close()


def test_large_block_goes_multipart_and_reads_ranged(moto_server, s3_bucket):
    big = KVLayout(num_layers=24, num_kv_heads=4, head_dim=64, dtype="float16")
    header, payload = make_header(7, big, 512)  # 12 MiB: three 5 MiB parts
    tier = s3_tier(moto_server, s3_bucket, part_bytes=5 * 2**20)
    tier.put(header, payload)
    head = moto_server.client().head_object(Bucket=s3_bucket, Key=tier._object_key(header.key))
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # a multipart upload of 3 parts
    assert head["ContentLength"] == header.block_len
    assert read(tier, header) == bytes(payload)  # three ranged GETs in parallel
    tier.close()


class TcpProxy:
    """127.0.0.1:port -> target port; stop() kills the endpoint as the daemon sees it (refused
    connections, open ones cut) while moto keeps its data; start() brings it back on the same port."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.target = target_port
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "TcpProxy":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._listener.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except OSError:
                pass
        self._conns = []


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def s3_settings(endpoint: str, bucket: str, **more) -> dict:
    return {"s3_endpoint": endpoint, "s3_bucket": bucket, **more}


def test_daemon_writes_behind_through_every_tier_and_serves_from_s3(daemon_factory, moto_server, s3_bucket):
    d = daemon_factory(**s3_settings(moto_server.url, s3_bucket, s3_codec="int8"))
    keys, payloads = make_blocks(6, seed=11)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        stats = wait_for(lambda: (s := client.stats())["tiers"]["s3"]["blocks"] == 6 and s, what="write-behind to s3")
        assert stats["tiers"]["disk"]["blocks"] == 6 and stats["queue_depth"] == 0
        client.clear(["cpu", "disk"])
        assert client.lookup(keys).tiers == ("s3",) * 6
        with client.fetch(keys, BLOCK) as fetched:
            # s3_codec int8: the copy written to S3 was re-encoded on its way down.
            assert [b.tier for b in fetched] == ["s3"] * 6
            assert all(b.codec.startswith("int8") and len(b.payload) < BLOCK for b in fetched)
        # The S3 hits were promoted back to the top, and from there written behind to disk again.
        wait_for(lambda: client.lookup(keys).tiers == ("cpu",) * 6, what="promotion to cpu")
        wait_for(lambda: client.stats()["tiers"]["disk"]["blocks"] == 6, what="disk refilled")


def test_two_daemons_share_one_bucket(daemon_factory, moto_server, s3_bucket):
    a = daemon_factory("a", **s3_settings(moto_server.url, s3_bucket))
    b = daemon_factory("b", **s3_settings(moto_server.url, s3_bucket))  # listed the bucket empty
    keys, payloads = make_blocks(4, seed=12)
    with KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb:
        assert cb.lookup(keys).hits == 0  # and now those keys are cached as absent for a few seconds
        ca.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        wait_for(lambda: ca.stats()["tiers"]["s3"]["blocks"] == 4, what="a's write-behind")
        result = wait_for(lambda: (r := cb.lookup(keys)).hits == 4 and r, timeout=10, what="b discovering a's blocks")
        assert result.tiers == ("s3",) * 4
        assert cb.get(keys, BLOCK) == [p.tobytes() for p in payloads]
    # A daemon started later finds them by listing the prefix.
    c = daemon_factory("c", **s3_settings(moto_server.url, s3_bucket))
    with KVStoreClient(c.address) as cc:
        assert cc.get(keys, BLOCK) == [p.tobytes() for p in payloads]


def test_endpoint_down_costs_fast_misses_and_tier_recovers(daemon_factory, moto_server, s3_bucket):
    proxy = TcpProxy(moto_server.port).start()
    d = daemon_factory(**s3_settings(proxy.url, s3_bucket, disk_path=""))
    keys, payloads = make_blocks(6, seed=13)
    expected = [p.tobytes() for p in payloads]
    try:
        with KVStoreClient(d.address) as client:
            client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
            wait_for(lambda: client.stats()["tiers"]["s3"]["blocks"] == 6, what="write-behind to s3")
            client.clear(["cpu"])
            proxy.stop()

            start = time.monotonic()
            assert client.get(keys, BLOCK) == [None] * 6  # misses, not errors
            first = time.monotonic() - start
            start = time.monotonic()
            assert client.lookup(keys).hits == 0  # breaker open: s3 blocks do not count as hits
            assert client.get(keys, BLOCK) == [None] * 6
            again = time.monotonic() - start
            assert first < 3.0 and again < 0.5, (first, again)

            more_keys, more = make_blocks(2, seed=14)
            start = time.monotonic()
            client.put(NS, [(k, 64, p) for k, p in zip(more_keys, more)])  # the top tier takes it
            assert time.monotonic() - start < 1.0
            wait_for(lambda: client.stats()["write_errors"] > 0, what="a counted s3 write error")

            proxy.start()  # back: after the cooldown the next request is the probe that closes it
            got = wait_for(lambda: (g := client.get(keys, BLOCK)) == expected and g, timeout=10,
                           what="reads from s3 after recovery")
            assert got == expected
            assert client.lookup(keys).hits == 6
            stats = client.stats()
            assert stats["misses"] >= 12 and stats["tiers"]["s3"]["hits"] >= 6
    finally:
        proxy.stop()


def test_breaker_fails_fast_while_open_then_probes():
    from tiers.s3 import CircuitBreaker

    now = [0.0]
    breaker = CircuitBreaker(failures=3, cooldown_s=2.0, clock=lambda: now[0])
    changes: list[str] = []  # the tier's availability is published on each (BlockStore.publish_availability)
    breaker.on_change = lambda: changes.append(breaker.state)
    for _ in range(3):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow() and changes == ["open"]
    now[0] = 2.5
    assert breaker.allow() and not breaker.allow()  # one probe, others still refused
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow() and changes == ["open", "open"]
    now[0] = 5.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow() and breaker.opened == 1
    assert changes == ["open", "open", "closed"]
    breaker.record_success()  # closed already: no change
    assert changes == ["open", "open", "closed"]


def serve_args(tmp, endpoint: str, bucket: str) -> list[str]:
    return [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{tmp}/k.sock", "--cpu-capacity",
            "16MiB", "--disk-path", "", "--s3-endpoint", endpoint, "--s3-bucket", bucket]


def test_missing_bucket_fails_at_start_with_the_fix(moto_server, s3_bucket, short_tmp):
    done = subprocess.run(serve_args(short_tmp, moto_server.url, "no-such-bucket"), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "bucket 'no-such-bucket' does not exist" in done.stderr and "create it" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_wrong_credentials_fail_at_start_with_the_fix(short_tmp, monkeypatch):
    # moto accepts any key by default; with IAM checks on from the first request it answers an
    # unknown access key with a real 403 InvalidAccessKeyId, as AWS, MinIO and Ceph do.
    server = MotoServer(short_tmp, require_auth=True).start()
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        done = subprocess.run(serve_args(short_tmp, server.url, "some-bucket"), cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    finally:
        server.stop()
    assert done.returncode != 0
    assert "denied" in done.stderr and "credentials" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
