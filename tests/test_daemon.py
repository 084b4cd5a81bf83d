"""The daemon as a real subprocess on a unix socket: both transports, tiers, restart, faults, bad input."""

from __future__ import annotations

import multiprocessing
import os
import stat
import urllib.request
from concurrent.futures import ProcessPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.keys import KVLayout, Namespace, prefix_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

LAYOUT = KVLayout(num_layers=6, num_kv_heads=3, head_dim=64, dtype="float16")
NS = Namespace("test-model", LAYOUT, chunk_tokens=64)
BLOCK = LAYOUT.block_bytes(64)  # 147 KiB


def make_blocks(n: int, seed: int = 0, ns: Namespace = NS):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50000, size=n * ns.chunk_tokens)
    keys = prefix_keys(ns, tokens)
    payloads = [rng.standard_normal(BLOCK // 2).astype(np.float16) for _ in keys]
    return keys, payloads


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "inline"])
def test_round_trip_through_cpu_and_disk(daemon_factory, shared_memory):
    # A CPU tier of ~10 blocks: 30 blocks force most of them down to disk.
    d = daemon_factory(cpu_capacity="1500KiB", write_policy="write-back")
    keys, payloads = make_blocks(30, seed=1)
    with KVStoreClient(d.address, shared_memory=shared_memory) as client:
        assert client.shared_memory == shared_memory
        assert client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)]) == 30
        result = client.lookup(keys)
        assert result.hits == 30 and {"cpu", "disk"} == set(result.tiers)
        got = client.get(keys, BLOCK)
        assert all(g == p.tobytes() for g, p in zip(got, payloads))
        stats = client.stats()
        assert stats["tiers"]["disk"]["hits"] > 0 and stats["tiers"]["cpu"]["evictions"] > 0


def test_restart_keeps_disk_blocks(daemon_factory):
    d = daemon_factory(write_policy="write-through")
    keys, payloads = make_blocks(5, seed=2)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    assert d.stop() == 0  # SIGTERM drains the write-through queue
    d.start()
    with KVStoreClient(d.address) as client:
        assert client.lookup(keys).tiers == ("disk",) * 5
        assert client.get(keys, BLOCK) == [p.tobytes() for p in payloads]


def test_corrupt_disk_block_under_a_running_daemon_is_a_miss(daemon_factory):
    d = daemon_factory(cpu_capacity="1MiB", write_policy="write-back", promote_on_get="false")
    keys, payloads = make_blocks(12, seed=3)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        assert client.lookup(keys).tiers[0] == "disk"
        path = d.folder / "disk" / keys[0].hex()[:2] / f"{keys[0].hex()}.kvb"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        assert client.get(keys[:2], BLOCK) == [None, payloads[1].tobytes()]
        assert client.lookup(keys).hits == 0
        stats = client.stats()
        # the Get's miss, and the 12 keys the local Lookup missed (reported with the Stats call)
        assert stats["tiers"]["disk"]["corrupt"] == 1 and stats["misses"] == 1 + 12


def _client_worker(args):
    address, seed = args
    keys, payloads = make_blocks(6, seed=100 + seed)
    with KVStoreClient(address) as client:
        for _ in range(3):
            client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
            got = client.get(keys, BLOCK)
            for g, p in zip(got, payloads):
                if g is not None and g != p.tobytes():
                    return "mixed up"
        return "ok" if client.lookup(keys).hits == 6 else "lost"


def test_eight_concurrent_clients_lose_and_mix_nothing(daemon_factory):
    d = daemon_factory(cpu_capacity="16MiB")
    # spawned, not forked: a fork of this process, whose earlier tests left gRPC's threads running,
    # may die in gRPC's fork handlers (tests/conftest.py: exec_after)
    with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_client_worker, [(d.address, i) for i in range(8)]))
    assert results == ["ok"] * 8


def test_lookup_lease_keeps_a_reported_hit_until_the_load(daemon_factory):
    """A Lookup with a lease keeps its hits from eviction (a CPU tier of ~10 blocks, no disk: evicted
    means gone) until the lease ends; a Lookup without one, or a miss, leases nothing."""
    d = daemon_factory(cpu_capacity="1500KiB", disk_path="")
    keys, payloads = make_blocks(24, seed=11)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys[:4], payloads[:4])])
        assert client.lookup(keys[:2], lease_s=30).hits == 2  # leased: keys 0, 1
        assert client.lookup(keys[2:4]).hits == 2             # not leased
        assert client.lookup([keys[20]], lease_s=30).hits == 0
        for start in range(4, 20, 4):  # 16 more blocks through a tier of ~10: LRU evicts the oldest
            client.put(NS, [(k, 64, p) for k, p in zip(keys[start : start + 4], payloads[start : start + 4])])
        assert client.lookup(keys[:2]).hits == 2 and client.get(keys[:2], BLOCK) == [p.tobytes() for p in payloads[:2]]
        assert client.lookup(keys[2:3]).hits == 0
        assert client.rpc_lookups >= 2  # leasing lookups go to the daemon, never the local index
        stats = client.stats()
        assert stats["tiers"]["cpu"]["evictions"] >= 8


