"""A hostile local client against a real daemon: arenas it does not own, shared memory changed
under the daemon, requests that ask for unbounded work, a reader that stalls, tenants probing each
other. Each test names the promise in docs/guarantees.md it holds."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.arena import Arena, arena_socket_path
from kvstore.daemon.auth import Tenant, tenant_key
from kvstore.host import load_secret
from kvstore.keys import KVLayout, Namespace, prefix_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import free_port
from tests.test_daemon import BLOCK, NS, _meta, make_blocks


def _code(call):
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def _tenants(folder):
    path = folder / "tenants.toml"
    path.write_text('[[tenant]]\nname = "a"\ntoken = "token-a-0123456789"\n\n'
                    '[[tenant]]\nname = "b"\ntoken = "token-b-0123456789"\n')
    return path


def _raw_arena(daemon, size: int, token: str = ""):
    """Ask the arena socket for an arena as a client would, but keep the fd (an attacker's view)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(str(arena_socket_path(daemon.address)))
    connection.sendall(json.dumps({"size": size, "token": token}).encode() + b"\n")
    data, fds, _, _ = socket.recv_fds(connection, 4096, 1)
    return connection, json.loads(data), fds


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_an_arena_is_usable_only_by_the_tenant_that_registered_it(daemon_factory, short_tmp):
    """guarantees: Isolation — an arena id is the registering tenant's alone."""
    d = daemon_factory(tenants_file=_tenants(short_tmp))
    keys, payloads = make_blocks(2, seed=60)
    with KVStoreClient(d.address, token="token-a-0123456789") as a, \
            KVStoreClient(d.address, token="token-b-0123456789") as b:
        a.put(NS, [(keys[0], 64, payloads[0])])
        a._arena.arena.buffer[:BLOCK] = payloads[1].tobytes()  # A's secret bytes in its arena
        stolen = pb.ArenaSlice(arena_id=a._arena.arena_id, offset=0, length=BLOCK)
        unknown = pb.ArenaSlice(arena_id=12345, offset=0, length=BLOCK)
        for name, make in {
            "put from A's arena": lambda s: b._stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(key=keys[1]), slice=s)]),
                                                        metadata=b._metadata),
            "get into A's arena": lambda s: b._stub.Get(pb.GetRequest(items=[pb.GetItem(key=keys[1], dest=s)],
                                                                      allow_missing=True), metadata=b._metadata),
            "layers into A's arena": lambda s: list(b._stub.GetLayers(pb.GetRequest(items=[pb.GetItem(key=keys[1], dest=s)],
                                                                                  allow_missing=True), metadata=b._metadata)),
        }.items():
            code, details = _code(lambda: make(stolen))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, name
            # exactly like an unknown id
            assert (code, details.replace(str(a._arena.arena_id), "ID")) == \
                tuple(x.replace("12345", "ID") if isinstance(x, str) else x for x in _code(lambda: make(unknown))), name
        for arena_id in (a._arena.arena_id, 12345):
            code, details = _code(lambda: b._stub.UnregisterArena(pb.UnregisterArenaRequest(arena_id=arena_id),
                                                                  metadata=b._metadata))
            assert code == grpc.StatusCode.NOT_FOUND and str(arena_id) in details
        assert a.get(keys[:1], BLOCK) == [payloads[0].tobytes()]   # A's arena still works
        a.put(NS, [(keys[1], 64, payloads[1])])
        assert b.lookup(keys).hits == 0
    # Arenas are never mapped from a name: not a client's file, not the key index.
    with KVStoreClient(d.address, token="token-a-0123456789", shared_memory=False) as c:
        code, _ = _code(lambda: c._stub.RegisterArena(pb.RegisterArenaRequest(name="kvstore-index-1-aa", size=4096),
                                                       metadata=c._metadata))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
    # Without a token the arena socket hands out nothing.
    connection, reply, fds = _raw_arena(d, 1 << 20, token="nope")
    connection.close()
    assert "token" in reply["error"] and not fds


