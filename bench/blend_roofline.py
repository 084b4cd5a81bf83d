"""What a GPU would see of a CacheBlend prefill: FLOPs and bytes per step against a roofline.

A prefill step runs every layer over some rows of the prompt (a row = one token's hidden state).
Per layer, rows R attending over a context of C tokens cost::

    projections  2 * R * P_layer FLOPs          P_layer = q, k, v, o and the MLP's three weights
    attention    4 * R * C * heads * head_dim   QK^T and PV (half of it under a causal mask, R = C)
    bytes        2 * P_layer (weights, bf16) + 4 * C * kv_heads * head_dim (the K and V it reads)

and a layer takes max(FLOPs / (peak * mfu), bytes / (bandwidth * mbu)) + a fixed cost (kernel
launches, host work). The three steps of the RAG bench (bench/vllm_rag.py)::

    full      every row (T), causal
    naive     the query's rows (Q) over the whole context: passages reused as stored
    blend r   a query pass (the stale_attention selector: the query's rows over the stale cache,
              about a naive step), then the selected rows (r * passage tokens) and the query's rows,
              each over the whole context
    shallow r the blend with the query pass cut after --pass-layers layers (the
              shallow_stale_attention selector: 10 by default), then the same recompute
    fused r   the selection made inside the recompute (a check-layer selector: every row through
              layer 0, the selected and the query's rows through the rest): no second weight read

The recompute cost is ``(blend - naive) / full / r``: 1 when recomputing a fraction r of the
passages costs r of a full prefill. On a GPU the weights' bytes and the fixed cost per layer set a
floor under every step, so naive and blend approach each other and the cost ratio falls below 1
for a model large enough to be compute-bound in its full prefill; for a 135M model every step is
the fixed cost, and the blend gains nothing.

    python bench/blend_roofline.py [--gpu h100] [--ratio 0.15] [--pass-layers 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Shape:
    """A decoder's shape (bf16 weights and KV)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        return attention + 3 * self.hidden * self.intermediate


@dataclass(frozen=True)
class Device:
    """A roofline: peak dense bf16 FLOP/s and memory bandwidth, the fractions of each a prefill's
    kernels reach, and a fixed cost per layer (kernel launches and the host between them)."""

    name: str
    peak_flops: float
    bandwidth: float
    mfu: float = 0.6
    mbu: float = 0.8
    fixed_per_layer_s: float = 30e-6


SHAPES = {
    "smollm2-135m": Shape("SmolLM2-135M", 30, 576, 1536, 9, 3, 64, 49152),
    "llama3-8b": Shape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256),
}
DEVICES = {
    "h100": Device("H100 SXM (989 TFLOP/s bf16 dense, 3.35 TB/s)", 989e12, 3.35e12),
    "h200": Device("H200 (989 TFLOP/s bf16 dense, 4.8 TB/s)", 989e12, 4.8e12),
}
# bench/vllm_rag.py's MuSiQue prompts (SmolLM2's tokenizer: about 1,900 tokens at top-3, 6,000
# with all 10 passages): head, passages, question
PROMPTS = {"top-3": (60, [600, 610, 620], 30), "all 10": (60, [590] * 10, 30)}


def step_seconds(shape: Shape, device: Device, rows: int, context: int, causal: bool, layers: int | None = None,
                 logits: bool = True) -> dict:
    """``rows`` rows over ``context`` tokens through ``layers`` layers (all), then the last row's
    logits: FLOPs, bytes, seconds, and what bounds a layer (compute, memory or the fixed cost)."""
    layers = shape.layers if layers is None else layers
    attention = 4 * rows * context * shape.heads * shape.head_dim * (0.5 if causal else 1.0)
    flops_layer = 2 * rows * shape.layer_params + attention
    bytes_layer = 2 * shape.layer_params + 4 * context * shape.kv_heads * shape.head_dim
    costs = {"compute": flops_layer / (device.peak_flops * device.mfu),
             "memory": bytes_layer / (device.bandwidth * device.mbu), "fixed": device.fixed_per_layer_s}
    head = 2 * shape.hidden * shape.vocab if logits else 0  # the last row's logits: FLOPs, and its weights' bytes
    seconds = layers * (max(costs["compute"], costs["memory"]) + costs["fixed"]) + max(
        head / (device.peak_flops * device.mfu), head / (device.bandwidth * device.mbu))
    return {"flops": layers * flops_layer + head, "bytes": layers * bytes_layer + head, "seconds": seconds,
            "bound": max(costs, key=costs.get)}


