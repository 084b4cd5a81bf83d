"""Request traces for `bench/cache_policy.py`: the JSON-lines format, its loader and writer, and a
synthetic multi-round QA generator, so the simulator runs without vLLM.

One line per request lookup, in arrival order (the vLLM connector and the serving bench write them):

    {"t": 1733450000.123, "request": "u3-r2", "local_tokens": 512,
     "blocks": [{"key": "ab12..", "parent": null, "tokens": 256, "bytes": 5898240},
                {"key": "cd34..", "parent": "ab12..", "tokens": 256, "bytes": 5898240}, ...],
     "hits": 3, "tiers": ["cpu", "cpu", "disk"], "lookup_s": 0.00021}

``blocks`` is the request's whole chain (each block's parent is the block before it; the last may be
a shorter tail block). ``hits``, ``tiers``, ``local_tokens`` and ``lookup_s`` are what the live system
saw: optional, carried for reports, never used by a replay. Other keys are ignored.

Mooncake's trace format (the FAST'25 release; `../shared/data/traces/`) is read as it is, line by line:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``hash_ids`` is the request's chain of 512-token prefix blocks (`MOONCAKE_BLOCK_TOKENS`), ids remapped so
equal ids are the same block with the same prefix; the last block holds ``input_length - 512 * (n-1)``
tokens. A block's key is ``"m<id>"``, its parent the id before it, its bytes its tokens x the model's KV
bytes per token (``token_bytes``); ``t`` is ``timestamp`` in seconds. A file may mix both formats.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

#: Defaults of the synthetic trace: 256-token chunks of SmolLM2-135M's raw KV
#: (30 layers x 2 x 3 KV heads x 64 x 2 bytes = 23,040 bytes a token, 5.9 MB a block).
BLOCK_TOKENS = 256
TOKEN_BYTES = 23_040
MOONCAKE_BLOCK_TOKENS = 512
NEVER = sys.maxsize  # next use of a block no later request asks for


class TraceError(ValueError):
    """A trace line that is not a request; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Block:
    key: str
    parent: str | None
    tokens: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Request:
    request: str
    blocks: tuple[Block, ...]
    t: float | None = None
    local_tokens: int | None = None     # vLLM's own GPU prefix cache had these
    hits: int | None = None             # blocks the live system found
    tiers: tuple[str, ...] | None = None
    lookup_s: float | None = None

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def request_from_json(line: dict, token_bytes: int = TOKEN_BYTES) -> Request:
    """One decoded trace line (ours, or Mooncake's with ``token_bytes`` a token) -> `Request`; ValueError
    says which field is wrong."""
    if not isinstance(line, dict):
        raise ValueError(f"expected a JSON object, got {type(line).__name__}")
    if "hash_ids" in line:
        return mooncake_request(line, token_bytes)
    raw_blocks = line.get("blocks")
    if not isinstance(raw_blocks, list):
        raise ValueError("'blocks' must be a list of {key, parent, tokens, bytes}")
    blocks = []
    parent = None
    for i, raw in enumerate(raw_blocks):
        if not isinstance(raw, dict) or not isinstance(raw.get("key"), str):
            raise ValueError(f"block {i} needs a string 'key'")
        if raw.get("parent") != parent:
            raise ValueError(f"block {i}'s parent is {raw.get('parent')!r}, but the block before it is {parent!r}")
        blocks.append(Block(raw["key"], parent, _int(raw.get("tokens"), f"block {i}'s tokens"),
                            _int(raw.get("bytes"), f"block {i}'s bytes")))
        parent = raw["key"]
    for name in ("hits", "local_tokens"):
        if line.get(name) is not None:
            _int(line[name], f"'{name}'")
    t = line.get("t")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))):
        raise ValueError(f"'t' must be a number of seconds, got {t!r}")
    tiers = line.get("tiers")
    return Request(request=str(line.get("request", "")), blocks=tuple(blocks), t=t,
                   local_tokens=line.get("local_tokens"), hits=line.get("hits"),
                   tiers=tuple(tiers) if isinstance(tiers, list) else None, lookup_s=line.get("lookup_s"))


