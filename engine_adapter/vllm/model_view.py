"""The blend's model over vLLM's own layers: `blend/` runs on the weights vLLM already holds.

`blend/` computes with a `LlamaModel`'s pieces (``embed``, each layer's ``qkv`` / ``output`` /
``feed_forward``, ``final_logits``, ``rope``). `VllmModelView` is a `LlamaModel` whose pieces call
vLLM's modules instead of weights of its own: the fused ``qkv_proj`` split into q, k, v, ``o_proj``,
the ``mlp`` and the ``RMSNorm`` layers, the embedding and the LM head, each through vLLM's own
kernels (on a CPU, weights vLLM may have repacked for oneDNN and dropped from ``.weight``, so a view
of its parameters would not do). RoPE stays `blend/`'s, so positions and re-rotation are the ones
`BlendEngine` uses everywhere. A partial layer's row-exact attention runs on vLLM's CPU attention
kernel where vLLM runs that backend (`row_attention.PagedRows`), else on `blend/`'s SDPA calls.

The connector is not handed the model (vLLM 0.32), so `find_vllm_model` finds it once, by its
attention layer: the live module whose submodule of that name is vLLM's registered attention layer.
A model whose shape does not fit (tensor or pipeline parallel, another architecture) gives None
and a reason, and the blender falls back to a second copy of the weights from the model folder.
"""

from __future__ import annotations

import gc
import logging

import torch
from torch import nn

from blend.recompute import SdpaRows
from engine_adapter.reference.model import DecoderLayer, LlamaModel, ModelConfig, apply_rope, rope_inverse_frequencies
from engine_adapter.vllm.row_attention import NO_ISA_YET, PagedRows, row_attention_problem

log = logging.getLogger("vllm.kvstore_connector")


def find_vllm_model(layer_name: str, attention: nn.Module) -> nn.Module | None:
    """The live vLLM model whose submodule ``layer_name`` is ``attention`` (vLLM's registered
    attention layer of that name), or None. Walks the collector's objects: call it once (the
    blender does, on its first blend)."""
    for obj in gc.get_objects():
        if isinstance(obj, nn.Module) and hasattr(obj, "lm_head") and obj is not attention:
            try:
                if obj.get_submodule(layer_name) is attention:
                    return obj
            except AttributeError:
                continue
    return None


