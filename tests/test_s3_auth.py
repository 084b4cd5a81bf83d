"""Shared storage is authenticated, and discovery is bounded (issue #39), against moto's server on
127.0.0.1 (real HTTP, boto3 unchanged): objects forged by someone who may write to the bucket but
lacks the hosts' secret, written under another secret, or by a daemon older than MACs, are never
indexed or served; a Lookup of 20,000 unknown keys costs a window of requests and delays nobody."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.host import s3_mac_key
from kvstore.block import BlockHeader, CorruptBlockError, payload_checksum
from kvstore.keys import KVLayout
from tests.test_daemon import BLOCK, NS, make_blocks
from tests.test_s3 import SMALL, make_header, wait_for
from tiers.s3 import S3Config, S3Tier
from tiers.s3_auth import BLOCK_FIELD, HEAD_FIELD, NONCE_FIELD, ObjectMac
from tiers.s3_discovery import DISCOVER_MAX_KEYS, DISCOVER_WINDOW

KEY = b"k" * 32  # the hosts' shared MAC key in the tier tests
OTHER_KEY = b"o" * 32  # a host with another secret


def s3_tier(moto_server, bucket: str, mac_key: bytes = KEY, list_on_start: bool = True, **settings) -> S3Tier:
    tier = S3Tier(S3Config(bucket=bucket, endpoint_url=moto_server.url, **settings), mac_key=mac_key,
                  list_on_start=list_on_start)
    assert tier.listed.wait(10)
    return tier


def read(tier: S3Tier, header: BlockHeader) -> bytes:
    dest = memoryview(bytearray(header.payload_len))
    assert tier.read_payload_into(header.key, dest) == header
    return bytes(dest)


def forge(genuine: BlockHeader, seed: int) -> tuple[bytes, bytes]:
    """What someone without the secret writes: another payload under the same key, its header's
    checksum recomputed with kvstore's own block encoder. Returns (object bytes, payload)."""
    payload = np.random.default_rng(seed).integers(0, 256, genuine.payload_len, dtype=np.uint8).tobytes()
    header = BlockHeader(key=genuine.key, namespace=genuine.namespace, layout=genuine.layout, tokens=genuine.tokens,
                         payload_len=len(payload), checksum=payload_checksum(payload))
    return header.pack() + payload, payload


def macs(key: bytes, header: BlockHeader, payload) -> dict[str, str]:
    """The metadata a host holding ``key`` gives the object of ``header`` and ``payload``."""
    mac = ObjectMac(key)
    hasher = mac.block_hasher()
    hasher.update(payload)
    return mac.metadata(header.pack(), hasher, mac.block(hasher, header.pack(), len(payload)))


def rewrite(moto_server, bucket: str, object_key: str, body: bytes, metadata: dict[str, str] | None = None) -> None:
    moto_server.client().put_object(Bucket=bucket, Key=object_key, Body=body, Metadata=metadata or {})


def test_forged_object_is_refused_and_never_served(moto_server, s3_bucket):
    """(a) An attacker rewrites an object with another payload and a recomputed checksum, keeping
    the genuine MACs (the best it can do): a host with the secret never indexes it (counted), and
    a host that indexed the genuine block finds it corrupt on read."""
    writer = s3_tier(moto_server, s3_bucket)
    header, payload = make_header(1, SMALL, 64)
    writer.put(header, payload)
    object_key = writer._object_key(header.key)
    genuine = moto_server.client().get_object(Bucket=s3_bucket, Key=object_key)
    body, forged = forge(header, seed=99)
    rewrite(moto_server, s3_bucket, object_key, body, genuine["Metadata"])

    reader = s3_tier(moto_server, s3_bucket)  # lists the bucket after the rewrite
    assert header.key not in reader and reader.corrupt_on_start == 1  # indexed, it would be served
    assert reader.discover([header.key], timeout_s=2.0) == []
    # refused twice, by the listing and by discovery: both counted (kvstore_corrupt_blocks_total)
    assert reader.take_refused() == 2 and reader.take_refused() == 0
    assert header.key not in reader

    with pytest.raises(CorruptBlockError):  # the writer indexed the genuine header
        read(writer, header)

    # The genuine bytes, MAC'd under another secret: the block MAC is checked on every read.
    rewrite(moto_server, s3_bucket, object_key, header.pack() + bytes(payload), macs(OTHER_KEY, header, payload))
    with pytest.raises(CorruptBlockError, match="block MAC does not match"):
        read(writer, header)
    assert forged != bytes(payload) and set(genuine["Metadata"]) == {NONCE_FIELD, HEAD_FIELD, BLOCK_FIELD}
    writer.close()
    reader.close()


