"""Prefix reuse through the kvstore daemon for a transformers (Hugging Face) Llama-family model.

The same request path as ``engine_adapter/cached.py`` (keys, lookup, load, compute the rest,
store), with a ``DynamicCache`` in place of the reference engine's ``KVCache``. Blocks keep the
project's layout, so a chunk stored by one engine is a hit for the other when both run the same
weights in the same dtype::

    DynamicCache.layers[l].keys / .values        [1, kv_heads, T, head_dim]   (keys after RoPE)
    block                                        [layers, 2, kv_heads, T, head_dim]
                                                  K at [:, 0], V at [:, 1], batch 1 dropped

What is reused (chunk_tokens = n; the last prompt token is always computed for its logits)::

    prompt   |--chunk 0--|--chunk 1--|--chunk 2--|-tail-|
    keys      prefix_keys(prompt[:-1])       -> a key per full chunk before the last token
    loaded    the longest stored run of them  -> cache tokens 0 .. reused-1
    computed  prompt[reused:] at positions reused .. len(prompt)-1

Storing runs in a background thread after the first token, as in ``CachedEngine``: the new chunks
are copied out of the cache on the calling thread (a few MB; decode may then append freely) and Put
by the thread; ``result.store_done`` is set when it ends. A daemon that is down or failing costs
misses, never an exception: each failure is counted in ``HFCachedGenerator.errors`` and logged once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine_adapter.cached import GenerationResult
from engine_adapter.client.prefix_cache import PrefixCache
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.reference.kv_cache import KVCache
from engine_adapter.client.shared_kv import SharedKVMemory, region_of
from engine_adapter.reference.loader import hf_rope
from kvstore.dtypes import TORCH_DTYPE_NAMES
from kvstore.keys import KVLayout, Namespace, prefix_keys

log = logging.getLogger(__name__)


# --- block layout <-> DynamicCache ----------------------------------------------------------------


def blocks_from_cache(cache: DynamicCache, start: int, end: int) -> torch.Tensor:
    """A copy of tokens start..end-1 of a batch-1 cache as a block [layers, 2, kv_heads, end-start, head_dim]."""
    length = cache.get_seq_length()
    if not 0 <= start <= end <= length:
        raise ValueError(f"blocks_from_cache({start}, {end}) is outside the cached range 0..{length}")
    layers = []
    for layer in cache.layers:
        if layer.keys.shape[0] != 1:
            raise ValueError(f"blocks_from_cache needs a batch-1 cache, got batch {layer.keys.shape[0]}")
        # keys, values: [1, kv_heads, T, head_dim] -> [2, kv_heads, end-start, head_dim]
        layers.append(torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end])))
    return torch.stack(layers)


def cache_from_blocks(blocks: Sequence[torch.Tensor], config) -> DynamicCache:
    """A batch-1 DynamicCache holding ``blocks`` (each [layers, 2, kv_heads, n_i, head_dim]) in order."""
    cache = DynamicCache(config=config)
    if not blocks:
        return cache
    num_layers = config.num_hidden_layers
    for block in blocks:
        if block.dim() != 5 or block.shape[0] != num_layers or block.shape[1] != 2:
            raise ValueError(f"block shape {tuple(block.shape)} is not [layers={num_layers}, 2, kv_heads, tokens, head_dim]")
    kv = torch.cat(list(blocks), dim=3)  # [layers, 2, kv_heads, sum(n_i), head_dim]
    for layer in range(num_layers):
        cache.update(kv[layer, 0].unsqueeze(0).contiguous(), kv[layer, 1].unsqueeze(0).contiguous(), layer)
    return cache


def cache_over(kv: KVCache, tokens: int, config) -> DynamicCache:
    """A batch-1 DynamicCache over tokens 0..tokens-1 of ``kv``: each plain layer's keys and values
    are views of ``kv`` (no copy; the first forward's update concatenates onto them, as it does onto
    any cache). A layer of another kind (sliding window) gets a copy through its own update."""
    cache = DynamicCache(config=config)
    for index in range(kv.num_layers):
        keys, values = (t.unsqueeze(0) for t in kv.read(index, tokens))
        layer = cache.layers[index] if index < len(cache.layers) else None
        if tokens and type(layer) is DynamicLayer:
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        elif tokens:
            cache.update(keys.contiguous(), values.contiguous(), index)
    return cache


# --- namespace --------------------------------------------------------------------------------------


def hf_namespace(model, model_id: str, tenant: str = "", chunk_tokens: int = 256) -> Namespace:
    """The namespace of a transformers model's KV; equals ``model_namespace`` of the reference engine
    loaded from the same weights in the same dtype when ``model_id`` is the same (the reference
    GGUF loader uses the file stem, e.g. "SmolLM2-135M-Instruct.Q4_1")."""
    config = model.config
    if model.dtype not in TORCH_DTYPE_NAMES:
        raise ValueError(f"model dtype {model.dtype} has no KV layout; use one of {list(TORCH_DTYPE_NAMES)}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, head_dim, TORCH_DTYPE_NAMES[model.dtype])
    theta, scaling = hf_rope(config.to_dict())  # the reference loader reads HF configs the same way
    rope = Namespace.rope_params(theta=theta, scaling=scaling)
    return Namespace(model_id, layout, rope=rope, tenant=tenant, chunk_tokens=chunk_tokens)


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids from our Tokenizer (``eos_token_ids``), an HF tokenizer, or the model's configs."""
    for source in (tokenizer, getattr(model, "generation_config", None), model.config):
        if source is None:
            continue
        ids = getattr(source, "eos_token_ids", None)
        if ids is None:
            ids = getattr(source, "eos_token_id", None)
        if ids is not None:
            return frozenset([ids] if isinstance(ids, int) else ids)
    return frozenset()


