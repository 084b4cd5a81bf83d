"""Cached generation: prefix reuse through the kvstore daemon, for the reference engine.

A request's path (docs/architecture.md lists the same steps with their files):

    1. keys     prefix keys of the prompt's full chunks        kvstore/keys.py
    2. lookup   longest run of stored chunks                   daemon: Lookup
    3. load     the daemon copies the run's blocks into the    daemon: Get in rows (shared_kv.py)
                KV cache, which is in shared memory
    4. prefill  compute only the tokens after the run          model.forward
    5. decode   first token out (TTFT stops here), then more
    6. store    new full chunks exported and Put by a background thread (never before token 1)

The last prompt token is always computed (its logits give the first new token), so at most the
chunks that end before it are reused::

    prompt   |--chunk 0--|--chunk 1--|--chunk 2--|-tail-|
    reusable  chunk 0, chunk 1, chunk 2 if the tail is non-empty; else only 0 and 1

A daemon that is down, slow or wrong costs misses, never a failed request: every call to it is
guarded, counted in ``CachedEngine.errors`` and logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine_adapter.client.blocks import BlockToPut
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.reference.generate import decode_after, sample_next
from engine_adapter.reference.kv_cache import KVCache
from engine_adapter.reference.model import LlamaModel, ModelConfig
from engine_adapter.client.prefix_cache import PrefixCache, fetch_slot_bytes, fetched_tensor
from engine_adapter.client.shared_kv import SharedKVMemory, block_to_store, region_of
from engine_adapter.reference.tokenizer import Tokenizer
from kvstore.dtypes import TORCH_DTYPE_NAMES
from kvstore.keys import KVLayout, Namespace, prefix_keys

log = logging.getLogger(__name__)


def model_namespace(model: LlamaModel, tenant: str = "", chunk_tokens: int = 256) -> Namespace:
    """The namespace of a model's KV: any engine with the same weights, dtype and tenant shares it."""
    return config_namespace(model.config, TORCH_DTYPE_NAMES[model.dtype], tenant, chunk_tokens)


def config_namespace(config: ModelConfig, dtype: str, tenant: str = "", chunk_tokens: int = 256) -> Namespace:
    """:func:`model_namespace` from the config alone (no weights loaded), e.g. to compute keys."""
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
    rope = Namespace.rope_params(theta=config.rope_theta, scaling=config.rope_scaling)
    return Namespace(config.model_id, layout, rope=rope, tenant=tenant, chunk_tokens=chunk_tokens)


@dataclass
class GenerationResult:
    tokens: list[int]                 # new token ids
    ttft_s: float                     # request start to first token
    prompt_tokens: int
    reused_tokens: int                # loaded from the cache instead of computed
    tiers: list[str]                  # tier each reused chunk came from
    load_s: float = 0.0               # lookup + fetch + copy into the KV cache
    prefill_s: float = 0.0            # compute of the non-reused tokens
    total_s: float = 0.0
    stored_chunks: int = 0            # chunks queued for storing
    store_done: threading.Event = field(default_factory=threading.Event, repr=False)


