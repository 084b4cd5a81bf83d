"""Making a calibration from text with the model itself, and the `kvstore calibrate` command.

    model, tokenizer = load_gguf(find_smollm2_gguf())
    stats = collect(model, [tokenizer.encode(text) for text in texts])   # prefill, KV + query moments
    calibration = calibrate(stats.blocks, Allocation(0.3, 0.6), metric=stats.metric(groups=1))
    # keys before RoPE (format v3), the first 4 positions raw:
    calibration = calibrate(stats.blocks, Allocation(0.3, 0.6, sink_tokens=4), metric=stats.metric(1, pre_rope=True),
                            rope_inv_freq=stats.inv_freq, max_position=stats.max_position)

`collect` prefills each text once (positions 0..n-1, as prefix reuse stores them) and keeps its KV
block and, per layer, the second moment of the post-RoPE queries, read with a forward hook on
`q_proj` (removed afterwards). The metric of a key row is the sum of E[q q^T] over the query heads
that read the row's KV heads; of a value row, the sum of W_o^T W_o over those heads' o_proj
columns (see `compression/calibration_fit.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field

import torch

from compression.calibration import Allocation, Calibration
from compression.calibration_fit import calibrate

DEFAULT_ALLOCATION = Allocation(key_step=0.3, value_step=0.6, sink_tokens=4)
SENSITIVITY_ALLOCATION = Allocation(key_step=0.35, value_step=0.35, drop=0.2)  # where row_sensitivity measures
SENSITIVITY_LIMIT = 4.0  # per-row step factors are clipped to [1/limit, limit] (docs/compression.md)


@dataclass
class ModelStats:
    """What `collect` saw: KV blocks [L, 2, KVH, T_i, D] (float16) and query moments [L, H, D, D]."""

    blocks: list[torch.Tensor]
    query_moment: torch.Tensor  # [L, H, D, D] float64: E[q q^T] per query head (post-RoPE)
    value_metric_heads: torch.Tensor  # [L, H, D, D] float64: W_o[:, head]^T W_o[:, head]
    inv_freq: torch.Tensor | None = None  # [D/2] float32: the model's RoPE frequencies
    max_position: int = 0  # the model's context length (max_position_embeddings)
    tokens: int = 0
    texts: int = 0
    notes: list[str] = field(default_factory=list)

    def metric(self, groups: int, pre_rope: bool = False) -> torch.Tensor:
        """Per-row metric [B, C, C] for rows (layer, k/v, group) of C = KVH/groups * D channels.

        ``pre_rope``: the key metric for keys coded before RoPE. A key at position p is read as
        q . R(p) k, so an error d in the un-rotated key costs d^T R(p)^T E[q q^T] R(p) d; the
        metric is that averaged over the positions the calibration texts covered (`_unrotated`).
        """
        n_layers, n_heads, head_dim, _ = self.query_moment.shape
        n_kv = self.blocks[0].shape[2]
        per_kv = n_heads // n_kv  # query heads per KV head (GQA: head j reads KV head j // per_kv)
        heads_per_group = n_kv // groups
        n_chan = heads_per_group * head_dim
        metric = torch.zeros(n_layers, 2, groups, n_chan, n_chan, dtype=torch.float64)
        for kind, per_head in enumerate((self.query_moment, self.value_metric_heads)):
            per_kv_head = per_head.view(n_layers, n_kv, per_kv, head_dim, head_dim).sum(2)  # [L, KVH, D, D]
            if kind == 0 and pre_rope:
                per_kv_head = self._unrotated(per_kv_head)
            for h in range(n_kv):
                g, i = divmod(h, heads_per_group)
                sl = slice(i * head_dim, (i + 1) * head_dim)
                metric[:, kind, g, sl, sl] = per_kv_head[:, h]
        return metric.view(-1, n_chan, n_chan)

    def _unrotated(self, moment: torch.Tensor, samples: int = 128) -> torch.Tensor:
        """mean over positions p of R(p)^T M R(p) for M [..., D, D]; p spaced evenly over the texts' span."""
        from kernels.rope_ref import rerotate_keys

        if self.inv_freq is None:
            raise ValueError("pre_rope metric needs the model's RoPE frequencies (ModelStats.inv_freq)")
        lead, head_dim = moment.shape[:-2], moment.shape[-1]
        m = moment.reshape(-1, head_dim, head_dim).float()  # [N, D, D]
        span = max(b.shape[3] for b in self.blocks)
        positions = torch.linspace(0, span - 1, samples).round().long()
        total = torch.zeros_like(m, dtype=torch.float64)
        for chunk in positions.split(32):  # [P]
            zeros = torch.zeros_like(chunk)
            # rows of M turned by R(p)^T: y[n, c, p, :] = (M R(p))[c, :]
            y = rerotate_keys(m[:, :, None, :].expand(-1, -1, len(chunk), -1).contiguous(), chunk, zeros, self.inv_freq)
            # then its columns: z[n, b, p, :] = (R(p)^T M R(p))[:, b]
            z = rerotate_keys(y.permute(0, 3, 2, 1).contiguous(), chunk, zeros, self.inv_freq)
            total += z.double().sum(2).transpose(1, 2)  # [N, D, D]
        out = total / len(positions)
        return (0.5 * (out + out.transpose(1, 2))).view(*lead, head_dim, head_dim)