def view_problem(model: nn.Module, config: ModelConfig) -> str | None:
    """Why ``model`` (a vLLM model) cannot serve as ``config``'s `VllmModelView`, or None."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not all(hasattr(inner, a) for a in ("embed_tokens", "norm")):
        return f"{type(model).__name__} has no model.embed_tokens / layers / norm"
    if len(layers) != config.num_layers:
        return f"{len(layers)} layers in this worker, the model has {config.num_layers} (pipeline parallel?)"
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        missing = [a for a in ("input_layernorm", "post_attention_layernorm", "mlp") if not hasattr(layer, a)]
        if attn is None or not hasattr(attn, "qkv_proj") or not hasattr(attn, "o_proj") or missing:
            return f"layer {type(layer).__name__} is not a Llama decoder layer (qkv_proj, o_proj, norms, mlp)"
        if (getattr(attn, "num_heads", None), getattr(attn, "num_kv_heads", None), getattr(attn, "head_dim", None)) != \
                (config.num_heads, config.num_kv_heads, config.head_dim):
            return (f"this worker holds {getattr(attn, 'num_heads', '?')} heads / {getattr(attn, 'num_kv_heads', '?')} "
                    f"KV heads, the model {config.num_heads} / {config.num_kv_heads} (tensor parallel?)")
    return None


class _LayerView(DecoderLayer):
    """A `DecoderLayer` whose projections, norms and MLP are vLLM's layer ``layer``."""

    def __init__(self, config: ModelConfig, index: int, layer: nn.Module) -> None:
        nn.Module.__init__(self)  # no weights of its own
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.__dict__["vllm_layer"] = layer  # not a submodule: .to() or state_dict() never reach vLLM's

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer = self.vllm_layer
        tokens, d = h.shape[0], self.head_dim
        fused, _ = layer.self_attn.qkv_proj(layer.input_layernorm(h))
        q, k, v = fused.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.reshape(tokens, self.num_heads, d).transpose(0, 1)
        k = k.reshape(tokens, self.num_kv_heads, d).transpose(0, 1)
        v = v.reshape(tokens, self.num_kv_heads, d).transpose(0, 1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        out, _ = self.vllm_layer.self_attn.o_proj(
            heads.transpose(0, 1).reshape(heads.shape[1], self.num_heads * self.head_dim))
        return out

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        layer = self.vllm_layer
        return layer.mlp(layer.post_attention_layernorm(h))


class VllmModelView(LlamaModel):
    """``config``'s `LlamaModel` computed by vLLM's ``model`` (check it with `view_problem`)."""

    def __init__(self, config: ModelConfig, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.__dict__["vllm_model"] = model
        self.layers = [_LayerView(config, i, layer) for i, layer in enumerate(model.model.layers)]
        self.inv_freq = rope_inverse_frequencies(config)
        self._dtype, self._device = dtype, torch.device(device)
        self.__dict__["vllm_attention"] = getattr(model.model.layers[0].self_attn, "attn", None)
        self.row_kernel: str | None = None  # "vllm" or why not, once the first partial layer asked

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.vllm_model.model.embed_tokens(input_ids)

    def row_attention(self, rows: torch.Tensor, total: int) -> KernelRows | None:
        if self.row_kernel is None:  # asked at the first blend: vLLM sets its kernel up after loading the model
            attention = self.vllm_attention
            problem = "no attention layer" if attention is None else row_attention_problem(attention,
                                                                                            self.config.head_dim)
            if problem == NO_ISA_YET:
                return None  # SDPA for this row set; asked again for the next
            if problem is None and self._device.type != "cpu":
                problem = f"the model is on {self._device}"
            if problem is None and self._dtype not in (torch.bfloat16, torch.float32):
                problem = f"{self._dtype} (the row kernel is tested in bf16 and float32)"
            self.row_kernel = problem or "vllm"
            log.info("KVStoreConnector: the blend's row attention runs on %s", "vLLM's CPU attention kernel"
                     if problem is None else f"SDPA calls ({problem})")
        if self.row_kernel != "vllm":
            return None
        config = self.config
        try:
            paged = PagedRows(self.vllm_attention, rows, total, config.num_heads, config.num_kv_heads,
                              config.head_dim, self._dtype)
        except Exception as exc:  # noqa: BLE001 - a kernel this host cannot plan: the SDPA calls, for good
            self.kernel_failed(exc)
            return None
        return KernelRows(self, paged, rows)

    def kernel_failed(self, exc: BaseException) -> None:
        """vLLM's row kernel raised: every later row set takes the SDPA calls (logged once)."""
        self.row_kernel = f"vLLM's kernel failed: {exc}"
        log.warning("KVStoreConnector: the blend's row attention falls back to SDPA calls: vLLM's CPU attention "
                    "kernel failed (%s)", exc)

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.vllm_model.lm_head
        logits = head.quant_method.apply(head, self.vllm_model.model.norm(h))
        return logits[..., : self.config.vocab_size].float()  # vLLM pads the vocabulary


class KernelRows:
    """`PagedRows` for one row set, which falls back to `blend.recompute.SdpaRows` (and makes its
    view do so for every later row set) the first time vLLM's kernel raises: a kernel that cannot
    run on this host, an ISA no test here ran, costs the blend speed, never the blend."""

    def __init__(self, view: VllmModelView, paged: PagedRows, rows: torch.Tensor) -> None:
        self.view, self.paged, self.rows = view, paged, rows
        self.sdpa: SdpaRows | None = None

    def __call__(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.paged is not None:
            try:
                return self.paged(layer, q, keys, values)
            except Exception as exc:  # noqa: BLE001 - see the class doc
                self.view.kernel_failed(exc)
                self.paged = None
        if self.sdpa is None:
            self.sdpa = SdpaRows(self.rows, self.view.dtype)
        return self.sdpa(layer, q, keys, values)