def test_forged_large_object_fails_the_mac_on_a_ranged_read(moto_server, s3_bucket):
    """The block MAC is checked on the ranged-GET path too (objects over ``part_bytes``)."""
    big = KVLayout(num_layers=24, num_kv_heads=4, head_dim=64, dtype="float16")
    header, payload = make_header(3, big, 256)  # 6 MiB: two 5 MiB parts
    tier = s3_tier(moto_server, s3_bucket, part_bytes=5 * 2**20)
    tier.put(header, payload)
    assert read(tier, header) == bytes(payload)
    object_key = tier._object_key(header.key)
    rewrite(moto_server, s3_bucket, object_key, header.pack() + bytes(payload), macs(OTHER_KEY, header, payload))
    with pytest.raises(CorruptBlockError, match="block MAC"):
        read(tier, header)
    tier.close()


def test_other_secret_and_old_objects_are_misses(moto_server, s3_bucket):
    """(b) Blocks written under another secret and (c) objects without MACs, as a daemon older
    than MACs wrote them, are neither indexed (listing, discovery) nor served."""
    stranger = s3_tier(moto_server, s3_bucket, mac_key=OTHER_KEY)
    theirs, their_payload = make_header(5, SMALL, 64)
    stranger.put(theirs, their_payload)
    old, old_payload = make_header(6, SMALL, 64)
    rewrite(moto_server, s3_bucket, stranger._object_key(old.key), old.pack() + bytes(old_payload))

    reader = s3_tier(moto_server, s3_bucket)
    assert theirs.key not in reader and old.key not in reader and reader.corrupt_on_start == 2
    assert reader.discover([theirs.key], 2.0) == [] and reader.discover([old.key], 2.0) == []
    assert reader.take_refused() == 4  # each refused by the listing and by discovery, each time counted
    assert len(reader) == 0
    # The stranger reads its own blocks; it refuses ours as we refuse its. (Ours is put as a top
    # tier puts: its checksum computed in the pass that makes its MAC.)
    ours, our_payload = make_header(7, SMALL, 64)
    assert reader.put_checksummed(dataclasses.replace(ours, checksum=0), our_payload) == ours
    assert read(reader, ours) == bytes(our_payload)
    assert read(stranger, theirs) == bytes(their_payload)
    assert stranger.discover([ours.key], 2.0) == [] and ours.key not in stranger
    stranger.close()
    reader.close()


def legacy_macs(key: bytes, header: BlockHeader, payload) -> dict[str, str]:
    """The metadata a host gave objects before the AEGIS block MAC: BLAKE2b of the header, and of
    payload || header || lengths (written out here, so the test does not lean on the tier's code)."""
    import hashlib

    packed = header.pack()
    head = hashlib.blake2b(packed, digest_size=32, key=key, person=b"kvs-s3-head")
    block = hashlib.blake2b(bytes(payload) + packed + len(packed).to_bytes(8, "little")
                            + len(payload).to_bytes(8, "little"), digest_size=32, key=key, person=b"kvs-s3-block")
    return {"kvstore-head-mac": head.hexdigest(), "kvstore-mac": block.hexdigest()}


def test_objects_macd_before_aegis_are_still_read_and_checked(moto_server, s3_bucket):
    """An object a host wrote with BLAKE2b MACs is indexed and served by this one, and refused when
    forged; an object written now carries no field an older host reads as a head MAC (it refuses
    it at listing and leaves it, instead of indexing it and deleting it when its block MAC reads)."""
    writer = s3_tier(moto_server, s3_bucket)
    old, old_payload = make_header(8, SMALL, 64)
    rewrite(moto_server, s3_bucket, writer._object_key(old.key), old.pack() + bytes(old_payload),
            legacy_macs(KEY, old, old_payload))
    forged_header, forged_payload = make_header(9, SMALL, 64)
    body, _ = forge(forged_header, seed=5)
    rewrite(moto_server, s3_bucket, writer._object_key(forged_header.key), body,
            legacy_macs(KEY, forged_header, forged_payload))  # genuine MACs of other bytes
    new, new_payload = make_header(10, SMALL, 64)
    writer.put(new, new_payload)
    stored = moto_server.client().get_object(Bucket=s3_bucket, Key=writer._object_key(new.key))["Metadata"]
    assert "kvstore-head-mac" not in stored and "kvstore-mac" not in stored

    reader = s3_tier(moto_server, s3_bucket)
    assert old.key in reader and new.key in reader and forged_header.key not in reader
    assert read(reader, old) == bytes(old_payload) and read(reader, new) == bytes(new_payload)
    genuine = legacy_macs(KEY, old, old_payload)
    rewrite(moto_server, s3_bucket, writer._object_key(old.key), old.pack() + bytes(forged_payload[: len(old_payload)]),
            genuine)  # the indexed header, another payload, the genuine legacy MACs
    with pytest.raises(CorruptBlockError):
        read(reader, old)
    writer.close()
    reader.close()