def test_pin_delete_clear_and_cli(daemon_factory):
    d = daemon_factory()
    keys, payloads = make_blocks(4, seed=4)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        assert client.pin(keys[:2]) == 2 and client.unpin(keys[:1]) == 1
        assert client.delete([keys[3], b"\x00" * 16]) == 1
        assert client.lookup(keys).hits == 3
    import subprocess
    import sys
    stats = subprocess.run([sys.executable, "-m", "kvstore.cli", "stats", "--address", d.address],
                           capture_output=True, text=True, check=True).stdout
    assert "cpu" in stats and "pinned 1" in stats
    cleared = subprocess.run([sys.executable, "-m", "kvstore.cli", "clear", "--address", d.address],
                             capture_output=True, text=True, check=True).stdout
    assert "cleared" in cleared
    with KVStoreClient(d.address) as client:
        assert client.lookup(keys).hits == 0


def test_socket_is_private_and_health_and_metrics_answer(daemon_factory):
    import socket as _socket
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
    with grpc.insecure_channel(d.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    keys, payloads = make_blocks(2, seed=5)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        client.get(keys, BLOCK)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvstore_hits_total{tier="cpu"} 2.0' in text and "kvstore_queue_depth" in text


# -- bad input ------------------------------------------------------------------------------------


@pytest.fixture
def raw(daemon):
    channel = grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 1 << 30)])
    yield pb_grpc.KVStoreStub(channel), daemon
    channel.close()


def _meta(key=b"k" * 16, tokens=64, layout=LAYOUT, payload_len=BLOCK, ns=NS.id):
    return pb.BlockMeta(key=key, namespace=ns, tokens=tokens, payload_len=payload_len, codec="raw",
                        layout=pb.Layout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                         head_dim=layout.head_dim, dtype=layout.dtype))


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_bad_inputs_get_clear_status_codes(raw):
    stub, d = raw
    ok = np.random.default_rng(6).standard_normal(BLOCK // 2).astype(np.float16).tobytes()
    stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(), inline=ok)]))
    cases = {
        "wrong payload size": (lambda: stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(key=b"a" * 16), inline=ok[:-2])])),
                               grpc.StatusCode.INVALID_ARGUMENT, "payload_len"),
        "raw size vs layout": (lambda: stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(key=b"a" * 16, tokens=63), inline=ok)])),
                               grpc.StatusCode.INVALID_ARGUMENT, "must be"),
        "layout vs namespace": (lambda: stub.Put(pb.PutRequest(items=[pb.PutItem(
                                    meta=_meta(key=b"b" * 16, layout=KVLayout(6, 3, 32, "float16"), tokens=128), inline=ok)])),
                                grpc.StatusCode.INVALID_ARGUMENT, "does not match namespace"),
        "bad dtype": (lambda: stub.Put(pb.PutRequest(items=[pb.PutItem(
                          meta=_meta(key=b"c" * 16, layout=pb.Layout(num_layers=6, num_kv_heads=3, head_dim=64, dtype="int3")), inline=ok)])),
                      grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
        "short key": (lambda: stub.Lookup(pb.LookupRequest(keys=[b"short"])), grpc.StatusCode.INVALID_ARGUMENT, "16 bytes"),
        "no payload": (lambda: stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(key=b"d" * 16))])),
                       grpc.StatusCode.INVALID_ARGUMENT, "no payload"),
        "unknown arena": (lambda: stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(key=b"e" * 16),
                              slice=pb.ArenaSlice(arena_id=99, offset=0, length=BLOCK))])),
                          grpc.StatusCode.INVALID_ARGUMENT, "not registered"),
        "unknown key get": (lambda: stub.Get(pb.GetRequest(items=[pb.GetItem(key=b"u" * 16)])),
                            grpc.StatusCode.NOT_FOUND, "not stored"),
        "unknown key pin": (lambda: stub.Pin(pb.KeysRequest(keys=[b"u" * 16])), grpc.StatusCode.NOT_FOUND, "not stored"),
        "oversized request": (lambda: stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(), inline=b"x" * (300 << 20))])),
                              grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        "arena by name": (lambda: stub.RegisterArena(pb.RegisterArenaRequest(name="../etc/passwd", size=10)),
                          grpc.StatusCode.FAILED_PRECONDITION, "never mapped from a name"),
        "unknown tier": (lambda: stub.Clear(pb.ClearRequest(tiers=["tape"])), grpc.StatusCode.INVALID_ARGUMENT, "unknown tiers"),
    }
    for name, (call, code, words) in cases.items():
        got_code, details = _code(call)
        assert got_code == code, f"{name}: {got_code} {details}"
        assert words in details, f"{name}: {details!r}"
    assert d.alive