class CachedEngine:
    """The reference engine with the kvstore daemon as its KV cache."""

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, client: KVStoreClient | None,
                 tenant: str = "", chunk_tokens: int = 256) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.client = client
        self.namespace = model_namespace(model, tenant, chunk_tokens)
        self.cache = PrefixCache(client, self.namespace)
        # KV caches in shared memory, where the daemon's Get fills them in one copy (shared_kv.py).
        self._allocate = SharedKVMemory(client, model.device) if client is not None and client.shared_memory else None
        # The KV cache of the last request, kept for the next once its store is done: like an
        # engine's preallocated KV memory, a warm request then pays no allocation and no first
        # touch of fresh pages (at 4k tokens in fp32, 189 MB: as long as copying them in).
        self._spare: tuple[KVCache, threading.Event] | None = None
        self._spare_lock = threading.Lock()

    def _take_cache(self, capacity: int) -> KVCache:
        """An empty KV cache for ``capacity`` tokens: the spare if its store is done and it is large
        enough, else a new one. Capacities are whole chunks, so prompts of one length in chunks
        share a cache (or its shared memory) instead of growing it by doubling."""
        capacity = -(-capacity // self.namespace.chunk_tokens) * self.namespace.chunk_tokens
        with self._spare_lock:
            spare = self._spare if self._spare is not None and self._spare[1].is_set() else None
            if spare is not None:
                self._spare = None
        region = region_of(spare[0].data) if spare is not None else None
        if spare is None or spare[0].capacity < capacity or (region is not None and not region.alive):
            # none yet, still being stored from, too small, or in memory a restarted daemon no longer holds
            return self.model.new_cache(capacity, self._allocate)
        kv = spare[0]
        kv.truncate(0)
        return kv

    def _keep_cache(self, kv: KVCache, stored: threading.Event) -> None:
        with self._spare_lock:
            if self._spare is None or self._spare[0].capacity <= kv.capacity:
                self._spare = (kv, stored)

    @property
    def errors(self) -> int:
        """Daemon failures so far (each one cost misses, not a request)."""
        return self.cache.errors

    def _load_prefix(self, keys: list[bytes], kv: KVCache, tiers: list[str]) -> int:
        """Load the longest stored run of ``keys`` into ``kv`` (in one copy where it is in shared
        memory: `PrefixCache.load`); returns tokens loaded."""
        return self.cache.load(keys, kv, tiers) * self.namespace.chunk_tokens

    def _prefill_layerwise(self, keys: list[bytes], prompt_ids: list[int], kv, tiers: list[str]
                           ) -> torch.Tensor | None:
        """Prefill with the reused run arriving layer by layer; the last position's logits, or
        None to fall back (no shared memory, a run too long for one fetch, a daemon failure)."""
        client, n, layout = self.client, self.namespace.chunk_tokens, self.namespace.layout
        if client is None or not keys or not client.shared_memory:
            return None
        slot = fetch_slot_bytes(layout, n)
        try:
            hits = client.lookup(keys).hits
            if hits == 0 or hits > client.max_fetch_blocks(slot):
                return None
            with client.fetch_layers(keys[:hits], slot) as stream:
                run = []
                for block in stream.blocks:
                    if block is None or block.tokens != n or block.layout != layout:
                        break  # a gap ends the run
                    run.append(fetched_tensor(block))  # raw: views that fill in layer by layer
                reused = len(run) * n
                ready = iter(stream)

                def load_layer(index: int) -> None:  # before the model runs layer `index`
                    if next(ready) != index:
                        raise RuntimeError("layers arrived out of order")
                    for c, block in enumerate(run):  # [layers, 2, kv_heads, n, head_dim]
                        kv.write(index, c * n, block[index, 0], block[index, 1])

                kv.reserve(len(prompt_ids))
                kv.length = reused  # the run's tokens: load_layer writes each layer's before it reads them
                logits = self.model(torch.tensor(prompt_ids[reused:], dtype=torch.long), kv, reused,
                                    last_only=True, before_layer=load_layer)[-1]
                tiers.extend(b.tier for b in stream.blocks[: len(run)])
                return logits
        except Exception as exc:  # noqa: BLE001 - any daemon failure: fall back to the plain path
            self.cache.failed("layer-wise get", exc)
            tiers.clear()
            kv.truncate(0)
            return None

    # -- generation ---------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None, use_cache: bool = True,
                 store: bool = True, layerwise: bool = False) -> GenerationResult:
        """Generate after ``prompt_ids``, reusing and storing prefix KV through the daemon.

        ``layerwise``: load the reused blocks layer by layer (``GetLayers``) and run each layer of
        the prefill as soon as that layer's KV is in place, overlapping the load with compute.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        start = time.perf_counter()
        prompt_ids = list(prompt_ids)
        n = self.namespace.chunk_tokens
        keys = prefix_keys(self.namespace, prompt_ids[: len(prompt_ids) - 1])  # the last token is computed
        kv = self._take_cache(len(prompt_ids) + max(max_new_tokens, 1))
        tiers: list[str] = []
        logits = self._prefill_layerwise(keys, prompt_ids, kv, tiers) if use_cache and layerwise else None
        if logits is not None:
            reused = len(tiers) * n
            loaded_at = start  # load and compute overlap: prefill_s is the whole
        else:
            reused = self._load_prefix(keys, kv, tiers) if use_cache else 0
            loaded_at = time.perf_counter()
            logits = self.model(torch.tensor(prompt_ids[reused:], dtype=torch.long), kv, reused, last_only=True)[-1]
        first = sample_next(logits, temperature, top_p, generator)
        ttft = time.perf_counter() - start
        result = GenerationResult(tokens=[first], ttft_s=ttft, prompt_tokens=len(prompt_ids), reused_tokens=reused,
                                  tiers=tiers, load_s=loaded_at - start, prefill_s=time.perf_counter() - loaded_at)
        # Store the chunks computed here, behind the first token; decode only appends after the prompt.
        new_chunks = range(reused // n, len(keys)) if store else range(0)
        result.stored_chunks = len(new_chunks) if self.client is not None else 0
        self.cache.store_async(keys, new_chunks, lambda c: block_to_store(kv, c * n, n), result.store_done,
                               token_ids=prompt_ids)
        result.tokens = decode_after(self.model, kv, first, max_new_tokens, self.tokenizer.eos_token_ids,
                                     temperature, top_p, generator)
        result.total_s = time.perf_counter() - start
        self._keep_cache(kv, result.store_done)
        return result

    def ingest(self, context_ids: Sequence[int], progress=None) -> tuple[int, int]:
        """Precompute and store the KV of every full chunk of ``context_ids``.

        Returns (chunks stored now, chunks that were already stored). ``progress`` is called with
        the number of chunks done after each one (for a progress bar).
        """
        if self.client is None:
            raise ValueError("ingest needs a daemon client")
        n = self.namespace.chunk_tokens
        keys = prefix_keys(self.namespace, context_ids)
        kv = self.model.new_cache(max(len(keys) * n, 1))
        tiers: list[str] = []
        present = self._load_prefix(keys, kv, tiers) // n
        if progress:
            progress(present)
        with torch.inference_mode():
            for c in range(present, len(keys)):
                self.model(torch.tensor(context_ids[c * n : (c + 1) * n], dtype=torch.long), kv, c * n, last_only=True)
                self.client.put(self.namespace, [BlockToPut(keys[c], n, kv.export(c * n, (c + 1) * n),
                                                            keys[c - 1] if c else b"", context_ids[c * n : (c + 1) * n])])
                if progress:
                    progress(1)
        return len(keys) - present, present