# --- generation ---------------------------------------------------------------------------------------


class HFCachedGenerator:
    """Greedy generation with a transformers causal LM, its prefix KV reused and stored via the daemon."""

    def __init__(self, model, tokenizer: Any | None, client: KVStoreClient | None, model_id: str,
                 tenant: str = "", chunk_tokens: int = 256) -> None:
        self.model = model
        self.client = client
        self.namespace = hf_namespace(model, model_id, tenant, chunk_tokens)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.cache = PrefixCache(client, self.namespace)
        on_cpu = torch.device(model.device).type == "cpu"
        self._allocate = SharedKVMemory(client) if on_cpu and client is not None and client.shared_memory else None

    @property
    def errors(self) -> int:
        """Daemon failures so far (each one cost misses, not a request)."""
        return self.cache.errors

    def _load(self, keys: list[bytes], tiers: list[str]) -> DynamicCache:
        """A cache holding the longest stored run of ``keys`` (one chunk each, tiers appended).
        On the CPU with shared memory the daemon copies the blocks into a `KVCache` in an arena
        (`PrefixCache.load`) and the DynamicCache views it: one copy; else the blocks are
        copied out of the fetch and concatenated."""
        config, n = self.model.config, self.namespace.chunk_tokens
        if self._allocate is not None and keys:
            layout = self.namespace.layout
            kv = KVCache(layout.num_layers, layout.num_kv_heads, layout.head_dim, len(keys) * n, self.model.dtype,
                         "cpu", self._allocate)
            if region_of(kv.data) is not None:
                return cache_over(kv, self.cache.load(keys, kv, tiers) * n, config)
        blocks: list[torch.Tensor] = []  # copies: the fetched views die with their fetch
        self.cache.load_run(keys, lambda c, block: blocks.append(block.clone()), tiers)
        return cache_from_blocks([b.to(device=self.model.device, dtype=self.model.dtype) for b in blocks], config)

    def _forward(self, ids: Sequence[int], cache: DynamicCache, start_pos: int) -> torch.Tensor:
        """Run ``ids`` at positions start_pos.. on top of ``cache``; logits of the last token [vocab]."""
        device = self.model.device
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)  # [1, T]
        positions = torch.arange(start_pos, start_pos + len(ids), device=device).unsqueeze(0)  # [1, T]
        out = self.model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    # -- generation ---------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 32, use_cache: bool = True,
                 store: bool = True) -> GenerationResult:
        """Greedy tokens after ``prompt_ids``, reusing and storing prefix KV through the daemon."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        start = time.perf_counter()
        prompt_ids = list(prompt_ids)
        n = self.namespace.chunk_tokens
        keys = prefix_keys(self.namespace, prompt_ids[: len(prompt_ids) - 1])  # the last token is computed
        tiers: list[str] = []
        cache = self._load(keys, tiers) if use_cache else DynamicCache(config=self.model.config)
        reused = len(tiers) * n
        loaded_at = time.perf_counter()
        logits = self._forward(prompt_ids[reused:], cache, reused)
        token = int(logits.argmax())
        result = GenerationResult(tokens=[token], ttft_s=time.perf_counter() - start, prompt_tokens=len(prompt_ids),
                                  reused_tokens=reused, tiers=tiers, load_s=loaded_at - start,
                                  prefill_s=time.perf_counter() - loaded_at)
        # Store the chunks computed here, behind the first token: copy them out now, Put in a thread.
        new_chunks = range(reused // n, len(keys)) if store and self.client is not None else range(0)
        result.stored_chunks = len(new_chunks)
        chunks = blocks_from_cache(cache, new_chunks.start * n, new_chunks.stop * n).cpu() if new_chunks else None
        self.cache.store_async(keys, new_chunks, lambda c: chunks[:, :, :, (c - new_chunks.start) * n:
                                                                 (c - new_chunks.start + 1) * n].contiguous(),
                               result.store_done, token_ids=prompt_ids)
        position = len(prompt_ids)
        while token not in self.eos_token_ids and len(result.tokens) < max_new_tokens:
            token = int(self._forward([token], cache, position).argmax())
            result.tokens.append(token)
            position += 1
        result.total_s = time.perf_counter() - start
        return result
