"""Metrics that tell the truth (issue #40): Lookups a same-host client answers from the shared key
index are counted by the daemon as if they were RPCs (keys asked, hits, misses), so hit and miss
ratios are right for every client path. Real daemons, real clients on the unix socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from engine_adapter.client.kvstore_client import KVStoreClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import ROOT, free_port
from tests.test_daemon import BLOCK, NS, make_blocks

REPORT_HEADER = "kvstore-local-lookups"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def counts(port: int) -> dict[str, float]:
    m = scrape(port)
    return {
        "requested_lookup": m.get(("kvstore_requested_total", (("rpc", "lookup"),)), 0.0),
        "requested_get": m.get(("kvstore_requested_total", (("rpc", "get"),)), 0.0),
        "misses": m.get(("kvstore_misses_total", ()), 0.0),
        "lookup_hits": m.get(("kvstore_lookup_hits_total", ()), 0.0),
        "lookups_local": m.get(("kvstore_lookups_total", (("path", "local"),)), 0.0),
        "lookups_rpc": m.get(("kvstore_lookups_total", (("path", "rpc"),)), 0.0),
        "get_hits": sum(v for (name, _), v in m.items() if name == "kvstore_hits_total"),
    }


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_local_lookups_count_as_requested_hits_and_misses(daemon_factory):
    """guarantees: Observability — every Lookup, local or RPC, counts its keys, hits and misses."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    keys, payloads = make_blocks(8, seed=401)
    stored, unknown = keys[:4], keys[4:]
    with KVStoreClient(d.address) as client:
        assert client.put(NS, [(k, 64, p) for k, p in zip(stored, payloads)]) == 4
        asked = hits = 0
        for _ in range(5):  # cold: N lookups of keys nobody stored
            assert client.lookup(unknown).hits == 0
            asked += len(unknown)
        for _ in range(3):  # warm: M lookups of stored keys
            assert client.lookup(stored).hits == 4
            asked, hits = asked + 4, hits + 4
        assert client.lookup([stored[0], unknown[0], stored[1]]).hits == 1  # the run ends at the miss
        asked, hits = asked + 3, hits + 1
        assert client.local_lookups == 9 and client.rpc_lookups == 0
        with client.fetch(stored[:2] + unknown[:1], BLOCK) as blocks:  # Gets: 2 served, 1 missing
            assert [b is not None for b in blocks] == [True, True, False]
    c = counts(port)
    assert c["requested_lookup"] == asked == 35
    assert c["lookup_hits"] == hits == 13
    assert c["lookups_local"] == 9 and c["lookups_rpc"] == 0
    assert c["requested_get"] == 3 and c["get_hits"] == 2
    assert c["misses"] == (asked - hits) + 1  # lookups' misses and the Get's one
    with KVStoreClient(d.address, local_lookup=False) as other:
        stats = other.stats()
        assert stats["requested"] == asked + 3 and stats["misses"] == asked - hits + 1
        # The RPC path feeds the same counters.
        assert other.lookup(stored + unknown).hits == 4 and other.rpc_lookups == 1
    c = counts(port)
    assert c["requested_lookup"] == asked + 8 and c["lookup_hits"] == hits + 4 and c["lookups_rpc"] == 1
    assert c["misses"] == (asked - hits) + 1 + 4


def test_an_open_client_reports_on_its_next_call_or_within_the_interval(daemon_factory):
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    keys, payloads = make_blocks(3, seed=402)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(keys[0], 64, payloads[0])])
        for _ in range(4):
            assert client.lookup(keys).hits == 1
        # the next call carries the tally: Stats, answered after it was added, already shows it
        stats = client.stats()
        assert stats["requested"] == 12 and stats["misses"] == 8
        for _ in range(10):
            client.lookup(keys[:1])
        # no other call: the client reports by itself within its interval (1 s)
        c = wait_until(lambda: (c := counts(port))["requested_lookup"] == 22 and c, 5, "the periodic report")
        assert c["lookup_hits"] == 14 and c["misses"] == 8 and c["lookups_local"] == 14
        assert client.rpc_lookups == 0