def mooncake_request(line: dict, token_bytes: int) -> Request:
    """A Mooncake trace line -> `Request` (module docstring): full 512-token blocks and a shorter last one.

    0       512      1024            512*(n-1)        input_length
    |-id 0--|-id 1---|  ...  |-id n-2-|--id n-1--------|
                                        input_length - 512*(n-1) tokens, 1..512
    """
    ids, length = line.get("hash_ids"), _int(line.get("input_length"), "'input_length'")
    if not isinstance(ids, list) or not ids:
        raise ValueError("'hash_ids' must be a non-empty list of block ids")
    tail = length - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)
    if not 0 < tail <= MOONCAKE_BLOCK_TOKENS:
        raise ValueError(f"'input_length' {length} does not fill {len(ids)} blocks of {MOONCAKE_BLOCK_TOKENS} "
                         "tokens (the last one partly)")
    blocks, parent = [], None
    for i, raw in enumerate(ids):
        key = f"m{_int(raw, f'hash id {i}')}"
        tokens = MOONCAKE_BLOCK_TOKENS if i < len(ids) - 1 else tail
        blocks.append(Block(key, parent, tokens, tokens * token_bytes))
        parent = key
    timestamp = line.get("timestamp")
    if timestamp is not None and (isinstance(timestamp, bool) or not isinstance(timestamp, (int, float))):
        raise ValueError(f"'timestamp' must be a number of milliseconds, got {timestamp!r}")
    return Request(request=str(line.get("request", "")), blocks=tuple(blocks),
                   t=None if timestamp is None else timestamp / 1000)


def request_to_json(request: Request) -> dict:
    line: dict = {"t": request.t, "request": request.request, "local_tokens": request.local_tokens,
                  "blocks": [{"key": b.key, "parent": b.parent, "tokens": b.tokens, "bytes": b.nbytes}
                             for b in request.blocks],
                  "hits": request.hits, "tiers": list(request.tiers) if request.tiers is not None else None,
                  "lookup_s": request.lookup_s}
    return {name: value for name, value in line.items() if value is not None}


def load_trace(path: str | Path, token_bytes: int = TOKEN_BYTES) -> list[Request]:
    """Requests of one JSON-lines trace, in file order (blank lines skipped); ``token_bytes``: KV bytes a
    token of Mooncake's lines, which carry no bytes.

    Raises `TraceError` ("trace.jsonl:17: ...") at the first line that is not a request.
    """
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                requests.append(request_from_json(json.loads(text), token_bytes))
            except ValueError as e:  # json.JSONDecodeError is one
                raise TraceError(f"{path}:{number}: {e}") from None
    return requests


def load_traces(paths: Iterable[str | Path], token_bytes: int = TOKEN_BYTES) -> list[Request]:
    """Several traces as one: merged by arrival time when every request has one (engines sharing a
    daemon), else concatenated in the order given."""
    requests = [r for path in paths for r in load_trace(path, token_bytes)]
    if all(r.t is not None for r in requests):
        requests.sort(key=lambda r: r.t)  # stable: one file's ties keep their order
    return requests


def conversation_sample(requests: Sequence[Request], one_in: int) -> list[Request]:
    """The requests of one conversation in ``one_in``: those whose second block's key ends in a
    number that is a multiple of ``one_in`` (Mooncake's ``m<id>``; a conversation's turns share their
    second block, so whole conversations are kept over the trace's whole span, where a short window
    would keep few returns: turns come back minutes apart). ``one_in`` 1 keeps every request."""
    if one_in <= 1:
        return list(requests)
    kept = []
    for request in requests:
        if len(request.blocks) > 1:
            digits = request.blocks[1].key.removeprefix("m")
            if digits.isdigit() and int(digits) % one_in == 0:
                kept.append(request)
    return kept