@pytest.mark.parametrize("nonce", ["", "zz" * 32, "00" * 31, "00" * 33, None])
def test_a_hostile_mac_nonce_is_refused_in_words(moto_server, s3_bucket, nonce):
    """An object whose nonce is missing, not hex, too short or too long, or another object's, is
    refused at listing and discovery (counted), and a read of it fails as corrupt."""
    writer = s3_tier(moto_server, s3_bucket)
    header, payload = make_header(11, SMALL, 64)
    writer.put(header, payload)
    object_key = writer._object_key(header.key)
    metadata = dict(moto_server.client().get_object(Bucket=s3_bucket, Key=object_key)["Metadata"])
    if nonce is None:  # another object's nonce: the head MAC binds the nonce
        other, other_payload = make_header(12, SMALL, 64)
        writer.put(other, other_payload)
        metadata[NONCE_FIELD] = moto_server.client().get_object(
            Bucket=s3_bucket, Key=writer._object_key(other.key))["Metadata"][NONCE_FIELD]
    elif nonce:
        metadata[NONCE_FIELD] = nonce
    else:
        del metadata[NONCE_FIELD]
    rewrite(moto_server, s3_bucket, object_key, header.pack() + bytes(payload), metadata)
    reader = s3_tier(moto_server, s3_bucket)
    assert header.key not in reader and reader.discover([header.key], 2.0) == []
    with pytest.raises(CorruptBlockError, match="MAC"):
        read(writer, header)
    writer.close()
    reader.close()


def test_daemons_serve_only_blocks_made_under_their_secret(daemon_factory, moto_server, s3_bucket, short_tmp):
    """Daemons a and c share a secret, b has another; all share the bucket. c serves a's blocks,
    never b's, a forger's or an old daemon's, and an object stripped of its MACs after c indexed
    it is a counted corrupt miss on read."""
    s3 = {"s3_endpoint": moto_server.url, "s3_bucket": s3_bucket, "disk_path": ""}
    shared, own = str(short_tmp / "secret-shared"), str(short_tmp / "secret-b")
    a = daemon_factory("a", tenant_secret_file=shared, **s3)
    b = daemon_factory("b", tenant_secret_file=own, **s3)
    c = daemon_factory("c", tenant_secret_file=shared, **s3)
    a_keys, a_blocks = make_blocks(3, seed=21)
    b_keys, b_blocks = make_blocks(3, seed=22)
    forged_keys, _ = make_blocks(2, seed=23)
    old_keys, old_blocks = make_blocks(2, seed=24)
    with KVStoreClient(a.address) as ca, KVStoreClient(b.address) as cb, KVStoreClient(c.address) as cc:
        ca.put(NS, [(k, 64, p) for k, p in zip(a_keys, a_blocks)])
        cb.put(NS, [(k, 64, p) for k, p in zip(b_keys, b_blocks)])
        wait_for(lambda: ca.stats()["tiers"]["s3"]["blocks"] == 3 and cb.stats()["tiers"]["s3"]["blocks"] == 3,
                 what="write-behind to s3")
        prefix = S3Config(bucket=s3_bucket).key_prefix

        def object_key(key: bytes) -> str:
            return f"{prefix}{key.hex()[:2]}/{key.hex()}.kvb"

        # A forger copies the MACs of one of a's objects; an old daemon wrote its blocks without any.
        a_macs = moto_server.client().head_object(Bucket=s3_bucket, Key=object_key(a_keys[0]))["Metadata"]
        for key, payload in zip(forged_keys + old_keys, [None, None] + old_blocks):
            header = BlockHeader(key=key, namespace=NS.id, layout=NS.layout, tokens=64, payload_len=BLOCK, checksum=0)
            if payload is None:
                body, _ = forge(header, seed=int.from_bytes(key[:4], "little"))
                rewrite(moto_server, s3_bucket, object_key(key), body, a_macs)
            else:
                header = BlockHeader(key=key, namespace=NS.id, layout=NS.layout, tokens=64, payload_len=BLOCK,
                                     checksum=payload_checksum(payload.tobytes()))
                rewrite(moto_server, s3_bucket, object_key(key), header.pack() + payload.tobytes())

        assert wait_for(lambda: cc.lookup(a_keys).hits == 3, timeout=10, what="c discovering a's blocks")
        assert cc.get(a_keys, BLOCK) == [p.tobytes() for p in a_blocks]
        for keys in (b_keys, forged_keys, old_keys):
            assert cc.lookup(keys).hits == 0
            assert cc.get(keys, BLOCK) == [None] * len(keys)
        assert "refused the object of key" in c.log.read_text()

        # An object c indexed, rewritten with the same bytes but no MACs: a counted corrupt miss on read.
        wait_for(lambda: cc.lookup(a_keys).tiers == ("cpu",) * 3 and cc.stats()["queue_depth"] == 0,
                 what="c's promotions")
        cc.clear(["cpu"])
        refused = cc.stats()["tiers"]["s3"]["corrupt"]   # objects refused at discovery count as corrupt too
        assert refused >= 7                              # b's 3, the forger's 2, the old daemon's 2
        body = moto_server.client().get_object(Bucket=s3_bucket, Key=object_key(a_keys[0]))["Body"].read()
        rewrite(moto_server, s3_bucket, object_key(a_keys[0]), body)
        assert cc.get(a_keys[:1], BLOCK) == [None]
        assert cc.stats()["tiers"]["s3"]["corrupt"] == refused + 1


