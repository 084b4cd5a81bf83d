"""Token selectors: which chunk tokens a blended prefill recomputes.

A selector sees the prompt's layout and, when it has a check layer, every token's fresh q, k, v at
that layer beside the cached (re-rotated) k, v. It returns sorted positions of chunk tokens to
recompute, at most ``budget`` of them (``budget = round(ratio * chunk tokens)``). Query tokens are
always recomputed and the prefix never is (its cached KV is exact), so neither is the selector's to
choose. A selector with ``query_pass`` sees instead what the query reads when it is computed over
the assembled cache before anything is recomputed (`StaleReadView`, made by
`blend.recompute.stale_query_attention`).

    name                 check layer  picks
    stale_attention      none (query  the first 16 tokens of every chunk, then the rest of the budget
                         pass)        by the attention the query pays each token, summed over layers
                                      2.., when it reads the assembled cache as it is (default:
                                      DEFAULT_SELECTOR; a budget too small for 16 per chunk goes to
                                      leading tokens only, split like sinks)
    shallow_stale_attention
                         none (query  stale_attention with the query pass cut after its first 10 layers
                         pass, 10     (scored on layers 2-9): a third of the pass on SmolLM2-135M's 30
                         layers)      layers; KL within 5% of the whole pass's on the tuning items,
                                      but 0.59x naive's against 0.32x on held-out ones (not the default)
    lead_attn_deviation  1            the first 16 tokens of every chunk, then the rest of the budget
                                      by attn_deviation (the default until 2026-12-04)
    attn_deviation       1            top-budget tokens by KV deviation x the attention the query pays
                                      them (a stale token matters only as much as the query reads it)
    kv_deviation         1            top-budget tokens by |K_fresh - K_cached|^2 + |V_fresh - V_cached|^2
    gradual              1            2x budget at the check layer, then re-scored on each of the next
                                      layers and narrowed linearly to the budget (the paper's gradual filter)
    sinks                none         the first tokens of each chunk, budget split by chunk length (EPIC)
    query_aware          1            top-budget tokens by the attention the query pays them at the check layer

Pick one with ``get_selector(name)``; unknown names raise ValueError listing the known ones
(``check_selector``).
Why the default is stale_attention, with the probes' numbers: docs/notes/blend-log.md.
"""

from __future__ import annotations

import math
import reprlib
from abc import ABC, abstractmethod
from functools import cached_property

import torch

from blend.assemble import BlendLayout

DEFAULT_SELECTOR = "stale_attention"


class CheckLayerView:
    """What a selector may read at the check layer (all tensors cover every prompt token).

    fresh_q [H, T, D], fresh_k / fresh_v [KVH, T, D]: recomputed from exact layer inputs.
    cached_k / cached_v [KVH, T, D]: the assembled cache before this layer's write.
    Scores are computed on first use and cached.
    """

    def __init__(self, layout: BlendLayout, fresh_q: torch.Tensor, fresh_k: torch.Tensor,
                 fresh_v: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor) -> None:
        self.layout = layout
        self.fresh_q, self.fresh_k, self.fresh_v = fresh_q, fresh_k, fresh_v
        self.cached_k, self.cached_v = cached_k, cached_v

    @property
    def device(self) -> torch.device:
        """Where the check layer's tensors, and so every selection, live."""
        return self.fresh_q.device

    @cached_property
    def kv_deviation(self) -> torch.Tensor:
        """[N] squared KV deviation of each chunk token (N = len(layout.chunk_positions))."""
        return kv_deviation(self.fresh_k, self.fresh_v, self.cached_k, self.cached_v, self.layout.chunk_positions)

    @cached_property
    def attention_deviation(self) -> torch.Tensor:
        """[N] KV deviation weighted by query attention: an estimate of how much each stale token
        moves what the query reads (attention weight x how wrong the K/V it reads is)."""
        return self.kv_deviation * self.query_attention

    @cached_property
    def query_attention(self) -> torch.Tensor:
        """[N] attention mass the query tokens put on each chunk token (fresh q and k, causal)."""
        device = self.fresh_q.device  # positions come from the layout, on the CPU
        rows = self.layout.query_positions.to(device)
        mass = torch.zeros(self.fresh_k.shape[1], dtype=torch.float32, device=device)
        for block in row_blocks(rows.numel(), self.fresh_q.shape[0], self.fresh_k.shape[1]):
            mass += attention_probs(self.fresh_q[:, rows[block]], self.fresh_k, rows[block]).sum((0, 1))
        return mass[self.layout.chunk_positions.to(device)]  # [N]


