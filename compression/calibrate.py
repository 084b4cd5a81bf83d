"""Making a calibration from text with the model itself, and the `kvstore calibrate` command.

    model, tokenizer = load_gguf(find_smollm2_gguf())
    stats = collect(model, [tokenizer.encode(text) for text in texts])   # prefill, KV + query moments
    calibration = calibrate(stats.blocks, Allocation(0.3, 0.6), metric=stats.metric(groups=1))

`collect` prefills each text once (positions 0..n-1, as prefix reuse stores them) and keeps its KV
block and, per layer, the second moment of the post-RoPE queries, read with a forward hook on
`q_proj` (removed afterwards). The metric of a key row is the sum of E[q q^T] over the query heads
that read the row's KV heads; of a value row, the sum of W_o^T W_o over those heads' o_proj
columns (see `compression/calibration.py`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compression.calibration import Allocation, Calibration, calibrate

DEFAULT_ALLOCATION = Allocation(key_step=0.3, value_step=0.6)


@dataclass
class ModelStats:
    """What `collect` saw: KV blocks [L, 2, KVH, T_i, D] (float16) and query moments [L, H, D, D]."""

    blocks: list[torch.Tensor]
    query_moment: torch.Tensor  # [L, H, D, D] float64: E[q q^T] per query head (post-RoPE)
    value_metric_heads: torch.Tensor  # [L, H, D, D] float64: W_o[:, head]^T W_o[:, head]
    tokens: int = 0
    texts: int = 0
    notes: list[str] = field(default_factory=list)

    def metric(self, groups: int) -> torch.Tensor:
        """Per-row metric [B, C, C] for rows (layer, k/v, group) of C = KVH/groups * D channels."""
        n_layers, n_heads, head_dim, _ = self.query_moment.shape
        n_kv = self.blocks[0].shape[2]
        per_kv = n_heads // n_kv  # query heads per KV head (GQA: head j reads KV head j // per_kv)
        heads_per_group = n_kv // groups
        n_chan = heads_per_group * head_dim
        metric = torch.zeros(n_layers, 2, groups, n_chan, n_chan, dtype=torch.float64)
        for kind, per_head in enumerate((self.query_moment, self.value_metric_heads)):
            per_kv_head = per_head.view(n_layers, n_kv, per_kv, head_dim, head_dim).sum(2)  # [L, KVH, D, D]
            for h in range(n_kv):
                g, i = divmod(h, heads_per_group)
                sl = slice(i * head_dim, (i + 1) * head_dim)
                metric[:, kind, g, sl, sl] = per_kv_head[:, h]
        return metric.view(-1, n_chan, n_chan)


@torch.inference_mode()
def collect(model, texts_ids: list[list[int]]) -> ModelStats:
    """Prefill each token list and gather KV blocks and query second moments (model: `LlamaModel`)."""
    from engine_adapter.generate import prefill
    from engine_adapter.model import apply_rope

    config = model.config
    n_layers, n_heads, head_dim = config.num_layers, config.num_heads, config.head_dim
    moment = torch.zeros(n_layers, n_heads, head_dim, head_dim, dtype=torch.float64)
    counted = [0]
    positions: list[torch.Tensor] = []

    def hook(layer_index: int):
        def on_q(module, inputs, output):  # output [T, H*D], before RoPE
            tokens = output.shape[0]
            q = output.view(tokens, n_heads, head_dim).transpose(0, 1)  # [H, T, D]
            cos, sin = model.rope(positions[-1][:tokens])
            q = apply_rope(q, cos, sin).double()
            moment[layer_index] += torch.bmm(q.transpose(1, 2), q)  # [H, D, T] @ [H, T, D] -> [H, D, D]
        return on_q

    handles = [layer.q_proj.register_forward_hook(hook(i)) for i, layer in enumerate(model.layers)]
    blocks = []
    try:
        for ids in texts_ids:
            if len(ids) < 2:
                continue
            positions.append(torch.arange(len(ids), device=model.device))
            kv = model.new_cache(len(ids))
            prefill(model, ids, kv, start_pos=0)
            blocks.append(kv.export(0, len(ids)).to(torch.float16).cpu())
            counted[0] += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    if not blocks:
        raise ValueError("calibration needs at least one text of two or more tokens")
    value_heads = torch.zeros(n_layers, n_heads, head_dim, head_dim, dtype=torch.float64)
    for i, layer in enumerate(model.layers):
        w_o = layer.o_proj.weight.detach().double().cpu().view(-1, n_heads, head_dim)  # [hidden, H, D]
        value_heads[i] = torch.einsum("rhd,rhe->hde", w_o, w_o)  # per head W_o^T W_o [H, D, D]
    return ModelStats(blocks, moment / counted[0], value_heads, tokens=counted[0], texts=len(blocks))


def calibrate_model(model, texts_ids: list[list[int]], allocation: Allocation = DEFAULT_ALLOCATION,
                    groups: int = 1, source: str = "") -> Calibration:
    """`collect` then `calibrate` with the query / o_proj metric."""
    stats = collect(model, texts_ids)
    return calibrate(stats.blocks, allocation, groups=groups, metric=stats.metric(groups),
                     source=source or f"{stats.texts} texts, {stats.tokens} tokens")


# -- kvstore calibrate -------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """`kvstore calibrate`: calibrate on files, save to the calibration directory, put into the daemon."""
    from compression import calibration_store
    from engine_adapter.loader import find_smollm2_gguf, load_gguf

    model, tokenizer = load_gguf(args.gguf or find_smollm2_gguf(), dtype=torch.float32)
    texts = [tokenizer.encode(path.read_text())[: args.max_tokens] for path in args.files]
    allocation = Allocation(DEFAULT_ALLOCATION.key_step if args.key_step is None else args.key_step,
                            DEFAULT_ALLOCATION.value_step if args.value_step is None else args.value_step)
    calibration = calibrate_model(model, texts, allocation, groups=args.groups,
                                  source=f"{len(texts)} files, {sum(map(len, texts))} tokens")
    path = calibration_store.save(calibration)
    print(f"calibration {calibration.id}\n  file {path}\n  codec spec: kvtc@{calibration.id[:12]}  "
          f"(e.g. kvstore serve --disk-codec kvtc@{calibration.id[:12]})")
    if args.no_put:
        return 0
    try:
        from engine_adapter.client import KVStoreClient

        with KVStoreClient(args.address) as client:
            client.wait_ready(timeout=2.0)
            stored = calibration_store.put_calibration(client, calibration)
        print(f"  stored in the daemon ({stored} block; it is written down to disk/S3 like any block)")
    except Exception as exc:  # the file is the calibration; the daemon copy is for other hosts
        print(f"  not stored in the daemon ({type(exc).__name__}: {exc}); the file above still works on this host",
              file=sys.stderr)
    return 0