def test_arenas_are_capped_per_client_and_released_with_their_connection(daemon_factory):
    """guarantees: Limits — arenas per client process (SO_PEERCRED) and bytes per arena are capped."""
    d = daemon_factory(max_arena_bytes="8MiB", max_arenas_per_client=2)
    held = [_raw_arena(d, 1 << 20) for _ in range(2)]
    assert all("arena_id" in reply and len(fds) == 1 for _, reply, fds in held)
    connection, reply, fds = _raw_arena(d, 1 << 20)
    assert "max_arenas_per_client" in reply["error"] and f"process {os.getpid()}" in reply["error"] and not fds
    connection.close()
    connection, reply, _ = _raw_arena(d, 16 << 20)   # over max_arena_bytes: refused even with room
    assert "max_arena_bytes" in reply["error"]
    connection.close()
    with KVStoreClient(d.address, shared_memory=False) as observer:
        assert observer.stats()["arenas"] == 2
        for connection, _, fds in held:
            connection.close()                     # the connection ends: the arena goes at once
            for fd in fds:
                os.close(fd)
        deadline = time.monotonic() + 5
        while observer.stats()["arenas"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert observer.stats()["arenas"] == 0
    # A connection that never sends its request is dropped; the socket keeps serving.
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(str(arena_socket_path(d.address)))
    with KVStoreClient(d.address, arena_bytes=1 << 20) as client:
        assert client.shared_memory
    idle.close()


def test_a_closing_client_frees_its_own_arena_pages(daemon):
    """guarantees: Integrity — a client's close returns once the daemon has unmapped its arena, so the
    client's own unmapping is the last and frees the pages (in the daemon, that CPU was taken from
    other clients' Gets)."""
    def daemon_arenas() -> int:
        with open(f"/proc/{daemon.proc.pid}/maps") as maps:
            return sum("memfd:kvstore-arena" in line for line in maps)

    before = daemon_arenas()
    for _ in range(5):  # the protocol: a byte after the reply; the daemon unmaps, then closes
        connection, reply, fds = _raw_arena(daemon, 64 << 20)
        os.close(fds[0])
        assert "arena_id" in reply and daemon_arenas() == before + 1
        connection.sendall(b"\n")
        assert connection.recv(1) == b""
        assert daemon_arenas() == before
        connection.close()
    for _ in range(3):  # what KVStoreClient.close does
        client = KVStoreClient(daemon.address, arena_bytes=8 << 20)
        assert client.shared_memory and daemon_arenas() == before + 1
        client.close()
        assert daemon_arenas() == before


def test_a_client_cannot_shrink_grow_or_hollow_its_arena_under_the_daemon(daemon):
    """guarantees: Isolation — nothing a client does to its shared memory crashes or bloats the daemon."""
    size = 4 * BLOCK
    connection, reply, fds = _raw_arena(daemon, size)
    fd = fds[0]
    for bad_size in (0, size // 2, size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, bad_size)          # sealed: the daemon's copies can never run past the end
    assert os.fstat(fd).st_size == size
    arena = Arena(fd, size)
    arena.buffer[:BLOCK] = np.random.default_rng(61).standard_normal(BLOCK // 2).astype(np.float16).tobytes()
    # Punch the pages out (what a sparse or re-created file would do): the daemon reads zeros, no SIGBUS.
    libc = ctypes.CDLL(None, use_errno=True)
    falloc_punch_hole_keep_size = 0x02 | 0x01
    assert libc.fallocate(fd, falloc_punch_hole_keep_size, ctypes.c_long(0), ctypes.c_long(size)) == 0
    keys, _ = make_blocks(1, seed=62)
    with KVStoreClient(daemon.address, shared_memory=False) as client:
        client._stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(key=keys[0]), slice=pb.ArenaSlice(
            arena_id=reply["arena_id"], offset=0, length=BLOCK))]))
        assert client.get(keys, BLOCK) == [bytes(BLOCK)]
        rss = _rss(daemon.proc.pid)
        for _ in range(20):  # hollow it again and again: the daemon maps the same bounded pages
            client._stub.Get(pb.GetRequest(items=[pb.GetItem(key=keys[0], dest=pb.ArenaSlice(
                arena_id=reply["arena_id"], offset=i * BLOCK, length=BLOCK)) for i in range(4)]))
            libc.fallocate(fd, falloc_punch_hole_keep_size, ctypes.c_long(0), ctypes.c_long(size))
        assert _rss(daemon.proc.pid) - rss < 32 * 2**20
    arena.close()
    os.close(fd)
    connection.close()
    assert daemon.alive