def blend_model(shape: Shape, device: Device, prefix: int, passages: list[int], query: int, ratio: float,
                pass_layers: int = 10) -> dict:
    """full, naive and blend r of one prompt: each step's FLOPs, bytes and seconds, the blend's
    speed-up over full and its recompute cost; "shallow", the blend with a query pass of
    ``pass_layers`` layers."""
    total = prefix + sum(passages) + query
    selected = round(ratio * sum(passages))
    full = step_seconds(shape, device, total, total, causal=True)
    naive = step_seconds(shape, device, query, total, causal=False)
    recompute = step_seconds(shape, device, selected + query, total, causal=False)
    blend = {key: naive[key] + recompute[key] for key in ("flops", "bytes", "seconds")}  # query pass + recompute
    shallow_pass = step_seconds(shape, device, query, total, causal=False, layers=min(pass_layers, shape.layers),
                                logits=False)
    shallow = {key: shallow_pass[key] + recompute[key] for key in ("flops", "bytes", "seconds")}
    first = step_seconds(shape, device, total, total, causal=True, layers=1, logits=False)  # layer 0, every row
    rest = step_seconds(shape, device, selected + query, total, causal=False, layers=shape.layers - 1)
    fused = {key: first[key] + rest[key] for key in ("flops", "bytes", "seconds")}

    def cost(step: dict) -> float:
        return (step["seconds"] - naive["seconds"]) / full["seconds"] / ratio

    return {"tokens": total, "selected": selected, "full": full, "naive": naive, "blend": blend, "fused": fused,
            "shallow": shallow, "speedup": full["seconds"] / blend["seconds"], "recompute_cost": cost(blend),
            "shallow_speedup": full["seconds"] / shallow["seconds"], "shallow_recompute_cost": cost(shallow),
            "fused_speedup": full["seconds"] / fused["seconds"], "fused_recompute_cost": cost(fused)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", choices=sorted(DEVICES), default="h100")
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--pass-layers", type=int, default=10,
                        help="the shallow query pass's layers (shallow_stale_attention's)")
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args()
    if args.pass_layers < 1:
        raise SystemExit("--pass-layers must be >= 1")
    device = DEVICES[args.gpu]
    print(f"{device.name}; mfu {device.mfu}, mbu {device.mbu}, {device.fixed_per_layer_s * 1e6:.0f} us fixed per "
          f"layer; blend r = {args.ratio}; shallow: a {args.pass_layers}-layer query pass")
    print(f"{'model':<14}{'prompt':<8}{'tokens':>7}{'full ms':>9}{'naive ms':>10}{'blend ms':>10}{'speed-up':>10}"
          f"{'cost':>7}{'shallow ms':>11}{'speed-up':>10}{'cost':>7}{'fused ms':>10}{'speed-up':>10}{'cost':>7}"
          f"  a full step's layer is")
    report = {"device": asdict(device), "ratio": args.ratio, "cases": []}
    for shape in SHAPES.values():
        for prompt, (prefix, passages, query) in PROMPTS.items():
            m = blend_model(shape, device, prefix, passages, query, args.ratio, args.pass_layers)
            print(f"{shape.name:<14}{prompt:<8}{m['tokens']:>7}{m['full']['seconds'] * 1e3:>9.2f}"
                  f"{m['naive']['seconds'] * 1e3:>10.2f}{m['blend']['seconds'] * 1e3:>10.2f}{m['speedup']:>9.2f}x"
                  f"{m['recompute_cost']:>7.2f}{m['shallow']['seconds'] * 1e3:>11.2f}{m['shallow_speedup']:>9.2f}x"
                  f"{m['shallow_recompute_cost']:>7.2f}{m['fused']['seconds'] * 1e3:>10.2f}{m['fused_speedup']:>9.2f}x"
                  f"{m['fused_recompute_cost']:>7.2f}  {m['full']['bound']}-bound")
            report["cases"].append({"model": shape.name, "prompt": prompt, **m})
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
