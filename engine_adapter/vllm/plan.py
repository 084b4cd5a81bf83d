"""What the scheduler side tells the workers each step: chunks to load, chunks to save.

Pure Python (no vLLM import), so the range arithmetic is unit-tested on its own. The connector in
``connector.py`` feeds it vLLM's requests and scheduler output.

Per request, the prompt minus its last token is cut into chunks with chained keys, exactly as the
reference engine does (``CachedEngine``), so a block stored by either engine is a hit for both::

    prompt           |--chunk 0--|--chunk 1--|--chunk 2--|-tail-|x|     x: last token, always computed
    keys             k0          k1          k2                        prefix_keys(prompt[:-1])
    vLLM's own hit   |=====local=====|                                 (page-aligned, any length)
    kvstore hit      |=========== hits * n ===========|
    load             ................|xxxxxxxxxxxxxxxx|                local .. hits*n (partial chunk 1, chunk 2)
    compute                                           |xxxxxxxxxxxxxxxxxx|

Each chunk kvstore lacks is saved once, in the first step after which vLLM holds all of it (the
step whose forward completes it, or the first step for chunks vLLM's own prefix cache supplied)::

    step computes tokens [before, after):  save chunks c in [saved, min(len(keys), after // n)),
                                            saved = kvstore's hit in chunks, then advanced to the end
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from engine_adapter.vllm.layout import PagedSpan
from kvstore.keys import Namespace, prefix_keys


@dataclass(frozen=True)
class ChunkLoad:
    """Tokens ``lo .. hi-1`` (chunk-relative) of the block ``key``, into ``span``."""

    key: bytes
    lo: int
    hi: int
    span: PagedSpan


@dataclass(frozen=True)
class ChunkSave:
    """The whole chunk ``key``, read from ``span``."""

    key: bytes
    span: PagedSpan


@dataclass
class StepPlan:
    """One step's work for the workers (pickled into vLLM's connector metadata)."""

    loads: dict[str, list[ChunkLoad]] = field(default_factory=dict)  # request id -> chunks, in order
    saves: list[ChunkSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class RequestChunks:
    """Scheduler-side state of one request."""

    keys: list[bytes]
    hit_tokens: int = 0     # kvstore's hit at the last lookup (whole chunks)
    local_tokens: int = 0   # vLLM's own computed tokens at that lookup: a load starts here
    hit_tiers: tuple[str, ...] = ()  # the daemon tier holding each hit chunk
    saved_chunks: int = -1  # chunks before this index are stored or need no saving; -1 until first scheduled


class Planner:
    """Chunk bookkeeping of the scheduler side.

    Calls, in vLLM's order: :meth:`keys_of` / :meth:`record_hit` from ``get_num_new_matched_tokens``
    (which may repeat for a request), :meth:`plan_load` from ``update_state_after_alloc``,
    :meth:`plan_step` from ``build_connector_meta`` once a step, :meth:`forget` when a request ends.
    """

    def __init__(self, namespace: Namespace, page_tokens: int) -> None:
        self.namespace = namespace
        self.page_tokens = page_tokens
        self.requests: dict[str, RequestChunks] = {}
        self._loads: dict[str, list[ChunkLoad]] = {}

    @property
    def chunk_tokens(self) -> int:
        return self.namespace.chunk_tokens

    def keys_of(self, request_id: str, prompt_ids: Sequence[int]) -> list[bytes]:
        """Prefix keys of the prompt's full chunks before its last token (computed once a request)."""
        state = self.requests.get(request_id)
        if state is None:
            state = RequestChunks(prefix_keys(self.namespace, list(prompt_ids)[: max(len(prompt_ids) - 1, 0)]))
            self.requests[request_id] = state
        return state.keys

    def record_hit(self, request_id: str, hit_chunks: int, computed_tokens: int, tiers: Sequence[str] = ()) -> int:
        """Remember kvstore's hit; returns the tokens to load beyond vLLM's own ``computed_tokens``."""
        state = self.requests[request_id]
        state.hit_tokens = min(hit_chunks, len(state.keys)) * self.chunk_tokens
        state.local_tokens = computed_tokens
        state.hit_tiers = tuple(tiers)
        return max(0, state.hit_tokens - computed_tokens)

    def hit_sources(self, request_id: str, tokens: int) -> dict[str, int]:
        """Tokens of the load after vLLM's own hit, by the daemon tier that holds them."""
        state = self.requests[request_id]
        n, start = self.chunk_tokens, state.local_tokens
        sources: dict[str, int] = {}
        for c in range(start // n, (start + tokens + n - 1) // n):
            tier = state.hit_tiers[c] if c < len(state.hit_tiers) else "unknown"
            overlap = min(start + tokens, (c + 1) * n) - max(start, c * n)
            sources[tier] = sources.get(tier, 0) + overlap
        return sources

    def plan_load(self, request_id: str, page_ids: Sequence[int], tokens: int) -> None:
        """Plan loading ``tokens`` prompt tokens after vLLM's own hit into the request's pages."""
        if tokens <= 0:
            return
        state = self.requests[request_id]
        n, start = self.chunk_tokens, state.local_tokens
        end = start + tokens
        if end > state.hit_tokens:
            raise ValueError(f"request {request_id}: load up to token {end} beyond the kvstore hit {state.hit_tokens}")
        loads = []
        for c in range(start // n, (end + n - 1) // n):
            lo, hi = max(start, c * n), min(end, (c + 1) * n)
            loads.append(ChunkLoad(state.keys[c], lo - c * n, hi - c * n, PagedSpan.of(page_ids, self.page_tokens, lo, hi)))
        self._loads[request_id] = loads

    def plan_step(self, scheduled: Sequence[tuple[str, int, int]],
                  page_ids_of: Callable[[str], Sequence[int]]) -> StepPlan:
        """This step's plan from ``(request id, computed tokens before it, scheduled tokens)`` per
        request; ``page_ids_of(request id)`` is asked only for requests with chunks to save."""
        plan = StepPlan(loads=self._loads)
        self._loads = {}
        n = self.chunk_tokens
        for request_id, before, scheduled_tokens in scheduled:
            state = self.requests.get(request_id)
            if state is None:
                continue
            if state.saved_chunks < 0:
                state.saved_chunks = state.hit_tokens // n  # kvstore has these; vLLM's own hits are saved
            first, last = state.saved_chunks, min(len(state.keys), (before + scheduled_tokens) // n)
            page_ids = page_ids_of(request_id) if last > first else ()
            for c in range(first, last):
                plan.saves.append(ChunkSave(state.keys[c], PagedSpan.of(page_ids, self.page_tokens, c * n, (c + 1) * n)))
            state.saved_chunks = max(state.saved_chunks, last)
        return plan

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._loads.pop(request_id, None)
