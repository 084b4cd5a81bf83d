"""Cluster lookup: which daemon holds the longest run of a prompt's keys.

A router without an event feed (kvstore/daemon/events.py) asks every daemon at once:

    result = locate(["10.0.0.5:7070", "10.0.0.6:7070", "unix:/run/kvstore.sock"], keys, deadline_s=0.5,
                    tokens=TokenBook.read("tokens.toml"), tls=ClientTLS("ca.pem"))
    result.best.address        # most leading keys held, then the faster tiers, then the quicker answer
    result.hosts[i].error      # "UNAVAILABLE: ..." for a host that did not answer in time: not fatal

Each host gets one Lookup with its own deadline, all in flight together (a thread each), so the
answer takes as long as the slowest host or the deadline, whichever is first. A daemon with an S3
tier answers for blocks any host stored in the shared bucket too (its Lookup asks the bucket).
How a client reaches each host (TLS, its token, one-line errors) is kvstore/connect.py.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

import grpc

from kvstore.connect import (PYTHON_OPTIONS, TOKEN_ENV, ClientTLS, OptionNames, TokenBook, explain, is_unix,
                             open_channel, plaintext_token_refusal)
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


# -- reaching a daemon ------------------------------------------------------------------------


# -- cluster lookup ---------------------------------------------------------------------------


def locate(addresses: Sequence[str], keys: Sequence[bytes], deadline_s: float = 1.0,
           token: str | None = None, *, tokens: TokenBook | Mapping[str, str] | None = None,
           tls: ClientTLS | None = None, insecure: bool = False,
           names: OptionNames = PYTHON_OPTIONS) -> LocateResult:
    """Ask every daemon in ``addresses`` (``host:port`` or ``unix:/path``) for the longest run of
    leading ``keys`` it holds, all at once, each within ``deadline_s``.

    Each host's token: its entry in ``tokens`` (a `TokenBook` or an address -> token mapping),
    else ``token``, else the book's default, else ``KVSTORE_AUTH_TOKEN``. ``tls`` applies to every
    TCP host. Raises ValueError for bad input, and before asking anyone when a token would go
    over plaintext TCP to a host that is not loopback (unless ``insecure``); a host that is down,
    slow or refuses is an answer with ``error`` set.
    """
    if not addresses:
        raise ValueError("locate needs at least one daemon address")
    if len(keys) > MAX_KEYS_PER_CALL:
        raise ValueError(f"{len(keys)} keys; a Lookup takes at most {MAX_KEYS_PER_CALL}")
    if any(len(k) != KEY_BYTES for k in keys):
        raise ValueError(f"keys must be {KEY_BYTES} bytes each")
    if deadline_s <= 0:
        raise ValueError(f"deadline_s must be positive, got {deadline_s}")
    host_tokens = tokens_for(addresses, token, tokens)
    refuse_plaintext_tokens(host_tokens, tls, insecure, names)
    if tls is not None:
        tls.credentials()  # ValueError now for a TLS file that cannot be used, not per host
    request = pb.LookupRequest(keys=list(keys))
    with ThreadPoolExecutor(len(addresses), thread_name_prefix="kvstore-locate") as pool:
        answers = tuple(pool.map(lambda a: _ask(a, request, deadline_s, host_tokens[a], tls, names), addresses))
    held = [a for a in answers if a.answered and a.hits]
    best = min(held, key=lambda a: (-a.hits, a.tier_cost, a.seconds), default=None)
    return LocateResult(len(keys), answers, best)


def tokens_for(addresses: Sequence[str], token: str | None = None,
               tokens: TokenBook | Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Each address's token: its entry in ``tokens``, else ``token``, else the book's default,
    else ``KVSTORE_AUTH_TOKEN`` (None: no token)."""
    book = tokens if isinstance(tokens, TokenBook) else TokenBook(None, dict(tokens or {}))
    fallback = token or book.default or os.environ.get(TOKEN_ENV) or None
    return {address: book.hosts.get(address, fallback) for address in addresses}


def refuse_plaintext_tokens(host_tokens: Mapping[str, str | None], tls: ClientTLS | None, insecure: bool,
                            names: OptionNames = PYTHON_OPTIONS) -> None:
    """ValueError (`plaintext_token_refusal`'s line) when any token would go over plaintext TCP to
    an address that is not loopback."""
    for address, token in host_tokens.items():
        refusal = plaintext_token_refusal(address, None if is_unix(address) else tls, token, insecure, names)
        if refusal:
            raise ValueError(refusal)


def _ask(address: str, request: pb.LookupRequest, deadline_s: float, token: str | None,
         tls: ClientTLS | None, names: OptionNames) -> HostAnswer:
    started = time.perf_counter()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    tls = None if is_unix(address) else tls
    try:
        with open_channel(address, tls) as channel:
            reply = pb_grpc.KVStoreStub(channel).Lookup(request, timeout=deadline_s, metadata=metadata)
    except grpc.RpcError as exc:
        left = deadline_s - (time.perf_counter() - started)
        reason = explain(exc, address, tls, token, probe_timeout=min(left, 1.0), names=names) \
            or " ".join((exc.details() or "").split())
        return HostAnswer(address, seconds=time.perf_counter() - started, error=f"{exc.code().name}: {reason}")
    return HostAnswer(address, reply.hits, tuple(reply.tiers), time.perf_counter() - started)
