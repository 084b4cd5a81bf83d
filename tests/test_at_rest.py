"""Encryption at rest (issue 56): disk files and S3 objects sealed with AEGIS-256X4 under keys derived
from the server secret (tiers/at_rest.py). Real daemons on unix sockets, S3 through moto's server on
127.0.0.1: the bytes stored are not the payload, a restart reads them back, a tampered, swapped or
truncated block is a counted miss, and a daemon with another secret misses."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.block import MAGIC as PLAIN_MAGIC
from kvstore.block import BlockHeader, CorruptBlockError, payload_checksum
from kvstore.keys import KVLayout
from tests.test_daemon import BLOCK, NS, make_blocks
from tests.test_s3 import s3_settings, wait_for
from tiers import at_rest
from tiers.at_rest import AtRestKey
from tiers.disk import DiskTier, block_path

SMALL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")


def sealed_block(i: int, tokens: int = 77) -> tuple[BlockHeader, bytes]:
    rng = np.random.default_rng(i)
    payload = rng.integers(0, 256, SMALL.block_bytes(tokens), dtype=np.uint8).tobytes()
    header = BlockHeader(key=bytes([i]) * 16, namespace=b"n" * 16, layout=SMALL, tokens=tokens,
                         payload_len=len(payload), checksum=payload_checksum(payload),
                         token_ids=np.arange(1000, 1000 + tokens, dtype="<u4").tobytes() if tokens <= 4096 else b"")
    return header, payload


def shows_plaintext(stored: bytes, payload: bytes) -> bool:
    """Whether any 32-byte window of ``payload`` (taken every 4 KiB) appears in ``stored``."""
    return any(payload[at : at + 32] in stored for at in range(0, len(payload) - 32, 4096))


def read(tier, header: BlockHeader) -> bytes:
    dest = memoryview(bytearray(header.payload_len))
    tier.read_payload_into(header.key, dest)
    return bytes(dest)


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_a_sealed_disk_tier_hides_payload_and_token_ids_and_refuses_what_does_not_open(tmp_path, o_direct):
    """guarantees: encryption at rest, the disk tier alone (both read paths)."""
    if o_direct and not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    key = AtRestKey(os.urandom(32))
    tier = DiskTier(tmp_path, 1 << 24, fsync=False, o_direct=o_direct, at_rest=key)
    blocks = [sealed_block(i, tokens) for i, tokens in ((1, 1), (2, 77), (3, 1500))]  # 1500: several read chunks
    for header, payload in blocks:
        tier.put(header, memoryview(payload))
    try:
        assert [read(tier, h) for h, _ in blocks] == [p for _, p in blocks]
    except CorruptBlockError as exc:
        if o_direct and "Invalid argument" in str(exc):
            pytest.skip(f"filesystem of {tmp_path} refuses O_DIRECT")
        raise
    for header, payload in blocks:
        stored = block_path(tmp_path, header.key).read_bytes()
        assert len(stored) == header.block_len + at_rest.OVERHEAD and stored[:4] == at_rest.MAGIC
        assert not shows_plaintext(stored, payload) and header.token_ids[:32] not in stored
        assert header.pack()[:96] not in stored  # the header too: its namespace, key, layout
    tier.check_integrity()

    # A flipped payload byte, a header byte, a file of another block, one cut short: each refused.
    (h1, _), (h2, p2), (h3, _) = blocks
    path = block_path(tmp_path, h3.key)
    stored = bytearray(path.read_bytes())
    stored[len(stored) // 2] ^= 1
    path.write_bytes(stored)
    path2 = block_path(tmp_path, h2.key)
    stored2 = bytearray(path2.read_bytes())
    stored2[at_rest.OVERHEAD + 20] ^= 1
    path2.write_bytes(stored2)
    block_path(tmp_path, h1.key).write_bytes(block_path(tmp_path, h3.key).read_bytes()[: h1.block_len + at_rest.OVERHEAD])
    for header in (h1, h2, h3):
        with pytest.raises(CorruptBlockError):
            read(tier, header)
    tier.close()

    # Restarted with the same key, the good block is back; with another key, none is.
    blocks = [sealed_block(i) for i in (4, 5)]
    again = DiskTier(tmp_path, 1 << 24, fsync=False, o_direct=o_direct, at_rest=key)
    for header, payload in blocks:
        again.put(header, memoryview(payload))
    again.close()
    again = DiskTier(tmp_path, 1 << 24, fsync=False, o_direct=o_direct, at_rest=key)
    assert [read(again, h) for h, _ in blocks] == [p for _, p in blocks]
    again.close()
    other = DiskTier(tmp_path, 1 << 24, fsync=False, o_direct=o_direct, at_rest=AtRestKey(os.urandom(32)))
    assert len(other) == 0 and other.corrupt_on_start >= 2
    other.close()


def test_a_sealed_disk_write_refuses_a_payload_its_checksum_does_not_name(tmp_path):
    """A sealed read trusts the payload's AEAD tag for its checksum and hashes nothing
    (tiers/disk.py _read_sealed), so the write is where the payload is checked against its header's
    checksum: a block whose payload is not the one its checksum names is not written at all (a
    plain tier writes it and its reads find the mismatch)."""
    tier = DiskTier(tmp_path, 1 << 24, fsync=False, at_rest=AtRestKey(os.urandom(32)))
    header, payload = sealed_block(6, tokens=1500)
    altered = bytearray(payload)
    altered[len(altered) // 2] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum"):
        tier.put(header, memoryview(altered))
    assert len(tier) == 0 and not [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"]
    tier.check_integrity()
    tier.put(header, memoryview(payload))
    assert read(tier, header) == payload
    tier.close()


def test_sealed_and_plain_files_never_mix_in_one_folder(tmp_path):
    """Turning disk_encrypt on drops the plain files (no plain block stays on disk); off, the sealed ones."""
    plain = DiskTier(tmp_path, 1 << 24, fsync=False)
    header, payload = sealed_block(6)
    plain.put(header, memoryview(payload))
    assert block_path(tmp_path, header.key).read_bytes()[:4] == PLAIN_MAGIC
    plain.close()
    key = AtRestKey(os.urandom(32))
    sealed = DiskTier(tmp_path, 1 << 24, fsync=False, at_rest=key)
    assert len(sealed) == 0 and sealed.corrupt_on_start == 1 and not block_path(tmp_path, header.key).exists()
    sealed.put(header, memoryview(payload))
    sealed.close()
    plain = DiskTier(tmp_path, 1 << 24, fsync=False)
    assert len(plain) == 0 and plain.corrupt_on_start == 1
    plain.close()


def test_hostile_sealed_heads_are_refused_in_words():
    key = AtRestKey(os.urandom(32))
    for head in (b"", b"KVE1", b"KVB1" + bytes(200), b"KVE1\x01\x00\xff\xff" + bytes(100),
                 b"KVE1\x01\x00\x80\x00" + bytes(300), b"KVE1\x02\x00\xff\xff" + bytes(300),
                 b"KVE1\x02\x00\x80\x00" + bytes(100), b"KVE1\x02\x00\x80\x00" + os.urandom(400)):
        with pytest.raises(CorruptBlockError):
            key.open_head(head)


def test_the_cipher_is_aegis_256x4_and_a_payload_opens_in_any_chunking():
    """The binding computes AEGIS-256X4 as its CFRG draft defines it (test vector 1: the tag over
    nothing), and a payload sealed in one chunking opens in another, bit for bit; a flipped byte of
    the associated prefix, the tag or the payload does not open."""
    import aeg.aegis256x4 as aegis

    _, tag = aegis.encrypt_detached(bytes(range(32)), bytes(range(0x10, 0x30)), b"", None)
    assert bytes(tag).hex() == "3b7fee6cee7bf17888ad11ed2397beb4"

    rng = np.random.default_rng(5)
    key = AtRestKey(os.urandom(32))
    for trial in range(6):
        header, _ = sealed_block(trial, tokens=int(rng.integers(1, 300)))
        payload = rng.integers(0, 256, header.payload_len, dtype=np.uint8).tobytes()
        packed = header.pack()

        def cuts(n: int) -> list[int]:
            return [0, *sorted(set(rng.integers(1, n, size=int(rng.integers(0, 9))).tolist())), n]

        sealer = key.sealer(len(packed))
        sealed = bytearray(len(payload))
        edges = cuts(len(payload))
        for a, b in zip(edges, edges[1:]):
            sealer.seal_into(memoryview(payload)[a:b], memoryview(sealed)[a:b])
        head = sealer.seal_head(packed)
        assert len(head) == AtRestKey.head_len(len(packed)) and not shows_plaintext(bytes(sealed), payload)

        def opened(head: bytes, sealed: bytes) -> bytes:
            got = key.open_head(head)
            assert got.packed == packed
            out = bytearray(len(sealed))
            edges = cuts(len(sealed))
            for a, b in zip(edges, edges[1:]):
                got.payload.open_into(memoryview(sealed)[a:b], memoryview(out)[a:b])
            got.payload.finish()
            return bytes(out)

        assert opened(head, bytes(sealed)) == payload
        for where in (6, 12, 16, 60, 85, 100):  # header_len, key id, the nonces, the payload's tag, the header's
            bad = bytearray(head)
            bad[where] ^= 1
            with pytest.raises(CorruptBlockError):
                opened(bytes(bad), bytes(sealed))
        bad = bytearray(sealed)
        bad[int(rng.integers(len(bad)))] ^= 0x10
        with pytest.raises(CorruptBlockError):
            opened(head, bytes(bad))


def test_blocks_sealed_by_the_earlier_format_are_dropped_at_start_and_said_once(tmp_path, caplog):
    """Format 1 (AES-GCM) files in a sealed folder are told apart by their version byte: dropped at
    start, counted, one warning for them all; the tier works on."""
    key = AtRestKey(os.urandom(32))
    tier = DiskTier(tmp_path, 1 << 24, fsync=False, at_rest=key)
    blocks = [sealed_block(i) for i in range(20, 24)]
    for header, payload in blocks:
        tier.put(header, memoryview(payload))
    tier.close()
    for header, _ in blocks[:3]:
        path = block_path(tmp_path, header.key)
        stored = bytearray(path.read_bytes())
        assert at_rest.format_of(stored) == "sealed"
        stored[4] = 1
        path.write_bytes(stored)
        assert at_rest.format_of(stored) == "sealed-old"
    with caplog.at_level("WARNING", logger="tiers.disk"):
        tier = DiskTier(tmp_path, 1 << 24, fsync=False, at_rest=key)
    assert len(tier) == 1 and tier.corrupt_on_start == 3
    assert [r.getMessage() for r in caplog.records if "earlier" in r.getMessage()] == [
        "disk: dropped 3 block files sealed by an earlier kvstore's format (format 2 is read now)"]
    assert read(tier, blocks[3][0]) == blocks[3][1]
    tier.close()


def test_a_daemon_seals_its_disk_reads_it_back_after_restart_and_counts_bad_files(daemon_factory):
    """guarantees: encryption at rest, disk, through a real daemon: files hold no payload bytes; a
    restart reads them back; a tampered or swapped file is a miss counted as corrupt; a daemon
    started on the folder with another secret misses every block."""
    settings = {"cpu_capacity": "0", "disk_encrypt": "true", "log_level": "INFO"}  # Puts land on disk, the top tier
    d = daemon_factory("d0", **settings)
    keys, payloads = make_blocks(6, seed=31)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        assert client.stats()["tiers"]["disk"]["blocks"] == 6
    folder = d.folder / "disk"
    files = sorted(folder.glob("??/*.kvb"))
    assert len(files) == 6
    for path in files:
        stored = path.read_bytes()
        assert stored[:4] == at_rest.MAGIC
        assert not any(shows_plaintext(stored, p.tobytes()) for p in payloads)
    assert "codec as put, encrypted" in d.log.read_text()  # the start log says so
    d.stop()

    d = daemon_factory("d0", **settings)
    with KVStoreClient(d.address) as client:
        assert client.get(keys, BLOCK) == [p.tobytes() for p in payloads]
        # One file's byte flipped, another's bytes replaced by a third block's file.
        tampered = block_path(folder, keys[0])
        stored = bytearray(tampered.read_bytes())
        stored[-1000] ^= 0x40
        tampered.write_bytes(stored)
        block_path(folder, keys[1]).write_bytes(block_path(folder, keys[2]).read_bytes())
        got = client.get(keys, BLOCK)
        assert got[0] is None and got[1] is None and got[2:] == [p.tobytes() for p in payloads[2:]]
        stats = client.stats()
        assert stats["tiers"]["disk"]["corrupt"] == 2 and stats["tiers"]["disk"]["blocks"] == 4
        client.put(NS, [(keys[0], 64, payloads[0])])  # eviction and stores go on
        assert client.get(keys[:1], BLOCK) == [payloads[0].tobytes()]
    d.stop()

    other_secret = d.folder / "other-secret"
    d = daemon_factory("d0", **settings, tenant_secret_file=str(other_secret))
    with KVStoreClient(d.address) as client:
        assert client.get(keys, BLOCK) == [None] * 6
        assert client.stats()["tiers"]["disk"]["corrupt"] == 5  # dropped at start, counted


def test_a_daemon_seals_its_s3_objects_and_another_secret_misses(daemon_factory, moto_server, s3_bucket):
    """guarantees: encryption at rest, S3: objects hold no payload bytes and no MAC metadata is
    needed; a daemon started later reads them back; a tampered object is a counted miss; a daemon
    on the bucket with another secret indexes none of them (counted) and misses."""
    settings = s3_settings(moto_server.url, s3_bucket, s3_encrypt="true", disk_path="")
    a = daemon_factory("a", **settings)
    keys, payloads = make_blocks(4, seed=32)
    s3 = moto_server.client()
    with KVStoreClient(a.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        wait_for(lambda: client.stats()["tiers"]["s3"]["blocks"] == 4, what="write-behind to s3")
        client.clear(["cpu"])
        assert client.get(keys, BLOCK) == [p.tobytes() for p in payloads]
    listed = s3.list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert len(listed) == 4
    objects = {entry["Key"]: s3.get_object(Bucket=s3_bucket, Key=entry["Key"])["Body"].read() for entry in listed}
    for stored in objects.values():
        assert stored[:4] == at_rest.MAGIC
        assert not any(shows_plaintext(stored, p.tobytes()) for p in payloads)
    a.stop()

    b = daemon_factory("b", **settings)  # a restart elsewhere: lists the bucket, opens the heads
    with KVStoreClient(b.address) as client:
        wait_for(lambda: client.lookup(keys).hits == 4, what="listing")
        name = next(k for k in objects if keys[0].hex() in k)
        stored = bytearray(objects[name])
        stored[-7] ^= 1
        s3.put_object(Bucket=s3_bucket, Key=name, Body=bytes(stored))
        got = client.get(keys, BLOCK)
        assert got[0] is None and got[1:] == [p.tobytes() for p in payloads[1:]]
        assert client.stats()["tiers"]["s3"]["corrupt"] == 1

    c = daemon_factory("c", **settings, tenant_secret_file=str(b.folder / "other-secret"))
    with KVStoreClient(c.address) as client:
        wait_for(lambda: client.stats()["tiers"]["s3"]["corrupt"] >= 2, what="listing refusing the objects")
        assert client.lookup(keys).hits == 0 and client.get(keys, BLOCK) == [None] * 4


def test_a_sealed_s3_tier_reads_whole_and_ranged_objects_and_refuses_altered_ones(moto_server, s3_bucket):
    """guarantees: encryption at rest, the S3 tier alone: a small object read in one GET and a
    large one in ranged parts both open; a flipped byte in either is refused; the objects hold
    no payload bytes."""
    from tiers.s3 import S3Config, S3Tier

    key = AtRestKey(os.urandom(32))
    config = S3Config(bucket=s3_bucket, endpoint_url=moto_server.url, part_bytes=5 * 2**20)
    tier = S3Tier(config, list_on_start=False, at_rest=key)
    blocks = [sealed_block(7, 77), sealed_block(8, 6000)]  # 6000 tokens: 12 MB, read in ranged parts
    blocks = [(tier.put_checksummed(h, memoryview(p)), p) for h, p in blocks]
    assert [read(tier, h) for h, _ in blocks] == [p for _, p in blocks]
    s3 = moto_server.client()
    for header, payload in blocks:
        name = tier._object_key(header.key)
        stored = bytearray(s3.get_object(Bucket=s3_bucket, Key=name)["Body"].read())
        assert len(stored) == header.block_len + at_rest.OVERHEAD and not shows_plaintext(bytes(stored), payload)
        stored[len(stored) * 2 // 3] ^= 0x10
        s3.put_object(Bucket=s3_bucket, Key=name, Body=bytes(stored))
        with pytest.raises(CorruptBlockError):
            read(tier, header)
    tier.close()