def test_a_killed_client_loses_at_most_its_unsent_batch(daemon_factory):
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    script = textwrap.dedent(f"""
        import os, sys, time
        from engine_adapter.client.kvstore_client import KVStoreClient
        from tests.test_daemon import make_blocks
        keys, _ = make_blocks(4, seed=403)
        client = KVStoreClient({d.address!r})
        for _ in range(100):
            assert client.lookup(keys).hits == 0
        assert client.local_lookups == 100
        time.sleep(2.5)               # reported by now
        for _ in range(50):
            client.lookup(keys)      # never reported: the process dies first
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    c = counts(port)
    # the first 100 lookups were reported before the kill; the last 50 at most with them
    assert c["requested_lookup"] in (400, 600) and c["misses"] == c["requested_lookup"]
    assert c["lookups_local"] == c["requested_lookup"] / 4


def _report(d, value: str, *extra: tuple[str, str], keys=()):
    channel = grpc.insecure_channel(d.address)
    try:
        stub = pb_grpc.KVStoreStub(channel)
        stub.Lookup(pb.LookupRequest(keys=list(keys)), timeout=10,
                    metadata=((REPORT_HEADER, value),) + extra)
    finally:
        channel.close()


def test_reports_are_bounded_and_malformed_ones_add_nothing(daemon_factory):
    """A client cannot make one call add more than a bounded tally, or anything nonsensical."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    for bad in ("", "1,2", "5,6,1", "-1,0,1", "1,0,-1", "x,0,1", "1e3,0,1", "99999999999,0,1",
                f"{1 << 30},0,1", "3,1,1,1", "3, 1,1", "0x3,1,1"):
        _report(d, bad)
    c = counts(port)
    assert c["requested_lookup"] == c["misses"] == c["lookup_hits"] == c["lookups_local"] == 0
    _report(d, "10,4,2", (REPORT_HEADER, "10,4,2"))  # one report per call: the second is ignored
    c = counts(port)
    assert (c["requested_lookup"], c["lookup_hits"], c["misses"], c["lookups_local"]) == (10, 4, 6, 2)


def test_with_tenants_there_is_no_index_and_reports_are_ignored(daemon_factory, short_tmp):
    tenants = short_tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntoken = "token-a-0123456789"\n')
    port = free_port()
    d = daemon_factory(tenants_file=str(tenants), metrics_listen=f"127.0.0.1:{port}")
    _report(d, "10,4,2", ("authorization", "Bearer token-a-0123456789"))
    c = counts(port)
    assert c["requested_lookup"] == c["misses"] == c["lookup_hits"] == 0
    with KVStoreClient(d.address, token="token-a-0123456789") as client:
        assert client.stats()["requested"] == 0


def test_a_tally_over_the_bound_goes_in_several_reports():
    from kvstore.lookup_report import MAX_REPORT, parse_report

    client = KVStoreClient(f"127.0.0.1:{free_port()}")  # never called: the channel connects lazily
    try:
        client._tally.unreported[:] = [MAX_REPORT + 5, MAX_REPORT + 3, 2]
        (name, value), = client._tally.take()
        assert name == REPORT_HEADER and parse_report(value) == (MAX_REPORT, MAX_REPORT, 2)
        (_, value), = client._tally.take()
        assert parse_report(value) == (5, 3, 0) and client._tally.take() == ()
    finally:
        client._channel.close()