def test_offsets_outside_the_arena_are_refused(daemon):
    with KVStoreClient(daemon.address, arena_bytes=1 << 20) as client:
        stub, arena_id = client._stub, client._arena.arena_id
        stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(), inline=b"\x01" * BLOCK)]))
        for offset, length in (((1 << 20) - 100, BLOCK), (1 << 40, 10), (0, (1 << 20) + 1)):
            code, details = _code(lambda: stub.Get(pb.GetRequest(items=[pb.GetItem(
                key=b"k" * 16, dest=pb.ArenaSlice(arena_id=arena_id, offset=offset, length=length))])))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside" in details
        code, details = _code(lambda: stub.Get(pb.GetRequest(items=[pb.GetItem(
            key=b"k" * 16, dest=pb.ArenaSlice(arena_id=arena_id, offset=0, length=100))])))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "needs" in details
    assert daemon.alive


def test_tcp_with_bearer_token(daemon_factory):
    import socket as _socket
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory(listen=f"127.0.0.1:{port}", auth_token="s3cret-0123456789ab")
    keys, payloads = make_blocks(1, seed=7)
    with KVStoreClient(f"127.0.0.1:{port}", token="s3cret-0123456789ab") as client:
        assert not client.shared_memory
        client.put(NS, [(keys[0], 64, payloads[0])])
        assert client.get(keys, BLOCK) == [payloads[0].tobytes()]
    with KVStoreClient(f"127.0.0.1:{port}", token="wrong") as client:
        with pytest.raises(grpc.RpcError) as info:
            client.lookup(keys)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert d.alive


def test_disk_codec_reencodes_demoted_blocks_within_its_bound(daemon_factory):
    import torch

    from compression import get_codec
    from engine_adapter.cached import fetch_slot_bytes, fetched_tensor

    d = daemon_factory(cpu_capacity="1MiB", write_policy="write-back", disk_codec="int8+shuffle+zstd",
                       promote_on_get="false")
    keys, payloads = make_blocks(12, seed=8)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        assert client.lookup(keys).tiers[0] == "disk"
        stats = client.stats()
        assert stats["tiers"]["disk"]["used_bytes"] < stats["tiers"]["disk"]["blocks"] * BLOCK / 1.9
        with client.fetch(keys[:3], fetch_slot_bytes(LAYOUT, 64)) as blocks:
            for block, payload in zip(blocks, payloads):
                assert block.tier == "disk" and block.codec == "int8+shuffle+zstd"
                original = torch.from_numpy(payload).view(LAYOUT.block_shape(64))
                bound = get_codec("int8").error_bound(original)
                error = (fetched_tensor(block).float() - original.float()).abs().max().item()
                assert 0 < error <= bound


def test_clients_leave_no_arena_file_even_when_killed(daemon):
    """Arenas are memfds the daemon hands over: no file in /dev/shm at any time, and the daemon
    unmaps the arena of a client that exits without closing, the moment its connection drops."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    def shm_files() -> set[str]:
        return {p.name for p in Path("/dev/shm").glob("kvstore-*") if not p.name.startswith("kvstore-index-")}

    before = shm_files()
    keys, payloads = make_blocks(2, seed=21)
    with KVStoreClient(daemon.address) as client:
        assert client.shared_memory and shm_files() == before
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
        assert client.get(keys, BLOCK) == [p.tobytes() for p in payloads]
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from engine_adapter.client.kvstore_client import KVStoreClient; "
         f"c = KVStoreClient({daemon.address!r}, arena_bytes=8 * 2**20); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    with KVStoreClient(daemon.address, shared_memory=False) as observer:
        try:
            assert child.stdout.readline().strip() == "ready"
            assert shm_files() == before
            assert observer.stats()["arenas"] == 1
        finally:
            child.kill()
            child.wait()
        deadline = time.monotonic() + 5
        while observer.stats()["arenas"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert observer.stats()["arenas"] == 0 and shm_files() == before


def test_the_client_counts_arena_bytes_as_its_allocator_takes_them():
    """A call is refused only when it cannot fit: items whose sizes fill the arena exactly fit,
    one byte more does not (the allocator rounds each extent up to 4 KiB)."""
    from engine_adapter.client.arena_space import slot_bytes as _slot_bytes
    from tiers.allocator import ExtentAllocator

    arena = ExtentAllocator(64 << 20, align=4096)
    for sizes in ([4 << 20] * 16, [4 << 20] * 15 + [(4 << 20) - 4095], [1, 4096, 4097, (1 << 20) + 3]):
        taken = [arena.allocate(size) for size in sizes]
        assert None not in taken
        assert sum(_slot_bytes(s) for s in sizes) == sum(arena._round(s) for s in sizes)
        for offset in taken:
            arena.free(offset)
    assert sum(_slot_bytes(s) for s in [4 << 20] * 16) == arena.capacity
    assert sum(_slot_bytes(s) for s in [4 << 20] * 15 + [(4 << 20) + 1]) > arena.capacity