class StaleReadView:
    """What a ``query_pass`` selector reads: ``attention`` [L, N], the attention mass the query
    tokens put on each chunk token on each layer when the query is computed over the assembled
    cache as it is (stale chunk KV, nothing recomputed: naive reuse's own compute)."""

    def __init__(self, layout: BlendLayout, attention: torch.Tensor) -> None:
        self.layout, self.attention = layout, attention

    @property
    def device(self) -> torch.device:
        return self.attention.device


# The float32 probabilities of one block of query rows over every key: a bound on what a selector's
# attention costs in memory whatever the prompt (a 2,000-token query over 32k keys with 9 heads is
# 2.3 GB at once; blocks of this size keep it at a few times 32 MiB, with scores, mask and softmax).
ATTENTION_BLOCK_BYTES = 32 << 20


def row_blocks(rows: int, heads: int, keys: int, block_bytes: int | None = None) -> list[slice]:
    """Slices over ``rows`` query rows such that one block's [heads, rows, keys] float32
    probabilities take at most ``block_bytes`` (default ATTENTION_BLOCK_BYTES; one row at least)."""
    step = max(1, (block_bytes or ATTENTION_BLOCK_BYTES) // (4 * heads * max(1, keys)))
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


def attention_probs(q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                    hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[H, R, S] float32 causal attention of queries ``q`` [H, R, D] at positions ``rows`` [R] over
    ``keys`` [KVH, S, D] (key j visible to row i iff j <= rows[i]; GQA groups share the keys).
    ``hidden``: `hidden_keys(rows, S)` where a caller has it already (the same rows on every layer).
    Callers bound R with `row_blocks`."""
    heads, num_rows, dim = q.shape
    kv_heads, num_keys = keys.shape[0], keys.shape[1]
    # GQA without repeating the keys: head h reads KV head h // G, so [H, R, D] is [KVH, G*R, D]
    grouped = (q.float() / math.sqrt(dim)).reshape(kv_heads, heads // kv_heads * num_rows, dim)
    scores = (grouped @ keys.float().transpose(1, 2)).view(heads, num_rows, num_keys)  # [H, R, S]
    hidden = hidden_keys(rows.to(q.device), num_keys) if hidden is None else hidden  # [R, S - first]
    first = num_keys - hidden.shape[1]  # keys before it are visible to every row
    scores[:, :, first:].masked_fill_(hidden, float("-inf"))
    return scores.softmax(-1)


def hidden_keys(rows: torch.Tensor, num_keys: int, first: int = 0) -> torch.Tensor:
    """Boolean [R, S - first], True where key first + j is after row i's position: masked. ``first``
    (at most the rows' first position, known to the caller without reading ``rows``): every key
    before it is visible to every row, so it is left out::

        keys    0 ........ first ......... S-1
        rows          (all visible) | hidden where key > row
    """
    return torch.arange(first, num_keys, device=rows.device)[None, :] > rows[:, None]


def kv_deviation(fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """[len(positions)] sum over heads and dims of (fresh - cached)^2 for K and V at ``positions``.

    fresh_* and cached_* are [KVH, T, D] over the same T tokens that ``positions`` index.
    """
    positions = positions.to(fresh_k.device)
    dk = (fresh_k[:, positions].float() - cached_k[:, positions].float()).pow(2).sum((0, 2))
    dv = (fresh_v[:, positions].float() - cached_v[:, positions].float()).pow(2).sum((0, 2))
    return dk + dv


def top_positions(scores: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted ``positions`` of the ``count`` highest ``scores`` (ties: lower position first), on
    the scores' device."""
    count = max(0, min(count, positions.numel()))
    order = torch.argsort(scores, descending=True, stable=True)[:count]
    return positions.to(scores.device)[order].sort().values


class TokenSelector(ABC):
    """Chooses chunk tokens to recompute. Stateless between requests; one instance may serve many.

    ``check_layer`` is the layer whose fresh KV the selector scores (every layer before it runs in
    full); None means the choice needs no model state and is made before layer 0.
    """

    name: str = ""
    check_layer: int | None = 1
    query_pass: bool = False  # True: `select` gets a StaleReadView (check_layer must be None)
    query_pass_layers: int | None = None  # the layers 0 .. n-1 a query pass runs (None: every layer)

    @abstractmethod
    def select(self, layout: BlendLayout, view: CheckLayerView | None, budget: int) -> torch.Tensor:
        """Sorted positions [<= budget] among ``layout.chunk_positions``. ``view``: a CheckLayerView
        when ``check_layer`` is set, a StaleReadView for a ``query_pass`` selector, else None."""

    def refine(self, step: int, kept: torch.Tensor, deviation: torch.Tensor, budget: int) -> torch.Tensor:
        """Positions to keep on the ``step``-th layer after the check layer (step >= 1), given the
        currently kept chunk positions [K] and their KV deviation [K] at this layer. Returns a
        sorted subset of ``kept``; the default keeps them all."""
        return kept

    def wants_refine(self, step: int) -> bool:
        """Whether `refine` should be called on the step-th layer after the check layer."""
        return False


class KVDeviationSelector(TokenSelector):
    name = "kv_deviation"

    def __init__(self, check_layer: int = 1) -> None:
        if check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {check_layer}")
        self.check_layer = check_layer

    def select(self, layout, view, budget):
        return top_positions(view.kv_deviation, layout.chunk_positions, budget)


class GradualFilterSelector(TokenSelector):
    """KV deviation with the paper's gradual filtering: start wide, narrow over ``steps`` layers.

        layer:   check    check+1 ...  check+steps
        kept:    e*B  ->  linearly down ->  B        (e = expand, B = budget)
    """

    name = "gradual"

    def __init__(self, check_layer: int = 1, expand: float = 2.0, steps: int = 3) -> None:
        if check_layer < 0 or expand < 1.0 or steps < 1:
            raise ValueError(f"need check_layer >= 0, expand >= 1, steps >= 1; got {check_layer}, {expand}, {steps}")
        self.check_layer, self.expand, self.steps = check_layer, expand, steps

    def _count(self, step: int, budget: int) -> int:
        start = math.ceil(budget * self.expand)
        return max(budget, round(start - (start - budget) * step / self.steps))

    def select(self, layout, view, budget):
        return top_positions(view.kv_deviation, layout.chunk_positions, self._count(0, budget))

    def wants_refine(self, step):
        return 1 <= step <= self.steps

    def refine(self, step, kept, deviation, budget):
        return top_positions(deviation, kept, self._count(step, budget))


class ChunkSinkSelector(TokenSelector):
    """The first tokens of every chunk (they act as attention sinks when computed alone; EPIC).

    The budget is split in proportion to chunk lengths (largest remainder), so each chunk gets
    about ratio * its length of its leading tokens.
    """

    name = "sinks"
    check_layer = None

    def select(self, layout, view, budget):
        chunks = layout.chunks
        total = sum(c.length for c in chunks)
        if not chunks or budget <= 0:
            return torch.zeros(0, dtype=torch.long)
        shares = [budget * c.length / total for c in chunks]
        counts = [min(c.length, math.floor(s)) for c, s in zip(chunks, shares)]
        by_remainder = sorted(range(len(chunks)), key=lambda i: counts[i] - shares[i])
        for i in by_remainder[: budget - sum(counts)]:
            counts[i] = min(chunks[i].length, counts[i] + 1)
        spans = [torch.arange(c.start, c.start + k) for c, k in zip(chunks, counts)]
        return torch.cat(spans)


class QueryAwareSelector(TokenSelector):
    name = "query_aware"

    def __init__(self, check_layer: int = 1) -> None:
        if check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {check_layer}")
        self.check_layer = check_layer

    def select(self, layout, view, budget):
        return top_positions(view.query_attention, layout.chunk_positions, budget)


class AttentionDeviationSelector(TokenSelector):
    """KV deviation weighted by the attention the query tokens pay each chunk token.

    KV deviation alone spends the budget on tokens whose K/V changed most, most of which the query
    barely reads; on SmolLM2-135M a 15% recompute of those is sometimes worse than none (a cache
    part fresh, part stale is less consistent than one all stale; exact KV spliced in for the top
    15% by true deviation over all layers does no better). Weighting by query attention at the same
    check layer keeps the budget on the stale tokens the answer depends on (docs/notes/blend-log.md).
    """

    name = "attn_deviation"

    def __init__(self, check_layer: int = 1) -> None:
        if check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {check_layer}")
        self.check_layer = check_layer

    def select(self, layout, view, budget):
        return top_positions(view.attention_deviation, layout.chunk_positions, budget)


class LeadingAttentionDeviationSelector(TokenSelector):
    """The first ``lead`` tokens of every chunk, then the rest of the budget by attn_deviation.

    attn_deviation alone does well on whole passages (MuSiQue) but is worse than naive reuse on
    chunks cut mid-text. The likely cause: a chunk computed alone turns its first tokens into
    attention sinks; when the cut falls mid-word or mid-sentence the rest of the chunk leans on
    those stale leading tokens, and the query's attention at the check layer does not reveal it.
    A fixed quota of leading tokens per chunk repairs that prompt (KL 0.325 -> 0.165, naive 0.276)
    and costs little on whole passages (0.057 -> 0.059, naive 0.080), where 16 tokens are a small
    share of a ~600-token chunk's ~90-token budget. When the budget cannot cover ``lead`` tokens of
    every chunk, all of it goes to leading tokens, split by chunk length as in `ChunkSinkSelector`.
    Probe (SmolLM2-135M, r = 0.15, first-token KL vs full prefill): docs/notes/blend-log.md.

        chunk:  |<- lead ->|..............................|
                 always      top by deviation x query attention (shared across all chunks)
    """

    name = "lead_attn_deviation"

    def __init__(self, lead: int = 16, check_layer: int = 1) -> None:
        if lead < 0 or check_layer < 0:
            raise ValueError(f"need lead >= 0 and check_layer >= 0; got {lead}, {check_layer}")
        self.lead, self.check_layer = lead, check_layer

    def select(self, layout, view, budget):
        return lead_then_top(layout, lambda: view.attention_deviation, budget, self.lead, view.device)


class StaleAttentionSelector(TokenSelector):
    """The first ``lead`` tokens of every chunk, then the tokens the query reads most in the stale cache.

    Before anything is recomputed, the query is computed over the assembled cache as naive reuse
    would compute it (`blend.recompute.stale_query_attention`: the query rows only, through every
    layer), and each chunk token is scored by the attention the query pays it, summed over heads,
    query tokens and layers ``first_layer``... A stale token hurts the answer as much as the query
    reads it, on the layers where it is read: the check layer's attention (attn_deviation) sees
    only layer 1, where chunk KV is still nearly exact. No check layer is needed, so layers 0 and 1
    run for the selected rows only, like every other layer. The leading-token quota is
    LeadingAttentionDeviationSelector's (chunks cut mid-text lean on their stale first tokens).

    Probe (SmolLM2-135M, fp32, MuSiQue top-3, first-token KL vs full prefill, r = 0.15; tuned on
    dev items 20-59, then run once on the bench's items 0-19): KL 0.032 against 0.048 for
    lead_attn_deviation and 0.086 naive on the tuning items, 0.038 / 0.070 / 0.098 on items 0-19,
    worse than naive on 3 of 40 and 2 of 20 questions (lead_attn_deviation 6 and 5): docs/notes/blend-log.md.

        chunk:  |<- lead ->|..............................|
                 always      top by stale query attention, layers first_layer.. (all chunks)
    """

    name = "stale_attention"
    check_layer = None
    query_pass = True

    def __init__(self, lead: int = 16, first_layer: int = 2, pass_layers: int | None = None) -> None:
        if lead < 0 or first_layer < 0 or (pass_layers is not None and pass_layers <= first_layer):
            raise ValueError(f"need lead >= 0, first_layer >= 0 and pass_layers (None: every layer) > first_layer; "
                             f"got {lead}, {first_layer}, {pass_layers}")
        self.lead, self.first_layer = lead, first_layer
        self.query_pass_layers = pass_layers

    def select(self, layout, view, budget):
        def scores():
            attention = view.attention  # [L', N]: the layers the pass ran
            return attention[min(self.first_layer, attention.shape[0] - 1):].sum(0)
        return lead_then_top(layout, scores, budget, self.lead, view.device)


class ShallowStaleAttentionSelector(StaleAttentionSelector):
    """`StaleAttentionSelector` with the query pass cut after ``pass_layers`` layers: the tokens the
    query reads most on layers ``first_layer`` .. ``pass_layers``-1 of the stale cache.

    The pass is the query's rows through every layer it runs, so its cost is proportional to its
    depth: on SmolLM2-135M (30 layers) the whole pass was 22-25% of a top-3 blend in vLLM. The early
    layers carry most of the signal (layers 2-14 alone beat 15-29 alone: docs/notes/blend-log.md).
    Probe (SmolLM2-135M, bf16, reference engine, MuSiQue dev items 40-59, top-3, r = 0.15, first-token
    KL vs full prefill; naive 0.1032): the whole pass 0.0369 (1 of 20 worse than naive); cut after 4 /
    6 / 8 / 10 / 15 layers 0.0542 / 0.0464 / 0.0412 / **0.0387** / 0.0409 (2 / 1 / 1 / 1 / 1 worse).
    Held out (vLLM, items 60-79, both in one process): 84 ms less a top-3 blend, but KL 0.59x naive's
    against 0.32x for the whole pass (item 78: 0.447 against 0.083): the deep layers decide some
    questions, so this is not the default. docs/benchmarks.md, "A shallow query pass".
    """

    name = "shallow_stale_attention"

    def __init__(self, lead: int = 16, first_layer: int = 2, pass_layers: int | None = 10) -> None:
        super().__init__(lead, first_layer, pass_layers)


def lead_then_top(layout: BlendLayout, scores, budget: int, lead: int, device: torch.device) -> torch.Tensor:
    """The first ``lead`` tokens of every chunk, then the rest of ``budget`` by ``scores()`` ([N]
    over ``layout.chunk_positions``; called only when the quota fits), sorted, on ``device``. A
    budget too small for the quota goes to leading tokens only, split by length as `ChunkSinkSelector`."""
    chunks = layout.chunks
    if not chunks or budget <= 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    leads = [min(lead, c.length) for c in chunks]
    if sum(leads) > budget:
        return ChunkSinkSelector().select(layout, None, budget).to(device)
    scores = scores().clone()
    positions = layout.chunk_positions.to(scores.device)
    forced = torch.cat([torch.arange(c.start, c.start + n, device=scores.device) for c, n in zip(chunks, leads)])
    scores[torch.isin(positions, forced)] = float("-inf")
    rest = top_positions(scores, positions, budget - forced.numel())
    return torch.cat((forced, rest)).sort().values


SELECTORS: dict[str, type[TokenSelector]] = {
    cls.name: cls for cls in (StaleAttentionSelector, ShallowStaleAttentionSelector, LeadingAttentionDeviationSelector,
                              AttentionDeviationSelector, KVDeviationSelector, GradualFilterSelector, ChunkSinkSelector,
                              QueryAwareSelector)
}


def check_selector(name: object) -> str:
    """``name`` if the registry knows it, else ValueError listing the known names: the one check of
    a selector name (settings and requests call it where they are read)."""
    if not isinstance(name, str) or name not in SELECTORS:
        raise ValueError(f"unknown selector {reprlib.repr(name)}; known: {sorted(SELECTORS)}")
    return name


def get_selector(name: str) -> TokenSelector:
    """A selector with its default settings, by registry name."""
    return SELECTORS[check_selector(name)]()
