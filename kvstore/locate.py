"""Cluster lookup: which daemon holds the longest run of a prompt's keys.

A router without an event feed (kvstore/events.py) asks every daemon at once:

    result = locate(["10.0.0.5:7070", "10.0.0.6:7070", "unix:/run/kvstore.sock"], keys, deadline_s=0.5)
    result.best.address        # most leading keys held, then the faster tiers, then the quicker answer
    result.hosts[i].error      # "UNAVAILABLE: ..." for a host that did not answer in time: not fatal

Each host gets one Lookup with its own deadline, all in flight together (a thread each), so the
answer takes as long as the slowest host or the deadline, whichever is first. A daemon with an S3
tier answers for blocks any host stored in the shared bucket too (its Lookup asks the bucket).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import grpc

from kvstore.keys import KEY_BYTES
from kvstore.limits import MAX_KEYS_PER_CALL
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

#: Tiers fastest first; a hit in a tier not named here ranks after them.
TIER_SPEED = ("gpu", "cpu", "disk", "s3")


@dataclass(frozen=True)
class HostAnswer:
    address: str
    hits: int = 0                 # keys[0:hits] are held by this host
    tiers: tuple[str, ...] = ()   # the highest tier holding each hit
    seconds: float = 0.0          # until it answered or failed
    error: str = ""               # why it gave no answer ("" when it answered)

    @property
    def answered(self) -> bool:
        return not self.error

    @property
    def tier_cost(self) -> int:
        """Sum of the hits' tier ranks (0 = gpu): lower loads faster."""
        return sum(TIER_SPEED.index(t) if t in TIER_SPEED else len(TIER_SPEED) for t in self.tiers)


@dataclass(frozen=True)
class LocateResult:
    keys: int
    hosts: tuple[HostAnswer, ...]  # in the order asked
    best: HostAnswer | None        # None when no host holds even the first key


def locate(addresses: Sequence[str], keys: Sequence[bytes], deadline_s: float = 1.0,
           token: str | None = None) -> LocateResult:
    """Ask every daemon in ``addresses`` (``host:port`` or ``unix:/path``) for the longest run of
    leading ``keys`` it holds, all at once, each within ``deadline_s``. Raises ValueError for bad
    input; a host that is down, slow or refuses is an answer with ``error`` set."""
    if not addresses:
        raise ValueError("locate needs at least one daemon address")
    if len(keys) > MAX_KEYS_PER_CALL:
        raise ValueError(f"{len(keys)} keys; a Lookup takes at most {MAX_KEYS_PER_CALL}")
    if any(len(k) != KEY_BYTES for k in keys):
        raise ValueError(f"keys must be {KEY_BYTES} bytes each")
    if deadline_s <= 0:
        raise ValueError(f"deadline_s must be positive, got {deadline_s}")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    request = pb.LookupRequest(keys=list(keys))
    with ThreadPoolExecutor(len(addresses), thread_name_prefix="kvstore-locate") as pool:
        answers = tuple(pool.map(lambda a: _ask(a, request, deadline_s, metadata), addresses))
    held = [a for a in answers if a.answered and a.hits]
    best = min(held, key=lambda a: (-a.hits, a.tier_cost, a.seconds), default=None)
    return LocateResult(len(keys), answers, best)


def _ask(address: str, request: pb.LookupRequest, deadline_s: float, metadata) -> HostAnswer:
    started = time.perf_counter()
    try:
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.KVStoreStub(channel).Lookup(request, timeout=deadline_s, metadata=metadata)
    except grpc.RpcError as exc:
        return HostAnswer(address, seconds=time.perf_counter() - started,
                          error=f"{exc.code().name}: {exc.details()}")
    return HostAnswer(address, reply.hits, tuple(reply.tiers), time.perf_counter() - started)