def test_work_is_bounded_before_it_starts(daemon_factory):
    """guarantees: Limits — bytes per Get and Put, layers per block, keys per call."""
    d = daemon_factory(cpu_capacity="32MiB", max_message_bytes="8MiB")
    layout = KVLayout(num_layers=16, num_kv_heads=4, head_dim=64, dtype="float16")
    ns = Namespace("big", layout, chunk_tokens=256)
    block = layout.block_bytes(256)  # 1 MiB
    key = prefix_keys(ns, np.arange(256))[0]
    payload = np.random.default_rng(63).standard_normal(block // 2).astype(np.float16)
    with KVStoreClient(d.address, arena_bytes=4 * block) as client:
        client.put(ns, [(key, 256, payload)])
        rss = _rss(d.proc.pid)
        # An inline Get naming one 1 MiB block 400 times: refused from metadata, nothing read.
        code, details = _code(lambda: client._stub.Get(pb.GetRequest(items=[pb.GetItem(key=key)] * 400)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_message_bytes" in details
        # The same through shared memory: 400 copies into one slice is more than the arena holds.
        dest = pb.ArenaSlice(arena_id=client._arena.arena_id, offset=0, length=block)
        code, details = _code(lambda: client._stub.Get(pb.GetRequest(items=[pb.GetItem(key=key, dest=dest)] * 400)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "arenas it names" in details
        client._arena.arena.buffer[:block] = payload.tobytes()
        code, _ = _code(lambda: client._stub.Put(pb.PutRequest(items=[pb.PutItem(
            meta=pb.BlockMeta(key=bytes([i % 256]) * 16, namespace=ns.id, tokens=256, payload_len=block,
                              layout=pb.Layout(num_layers=16, num_kv_heads=4, head_dim=64, dtype="float16")),
            slice=dest) for i in range(400)])))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _rss(d.proc.pid) - rss < 64 * 2**20
        # A block of too many layers is refused at Put (a GetLayers stream sends one message per layer).
        code, details = _code(lambda: client._stub.Put(pb.PutRequest(items=[pb.PutItem(
            meta=pb.BlockMeta(key=b"L" * 16, namespace=b"N" * 16, tokens=1, payload_len=65535 * 2,
                              layout=pb.Layout(num_layers=65535, num_kv_heads=1, head_dim=1, dtype="float16")),
            inline=b"\x01" * (65535 * 2))])))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_layers" in details
        code, details = _code(lambda: client._stub.Lookup(pb.LookupRequest(keys=[b"k" * 16] * 65537)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 65536" in details
        assert client.get([key], block) == [payload.tobytes()]  # and the daemon is fine


def test_a_stalled_layerwise_reader_delays_no_other_client(daemon_factory):
    """guarantees: Limits — no lock is held across a network send."""
    d = daemon_factory(cpu_capacity="64MiB")
    layout = KVLayout(num_layers=8, num_kv_heads=1, head_dim=8, dtype="float16")
    ns = Namespace("tiny", layout, chunk_tokens=16)
    key = prefix_keys(ns, np.arange(16))[0]
    small = layout.block_bytes(16)
    payload = np.random.default_rng(64).standard_normal(small // 2).astype(np.float16)
    keys, payloads = make_blocks(4, seed=65)
    with KVStoreClient(d.address, arena_bytes=8 << 20) as reader, KVStoreClient(d.address) as writer:
        reader.put(ns, [(key, 16, payload)])
        # A first message of ~6,000 results (hundreds of KB) that the reader never takes: the daemon's
        # send waits on flow control for as long as the reader stalls.
        items = [pb.GetItem(key=key, dest=pb.ArenaSlice(arena_id=reader._arena.arena_id, offset=(i % 64) * small,
                                                        length=small)) for i in range(6000)]
        # No BDP probing: the reader's receive window stays at its initial 64 KiB.
        channel = grpc.insecure_channel(d.address, options=[("grpc.http2.bdp_probe", 0)])
        stream = pb_grpc.KVStoreStub(channel).GetLayers(pb.GetRequest(items=items))
        try:
            time.sleep(0.5)
            for i in range(len(keys)):
                started = time.monotonic()
                writer.put(NS, [(keys[i], 64, payloads[i])])
                assert time.monotonic() - started < 2.0, "a Put waited on the stalled stream"
            assert writer.get(keys, BLOCK) == [p.tobytes() for p in payloads]
        finally:
            stream.cancel()
            channel.close()
    assert d.alive


def test_layerwise_reads_hold_no_lock_and_never_copy_a_replaced_block(tmp_path):
    """The store's side of the above, deterministic: between two layers of a suspended layer-wise
    read, a Put of another block completes, the streamed block is not evicted, and a Delete of it
    ends the stream with BlockGoneError instead of copying bytes that are no longer its own."""
    from kvstore.daemon.placement import BlockGoneError
    from tests.test_placement import blocks, make_store

    async def scenario():
        store = make_store(tmp_path, cpu_blocks=2)
        store.start()
        (h1, p1), (h2, p2), (h3, p3) = blocks(3, start=70)
        await store.put(h1, p1)
        dest = memoryview(bytearray(h1.payload_len))
        stream = store.reads.get_layerwise([(h1.key, dest)])
        assert (await stream.__anext__())[0] == -1
        assert (await stream.__anext__())[0] == 0            # suspended mid-stream, as while sending
        await asyncio.wait_for(store.put(h2, p2), 1.0)       # no lock held: completes at once
        await asyncio.wait_for(store.put(h3, p3), 1.0)       # needs room: evicts h2, not the streamed h1
        assert store.locate(h1.key) == 0
        await store.delete([h1.key])
        with pytest.raises(BlockGoneError):
            await stream.__anext__()
        store.check_integrity()
        await store.close()

    asyncio.run(scenario())


def test_tenants_share_no_namespace_stats_or_predictable_keys(daemon_factory, short_tmp):
    """guarantees: Isolation — namespaces, layouts, stats and stored keys are per tenant."""
    d = daemon_factory(tenants_file=_tenants(short_tmp))
    keys, payloads = make_blocks(3, seed=66)
    wrong = pb.Layout(num_layers=2, num_kv_heads=3, head_dim=64, dtype="float16")
    with KVStoreClient(d.address, token="token-a-0123456789") as a, \
            KVStoreClient(d.address, token="token-b-0123456789") as b:
        # A stores under B's (public) namespace id with a wrong layout: B never notices.
        code, _ = _code(lambda: a._stub.Put(pb.PutRequest(items=[pb.PutItem(
            meta=pb.BlockMeta(key=b"x" * 16, namespace=NS.id, layout=wrong, tokens=64, payload_len=2 * 3 * 64 * 64 * 2 * 2),
            inline=b"\x01" * (2 * 3 * 64 * 64 * 2 * 2))]), metadata=a._metadata))
        assert code == grpc.StatusCode.OK
        assert b.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)]) == 3
        assert b.get(keys, BLOCK) == [p.tobytes() for p in payloads]
        # A's errors about a namespace are the same whether B uses it or not.
        used_by_b = Namespace("used-by-b", NS.layout, chunk_tokens=64)
        never_used = Namespace("never-used", NS.layout, chunk_tokens=64)
        b._stub.Put(pb.PutRequest(items=[pb.PutItem(meta=_meta(key=b"w" * 16, ns=used_by_b.id),
                                                    inline=payloads[0].tobytes())]), metadata=b._metadata)
        bad = pb.Layout(num_layers=3, num_kv_heads=3, head_dim=64, dtype="float16")

        def put_bad(namespace_id):
            return _code(lambda: a._stub.Put(pb.PutRequest(items=[pb.PutItem(
                meta=pb.BlockMeta(key=b"y" * 16, namespace=namespace_id, layout=bad, tokens=64,
                                  payload_len=3 * 3 * 64 * 64 * 2 * 2),
                inline=b"\x02" * (3 * 3 * 64 * 64 * 2 * 2))]), metadata=a._metadata))
        assert put_bad(used_by_b.id) == put_bad(never_used.id) == (grpc.StatusCode.OK, "")
        # Stats: each tenant sees its own traffic only.
        a.lookup([b"z" * 16])
        stats_a, stats_b = a.stats(), b.stats()
        assert stats_b["tiers"]["cpu"]["hits"] == 3 and stats_a["tiers"]["cpu"]["hits"] == 0
        assert stats_b["tiers"]["cpu"]["bytes_in"] == 3 * BLOCK + BLOCK
        assert stats_a["misses"] >= 1 and stats_b["misses"] == 0
        assert stats_a["tiers"]["cpu"]["used_bytes"] == 0 and stats_a["tiers"]["cpu"]["blocks"] == 0
    # Stored keys: a keyed hash of the whole name under the server secret.
    secret_path = short_tmp / "tenant-secret"
    assert secret_path.stat().st_mode & 0o777 == 0o600 and len(load_secret(secret_path)) == 32
    long_a, long_b = "t" * 64 + "-a", "t" * 64 + "-b"
    secret = load_secret(secret_path)
    key = keys[0]
    assert Tenant(long_a, key=tenant_key(secret, long_a)).stored_key(key) != \
        Tenant(long_b, key=tenant_key(secret, long_b)).stored_key(key)
    assert Tenant("a", key=tenant_key(secret, "a")).stored_key(key) != \
        Tenant("a", key=tenant_key(bytes(32), "a")).stored_key(key)
    loose = short_tmp / "loose-secret"
    loose.write_bytes(os.urandom(32))
    loose.chmod(0o644)
    with pytest.raises(ValueError, match="read by others"):
        load_secret(loose)


def test_misses_requests_capacity_and_rpc_latency_are_reported(daemon_factory):
    """guarantees: Observability — misses counted in Lookup and Get; capacity and latency metrics."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    keys, payloads = make_blocks(4, seed=67)
    with KVStoreClient(d.address, shared_memory=False) as client:
        client.put(NS, [(keys[0], 64, payloads[0])])
        assert client.lookup(keys).hits == 1                       # 3 missing
        assert client.get(keys[:2], BLOCK)[1] is None               # 1 missing
        stats = client.stats()
        assert stats["misses"] == 4 and stats["requested"] == 6
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "kvstore_misses_total 4.0" in text
    assert 'kvstore_capacity_bytes{tier="cpu"} 6.7108864e+07' in text
    assert 'kvstore_rpc_seconds_count{method="Get"} 1.0' in text
    assert 'kvstore_requested_total{rpc="lookup"} 4.0' in text


def test_get_replies_serialized_by_hand_parse_as_protobuf():
    from kvstore.wire import encode_get_response

    rng = np.random.default_rng(68)
    replies = []
    for i in range(5):
        result = pb.GetResult(found=i != 2, tier="cpu" if i != 2 else "", meta=pb.BlockMeta(key=bytes([i]) * 16))
        payload = None if i == 2 else memoryview(rng.integers(0, 256, size=int(rng.integers(1, 300_000)),
                                                               dtype=np.uint8).tobytes())
        replies.append((result, payload))
    parsed = pb.GetResponse.FromString(encode_get_response(replies))
    for (result, payload), got in zip(replies, parsed.results):
        expected = pb.GetResult()
        expected.CopyFrom(result)
        if payload is not None:
            expected.inline = payload.tobytes()
        assert got == expected


def test_arena_requests_fail_in_one_line_and_tenants_keep_their_share(daemon_factory, short_tmp):
    """guarantees: Limits — malformed arena requests get an answer; one tenant cannot take another's share."""
    d = daemon_factory(tenants_file=_tenants(short_tmp), max_arena_bytes="4MiB", max_arena_total_bytes="8MiB",
                       max_arenas_per_client=64)
    for raw in (b'{"size": 1e400}\n', b"[" * 3000 + b"\n", b'{"size": "4096"}\n', b"\xff\n"):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(str(arena_socket_path(d.address)))
        connection.sendall(raw)
        reply = json.loads(connection.recv(4096))
        connection.close()
        assert "one JSON line" in reply["error"], raw[:20]
    # Two tenants share 8 MiB: A gets its 4 MiB half and no more, whatever it does; B still gets its half.
    held = []
    while True:
        connection, reply, fds = _raw_arena(d, 1 << 20, token="token-a-0123456789")
        held.append((connection, fds))
        if "error" in reply:
            break
    assert len(held) == 5 and "your share" in reply["error"] and "4194304" in reply["error"]
    connection, reply, fds = _raw_arena(d, 4 << 20, token="token-b-0123456789")
    assert "arena_id" in reply
    held.append((connection, fds))
    for connection, fds in held:
        connection.close()
        for fd in fds:
            os.close(fd)


def test_calls_are_capped_in_items_and_layer_copies_and_misses_count_even_when_refused(daemon):
    """guarantees: Limits and Observability."""
    keys, payloads = make_blocks(2, seed=69)
    with KVStoreClient(daemon.address, arena_bytes=8 << 20) as client:
        client.put(NS, [(keys[0], 64, payloads[0])])
        code, details = _code(lambda: client._stub.Get(pb.GetRequest(items=[pb.GetItem(key=keys[0])] * 4097)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 4096" in details
        before = client.stats()
        code, _ = _code(lambda: client._stub.Get(pb.GetRequest(items=[pb.GetItem(key=k) for k in keys])))
        assert code == grpc.StatusCode.NOT_FOUND
        after = client.stats()
        assert after["misses"] - before["misses"] == 1 and after["requested"] - before["requested"] == 2
        # 4096 items of a 6-layer block is 24,576 layer copies: allowed; a 1,024-layer block 4096 times is not.
        layout = KVLayout(num_layers=1024, num_kv_heads=1, head_dim=1, dtype="float16")
        ns = Namespace("deep", layout, chunk_tokens=1)
        deep = prefix_keys(ns, [7])[0]
        client.put(ns, [(deep, 1, np.random.default_rng(70).standard_normal(2048).astype(np.float16))])
        dest = pb.ArenaSlice(arena_id=client._arena.arena_id, offset=0, length=layout.block_bytes(1))
        code, details = _code(lambda: list(client._stub.GetLayers(pb.GetRequest(
            items=[pb.GetItem(key=deep, dest=dest)] * 65))))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "layer copies" in details
        with client.fetch_layers([deep], layout.block_bytes(1)) as stream:
            assert list(stream) == list(range(1024))


def test_a_disk_read_that_fails_for_want_of_fds_is_a_miss_not_a_corrupt_block(tmp_path, monkeypatch):
    """One client exhausting the daemon's fds must not get another's blocks deleted as corrupt.
    (An injected EMFILE: a real one needs the whole process out of descriptors.)"""
    import errno

    import tiers.disk
    from tests.test_tiers import make_block
    from tiers.base import TierUnavailableError
    from tiers.disk import DiskTier

    tier = DiskTier(tmp_path, 1 << 20, fsync=False)
    header, payload = make_block(71)
    tier.put(header, payload)
    real_open = os.open

    def exhausted(path, flags, *args):
        if str(path).endswith(".kvb"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args)

    monkeypatch.setattr(tiers.disk.os, "open", exhausted)
    with pytest.raises(TierUnavailableError):
        tier.read_payload_into(header.key, memoryview(bytearray(header.payload_len)))
    monkeypatch.setattr(tiers.disk.os, "open", real_open)
    dest = bytearray(header.payload_len)
    assert tier.read_payload_into(header.key, memoryview(dest)) == header and bytes(dest) == bytes(payload)


def test_one_daemon_per_socket_and_per_disk_folder(daemon_factory, short_tmp):
    """guarantees: Durability — a live daemon's socket and folder are never taken over; the rebuild
    touches only the daemon's own file names and follows no symlink."""
    import subprocess
    import sys

    first = daemon_factory("one")
    keys, payloads = make_blocks(1, seed=72)
    with KVStoreClient(first.address) as client:
        client.put(NS, [(keys[0], 64, payloads[0])])

    def serve(**flags):
        args = [sys.executable, "-m", "kvstore.cli", "serve", "--cpu-capacity", "16MiB", "--disk-capacity", "64MiB"]
        for name, value in flags.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        return subprocess.run(args, capture_output=True, text=True, timeout=60)

    same_socket = serve(listen=first.address, disk_path=short_tmp / "other-disk")
    assert same_socket.returncode == 1 and f"unix socket {first.socket} is in use" in same_socket.stderr
    same_folder = serve(listen=f"unix:{short_tmp / 'other.sock'}", disk_path=first.folder / "disk")
    assert same_folder.returncode == 1 and f"{first.folder / 'disk'} is in use" in same_folder.stderr
    assert f"pid {first.proc.pid}" in same_folder.stderr
    with KVStoreClient(first.address) as client:   # the first one never noticed
        assert client.get(keys, BLOCK) == [payloads[0].tobytes()]
    # A folder linked under the disk path is someone else's: never read, never cleaned.
    other = short_tmp / "elsewhere"
    other.mkdir()
    (other / "notes.kvb").write_bytes(b"mine")
    (other / "report.tmp.docx").write_bytes(b"mine")
    (first.folder / "disk" / "ab").symlink_to(other)
    first.stop(signal_kill=True)                   # kill -9: stale socket and lock files stay behind
    first.start()
    with KVStoreClient(first.address) as client:
        assert client.get(keys, BLOCK) == [payloads[0].tobytes()]
    assert sorted(p.name for p in other.iterdir()) == ["notes.kvb", "report.tmp.docx"]
    assert (first.folder / "disk").stat().st_mode & 0o777 == 0o700
