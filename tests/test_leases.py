"""The vLLM connector's leases, sent off the scheduler's thread (engine_adapter/vllm/leases.py):
they still keep a reported hit from eviction until the load, queueing one costs the scheduler no
round trip, and a daemon slower than the requests costs dropped leases, never a wait."""

from __future__ import annotations

import threading

from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.client.prefix_cache import PrefixCache
from engine_adapter.vllm.leases import MAX_WAITING, Leases
from tests.test_daemon import BLOCK, NS, make_blocks


def test_a_lease_sent_off_the_thread_keeps_a_hit_until_the_load(daemon_factory):
    """As tests/test_daemon.py's lease test, with the lease queued: a CPU tier of ~10 blocks, no
    disk (evicted means gone); the leased blocks survive 16 more Puts, the others are evicted."""
    d = daemon_factory(cpu_capacity="1500KiB", disk_path="")
    keys, payloads = make_blocks(24, seed=12)
    with KVStoreClient(d.address) as client:
        cache = PrefixCache(client, NS)
        leases = Leases(lambda k, s: cache.lookup(k, lease_s=s))
        client.put(NS, [(k, 64, p) for k, p in zip(keys[:4], payloads[:4])])
        assert client.lookup(keys[:4]).hits == 4
        leases.send(keys[:2], 30.0)
        assert leases.wait(10) and (leases.sent, leases.failed, leases.dropped) == (1, 0, 0)
        for start in range(4, 20, 4):
            client.put(NS, [(k, 64, p) for k, p in zip(keys[start : start + 4], payloads[start : start + 4])])
        assert client.lookup(keys[:2]).hits == 2
        assert client.get(keys[:2], BLOCK) == [p.tobytes() for p in payloads[:2]]
        assert client.lookup(keys[2:3]).hits == 0  # not leased: evicted
        leases.stop()


def test_queueing_a_lease_never_waits_for_the_daemon_and_past_the_bound_drops():
    """A daemon that does not answer (a lease call that blocks: the fault a live daemon cannot be
    made to show on cue) holds the sender; `send` returns at once all the same, and the leases
    past `MAX_WAITING` are dropped and counted."""
    release = threading.Event()
    calls: list[int] = []

    def stuck(keys, lease_s):
        calls.append(len(keys))
        release.wait(30)
        return object()

    leases = Leases(stuck)
    for i in range(MAX_WAITING + 10):
        leases.send([b"k" * 16] * (i + 1), 10.0)
    # every send returned while the first call is still stuck: none waited for it
    assert not release.is_set() and len(calls) <= 1
    # one being sent (or about to be), MAX_WAITING waiting, the rest dropped
    assert leases.dropped in (9, 10)
    assert not leases.wait(0.05)
    release.set()
    assert leases.wait(10)
    assert leases.sent == MAX_WAITING + 10 - leases.dropped and leases.failed == 0
    assert calls[0] == 1  # in the order queued
    leases.stop()


def test_a_failed_lease_is_counted_and_the_sender_goes_on():
    outcomes = iter([RuntimeError("daemon gone"), None, object()])

    def flaky(keys, lease_s):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    leases = Leases(flaky)
    for _ in range(3):
        leases.send([b"k" * 16], 1.0)
    assert leases.wait(10)
    assert (leases.sent, leases.failed, leases.dropped) == (1, 2, 0)
    leases.stop()


def test_a_waiting_requests_repeated_asks_lease_once_until_its_hit_grows_or_half_the_lease_ran():
    """vLLM asks a waiting request's lookup at every scheduling step: one lease, not one a step."""
    sent: list[int] = []
    leases = Leases(lambda keys, lease_s: sent.append(len(keys)) or object())
    keys = [bytes([i]) * 16 for i in range(4)]
    for _ in range(5):
        leases.lease("r1", keys[:3], 10.0)  # asked again while it waits for pages
    leases.lease("r2", keys[:2], 10.0)
    leases.lease("r1", keys, 10.0)  # its hit grew: the new keys need a lease
    leases.lease("r1", keys[:2], 10.0)  # it shrank: those keys are leased already
    leases.lease("r2", keys[:2], 0.0)  # a lease with no time left to run is renewed
    leases.forget("r1")
    leases.lease("r1", keys, 10.0)  # finished, its id seen again: a new request
    assert leases.wait(10)
    assert sent == [3, 2, 4, 2, 4] and leases.repeated == 5 and leases.sent == 5
    leases.stop()