@torch.inference_mode()
def collect(model, texts_ids: list[list[int]]) -> ModelStats:
    """Prefill each token list and gather KV blocks and query second moments (model: `LlamaModel`)."""
    from engine_adapter.reference.generate import prefill
    from engine_adapter.reference.model import apply_rope

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
    return ModelStats(blocks, moment / counted[0], value_heads, inv_freq=model.inv_freq.cpu(),
                      max_position=config.max_position_embeddings, tokens=counted[0],
                      texts=len(blocks))


@torch.inference_mode()
def row_sensitivity(model, texts_ids: list[list[int]], blocks: list[torch.Tensor], codec,
                    probe_tokens: int = 64, chunk_tokens: int = 256) -> torch.Tensor:
    """[L * 2] mean KL (nats) of the next-token distributions when only row (layer, k/v) goes through ``codec``.

    Per text (ids and its KV block from `collect`): the last ``probe_tokens`` tokens are the
    probe, the rest the context. The context KV is loaded exact, then one row at a time replaced
    by its codec round trip (chunks of ``chunk_tokens``, as the store cuts them), and the probe
    run on top; KL is against the probe's logits on the exact KV::

        |<------------- context: KV exact, row (l, kv) decoded ------------->|<-- probe -->|
    """
    n_layers = model.config.num_layers
    total = torch.zeros(n_layers, 2, dtype=torch.float64)
    used = 0
    for ids, block in zip(texts_ids, blocks):
        n_ctx = len(ids) - probe_tokens
        if n_ctx < chunk_tokens:
            continue
        exact = block[:, :, :, :n_ctx]
        decoded = torch.cat([codec_round_trip(codec, exact[:, :, :, s:s + chunk_tokens].contiguous())
                             for s in range(0, n_ctx, chunk_tokens)], dim=3)  # [L, 2, H, n_ctx, D]
        probe = torch.tensor(ids[n_ctx:], dtype=torch.long)
        kv = model.new_cache(len(ids) + 1)
        kv.load(exact, 0)
        ref = torch.log_softmax(model(probe, kv, n_ctx).double(), -1)  # [P, vocab]
        for layer in range(n_layers):
            for kind in range(2):
                kv.truncate(n_ctx)
                kv.write(layer, 0, *(decoded[layer, i] if i == kind else exact[layer, i] for i in range(2)))
                logp = torch.log_softmax(model(probe, kv, n_ctx).double(), -1)
                total[layer, kind] += (ref.exp() * (ref - logp)).sum(-1).mean()
                kv.write(layer, 0, exact[layer, 0], exact[layer, 1])
        used += 1
    if not used:
        raise ValueError(f"row_sensitivity needs a text longer than {chunk_tokens + probe_tokens} tokens")
    return (total / used).view(-1)


def codec_round_trip(codec, block: torch.Tensor) -> torch.Tensor:
    encoded = codec.encode(block)
    return codec.decode(encoded.payload, encoded.params, tuple(block.shape), block.dtype)


def sensitivity_scale(sensitivity: torch.Tensor, groups: int = 1, strength: float = 1.0,
                      limit: float = SENSITIVITY_LIMIT) -> tuple[float, ...]:
    """Per-row step factors for `Allocation.row_scale` from per-(layer, k/v) KL sensitivities [L * 2].

    The KL a row adds grows as step^2 (small errors), and its bits fall as log2(step); spending
    bits where they buy the most KL means step_b^2 proportional to 1 / sensitivity_b. Factors are
    normalised to geometric mean 1, raised to ``strength`` (0 = uniform) and clipped to
    [1/limit, limit]; each factor is repeated for the row's ``groups`` head groups.
    """
    if not limit >= 1:
        raise ValueError(f"sensitivity limit must be >= 1 (factors are clipped to [1/limit, limit]), got {limit}")
    s = sensitivity.double().clamp_min(float(sensitivity.max()) * 1e-6)
    factor = (s.log().mean() - s.log()).mul(0.5 * strength).exp().clamp(1 / limit, limit)  # [L * 2]
    return tuple(float(f) for f in factor.repeat_interleave(groups))


