"""What the scheduler side tells the workers each step: chunks to load, chunks to save.

Pure Python (no vLLM import), so the range arithmetic is unit-tested on its own. The connector's
scheduler side (``scheduler.py``) feeds it vLLM's requests and scheduler output.

Per request, the prompt minus its last token is cut into chunks with chained keys, exactly as the
reference engine does (``CachedEngine``), so a block stored by either engine is a hit for both;
then the tokens after the last full chunk, up to the last page boundary, form one short *tail*
block (``kvstore.keys.tail_key``), so a repeat hits up to the last page, not the last chunk::

    prompt           |--chunk 0--|--chunk 1--|--chunk 2--|-tail-|..|x|  x: last token, always computed
    keys             k0          k1          k2          t3            paged_prefix_keys(prompt[:-1])
    pages            |   |   |   |   |   |   |   |   |   |   |   |     (tail ends on a page boundary)
    vLLM's own hit   |=====local=====|                                  (page-aligned, any length)
    kvstore hit      |=============== hit pieces ===============|
    load             ................|xxxxxxxxxxxxxxxxxxxxxxxxxxx|       local .. hit end (partial chunk 1, ...)
    compute                                                      |xxxx|

Each piece (chunk or tail) kvstore lacks is saved once, in the first step after which vLLM holds
all of it (the step whose forward completes it, or the first step for pieces vLLM's own prefix
cache supplied)::

    step computes tokens [before, after):  save pieces i in [saved, pieces ending at or before after),
                                            saved = kvstore's hit in pieces, then advanced to the end
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from engine_adapter.vllm.layout import PagedSpan
from kvstore.keys import Namespace, paged_prefix_keys


@dataclass(frozen=True)
class ChunkLoad:
    """Tokens ``lo .. hi-1`` (block-relative) of the block ``key`` of ``tokens`` tokens, into ``span``."""

    key: bytes
    lo: int
    hi: int
    span: PagedSpan
    tokens: int


@dataclass(frozen=True)
class ChunkSave:
    """The whole block ``key`` (``span.tokens`` tokens: a chunk or a tail), read from ``span``;
    ``event``: what to tell vLLM's KV-event stream once it is stored (None: events are off)."""

    key: bytes
    span: PagedSpan
    event: object = None
    parent: bytes = b""  # the key before it in the prompt's chain (b"": the first)
    token_ids: list[int] | None = None  # its tokens, for the daemon's KV events (None: not known)


@dataclass
class StepPlan:
    """One step's work for the workers (pickled into vLLM's connector metadata)."""

    loads: dict[str, list[ChunkLoad]] = field(default_factory=dict)  # request id -> pieces, in order
    saves: list[ChunkSave] = field(default_factory=list)
    blends: list = field(default_factory=list)  # blend.BlendRequest (pages set) of requests blended this step

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.blends)


@dataclass
class RequestChunks:
    """Scheduler-side state of one request."""

    keys: list[bytes]       # full chunks, then the tail (if any)
    tail: int = 0           # tokens of the last key's block when it is a tail; 0: every key is a full chunk
    hit_tokens: int = 0     # kvstore's hit at the last lookup (whole pieces)
    local_tokens: int = 0   # vLLM's own computed tokens at that lookup: a load starts here
    hit_tiers: tuple[str, ...] = ()  # the daemon tier holding each hit piece
    saved_chunks: int = -1  # pieces before this index are stored or need no saving; -1 until first scheduled