def test_warm_up_calls_count_nothing_and_start_the_reporter(daemon_factory):
    """The vLLM connector's warm-up before the first request (engine_adapter/vllm/scheduler.py and
    worker.py ``warm_up``): an empty local Lookup, an empty leasing Lookup RPC and an empty Get
    through the arena. They name no key, so the daemon counts nothing; the local one starts the
    tally's reporter thread, so the first real Lookup does not."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}")
    before = counts(port)
    with KVStoreClient(d.address) as client:
        assert client.lookup([]).hits == 0 and client._tally.reporter is not None and client._tally.reporter.is_alive()
        assert client.lookup([], lease_s=10).hits == 0
        with client.fetch([], BLOCK) as blocks:
            assert blocks == []
    assert counts(port) == before


# -- the keys of local Lookups: uses for eviction adaptive (kvstore/lookup_report.py) --------


def key_counts(port: int) -> dict[str, float]:
    m = scrape(port)
    found = {outcome: m.get(("kvstore_local_lookup_keys_total", (("outcome", outcome),)), 0.0)
             for outcome in ("held", "not_held", "dropped")}
    found["frequent"] = m.get(("kvstore_arc_frequent_blocks", (("tier", "cpu"),)), 0.0)
    return found


def test_local_lookups_are_uses_for_the_adaptive_policy(daemon_factory):
    """A block found by local Lookups through the key index moves to ARC's frequent segment, as a
    Get of it would; a Get that follows adds nothing more; blocks only Put stay in the recent one."""
    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}", eviction="adaptive")
    keys, payloads = make_blocks(6, seed=403)
    with KVStoreClient(d.address) as client:
        assert client.put(NS, [(k, 64, p) for k, p in zip(keys[:4], payloads)]) == 4
        assert key_counts(port)["frequent"] == 0
        for _ in range(3):
            assert client.lookup(keys[:2]).hits == 2 and client.lookup(keys[4:]).hits == 0
        assert client.local_lookups == 6 and client.rpc_lookups == 0
        client.stats()  # the next call carries the report: the two hit keys, once each
        c = key_counts(port)
        assert (c["frequent"], c["held"], c["not_held"], c["dropped"]) == (2, 2, 0, 0)
        with client.fetch(keys[:2], BLOCK) as blocks:
            assert all(b is not None for b in blocks)
        assert key_counts(port)["frequent"] == 2
        client.lookup(keys[:3])  # reported by the reporter thread within its interval
        wait_until(lambda: key_counts(port)["frequent"] == 3, 5, "the periodic report")
    assert counts(port)["lookups_local"] == 7


def test_reported_keys_are_bounded_and_ignored_with_tenants(daemon_factory, short_tmp):
    from kvstore.lookup_report import MAX_REPORT_KEYS, REPORT_KEYS_HEADER

    port = free_port()
    d = daemon_factory(metrics_listen=f"127.0.0.1:{port}", eviction="adaptive")
    keys, payloads = make_blocks(3, seed=404)
    with KVStoreClient(d.address) as client:
        client.put(NS, [(k, 64, p) for k, p in zip(keys, payloads)])
    for bad in (keys[0][:-1], keys[0] * (MAX_REPORT_KEYS + 1), b""):  # not whole keys, too many, none
        _report(d, "1,1,1", (REPORT_KEYS_HEADER, bad))
    assert key_counts(port)["held"] == key_counts(port)["not_held"] == 0
    unknown = [os.urandom(16) for _ in range(MAX_REPORT_KEYS - 4)]
    _report(d, "1,1,1", (REPORT_KEYS_HEADER, b"".join(keys + keys + unknown[:-2])),
            (REPORT_KEYS_HEADER, keys[0]))  # a key twice counts once; a second report on a call, not at all
    c = key_counts(port)
    # 6 + 122 keys: the most a call carries
    assert (c["held"], c["not_held"], c["frequent"]) == (3, MAX_REPORT_KEYS - 6, 3)

    tenants = short_tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntoken = "token-a-0123456789"\n')
    port = free_port()
    d = daemon_factory("d1", tenants_file=str(tenants), metrics_listen=f"127.0.0.1:{port}", eviction="adaptive")
    _report(d, "1,1,1", ("authorization", "Bearer token-a-0123456789"), (REPORT_KEYS_HEADER, b"".join(keys)))
    assert key_counts(port)["held"] == key_counts(port)["not_held"] == 0


def test_reported_keys_count_within_a_rate_for_all_clients():
    from kvstore.lookup_report import KeyRate

    now = [0.0]
    rate = KeyRate(100, clock=lambda: now[0])
    assert rate.admit(60) == 60 and rate.admit(60) == 40 and rate.admit(5) == 0  # a second's worth banked
    now[0] = 0.5
    assert rate.admit(100) == 50
    now[0] = 10.0
    assert rate.admit(500) == 100  # never more than a second's worth after a pause


def test_a_client_keeps_a_bounded_number_of_hit_keys_for_its_reports():
    from kvstore.lookup_report import MAX_PENDING_KEYS, MAX_REPORT_KEYS, REPORT_KEYS_HEADER, parse_report_keys

    client = KVStoreClient(f"127.0.0.1:{free_port()}")  # never called: the channel connects lazily
    try:
        tally = client._tally
        many = [i.to_bytes(16, "little") for i in range(MAX_PENDING_KEYS + 10)]
        tally.count(len(many), len(many), client._report, many)
        tally.count(2, 2, client._report, many[:2])  # already waiting: kept once
        assert len(tally.hit_keys) == MAX_PENDING_KEYS and tally.dropped_keys == 10
        reports = []
        while tally:
            reports.append(dict(tally.take()))
        assert len(reports) == MAX_PENDING_KEYS // MAX_REPORT_KEYS
        sent = [k for r in reports for k in parse_report_keys(r[REPORT_KEYS_HEADER])]
        assert sent == many[:MAX_PENDING_KEYS]
    finally:
        client._tally.stop()
        client._channel.close()
