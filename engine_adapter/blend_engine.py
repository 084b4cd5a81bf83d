"""CacheBlend for the reference engine: reuse the KV of chunks wherever they appear in a prompt.

A request's path (docs/blend.md has the same list with the design choices)::

    1. keys      chunk_key(namespace, tokens) of the prefix and every chunk   kvstore/keys.py
    2. load      Get the blocks through shared memory; misses are computed    engine_adapter/blend_engine.py
                 alone (positions 0..n-1) and stored after the first token
    3. assemble  each block written at its place, keys re-rotated (RoPE)      blend/assemble.py
    4. ratio     fixed, or from the loading controller                        blend/controller.py
    5. blend     layer 0 (+ check layer) in full, selector picks the tokens,  blend/recompute.py,
                 later layers recompute only those and the query              blend/select.py
    6. decode    first token out (TTFT stops here), then more on the assembled cache

A daemon that is down, slow or wrong costs misses (computed chunks), never a failed request: every
call to it goes through the engines' shared guard (engine_adapter/client/prefix_cache.py), counted in
``BlendEngine.errors`` and logged once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from blend.assemble import BlendLayout, Segment, chunk_block, place_block, rotate_into_place
from blend.controller import LoadingController, Ratio
from blend.recompute import blend_prefill
from blend.prompt import DEFAULT_RATIO
from blend.select import DEFAULT_SELECTOR, TokenSelector, get_selector
from engine_adapter.cached import model_namespace
from engine_adapter.client.blocks import FetchedBlock
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.client.prefix_cache import PrefixCache, fetch_slot_bytes, fetched_tensor
from engine_adapter.reference.generate import decode_after, sample_next
from engine_adapter.reference.kv_cache import KVCache
from engine_adapter.reference.model import LlamaModel
from engine_adapter.client.shared_kv import SharedKVMemory, SharedRegion, rows_in, rows_region
from engine_adapter.reference.tokenizer import Tokenizer
from kvstore.keys import Namespace, chunk_key

#: Blend caches are whole multiples of this many tokens: blends of near sizes share one (its
#: shared memory kept between blends, engine_adapter/client/shared_kv.py).
CACHE_ROUND = 256


@dataclass
class BlendResult:
    tokens: list[int]               # new token ids
    first_logits: torch.Tensor      # [vocab] float32: the distribution of the first new token
    ttft_s: float
    prompt_tokens: int
    chunk_tokens: int               # tokens in chunks (what `ratio` is a fraction of)
    recomputed_tokens: int          # chunk tokens recomputed on the last layer
    prefilled_tokens: float         # token-layers computed / layers, incl. chunks computed on a miss
    loaded_tokens: int              # tokens whose KV came from the daemon
    loaded_bytes: int
    computed_segments: int          # prefix/chunks missing from the daemon, computed alone
    tiers: list[str]                # tier of each loaded block
    ratio: float
    selector: str
    load_s: float = 0.0             # fetch + assemble (incl. computing misses)
    blend_s: float = 0.0            # selective recompute
    total_s: float = 0.0
    store_done: threading.Event = field(default_factory=threading.Event, repr=False)


@dataclass
class BlendedPrompt:
    """What :meth:`BlendEngine.prefill` leaves: the blended cache of every prompt token."""

    kv: KVCache                     # tokens 0..layout.total-1 filled; kv.span(a, b) is a block, no copy
    layout: BlendLayout
    result: BlendResult             # ttft_s, tokens and total_s are the caller's to fill
    missing: list[tuple[bytes, int, torch.Tensor]]  # (chunk key, tokens, block) computed alone: to store
    started: float                  # perf_counter() when the prefill began


class BlendEngine:
    """The reference engine with CacheBlend chunk reuse through the kvstore daemon.

    ``selector`` is a registry name (see `blend.select.SELECTORS`; default ``stale_attention``)
    or an instance; ``ratio`` is the default fraction of chunk tokens recomputed; with a
    ``controller`` and ``ratio=None`` (or `Ratio.AUTO`) in `generate`, the controller picks it from
    measured load and compute speeds.
    """

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, client: KVStoreClient | None,
                 selector: str | TokenSelector = DEFAULT_SELECTOR, ratio: float = DEFAULT_RATIO,
                 controller: LoadingController | None = None, tenant: str = "",
                 cache: PrefixCache | None = None, namespace: Namespace | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.client = client
        self.selector = get_selector(selector) if isinstance(selector, str) else selector
        self.ratio = Ratio(ratio)  # a fixed one: without a ratio, the controller's choice goes first
        self.controller = controller
        # another engine's guarded daemon link and namespace (the vLLM connector's) may be shared
        self.namespace = namespace or (cache.namespace if cache is not None else model_namespace(model, tenant))
        self.cache = cache or PrefixCache(client, self.namespace)
        # Blend caches in shared memory, kept for the next blend: the daemon copies each stored
        # block straight to its segment, and no blend first-touches a fresh cache (shared_kv.py).
        self._allocate = SharedKVMemory(self.cache.client, model.device)

    @property
    def errors(self) -> int:
        """Daemon failures so far (each one cost misses, not a request)."""
        return self.cache.errors

    def ratio_of(self, ratio: float | Ratio | None) -> Ratio:
        """A call's ratio as chosen: a number is fixed; None is the controller's choice when the
        engine has one, else the engine's ratio. ValueError for a number outside [0, 1] (`Ratio`)
        or "auto" without a controller."""
        if ratio is None:
            return Ratio.AUTO if self.controller is not None else self.ratio
        ratio = ratio if isinstance(ratio, Ratio) else Ratio(ratio)
        if ratio.auto and self.controller is None:
            raise ValueError('ratio "auto" needs a loading controller; this engine has none')
        return ratio

    def chunk_keys(self, segments: Sequence[Sequence[int]]) -> list[bytes]:
        return [chunk_key(self.namespace, tokens) for tokens in segments]

    # -- load ---------------------------------------------------------------------------------

    def _fetch(self, keys: list[bytes], parts: list[list[int]], placed: list[Segment], kv: KVCache,
               result: BlendResult) -> list[bool]:
        """Fetch and place every stored block; returns which segments were found."""
        if not keys:
            return []
        region = rows_region(kv, min(len(part) for part in parts))  # rows of the shortest part fit: all do
        if region is not None:
            return self._fetch_rows(keys, parts, placed, kv, region, result)
        return self._fetch_copies(keys, parts, placed, kv, result)

    def _fetch_copies(self, keys: list[bytes], parts: list[list[int]], placed: list[Segment], kv: KVCache,
                      result: BlendResult) -> list[bool]:
        """`_fetch` through the staging arena: each block copied out of it into its segment (`place_block`)."""
        found = [False] * len(keys)
        layout = self.namespace.layout
        per_tier: dict[str, int] = {}  # bytes loaded per tier in the current Get

        def take(i: int, block: FetchedBlock | None) -> bool:
            if block is None or block.tokens != len(parts[i]) or block.layout != layout:
                return True  # a miss: computed later
            place_block(self.model, kv, fetched_tensor(block), placed[i])
            found[i] = True
            self._loaded(block.tier, block.tokens, result, per_tier)
            return True

        self.cache.fetch_blocks(keys, fetch_slot_bytes(layout, max(len(p) for p in parts)), take,
                                lambda seconds: self._observe(per_tier, seconds))
        return found

    def _fetch_rows(self, keys: list[bytes], parts: list[list[int]], placed: list[Segment], kv: KVCache,
                    region: SharedRegion, result: BlendResult) -> list[bool]:
        """`_fetch` into a cache in shared memory: the daemon copies each raw block straight to its
        segment (one copy), whose keys are then rotated into place; a coded block, which it does not
        copy, loads the usual way."""
        started = time.perf_counter()
        got = self.cache.get_rows(keys, region, [rows_in(kv, region, segment.start, len(part))
                                                 for segment, part in zip(placed, parts)])
        found = [False] * len(keys)
        per_tier: dict[str, int] = {}
        coded = []
        for i, block in enumerate(got):
            if block.in_place:
                rotate_into_place(self.model, kv, placed[i])
                found[i] = True
                self._loaded(block.tier, len(parts[i]), result, per_tier)
            elif block.found and block.codec != "raw":
                coded.append(i)  # not copied: loads below; any other is a miss, computed later
        self._observe(per_tier, time.perf_counter() - started)
        if coded:
            loaded = self._fetch_copies([keys[i] for i in coded], [parts[i] for i in coded],
                                        [placed[i] for i in coded], kv, result)
            for i, was_found in zip(coded, loaded):
                found[i] = was_found
        return found

    def _loaded(self, tier: str, tokens: int, result: BlendResult, per_tier: dict[str, int]) -> None:
        """Count a block of ``tokens`` from ``tier`` placed in the cache: in the result, and its bytes
        per tier for the controller."""
        size = self.namespace.layout.block_bytes(tokens)
        result.tiers.append(tier)
        result.loaded_tokens += tokens
        result.loaded_bytes += size
        per_tier[tier] = per_tier.get(tier, 0) + size

    def _observe(self, per_tier: dict[str, int], seconds: float) -> None:
        """Tell the controller what the last Get moved from each tier in ``seconds``; then forget it."""
        if self.controller is not None and per_tier:
            moved = sum(per_tier.values())
            for tier, size in per_tier.items():
                self.controller.observe_load(tier, size, seconds * size / moved)
        per_tier.clear()

    def _compute_block(self, tokens: list[int]) -> torch.Tensor:
        started = time.perf_counter()
        block = chunk_block(self.model, tokens)
        if self.controller is not None:
            self.controller.observe_prefill(len(tokens), time.perf_counter() - started)
        return block

    def ingest(self, chunks: Sequence[Sequence[int]]) -> tuple[int, int]:
        """Compute and store the chunks (or a prefix) not yet stored; returns (stored now, present)."""
        if self.client is None:
            raise ValueError("ingest needs a daemon client")
        stored = present = 0
        for tokens in chunks:
            key = chunk_key(self.namespace, tokens)
            if self.client.lookup([key]).hits:
                present += 1
                continue
            self.client.put(self.namespace, [(key, len(tokens), self._compute_block(list(tokens)))])
            stored += 1
        return stored, present

    def calibrate(self, tokens: int = 256) -> float:
        """Time one prefill of ``tokens`` tokens for the controller; returns seconds per token."""
        if self.controller is None:
            raise ValueError("calibrate needs a controller")
        ids = list(range(1, tokens + 1))
        self._compute_block(ids)
        return self.controller.prefill_s_per_token

    # -- generation ---------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prefix: Sequence[int], chunks: Sequence[Sequence[int]], query: Sequence[int],
                ratio: float | Ratio | None = None, selector: str | TokenSelector | None = None, use_cache: bool = True,
                room: int = 1, kv_only: bool = False, glue: Sequence[Sequence[int]] | None = None) -> BlendedPrompt:
        """Load, assemble and blend ``prefix + chunks + query`` (token ids): the cache then holds
        every prompt token's KV (chunks' selected tokens recomputed) and ``logits`` the first new
        token's distribution. Segments the daemon lacks are computed alone and returned in
        ``missing`` for the caller to store; ``room``: cache capacity past the prompt. ``kv_only``:
        for an engine that computes the query itself, only the non-query KV is exact afterwards and
        ``first_logits`` is empty (`blend.recompute.blend_prefill`). ``glue[i]``: tokens just before
        chunk i that belong to no stored segment (a separator tokenized inside the whole prompt):
        never looked up, computed on every layer (`blend.assemble`).

        ``ratio``: a number or `Ratio`; None: the controller's choice when the engine has one, else
        the engine's ratio (`ratio_of`).
        """
        start = time.perf_counter()
        ratio = self.ratio_of(ratio)
        prefix, query = list(prefix), list(query)
        chunks = [list(c) for c in chunks]
        glue = [list(g) for g in glue] if glue is not None else [[] for _ in chunks]
        layout = BlendLayout.from_lengths(len(prefix), [len(c) for c in chunks], len(query), [len(g) for g in glue])
        parts = ([prefix] if prefix else []) + chunks
        selector = self.selector if selector is None else (
            get_selector(selector) if isinstance(selector, str) else selector)
        keys = self.chunk_keys(parts)
        capacity = -(-(layout.total + max(room, 1)) // CACHE_ROUND) * CACHE_ROUND  # blends of near sizes share one
        kv = self.model.new_cache(capacity, self._allocate)
        kv.clear(layout.query.start, kv.capacity)  # never read before written; zeroed all the same
        result = BlendResult(tokens=[], first_logits=torch.empty(0), ttft_s=0.0, prompt_tokens=layout.total,
                             chunk_tokens=layout.chunk_positions.numel(), recomputed_tokens=0, prefilled_tokens=0.0,
                             loaded_tokens=0, loaded_bytes=0, computed_segments=0, tiers=[], ratio=0.0,
                             selector=selector.name)
        found = self._fetch(keys, parts, list(layout.cached), kv, result) if use_cache else [False] * len(parts)
        missing: list[tuple[bytes, int, torch.Tensor]] = []
        computed_tokens = 0
        for i, segment in enumerate(layout.cached):
            if not found[i]:
                block = self._compute_block(parts[i])
                place_block(self.model, kv, block, segment)
                missing.append((keys[i], len(parts[i]), block))
                computed_tokens += len(parts[i])
        result.computed_segments = len(missing)
        if ratio.auto:  # the controller, from this blend's measured loads (ratio_of: it has one)
            per_tier: dict[str, int] = {}
            for tier, part in zip(result.tiers, (p for p, f in zip(parts, found) if f)):
                per_tier[tier] = per_tier.get(tier, 0) + self.namespace.layout.block_bytes(len(part))
            result.ratio = self.controller.choose(result.chunk_tokens, per_tier).ratio
        else:
            result.ratio = ratio.value
        loaded_at = time.perf_counter()
        ids = torch.tensor(prefix + [t for g, c in zip(glue, chunks) for t in g + c] + query, dtype=torch.long)
        prefill = blend_prefill(self.model, kv, layout, ids, selector, result.ratio, kv_only=kv_only)
        result.load_s, result.blend_s = loaded_at - start, time.perf_counter() - loaded_at
        result.first_logits = prefill.logits
        result.recomputed_tokens = int(prefill.selected.numel())
        result.prefilled_tokens = prefill.token_layers / len(self.model.layers) + computed_tokens
        return BlendedPrompt(kv, layout, result, missing, start)

    @torch.inference_mode()
    def generate(self, prefix: Sequence[int], chunks: Sequence[Sequence[int]], query: Sequence[int],
                 max_new_tokens: int = 32, ratio: float | Ratio | None = None, selector: str | TokenSelector | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
                 use_cache: bool = True, store: bool = True,
                 glue: Sequence[Sequence[int]] | None = None) -> BlendResult:
        """Generate after ``prefix + chunks + query`` (token ids), reusing each chunk's stored KV
        (:meth:`prefill`), then store the segments that were missing, in the background.

        ``ratio``: a number or `Ratio`; None: the controller's choice when the engine has one, else
        the engine's ratio.
        """
        blended = self.prefill(prefix, chunks, query, ratio, selector, use_cache, room=max_new_tokens, glue=glue)
        result = blended.result
        first = sample_next(result.first_logits, temperature, top_p, generator)
        result.ttft_s = time.perf_counter() - blended.started
        missing = blended.missing
        self.cache.store_blocks_async(len(missing) if store else 0, missing.__getitem__, result.store_done)
        result.tokens = decode_after(self.model, blended.kv, first, max_new_tokens, self.tokenizer.eos_token_ids,
                                     temperature, top_p, generator)
        result.total_s = time.perf_counter() - blended.started
        return result
