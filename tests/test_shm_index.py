"""The shared-memory key index: the table against a dict model, the reader's fallbacks, and a real
daemon whose clients answer Lookup from it exactly as the RPC does."""

from __future__ import annotations

import os
import random
import struct
import threading
import time

import grpc
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore import shm_index
from kvstore.shm_index import MIN_SLOTS, KeyIndexReader, KeyIndexWriter
from tests.test_daemon import BLOCK, NS, make_blocks
from tests.test_s3 import wait_for

TIERS = ["gpu", "cpu", "disk", "s3"]


def random_key(rng: random.Random) -> bytes:
    return rng.randbytes(16)


def expected_lookup(model: dict[bytes, int], keys: list[bytes], available: int = 0b1111):
    tiers = []
    for key in keys:
        mask = model.get(key, 0) & available
        if not mask:
            break
        tiers.append(TIERS[(mask & -mask).bit_length() - 1])
    return len(tiers), tuple(tiers)


@pytest.fixture
def writer():
    w = KeyIndexWriter(TIERS)
    yield w
    w.close()


def test_table_matches_a_dict_model_through_growth_and_tombstones(writer):
    rng = random.Random(7)
    model: dict[bytes, int] = {}
    reader = KeyIndexReader.attach(writer.name)
    # Enough distinct keys to grow the table twice, with churn that leaves many tombstones, and
    # colliding keys (same home slot) so probe chains are exercised.
    colliding = [bytes(8) + rng.randbytes(8) for _ in range(40)]
    colliding[0] = (1).to_bytes(8, "little") + colliding[0][8:]
    pool = [random_key(rng) for _ in range(3 * MIN_SLOTS)] + colliding
    first_name = writer.name
    for step in range(30_000):
        key = rng.choice(pool)
        level = rng.randrange(len(TIERS))
        if rng.random() < 0.6:
            writer.add(key, level)
            model[key] = model.get(key, 0) | (1 << level)
        else:
            writer.remove(key, level)
            if key in model:
                model[key] &= ~(1 << level)
                if not model[key]:
                    del model[key]
        if step % 3000 == 0:
            probe = rng.sample(pool, 64)
            for key in probe:
                assert reader.mask(key) == model.get(key, 0) or reader.lookup([key]) is not None
            run = [k for k in pool if k in model][:50]
            assert reader.lookup(run) == expected_lookup(model, run)  # follows a moved table
    assert writer.name != first_name, "the table never grew"
    writer.check_integrity(model)
    assert all(reader.lookup([k]) == expected_lookup(model, [k]) for k in pool[:2000] + colliding)
    reader.close()


def test_a_reader_of_the_first_table_follows_two_moves(writer):
    rng = random.Random(9)
    reader = KeyIndexReader.attach(writer.name)
    names = {writer.name}
    keys = []
    while len(names) < 3:  # grow twice before the reader looks again
        keys.append(random_key(rng))
        writer.add(keys[-1], 2)
        names.add(writer.name)
    assert reader.lookup(keys[:100]) == (100, ("disk",) * 100)
    assert reader.name == writer.name
    assert sorted(p.name for p in shm_index.SHM_DIR.glob(f"kvstore-index-{os.getpid()}-*")) == [writer.name]
    reader.close()


def test_lookup_stops_at_the_first_miss_and_honours_availability(writer):
    rng = random.Random(3)
    keys = [random_key(rng) for _ in range(6)]
    for i, key in enumerate(keys[:4]):
        writer.add(key, i % 4)
    writer.add(keys[0], 3)  # also in s3: the highest tier (gpu) is reported
    with_gap = keys[:2] + [keys[5]] + keys[2:4]
    reader = KeyIndexReader.attach(writer.name)
    assert reader.lookup(keys) == (4, ("gpu", "cpu", "disk", "s3"))
    assert reader.lookup(with_gap) == (2, ("gpu", "cpu"))
    assert reader.lookup([]) == (0, ())
    writer.tick([False, True, True, True])  # the gpu tier is unreadable: keys[0] comes from s3
    assert reader.lookup(keys) == (4, ("s3", "cpu", "disk", "s3"))
    writer.tick([True, True, True, False])  # s3 down: keys[3] is a miss
    assert reader.lookup(keys) == (3, ("gpu", "cpu", "disk"))
    reader.close()


def test_a_shared_tier_sends_misses_to_the_daemon():
    w = KeyIndexWriter(["cpu", "s3"], shared_tier=True)
    try:
        key, other = b"k" * 16, b"m" * 16
        w.add(key, 0)
        reader = KeyIndexReader.attach(w.name)
        assert reader.lookup([key]) == (1, ("cpu",))
        assert reader.lookup([key, other]) is None  # another host may have put `other` in S3
        reader.close()
    finally:
        w.close()


def test_reader_gives_up_on_a_stale_closed_or_busy_index(writer, monkeypatch):
    key = b"x" * 16
    writer.add(key, 1)
    reader = KeyIndexReader.attach(writer.name)
    assert reader.lookup([key]) == (1, ("cpu",))
    # A write in progress (odd seq) that never ends: bounded retries, then ask the daemon.
    struct.pack_into("<Q", writer._mm, 8, writer._seq + 1)
    assert reader.lookup([key]) is None
    struct.pack_into("<Q", writer._mm, 8, writer._seq)
    # No heartbeat for STALE_S: the daemon is gone or stuck.
    monkeypatch.setattr(shm_index, "STALE_S", 0.05)
    time.sleep(0.1)
    assert reader.lookup([key]) is None
    writer.tick([True] * 4)
    assert reader.lookup([key]) == (1, ("cpu",))
    name = writer.name
    writer.close()
    assert reader.lookup([key]) is None  # closed
    assert not (shm_index.SHM_DIR / name).exists()
    reader.close()


