"""A compact reference decoder for the Llama family (Llama, Qwen2, SmolLM2), batch size 1.

The model keeps no state of its own: every call reads and writes an explicit `KVCache`, so the
KV of a prefix can be exported as a block, stored in a tier, and loaded back into a fresh cache.

A forward pass, layer by layer (the pieces are public so CacheBlend can run them one at a time):

    h = model.embed(ids)                                 # [T, hidden]
    cos, sin = model.rope(positions)                     # [T, head_dim] each
    for layer in model.layers:
        q, k, v = layer.qkv(h, cos, sin)                 # [H, T, D], [KVH, T, D], [KVH, T, D]
        kv.write(layer.index, start_pos, k, v)
        keys, values = kv.read(layer.index, start_pos + T)
        h = h + layer.attend(q, keys, values)            # causal, or an explicit boolean mask
        h = h + layer.feed_forward(h)
    logits = model.final_logits(h)                       # [T, vocab] float32

Keys are stored after RoPE, at their absolute positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_adapter.reference.kv_cache import Allocate, KVCache

ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one Llama-family decoder.

    `rope_scaling` is None (plain RoPE) or a dict with `rope_type` "linear" (needs `factor`) or
    "llama3" (needs `factor`, `low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings`). `attention_bias` means biases on the q, k and v
    projections (Qwen2 style); the output projection never has one.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_id: str

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                "for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_scaling is not None:
            self._check_rope_scaling(self.rope_scaling)
        if not isinstance(self.eos_token_ids, tuple) or not self.eos_token_ids:
            raise ValueError(
                f"eos_token_ids must be a non-empty tuple of ints, got {self.eos_token_ids!r}; "
                "pass tuple(ids)"
            )
        special = (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,)))
        for token_id in special:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise ValueError(f"special token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")
        if not self.model_id:
            raise ValueError("model_id must be a non-empty name such as 'SmolLM2-135M-Instruct'")

    @staticmethod
    def _check_rope_scaling(scaling: dict[str, Any]) -> None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use one of {ROPE_TYPES} or None")
        if rope_type == "default":
            return
        if not scaling.get("factor", 0) > 0:
            raise ValueError(f"rope_scaling {rope_type!r} needs a positive 'factor', got {scaling!r}")
        if rope_type == "llama3":
            missing = [key for key in LLAMA3_ROPE_KEYS if key not in scaling]
            if missing:
                raise ValueError(f"llama3 rope_scaling is missing {missing}; got {scaling!r}")
            if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")

    @cached_property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))

    @cached_property
    def group_size(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, after the config's rope scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_type == "linear":
        return inv_freq / config.rope_scaling["factor"]
    if config.rope_type == "llama3":
        # Wavelengths longer than the pretraining context are slowed by `factor`, shorter than
        # context / high_freq_factor are kept, and the band between is interpolated smoothly.
        scaling = config.rope_scaling
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelength < context / high) * ~(wavelength > context / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [heads, T, D]; cos, sin: [T, D]
    return x * cos + rotate_half(x) * sin


def causal_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """Boolean mask [T, S], True where a query may attend, for queries at the end of the keys.

        keys:    0 ........ S-T ............ S-1
        queries:             0 ............ T-1
        query i sees keys 0 .. S-T+i
    """
    offset = num_keys - num_queries
    query_positions = torch.arange(num_queries, device=device)[:, None] + offset
    return torch.arange(num_keys, device=device)[None, :] <= query_positions


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm SwiGLU MLP; each piece callable on its own."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, q_width, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed projections of the residual stream h [T, hidden], RoPE applied to q and k.

        Returns q [H, T, D], k [KVH, T, D], v [KVH, T, D].
        """
        x = self.input_layernorm(h)
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)  # [KVH, T, D]
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim).transpose(0, 1)  # [KVH, T, D]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output [T, hidden] (after o_proj), to add to the residual stream.

        q [H, T, D]; keys, values [KVH, S, D]. With `mask` None the queries are the last T of the
        S positions and attend causally (see `causal_mask`); otherwise `mask` is [T, S], boolean
        (True where a query may attend) or additive in q's dtype (0 or -inf).
        """
        num_queries, num_keys = q.shape[1], keys.shape[1]
        is_causal = False
        if mask is None and num_queries == num_keys:
            is_causal = num_queries > 1
        elif mask is None and num_queries > 1:
            mask = causal_mask(num_queries, num_keys, q.device)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),  # [1, H, T, D], [1, KVH, S, D]
            attn_mask=mask, is_causal=is_causal, enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [1, H, T, D]
        return self.output(out[0])

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        """Per-head attention outputs [H, T, D] as the layer's output [T, hidden] (after o_proj)."""
        return self.o_proj(heads.transpose(0, 1).reshape(heads.shape[1], self.num_heads * self.head_dim))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU MLP output [T, hidden] of the normed residual stream, to add to it."""
        x = self.post_attention_layernorm(h)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start_pos: int
                ) -> torch.Tensor:
        q, k, v = self.qkv(h, cos, sin)
        kv.write(self.index, start_pos, k, v)
        keys, values = kv.read(self.index, start_pos + h.shape[0])
        h = h + self.attend(q, keys, values)
        return h + self.feed_forward(h)


class LlamaModel(nn.Module):
    """Decoder with tied or separate LM head. Parameter names: `embed_tokens`, `layers.{i}.q_proj`, ..."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # float32 and outside the module's buffers, so model.to(dtype) never rounds it
        self.inv_freq = rope_inverse_frequencies(config)  # [D/2]

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: dict[str, torch.Tensor],
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LlamaModel:
        """Build without random init and take the weights from `state` (names as in this module).

        `lm_head.weight` is ignored when the embeddings are tied. Raises ValueError on missing,
        unexpected or misshapen weights.
        """
        with torch.device("meta"):
            model = cls(config)
        expected = {name: p.shape for name, p in model.state_dict().items()}
        if config.tie_word_embeddings:
            expected.pop("lm_head.weight")
            state = {name: tensor for name, tensor in state.items() if name != "lm_head.weight"}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"weights do not match the config: missing {missing[:8]}, unexpected {unexpected[:8]}")
        for name, tensor in state.items():
            if tensor.shape != expected[name]:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name])}")
        model.load_state_dict(state, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.to(device=device, dtype=dtype).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, capacity: int, allocate: Allocate | None = None) -> KVCache:
        config = self.config
        return KVCache(config.num_layers, config.num_kv_heads, config.head_dim, capacity, self.dtype, self.device,
                       allocate)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Residual stream [T, hidden] for token ids [T]."""
        return self.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in the model dtype for absolute positions [T]."""
        inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [T, D]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab] from the residual stream [T, hidden]."""
        return self.lm_head(self.norm(h)).float()

    def row_attention(self, rows: torch.Tensor, total: int) -> Callable[..., torch.Tensor] | None:
        """A kernel of the model's own for row-exact attention of sorted ``rows`` over ``total``
        cached tokens (`blend.recompute.SdpaRows`'s call), or None: the blend's SDPA calls. This
        model has none; vLLM's does (`engine_adapter.vllm.model_view`)."""
        return None

    def forward(self, input_ids: torch.Tensor, kv: KVCache, start_pos: int, last_only: bool = False,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [T, vocab] (float32) for tokens [T] at positions start_pos..start_pos+T-1.

        Attends to kv tokens 0..start_pos-1 plus the new tokens causally, writes the new K and V at
        start_pos.., and sets kv.length to start_pos + T (anything after is dropped). With
        ``last_only`` only the last position's logits are computed ([1, vocab]): a prefill needs
        no more, and the LM head over every prompt token costs ~10% of a 4k-token prefill.
        ``before_layer(index)`` runs before each layer does: a layer-wise load writes that layer's
        tokens 0..start_pos-1 there, just before the layer reads them.
        """
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor [T], got shape {tuple(input_ids.shape)}")
        if not 0 <= start_pos <= kv.length:
            raise ValueError(f"start_pos {start_pos} must be within the cache's filled range 0..{kv.length}")
        end = start_pos + input_ids.shape[0]
        input_ids = input_ids.to(self.device)
        kv.reserve(end)
        cos, sin = self.rope(torch.arange(start_pos, end, device=self.device))
        h = self.embed(input_ids)
        for layer in self.layers:
            if before_layer is not None:
                before_layer(layer.index)
            h = layer(h, cos, sin, kv, start_pos)
        kv.length = end
        return self.final_logits(h[-1:] if last_only else h)