def calibrate_model(model, texts_ids: list[list[int]], allocation: Allocation = DEFAULT_ALLOCATION,
                    groups: int = 1, source: str = "", pre_rope: bool = True, sensitivity: bool = False,
                    sensitivity_limit: float = SENSITIVITY_LIMIT, layer_group: int = 1) -> Calibration:
    """`collect` then `calibrate` with the query / o_proj metric; keys before RoPE unless ``pre_rope=False``.

    ``sensitivity``: per-row step factors from `row_sensitivity`, measured under the calibration at
    ``SENSITIVITY_ALLOCATION`` (relative sensitivities hold at any step to first order), clipped to
    [1/sensitivity_limit, sensitivity_limit].
    ``layer_group``: rows over that many layers (`Calibration.layer_group`); the sensitivities are
    measured per layer as above and folded into the grouped bases.
    """
    stats = collect(model, texts_ids)
    source = source or f"{stats.texts} texts, {stats.tokens} tokens"
    metric = stats.metric(groups, pre_rope=pre_rope)

    def make(allocation: Allocation, layer_group: int = 1) -> Calibration:
        return calibrate(stats.blocks, allocation, groups=groups, metric=metric, source=source,
                         rope_inv_freq=stats.inv_freq if pre_rope else None,
                         max_position=stats.max_position if pre_rope else 0, layer_group=layer_group)

    if sensitivity:
        from compression.transform import TransformCodec

        reference = make(dataclasses.replace(SENSITIVITY_ALLOCATION, sink_tokens=allocation.sink_tokens))
        rows = row_sensitivity(model, texts_ids, stats.blocks, TransformCodec(reference))
        allocation = dataclasses.replace(allocation, row_scale=sensitivity_scale(rows, groups=groups,
                                                                                 limit=sensitivity_limit))
    return make(allocation, layer_group)


# -- kvstore calibrate -------------------------------------------------------------------------------------


def check_layer_group_early(layer_group: int, config, groups: int, tokens: int) -> None:
    """ValueError naming ``--layer-group`` before any work, where the grouped calibration would fail
    after the forwards: not a divisor of the model's layers, rows too wide, or too few tokens."""
    from compression.calibration import check_layer_group

    if not (groups >= 1 and config.num_kv_heads % groups == 0):
        raise ValueError(f"--groups {groups}: must divide the model's {config.num_kv_heads} kv heads")
    try:
        check_layer_group(layer_group, config.num_layers, config.num_kv_heads // groups * config.head_dim)
    except ValueError as exc:
        raise ValueError(f"--layer-group {layer_group}: {exc}") from None
    channels = layer_group * config.num_kv_heads // groups * config.head_dim
    if layer_group > 1 and tokens < 2 * channels:
        raise ValueError(f"--layer-group {layer_group}: rows of {channels} channels need at least {2 * channels} "
                         f"tokens of text, got {tokens}; give more text (--max-tokens) or group fewer layers")


def run(args: argparse.Namespace) -> int:
    """`kvstore calibrate`: calibrate on files, save to the calibration directory, put into the daemon."""
    from compression import calibration_store
    from engine_adapter.reference.loader import find_smollm2_gguf, load_gguf

    model, tokenizer = load_gguf(args.gguf or find_smollm2_gguf(), dtype=torch.float32)
    texts = [tokenizer.encode(path.read_text())[: args.max_tokens] for path in args.files]
    sinks = args.sink_tokens if args.sink_tokens is not None else (0 if args.post_rope else DEFAULT_ALLOCATION.sink_tokens)
    check_layer_group_early(args.layer_group, model.config, args.groups, sum(max(0, len(t) - sinks) for t in texts))
    allocation = dataclasses.replace(
        DEFAULT_ALLOCATION, sink_tokens=sinks,
        key_step=DEFAULT_ALLOCATION.key_step if args.key_step is None else args.key_step,
        value_step=DEFAULT_ALLOCATION.value_step if args.value_step is None else args.value_step)
    calibration = calibrate_model(model, texts, allocation, groups=args.groups,
                                  source=f"{len(texts)} files, {sum(map(len, texts))} tokens",
                                  pre_rope=not args.post_rope, sensitivity=args.sensitivity,
                                  sensitivity_limit=SENSITIVITY_LIMIT if args.sensitivity_limit is None
                                  else args.sensitivity_limit, layer_group=args.layer_group)
    path = calibration_store.save(calibration)
    print(f"calibration {calibration.id}\n  file {path}\n  codec spec: kvtc@{calibration.id[:12]}  "
          f"(e.g. kvstore serve --disk-codec kvtc@{calibration.id[:12]})")
    if args.no_put:
        return 0
    try:
        from engine_adapter.client.kvstore_client import KVStoreClient

        with KVStoreClient(args.address) as client:
            client.wait_ready(timeout=2.0)
            stored = calibration_store.put_calibration(client, calibration)
        print(f"  stored in the daemon ({stored} block; it is written down to disk/S3 like any block)")
    except Exception as exc:  # the file is the calibration; the daemon copy is for other hosts
        print(f"  not stored in the daemon ({type(exc).__name__}: {exc}); the file above still works on this host",
              file=sys.stderr)
    return 0
