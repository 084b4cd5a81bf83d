"""Hypothesis-driven fuzzing of every RPC against a real daemon: only well-defined status codes,
and the daemon stays up. The number of cases run is printed (``pytest -s`` shows it)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.proto import kvstore_pb2 as pb
from tests.conftest import DaemonProcess

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION}
CASES = {"count": 0}

keys = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=40))
dtypes = st.sampled_from(["float16", "bfloat16", "float32", "", "int8", "float64", "x" * 300])
small = st.integers(min_value=0, max_value=2**32 - 1)
layouts = st.builds(pb.Layout, num_layers=st.one_of(st.integers(0, 70), small),
                    num_kv_heads=st.one_of(st.integers(0, 9), small),
                    head_dim=st.one_of(st.sampled_from([0, 16, 64, 128]), small), dtype=dtypes)
offsets = st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1))


def metas(draw_payload_len):
    return st.builds(pb.BlockMeta, key=keys, namespace=keys, layout=st.one_of(st.none(), layouts),
                     tokens=st.one_of(st.integers(0, 300), small), codec=st.sampled_from(["raw", "", "int8", "zzz"]),
                     codec_params_json=st.sampled_from(["", "{}", "[1]", "{bad", '{"group": 32}']),
                     payload_len=draw_payload_len)


@pytest.fixture(scope="module")
def target():
    folder = Path(tempfile.mkdtemp(prefix="kvf-"))
    daemon = DaemonProcess(folder, cpu_capacity="8MiB", disk_capacity="16MiB").start()
    client = KVStoreClient(daemon.address, arena_bytes=1 << 20)
    yield daemon, client
    print(f"\nfuzz: {CASES['count']} RPC cases, daemon alive: {daemon.alive}")
    client.close()
    daemon.stop()


def _call(fn, request, stream: bool = False):
    CASES["count"] += 1
    try:
        reply = fn(request, timeout=10)
        if stream:
            for _ in reply:
                pass
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, f"{exc.code()}: {exc.details()}"


fuzz = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@fuzz
@given(items=st.lists(st.tuples(metas(st.integers(0, 70000)),
                                st.one_of(st.binary(max_size=70000).map(lambda b: ("inline", b)),
                                          st.tuples(st.integers(0, 3), offsets, offsets).map(lambda t: ("slice", t)))),
                      max_size=3))
def test_fuzz_put(target, items):
    daemon, client = target
    request = pb.PutRequest()
    for meta, (kind, data) in items:
        item = request.items.add(meta=meta)
        if kind == "inline":
            item.inline = data
        else:
            arena, offset, length = data
            item.slice.CopyFrom(pb.ArenaSlice(arena_id=client._arena.arena_id if arena else 99, offset=offset,
                                              length=length))
    _call(client._stub.Put, request)


@fuzz
@given(items=st.lists(st.tuples(keys, st.one_of(st.none(), st.tuples(st.booleans(), offsets, offsets))), max_size=4),
       allow_missing=st.booleans(), gpu_direct=st.booleans(), layers=st.booleans())
def test_fuzz_get(target, items, allow_missing, gpu_direct, layers):
    daemon, client = target
    request = pb.GetRequest(allow_missing=allow_missing, gpu_direct=gpu_direct)
    for key, dest in items:
        item = request.items.add(key=key)
        if dest is not None:
            ok, offset, length = dest
            item.dest.CopyFrom(pb.ArenaSlice(arena_id=client._arena.arena_id if ok else 12345, offset=offset, length=length))
    if layers:
        _call(client._stub.GetLayers, request, stream=True)
    else:
        _call(client._stub.Get, request)


@fuzz
@given(method=st.sampled_from(["Lookup", "Prefetch", "Delete", "Pin", "Unpin", "Release"]), ks=st.lists(keys, max_size=5))
def test_fuzz_key_calls(target, method, ks):
    daemon, client = target
    request = pb.LookupRequest(keys=ks) if method == "Lookup" else pb.KeysRequest(keys=ks)
    _call(getattr(client._stub, method), request)


@fuzz
@given(name=st.one_of(st.text(max_size=40), st.sampled_from(["kvstore-nope", "../../etc/passwd", "kvstore-" + "a" * 200])),
       size=st.one_of(st.integers(0, 1 << 20), small), arena_id=st.integers(0, 2**64 - 1),
       tiers=st.lists(st.sampled_from(["cpu", "disk", "gpu", "", "tape"]), max_size=2))
def test_fuzz_arena_clear_stats(target, name, size, arena_id, tiers):
    daemon, client = target
    _call(client._stub.RegisterArena, pb.RegisterArenaRequest(name=name, size=size))
    _call(client._stub.UnregisterArena, pb.UnregisterArenaRequest(arena_id=arena_id if arena_id != client._arena.arena_id else 0))
    if "disk" not in tiers and "cpu" not in tiers:
        _call(client._stub.Clear, pb.ClearRequest(tiers=tiers))
    _call(client._stub.Stats, pb.StatsRequest())
    _call(client._stub.ExportGpuPool, pb.ExportGpuPoolRequest())


def test_daemon_survived_the_fuzzing(target):
    """After whichever fuzz tests ran before it (all of them in a full run: about 150 cases each),
    the daemon is up and answers; run alone, it still fuzzes a little itself."""
    daemon, client = target
    if CASES["count"] == 0:
        for key in (b"", b"x" * 16, b"y" * 40):
            _call(client._stub.Lookup, pb.LookupRequest(keys=[key]))
    assert daemon.alive and CASES["count"] > 0
    client.stats()
