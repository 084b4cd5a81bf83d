"""Tables a caller can grow are bounded and charged to it (issue 56): the namespace-to-layout
table, health Watch streams without a token, and the probes' connections. Real daemons as
subprocesses, the attacker's side as raw clients."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.block import BlockHeader
from kvstore.daemon.namespaces import NamespaceLayouts
from kvstore.keys import KVLayout, Namespace, prefix_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import layout_message
from tests.conftest import free_port

TOKEN_A, TOKEN_B = "token-of-tenant-a-0123456789", "token-of-tenant-b-0123456789"
TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")  # 32 bytes a token
OTHER = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16")


def _tenants(folder):
    path = folder / "tenants.toml"
    path.write_text(f'[[tenant]]\nname = "a"\ntoken = "{TOKEN_A}"\n\n[[tenant]]\nname = "b"\ntoken = "{TOKEN_B}"\n')
    path.chmod(0o600)
    return path


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def header(namespace: int, layout: KVLayout = TINY) -> BlockHeader:
    return BlockHeader(key=namespace.to_bytes(16, "big"), namespace=namespace.to_bytes(16, "big"), layout=layout,
                       tokens=1, codec="raw", payload_len=layout.block_bytes(1), checksum=0)


def put_under_namespaces(client: KVStoreClient, first: int, count: int, layout: KVLayout = TINY, batch: int = 2048):
    """One 1-token block under each of ``count`` namespaces, ``batch`` namespaces a Put; the keys."""
    rng = np.random.default_rng(first)
    keys = []
    for start in range(first, first + count, batch):
        items = []
        for n in range(start, min(first + count, start + batch)):
            key = rng.bytes(16)
            keys.append(key)
            meta = pb.BlockMeta(key=key, namespace=n.to_bytes(16, "big"), layout=layout_message(layout), tokens=1,
                                codec="raw", payload_len=layout.block_bytes(1))
            items.append(pb.PutItem(meta=meta, inline=b"\x01" * layout.block_bytes(1)))
        assert client._call(client._stub.Put, pb.PutRequest(items=items)).stored == len(items)
    return keys


def test_namespace_layouts_forget_the_least_recently_put_within_each_owners_share():
    table = NamespaceLayouts(limit=8)  # a named owner: 2 at most
    for n in range(3):
        table.note(header(n), "a")
    assert table.owned("a") == 2 and table.forgotten == 1
    table.check(header(0, OTHER))  # forgotten: no longer bound
    with pytest.raises(ValueError, match="does not match namespace"):
        table.check(header(1, OTHER))
    table.note(header(1), "a")  # refreshed: 2 goes next
    table.note(header(3), "a")
    with pytest.raises(ValueError):
        table.check(header(1, OTHER))
    table.check(header(2, OTHER))
    for n in range(100, 110):  # the anonymous owner may take the whole table, least recent first
        table.note(header(n))
        table.check_integrity()
    assert len(table) == 8 and table.owned("a") == 0 and table.owned("") == 8


def test_a_tenant_putting_under_endless_namespaces_churns_only_its_own_share(daemon_factory, short_tmp):
    """guarantees: namespaces are bounded — tenant a Puts one-token blocks under 6 x 2,000 fresh
    namespaces and deletes them: the daemon remembers at most max_namespaces (a's quarter of them),
    b's namespace stays bound to its layout, and the daemon's RSS stops growing with the count (on
    ee82bf6 every namespace was remembered forever: 87 MiB for 409,600)."""
    port = free_port()
    d = daemon_factory(tenants_file=str(_tenants(short_tmp)), max_namespaces=1000, metrics_listen=f"127.0.0.1:{port}",
                       listen=f"127.0.0.1:{free_port()}", disk_path="")
    with KVStoreClient(d.address, token=TOKEN_B) as b:
        put_under_namespaces(b, first=1 << 40, count=1)
        with KVStoreClient(d.address, token=TOKEN_A) as a:
            for round_ in range(6):
                keys = put_under_namespaces(a, first=round_ * 2000, count=2000)
                assert a.delete(keys) == len(keys)
                if round_ == 1:
                    settled = rss_bytes(d.proc.pid)
            grown = rss_bytes(d.proc.pid) - settled
        assert metric(port, "kvstore_namespaces") <= 251  # a's quarter, and b's one
        with pytest.raises(grpc.RpcError) as refused:  # b's binding survived a's churn
            put_under_namespaces(b, first=1 << 40, count=1, layout=OTHER)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert grown < 16 * 2**20, grown


def test_at_default_settings_a_tenants_first_namespace_is_forgotten_past_its_share(daemon_factory, short_tmp):
    """guarantees: namespaces are bounded — with no setting given (max_namespaces 65,536, a named
    tenant's quarter 16,384), tenant a Puts under 16,384 + 256 fresh namespaces: its first is
    forgotten, so a Put of another layout under it binds again instead of being refused (on ee82bf6
    every namespace was remembered forever: refused)."""
    from kvstore.daemon.namespaces import DEFAULT_LIMIT

    d = daemon_factory(tenants_file=str(_tenants(short_tmp)), listen=f"127.0.0.1:{free_port()}", disk_path="")
    with KVStoreClient(d.address, token=TOKEN_A) as a:
        keys = put_under_namespaces(a, first=0, count=DEFAULT_LIMIT // 4 + 256)
        assert a.delete(keys) == len(keys)
        put_under_namespaces(a, first=0, count=1, layout=OTHER)  # namespace 0, another layout: bound anew
        with pytest.raises(grpc.RpcError) as refused:  # the last ones are still remembered
            put_under_namespaces(a, first=DEFAULT_LIMIT // 4 + 255, count=1, layout=OTHER)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _watches(address: str, connections: int, per_connection: int, metadata=()):
    """Open Watch streams, ``per_connection`` on each of ``connections`` TCP connections; the
    channels, the streams that answered SERVING (still open) and the codes of those refused."""
    channels, live, refused = [], [], []
    for _ in range(connections):
        channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(channel)
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(per_connection):
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""), metadata=metadata, timeout=60)
            try:
                assert next(call).status == health_pb2.HealthCheckResponse.SERVING
                live.append(call)
            except grpc.RpcError as exc:
                refused.append(exc.code())
    return channels, live, refused


def test_health_watch_streams_are_bounded_per_connection_and_before_authentication(daemon_factory):
    """guarantees: health Watch bounded — 1,200 Watch streams without a token on 60 connections: at
    most 4 live per connection and 64 in all without a token, the rest RESOURCE_EXHAUSTED at once;
    a token holder still watches and Check still answers; the daemon's RSS stays within 64 MiB of
    idle (on ee82bf6 every stream stayed open: 30,000 took 545 MiB)."""
    d = daemon_factory(listen=f"127.0.0.1:{free_port()}", auth_token=TOKEN_A)
    idle = rss_bytes(d.proc.pid)
    channels, live, refused = _watches(d.address, connections=60, per_connection=20)
    assert len(live) == 64 and set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    mine, mine_live, mine_refused = _watches(d.address, 1, 6, metadata=(("authorization", f"Bearer {TOKEN_A}"),))
    assert len(mine_live) == 4 and len(mine_refused) == 2  # a token holder: 4 on its connection
    with grpc.insecure_channel(d.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    assert rss_bytes(d.proc.pid, "VmHWM") - idle < 64 * 2**20
    for call in live + mine_live:
        call.cancel()
    for channel in channels + mine:
        channel.close()


def _inline_get_outcome(client: KVStoreClient, keys: list[bytes], max_payload_bytes: int) -> str:
    """``"served"`` when every block came back, else the refusal's status and details."""
    try:
        with client.fetch(keys, max_payload_bytes, inline=True) as blocks:
            return "served" if all(b is not None for b in blocks) else "missed"
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"


def _six_inline_gets(d, readers: list[KVStoreClient], calls: list[tuple[list[bytes], int]]) -> tuple[list[str], int]:
    """Each reader's calls, the six readers at once; their outcomes and the daemon's peak RSS
    above its RSS before them (VmHWM after clear_refs)."""
    Path(f"/proc/{d.proc.pid}/clear_refs").write_text("5")  # peak RSS := RSS now
    idle = rss_bytes(d.proc.pid)
    with concurrent.futures.ThreadPoolExecutor(len(readers)) as pool:
        outcomes = list(pool.map(lambda c: [_inline_get_outcome(c, *call) for call in calls], readers))
    return [o for per_reader in outcomes for o in per_reader], rss_bytes(d.proc.pid, "VmHWM") - idle


def test_six_concurrent_large_inline_gets_keep_peak_rss_within_the_inline_budget(daemon_factory):
    """guarantees: budgets count real bytes — issue 56's six concurrent 250 MiB inline Gets under
    a 256 MiB budget, scaled to 60 MiB Gets under 64 MiB: a gRPC reply makes three copies of its
    payloads (the tiers' read buffers, the serialized reply, gRPC's copy of it), so a Get whose
    three copies exceed the budget is refused at once (RESOURCE_EXHAUSTED, pointing to shared
    memory and the data channel, no figure of the daemon's in it), and six 16 MiB Gets (48 MiB
    charged each) run one at a time; all twelve together raise the daemon's peak RSS by less than
    the budget (before this refusal the 60 MiB Gets ran, one at a time: +168 MiB)."""
    layout = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, dtype="float16")  # 32 KiB a token
    small_ns = Namespace("copies", layout, chunk_tokens=128)
    large_ns = Namespace("copies-large", layout, chunk_tokens=1920)
    budget = 64 * 2**20
    d = daemon_factory(cpu_capacity="160MiB", disk_path="", max_inline_bytes="64MiB")
    rng = np.random.default_rng(5)
    small_keys = prefix_keys(small_ns, rng.integers(0, 30000, size=4 * 128))  # 4 x 4 MiB
    large_key = prefix_keys(large_ns, rng.integers(0, 30000, size=1920))[0]  # 60 MiB
    small = rng.integers(1, 255, layout.block_bytes(128), dtype=np.uint8)
    large = rng.integers(1, 255, layout.block_bytes(1920), dtype=np.uint8)
    with KVStoreClient(d.address) as writer:  # through shared memory: no inline buffers left behind
        assert writer.shared_memory
        assert writer.put(small_ns, [(k, 128, small) for k in small_keys]) == len(small_keys)
        assert writer.put(large_ns, [(large_key, 1920, large)]) == 1
    readers = [KVStoreClient(d.address, shared_memory=False) for _ in range(6)]
    try:
        assert readers[0].get(small_keys[:1], layout.block_bytes(128))[0] == small.tobytes()
        outcomes, grown = _six_inline_gets(d, readers, [([large_key], layout.block_bytes(1920)),
                                                        (small_keys, layout.block_bytes(128))])
    finally:
        for reader in readers:
            reader.close()
    print(f"six 60 MiB and six 16 MiB inline Gets under a 64 MiB budget: peak RSS +{grown >> 20} MiB")
    refusals, served = outcomes[0::2], outcomes[1::2]
    assert served == ["served"] * 6, served
    for refusal in refusals:
        assert refusal.startswith("RESOURCE_EXHAUSTED") and "data channel" in refusal, refusal
        assert not re.search(r"\d", refusal.split(":", 1)[1]), refusal  # no figure of the daemon's
    assert grown < budget, f"peak RSS grew by {grown >> 20} MiB"


@pytest.mark.slow
def test_six_concurrent_250_mib_inline_gets_stay_under_256_mib_above_idle(daemon_factory):
    """guarantees: budgets count real bytes, at issue 56's full scale — six clients without shared
    memory Get one 250 MiB block inline at once, default budget (256 MiB): each reply would hold
    three copies (750 MiB), so each is refused at once, pointing to shared memory and the data
    channel, and the daemon's peak RSS stays under 256 MiB above idle (before the refusal: +749
    MiB, the six served one after another; on ee82bf6 +623-749 MiB)."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
    tokens = 2000  # 250 MiB
    namespace = Namespace("large", layout, chunk_tokens=tokens)
    d = daemon_factory(cpu_capacity="600MiB", disk_path="")
    rng = np.random.default_rng(6)
    key = prefix_keys(namespace, rng.integers(0, 30000, size=tokens))[0]
    payload = rng.integers(1, 255, layout.block_bytes(tokens), dtype=np.uint8)
    with KVStoreClient(d.address) as writer:
        assert writer.shared_memory and writer.put(namespace, [(key, tokens, payload)]) == 1
    readers = [KVStoreClient(d.address, shared_memory=False) for _ in range(6)]
    try:
        outcomes, grown = _six_inline_gets(d, readers, [([key], layout.block_bytes(tokens))])
    finally:
        for reader in readers:
            reader.close()
    print(f"six 250 MiB inline Gets at once: peak RSS +{grown >> 20} MiB")
    assert all(o.startswith("RESOURCE_EXHAUSTED") and "data channel" in o for o in outcomes), outcomes
    assert grown < 256 * 2**20, f"peak RSS grew by {grown >> 20} MiB"


def test_a_byte_budget_keeps_each_named_owners_share_while_others_wait():
    """A named owner's one call may be as large as the budget, but what it holds beyond its share
    (a quarter) crowds out no other owner's call within its share; its own next call waits without
    holding up others; a refusal names no figure of the daemon's."""
    from kvstore.daemon.budget import BudgetExhausted, ByteBudget

    async def scenario():
        budget = ByteBudget(100, "test replies", shared=True)
        await budget.acquire(100, 1, "a")  # a's one call: all of it
        await asyncio.wait_for(budget.acquire(10, 5, "b"), 1)  # b within its share goes through
        with pytest.raises(BudgetExhausted) as refused:
            await budget.acquire(10, 0.05, "a")  # a past its share waits, then is refused
        assert not re.search(r"\b(100|110|25)\b", str(refused.value)), refused.value
        waiting = asyncio.create_task(budget.acquire(5, 5, "a"))
        await asyncio.sleep(0.01)
        await asyncio.wait_for(budget.acquire(10, 5, "c"), 1)  # a's waiting call holds up nobody
        assert not waiting.done()
        budget.release(100, "a")
        await asyncio.wait_for(waiting, 1)
        assert budget.in_flight == 25 and budget.held("a") == 5
        for owner, n in (("a", 5), ("b", 10), ("c", 10)):
            budget.release(n, owner)
        assert budget.in_flight == 0 and budget._excess == 0

    asyncio.run(scenario())


def test_a_budget_refusal_names_no_figure_of_the_daemons():
    """guarantees: fair budgets — a call refused after its wait learns that the budget was full,
    not how many bytes were in flight or what the budget is (on ee82bf6: "100 bytes in flight
    (budget 100)", which tells a tenant what the others move)."""
    from kvstore.daemon.budget import BudgetExhausted, ByteBudget

    async def scenario():
        budget = ByteBudget(100, "test replies")
        await budget.acquire(90, 1)
        with pytest.raises(BudgetExhausted) as refused:
            await budget.acquire(20, 0.05)
        assert "test replies" in str(refused.value) and not re.search(r"\b(90|100|110)\b", str(refused.value)), refused.value

    asyncio.run(scenario())


def test_a_tenant_trickling_a_put_as_large_as_the_budget_starves_no_other_tenant(daemon_factory, short_tmp):
    """guarantees: fair budgets — tenant a sends a 200 MiB data-channel Put, more than the whole
    96 MiB inline budget (it runs alone, 26 s at the 8 MB/s floor), a few bytes a second; tenant b's
    1 MiB Gets, on the data channel and inline in gRPC, go through meanwhile (on ee82bf6 they
    waited 10 s and were refused RESOURCE_EXHAUSTED)."""
    from kvstore.wire import GET, GET_REPLY, PUT, READY, frame, parse_error
    from tests.test_data_channel import LAYOUT, NS, hello, read_frame

    d = daemon_factory(tenants_file=str(_tenants(short_tmp)), listen=f"127.0.0.1:{free_port()}",
                       data_listen="127.0.0.1:0", max_message_bytes="200MiB", max_inline_bytes="96MiB",
                       cpu_capacity="64MiB", disk_path="")
    rng = np.random.default_rng(9)
    tokens = 64
    block = LAYOUT.block_bytes(tokens)
    keys = prefix_keys(NS, rng.integers(0, 49152, size=(2**20 // block) * tokens))  # 1 MiB a Get
    stored = [(k, tokens, rng.integers(1, 256, LAYOUT.block_bytes(tokens), dtype=np.uint8)) for k in keys]
    with KVStoreClient(d.address, token=TOKEN_B, shared_memory=False) as b:
        assert b.put(NS, stored) == len(stored)
        port = b.stats()["data_port"]
    big = [pb.PutItem(meta=pb.BlockMeta(key=k, namespace=NS.id, layout=layout_message(LAYOUT), tokens=tokens,
                                        codec="raw", payload_len=LAYOUT.block_bytes(tokens)))
           for k in prefix_keys(NS, rng.integers(0, 49152, size=(200 * 2**20 // block) * tokens))]  # 200 MiB
    trickler = hello(port, TOKEN_A)
    assert read_frame(trickler) == (READY, b"")
    trickler.sendall(frame(PUT, pb.PutRequest(items=big).SerializeToString()) + b"\x01" * 4096)
    stop = threading.Event()

    def trickle():  # a byte every half second: each read within its timeout, the transfer within its deadline
        while not stop.wait(0.5):
            try:
                trickler.sendall(b"\x01")
            except OSError:
                return

    trickling = threading.Thread(target=trickle, daemon=True)
    trickling.start()
    time.sleep(1.0)  # the daemon reads the head and takes the budget (a tenant's Stats do not show it)
    reader = hello(port, TOKEN_B)
    try:
        assert read_frame(reader) == (READY, b"")
        for _ in range(4):  # on the data channel: a reply, not RESOURCE_EXHAUSTED after 10 s
            reader.sendall(frame(GET, pb.GetRequest(items=[pb.GetItem(key=k) for k in keys]).SerializeToString()))
            kind, body = read_frame(reader)
            assert kind == GET_REPLY, parse_error(body)
            assert all(r.found for r in pb.GetResponse.FromString(body).results)
            reader.settimeout(10)
            left = len(keys) * block
            while left:
                left -= len(reader.recv(left))
        with KVStoreClient(d.address, token=TOKEN_B, shared_memory=False) as b:  # and inline in gRPC
            reply = b._call(b._stub.Get, pb.GetRequest(items=[pb.GetItem(key=k) for k in keys]))
            assert [r.inline for r in reply.results] == [p.tobytes() for _, _, p in stored]
    finally:
        stop.set()
        trickling.join()
        reader.close()
        trickler.close()