def write_trace(requests: Iterable[Request], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for request in requests:
            out.write(json.dumps(request_to_json(request)) + "\n")


def working_set_bytes(requests: Iterable[Request]) -> int:
    """Bytes of the distinct blocks: what a cache must hold to miss only each block's first put."""
    sizes = {b.key: b.nbytes for r in requests for b in r.blocks}
    return sum(sizes.values())


def next_uses(requests: Sequence[Request]) -> list[list[int]]:
    """[request][block of its chain] -> index of the next request asking for that block, or NEVER."""
    later: dict[str, int] = {}
    uses: list[list[int]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        uses[r] = [later.get(b.key, NEVER) for b in requests[r].blocks]
        for block in requests[r].blocks:
            later[block.key] = r
    return uses


def block_key(parent: str | None, content: tuple) -> str:
    """A chained key, as the engine's: a hash of the parent key and the chunk's content (here an id)."""
    h = hashlib.blake2b(digest_size=16, person=b"cache-trace")
    h.update((parent or "").encode())
    h.update(repr(content).encode())
    return h.hexdigest()


def synthetic_trace(users: int, rounds: int, context_blocks: int, question_blocks: int, seed: int,
                    shared_system_blocks: int = 2, no_reuse: bool = False, zipf: float | None = None,
                    active: int | None = None, scans: float = 0.0, block_tokens: int = BLOCK_TOKENS,
                    token_bytes: int = TOKEN_BYTES) -> list[Request]:
    """Multi-round QA over long contexts: each user's round r asks for the chain

        [system: shared by all users][user's context][q+a 0][q+a 1] ... [q r]
         shared_system_blocks          context_blocks  question_blocks each

    so round r reuses all of round r-1's chain and adds ``question_blocks`` blocks (the previous
    answer and the new question). Users are interleaved: with ``zipf`` None every round visits the
    users still asking in a fresh random order, so a user's next round comes about ``users`` requests
    later; with ``zipf`` = s each request comes from a user drawn with weight 1 / rank^s among those
    with rounds left (popular users come back sooner). ``no_reuse``: every request's blocks are new
    (no shared system prompt either), a trace on which no cache can hit. ``active`` = k: users come
    in sessions instead, at most k talking at once, each request from one of them drawn uniformly;
    when one has asked all its rounds the next user starts (recency wins: a user never comes back
    after its session). ``scans`` = f: besides the users' requests, a fraction f of all requests are
    scans of one-off documents (a chain of ``context_blocks`` new blocks behind the shared system
    prompt, never asked for again), spread through the trace. An agent re-reading its tool prompt is
    a long ``shared_system_blocks``. All blocks are full chunks.
    """
    if min(users, rounds, question_blocks) < 1 or min(context_blocks, shared_system_blocks) < 0:
        raise ValueError("users, rounds and question_blocks must be >= 1; context and system blocks >= 0")
    if active is not None and (active < 1 or zipf is not None):
        raise ValueError("active must be >= 1 and excludes zipf")
    rng = random.Random(seed)
    order: list[int] = []
    if active is not None:
        left, talking, newcomer = [rounds] * users, list(range(min(active, users))), min(active, users)
        while talking:
            user = rng.choice(talking)
            order.append(user)
            left[user] -= 1
            if not left[user]:
                talking.remove(user)
                if newcomer < users:
                    talking.append(newcomer)
                    newcomer += 1
    elif zipf is None:
        for _ in range(rounds):
            asking = list(range(users))
            rng.shuffle(asking)
            order += asking
    else:
        left = [rounds] * users
        weights = [1 / (rank + 1) ** zipf for rank in range(users)]
        for _ in range(users * rounds):
            asking = [u for u in range(users) if left[u]]
            user = rng.choices(asking, weights=[weights[u] for u in asking])[0]
            left[user] -= 1
            order.append(user)
    if not 0 <= scans < 1:
        raise ValueError(f"scans is a fraction of the requests, 0 <= scans < 1, got {scans}")
    scan_count = round(len(order) * scans / (1 - scans))
    for j, at in enumerate(sorted(rng.randrange(len(order) + 1) for _ in range(scan_count))):
        order.insert(at + j, -1)  # -1: a scan
    nbytes = block_tokens * token_bytes
    asked = [0] * users
    requests = []
    for i, user in enumerate(order):
        owner = ("request", i) if no_reuse or user < 0 else ("user", user)
        contents = [("system", j) if not no_reuse else (owner, "system", j) for j in range(shared_system_blocks)]
        contents += [(owner, "context", j) for j in range(context_blocks)]
        if user < 0:
            blocks, parent = [], None
            for content in contents:
                blocks.append(Block(key := block_key(parent, content), parent, block_tokens, nbytes))
                parent = key
            requests.append(Request(request=f"scan{i}", blocks=tuple(blocks), t=float(i)))
            continue
        contents += [(owner, "qa", r, j) for r in range(asked[user] + 1) for j in range(question_blocks)]
        blocks, parent = [], None
        for content in contents:
            key = block_key(parent, content)
            blocks.append(Block(key, parent, block_tokens, nbytes))
            parent = key
        requests.append(Request(request=f"u{user}-r{asked[user]}", blocks=tuple(blocks), t=float(i)))
        asked[user] += 1
    return requests