class Planner:
    """Chunk bookkeeping of the scheduler side.

    Calls, in vLLM's order: :meth:`keys_of` / :meth:`loadable` / :meth:`record_hit` from ``get_num_new_matched_tokens``
    (which may repeat for a request), :meth:`plan_load` from ``update_state_after_alloc``,
    :meth:`plan_step` from ``build_connector_meta`` once a step, :meth:`forget` when a request ends.
    ``tails=False`` keeps to full chunks (hits end on a chunk boundary); ``saves=False`` plans loads only.
    """

    def __init__(self, namespace: Namespace, page_tokens: int, tails: bool = True, saves: bool = True) -> None:
        self.namespace = namespace
        self.page_tokens = page_tokens
        self.tails = tails
        self.saves = saves  # False: a consumer (P/D decode side) loads and never stores
        self.requests: dict[str, RequestChunks] = {}
        self._loads: dict[str, list[ChunkLoad]] = {}

    @property
    def chunk_tokens(self) -> int:
        return self.namespace.chunk_tokens

    def keys_of(self, request_id: str, prompt_ids: Sequence[int]) -> list[bytes]:
        """Keys of the prompt's pieces before its last token (computed once a request)."""
        state = self.requests.get(request_id)
        if state is None:
            tokens = list(prompt_ids)[: max(len(prompt_ids) - 1, 0)]
            page = self.page_tokens if self.tails else self.chunk_tokens
            keys, tail = paged_prefix_keys(self.namespace, tokens, page)
            state = RequestChunks(keys, tail)
            self.requests[request_id] = state
        return state.keys

    def _bounds(self, state: RequestChunks, i: int) -> tuple[int, int]:
        """Token range [start, end) of piece ``i``."""
        n = self.chunk_tokens
        size = state.tail if state.tail and i == len(state.keys) - 1 else n
        return i * n, i * n + size

    def _end(self, state: RequestChunks, pieces: int) -> int:
        """Tokens covered by the first ``pieces`` pieces."""
        return self._bounds(state, pieces - 1)[1] if pieces > 0 else 0

    def loadable(self, request_id: str, hit_chunks: int, computed_tokens: int) -> int:
        """The tokens a hit of ``hit_chunks`` pieces would load beyond vLLM's own ``computed_tokens``
        (what `record_hit` would return; nothing is remembered)."""
        state = self.requests[request_id]
        return max(0, self._end(state, min(hit_chunks, len(state.keys))) - computed_tokens)

    def record_hit(self, request_id: str, hit_chunks: int, computed_tokens: int, tiers: Sequence[str] = ()) -> int:
        """Remember kvstore's hit (in pieces); returns the tokens to load beyond vLLM's own ``computed_tokens``."""
        state = self.requests[request_id]
        state.hit_tokens = self._end(state, min(hit_chunks, len(state.keys)))
        state.local_tokens = computed_tokens
        state.hit_tiers = tuple(tiers)
        return max(0, state.hit_tokens - computed_tokens)

    def _overlapping(self, state: RequestChunks, start: int, end: int) -> list[tuple[int, int, int]]:
        """(piece, lo, hi): the pieces holding tokens [start, end), with the absolute range in each."""
        out = []
        for i in range(start // self.chunk_tokens, len(state.keys)):
            lo, hi = self._bounds(state, i)
            if lo >= end:
                break
            if hi > start:
                out.append((i, max(lo, start), min(hi, end)))
        return out

    def hit_sources(self, request_id: str, tokens: int) -> dict[str, int]:
        """Tokens of the load after vLLM's own hit, by the daemon tier that holds them."""
        state = self.requests[request_id]
        sources: dict[str, int] = {}
        for i, lo, hi in self._overlapping(state, state.local_tokens, state.local_tokens + tokens):
            tier = state.hit_tiers[i] if i < len(state.hit_tiers) else "unknown"
            sources[tier] = sources.get(tier, 0) + hi - lo
        return sources

    def plan_load(self, request_id: str, page_ids: Sequence[int], tokens: int) -> list[bytes]:
        """Plan loading ``tokens`` prompt tokens after vLLM's own hit into the request's pages;
        returns the keys to load."""
        if tokens <= 0:
            return []
        state = self.requests[request_id]
        start = state.local_tokens
        end = start + tokens
        if end > state.hit_tokens:
            raise ValueError(f"request {request_id}: load up to token {end} beyond the kvstore hit {state.hit_tokens}")
        loads = []
        for i, lo, hi in self._overlapping(state, start, end):
            first, last = self._bounds(state, i)
            loads.append(ChunkLoad(state.keys[i], lo - first, hi - first, PagedSpan.of(page_ids, self.page_tokens, lo, hi),
                                   last - first))
        self._loads[request_id] = loads
        return [load.key for load in loads]

    def plan_step(self, scheduled: Sequence[tuple[str, int, int]], page_ids_of: Callable[[str], Sequence[int]],
                  event_of: Callable[[str, int, int], object] | None = None,
                  tokens_of: Callable[[str, int, int], list[int] | None] | None = None) -> StepPlan:
        """This step's plan from ``(request id, computed tokens before it, scheduled tokens)`` per
        request; ``page_ids_of(request id)`` is asked only for requests with pieces to save, and
        ``event_of(request id, start, end)`` and ``tokens_of(request id, start, end)`` (if given)
        for each piece saved."""
        plan = StepPlan(loads=self._loads)
        self._loads = {}
        for request_id, before, scheduled_tokens in scheduled:
            state = self.requests.get(request_id)
            if state is None:
                continue
            if state.saved_chunks < 0:  # kvstore has the hit pieces; vLLM's own hits are saved
                state.saved_chunks = sum(1 for i in range(len(state.keys)) if self._end(state, i + 1) <= state.hit_tokens)
            after = before + scheduled_tokens
            first = last = state.saved_chunks
            while self.saves and last < len(state.keys) and self._bounds(state, last)[1] <= after:
                last += 1
            page_ids = page_ids_of(request_id) if last > first else ()
            for i in range(first, last):
                lo, hi = self._bounds(state, i)
                event = event_of(request_id, lo, hi) if event_of is not None else None
                plan.saves.append(ChunkSave(state.keys[i], PagedSpan.of(page_ids, self.page_tokens, lo, hi), event,
                                            state.keys[i - 1] if i else b"",
                                            tokens_of(request_id, lo, hi) if tokens_of is not None else None))
            state.saved_chunks = last
        return plan

    def lost(self, request_id: str, loaded_tokens: int) -> None:
        """The workers loaded only ``loaded_tokens`` of the planned hit: the rest is computed, and saved."""
        state = self.requests.get(request_id)
        if state is not None and loaded_tokens < state.hit_tokens:
            state.hit_tokens = loaded_tokens
            state.saved_chunks = min(state.saved_chunks, sum(
                1 for i in range(len(state.keys)) if self._end(state, i + 1) <= loaded_tokens))

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._loads.pop(request_id, None)
