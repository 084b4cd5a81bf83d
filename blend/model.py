"""What CacheBlend needs from a model and its KV cache: the protocol every engine implements.

Blend stands below the engines: it imports none of them. The reference engine's `LlamaModel` and
`KVCache` (engine_adapter/reference/) and vLLM's model view (`engine_adapter.vllm.model_view`,
vLLM's own modules behind the same calls) implement these structurally, so the recompute runs the
engine's own projections, attention and MLP on the rows it picks.

Shapes: T tokens, H query heads, KVH key/value heads, D head dim, L layers.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch


class BlendCache(Protocol):
    """One sequence's keys and values, layer-major (the reference engine's `KVCache`)."""

    length: int                                     # tokens filled
    keys: Sequence[torch.Tensor]                    # per layer [KVH, capacity, D] views
    values: Sequence[torch.Tensor]

    @property
    def capacity(self) -> int: ...
    @property
    def data(self) -> torch.Tensor: ...             # [L, 2, KVH, capacity, D]
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...

    def reserve(self, num_tokens: int) -> None: ...
    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...
    def write_layers(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...
    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def export(self, start: int, end: int) -> torch.Tensor: ...  # [L, 2, KVH, end - start, D]


class BlendLayer(Protocol):
    """One decoder layer, in the pieces the recompute calls on chosen rows."""

    index: int

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...  # q [H, T, D], k, v [KVH, T, D], RoPE'd
    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor: ...  # [T, hidden]
    def output(self, heads: torch.Tensor) -> torch.Tensor: ...         # [H, T, D] -> [T, hidden] (o_proj)
    def feed_forward(self, h: torch.Tensor) -> torch.Tensor: ...       # [T, hidden], to add to h


class BlendModel(Protocol):
    """A decoder the blend can run row by row: embeddings, RoPE, layers, logits, and an attention
    kernel of its own for given rows where it has one."""

    layers: Sequence[BlendLayer]
    inv_freq: torch.Tensor                          # [D/2] RoPE inverse frequencies
    config: object                                  # .num_heads

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...

    def new_cache(self, capacity: int) -> BlendCache: ...
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...      # [T] -> [T, hidden]
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...  # cos, sin [T, D]
    def final_logits(self, h: torch.Tensor) -> torch.Tensor: ...       # [T, hidden] -> float32 [T, vocab]
    def row_attention(self, rows: torch.Tensor, total: int) -> Callable[..., torch.Tensor] | None: ...
    def __call__(self, input_ids: torch.Tensor, kv: BlendCache, start_pos: int,
                 last_only: bool = False) -> torch.Tensor: ...        # prefill: logits, kv filled