def test_a_full_dev_shm_disables_the_index_instead_of_crashing(writer, monkeypatch):
    reader = KeyIndexReader.attach(writer.name)
    rng = random.Random(5)

    def no_space(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    for _ in range(MIN_SLOTS // 2 + 1):  # the last add needs a larger table
        writer.add(random_key(rng), 0)
    assert reader.lookup([random_key(rng)]) is None  # closed: clients ask the daemon
    writer.add(random_key(rng), 1)  # later changes are ignored, not errors
    writer.check_integrity({})
    reader.close()


def test_attach_refuses_what_is_not_an_index(tmp_path):
    with pytest.raises(ValueError, match="must match"):
        KeyIndexReader.attach("../etc/passwd")
    name = f"kvstore-index-{os.getpid()}-{'0' * 12}"
    path = shm_index.SHM_DIR / name
    path.write_bytes(os.urandom(4096))
    try:
        with pytest.raises(ValueError, match="not a kvstore key index"):
            KeyIndexReader.attach(name)
    finally:
        path.unlink()


def test_stale_files_of_dead_daemons_are_removed():
    dead = 2**22 + 12345  # above the default pid_max: no such process
    path = shm_index.SHM_DIR / f"kvstore-index-{dead}-{'a' * 12}"
    path.write_bytes(b"x")
    live = KeyIndexWriter(["cpu"])
    try:
        assert shm_index.remove_stale_files() >= 1
        assert not path.exists() and (shm_index.SHM_DIR / live.name).exists()
    finally:
        path.unlink(missing_ok=True)
        live.close()


# -- through a real daemon -------------------------------------------------------------------


def test_clients_answer_lookup_locally_exactly_as_the_rpc_does(daemon_factory):
    # ~10 blocks fit the CPU tier: puts evict and demote to disk, Gets promote back.
    d = daemon_factory(cpu_capacity="1500KiB", write_policy="write-back")
    keys, payloads = make_blocks(24, seed=11)
    with KVStoreClient(d.address) as local, KVStoreClient(d.address, local_lookup=False) as remote:
        def same(probe):
            # Background promotions may move a block between the two lookups: equal once settled.
            def agree():
                a, b = local.lookup(probe), remote.lookup(probe)
                return (a,) if a == b else None
            return wait_for(agree, 5, "the local Lookup to equal the RPC's")[0]

        assert same(keys).hits == 0
        local.put(NS, [(k, 64, p) for k, p in zip(keys[:16], payloads[:16])])
        result = same(keys)
        assert result.hits == 16 and set(result.tiers) == {"cpu", "disk"}
        local.get(keys[:3], BLOCK)  # disk hits are promoted in the background
        wait_for(lambda: remote.lookup(keys[:3]).tiers == ("cpu",) * 3, 5, "the promotions")
        same(keys)
        assert local.delete([keys[5]]) == 1
        assert same(keys).hits == 5
        same(keys[6:16])
        local.put(NS, [(k, 64, p) for k, p in zip(keys[16:], payloads[16:])])
        same(keys[6:])
        local.clear(["cpu"])
        assert set(same(keys[6:]).tiers) == {"disk"}
        assert local.local_lookups == 7 and local.rpc_lookups == 0
        assert remote.local_lookups == 0
        # Wrong-sized keys go to the daemon, which says what is wrong.
        with pytest.raises(grpc.RpcError) as err:
            local.lookup([b"short"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d.stop()


def test_lookup_is_consistent_under_concurrent_writes(daemon_factory):
    """Readers never see a half-written table while the daemon puts and evicts."""
    d = daemon_factory(cpu_capacity="1500KiB", write_policy="write-back")
    keys, payloads = make_blocks(40, seed=12)
    stop = threading.Event()
    errors: list[str] = []

    def writer():
        with KVStoreClient(d.address) as client:
            i = 0
            while not stop.is_set():
                batch = [(keys[j % 40], 64, payloads[j % 40]) for j in range(i, i + 4)]
                client.put(NS, batch)
                i += 4

    local = []

    def reader():
        with KVStoreClient(d.address) as client:
            while not stop.is_set():
                result = client.lookup(keys)
                if len(result.tiers) != result.hits or not set(result.tiers) <= {"cpu", "disk"}:
                    errors.append(repr(result))
            local.append(client.local_lookups)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join()
    assert not errors and min(local) > 100
    d.stop()


def test_a_stopped_daemon_sends_lookups_back_to_grpc(daemon_factory):
    d = daemon_factory()
    keys, payloads = make_blocks(2, seed=13)
    client = KVStoreClient(d.address, timeout=2)
    client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    assert client.lookup(keys).hits == 2 and client.local_lookups == 1
    d.stop()
    with pytest.raises(grpc.RpcError):
        client.lookup(keys)  # the index says closed: the RPC then fails as it should
    assert client.rpc_lookups == 1
    client._channel.close()


def test_tenants_get_no_index(daemon_factory, short_tmp):
    tenants = short_tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntoken = "token-a-0123456789"\n')
    d = daemon_factory(tenants_file=str(tenants))
    keys, payloads = make_blocks(2, seed=14)
    with KVStoreClient(d.address, token="token-a-0123456789") as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        assert client.lookup(keys).hits == 2
        assert client.local_lookups == 0 and client.rpc_lookups == 1