class RequestCounter:
    """Counts the GETs a boto3 client sends (its ``before-send`` event: every request, on the wire)."""

    def __init__(self, tier: S3Tier) -> None:
        self.count = 0
        self._lock = threading.Lock()
        tier._s3.meta.events.register("before-send.s3.GetObject", self._sent)

    def _sent(self, **kwargs) -> None:
        with self._lock:
            self.count += 1


def test_discovery_of_a_flood_is_bounded_and_delays_nobody(moto_server, s3_bucket):
    """(d) Discovering 20,000 unknown keys for a Lookup asks in order and stops at the first absent
    one: a window of requests, not 20,000; repeated, none. For a Get (each key wanted) it asks at
    most ``DISCOVER_MAX_KEYS``. Floods from several callers at once leave another caller's
    discovery of a present key quick."""
    writer = s3_tier(moto_server, s3_bucket)
    present = [make_header(i, SMALL, 64)[0].key for i in range(10, 15)]
    for i in range(10, 15):
        writer.put(*make_header(i, SMALL, 64))
    tier = s3_tier(moto_server, s3_bucket, list_on_start=False)
    counter = RequestCounter(tier)

    unknown = [os.urandom(16) for _ in range(20_000)]
    start = time.monotonic()
    assert tier.discover(unknown, timeout_s=0.5, stop_at_absent=True) == []
    took = time.monotonic() - start
    time.sleep(0.5)  # anything still queued would be sent by now
    assert counter.count <= DISCOVER_WINDOW and took < 1.0, (counter.count, took)
    sent = counter.count
    assert tier.discover(unknown, timeout_s=0.5, stop_at_absent=True) == [] and counter.count == sent  # remembered

    more = [os.urandom(16) for _ in range(20_000)]
    start = time.monotonic()
    assert tier.discover(more, timeout_s=2.0) == []
    took = time.monotonic() - start
    time.sleep(0.5)
    assert counter.count - sent <= DISCOVER_MAX_KEYS and took < 2.5, (counter.count - sent, took)

    # In order: a Lookup's finds end at the first absent key; a Get's go on past it (to the cap).
    gap = os.urandom(16)
    assert tier.discover([present[0], present[1], gap, present[2]], timeout_s=2.0, stop_at_absent=True) \
        == [present[0], present[1]]
    assert tier.discover([gap, present[3]], timeout_s=2.0) == [present[3]]

    # Four callers flooding at once, each asking for a Get (its whole cap); another caller's
    # present key is still found within a fraction of its timeout (it waits behind their windows).
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():  # new keys each time: never remembered absent
            tier.discover([os.urandom(16) for _ in range(DISCOVER_MAX_KEYS)] + unknown, timeout_s=0.5)

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for thread in flooders:
        thread.start()
    try:
        time.sleep(0.3)
        start = time.monotonic()
        assert tier.discover([present[4]], timeout_s=2.0) == [present[4]]
        assert time.monotonic() - start < 1.0
    finally:
        stop.set()
        for thread in flooders:
            thread.join(5)
    writer.close()
    tier.close()


def test_mac_key_is_derived_apart_from_tenant_keys(tmp_path):
    from kvstore.daemon.auth import tenant_key
    from kvstore.host import load_secret

    secret_file = tmp_path / "secret"
    key = s3_mac_key(secret_file)
    assert len(key) == 32 and key == s3_mac_key(secret_file)
    secret = load_secret(secret_file)
    assert key != tenant_key(secret, "") and key not in (secret, secret[:32])
    (tmp_path / "other").write_bytes(os.urandom(32))
    (tmp_path / "other").chmod(0o600)
    assert s3_mac_key(tmp_path / "other") != key
