"""Selective recompute: a prefill that recomputes only some rows on top of an assembled cache.

Layer by layer (check = the selector's check layer; budget = round(ratio * chunk tokens))::

    layers < check   every token, in full; fresh K/V overwrite the cache (exact from here down)
    layer  check     fresh q, k, v for every token; the selector scores them against the cached
                     K/V and keeps <= budget chunk tokens; fresh K/V are written for every token
                     (computed anyway); attention and MLP run for the kept rows + query rows only
    layers > check   q, k, v for the kept rows only; their K/V are written into the cache at their
                     positions; they attend to the whole cache under a row-exact causal mask

budget 0 skips the check (naive reuse: only the query is computed). A selector without a check
layer (sinks, stale_attention) chooses before layer 0, and every layer is partial. A ``query_pass``
selector (stale_attention) first sees the query computed over the assembled cache as it is
(`stale_query_attention`: the query and glue rows through every layer, naive reuse's compute) and
chooses from the attention it paid each chunk token. Glue tokens (a separator between
chunks, `blend.assemble`) are computed on every layer, like the query, and are no part of the budget.

``kv_only``: for an engine that computes the query itself (vLLM through the connector), only the
chunk KV is wanted. Query rows then leave after the check layer (the selector needed their fresh q
there), the last layer writes K/V without attention or MLP, and no logits are made; budget 0 is
no compute at all. After a query pass the query rows' K/V on later layers are the pass's (scratch:
the engine computes the query itself). The chunk rows' KV is the same either way, to float32
rounding: they precede the query, so under the causal mask they never read it (a BLAS may block a
product of fewer rows differently: on an AVX2 host, 10 against 19 rows differed by 2e-7 relative).

The mask: kept rows are not contiguous, so the usual bottom-right causal mask (row i sees the
first S-R+i keys) is wrong for them; row i sees keys 0..rows[i] exactly::

    rows = [2, 5, 6]          keys 0 1 2 3 4 5 6 7
    row 0 (position 2)             x x x . . . . .
    row 1 (position 5)             x x x x x x . .
    row 2 (position 6)             x x x x x x x .
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from blend.assemble import BlendLayout
from blend.select import (CheckLayerView, StaleReadView, TokenSelector, attention_probs, hidden_keys, kv_deviation,
                          row_blocks)
from blend.model import BlendCache, BlendModel
from kernels.query_probs import query_probs


def row_causal_mask(rows: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Boolean [R, num_keys], True where the query at position rows[i] may attend (keys <= rows[i])."""
    return torch.arange(num_keys, device=rows.device)[None, :] <= rows[:, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (boolean) as an additive attention mask: 0 where True, -inf elsewhere. Built once
    for the layers that share the rows (SDPA converts a boolean mask on every call, and takes the
    additive one faster: 4.1 against 4.8 ms for 330 rows x 1,900 keys in bf16 here)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


# Rows per attention call of a partial layer: a block of rows reads only the keys up to its last
# row, so the keys past it are never multiplied; smaller blocks skip more, each call costs ~0.1 ms.
ROWS_PER_BLOCK = 64


@dataclass(frozen=True)
class RowBlock:
    """Computed rows ``start .. stop-1`` (indices into the sorted rows), which read keys
    ``0 .. keys-1`` (keys = the block's last position + 1) under ``mask`` [stop-start, keys]
    (additive, row-exact)."""

    start: int
    stop: int
    keys: int
    mask: torch.Tensor


def row_blocks_of(rows: torch.Tensor, dtype: torch.dtype, rows_per_block: int = ROWS_PER_BLOCK) -> list[RowBlock]:
    """The attention calls of a partial layer over sorted ``rows`` [R]: blocks of about
    ``rows_per_block`` rows, each reading keys up to its own last row only::

        rows (positions)    3 9 14 | 120 121 122 | 700 ... 705
        block 0 reads keys  0 .. 14              (mask row-exact inside)
        block 1 reads keys  0 .. 122
        block 2 reads keys  0 .. 705

    Built once per set of rows (one host read of the block ends), shared by every layer that
    computes them. A full prefill's causal attention does half the work of every row reading every
    key; blocks bring the rows' attention close to that share."""
    count = rows.numel()
    pieces = max(1, math.ceil(count / rows_per_block))
    bounds = [count * i // pieces for i in range(pieces + 1)]
    ends = rows[torch.tensor(bounds[1:], device=rows.device) - 1].tolist() if count else []
    blocks = []
    for start, stop, end in zip(bounds, bounds[1:], ends):
        keys = int(end) + 1
        blocks.append(RowBlock(start, stop, keys, additive_mask(row_causal_mask(rows[start:stop], keys), dtype)))
    return blocks


class SdpaRows:
    """Row-exact attention of sorted ``rows`` over a cache, one SDPA call per `RowBlock` (each over
    the keys its rows may see only): any model, any device. A model with a faster kernel of its own
    for it answers `LlamaModel.row_attention` (vLLM's CPU attention: `engine_adapter.vllm.row_attention`)."""

    def __init__(self, rows: torch.Tensor, dtype: torch.dtype) -> None:
        self.blocks = row_blocks_of(rows, dtype)

    def __call__(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Per-head outputs [H, R, D] of queries ``q`` [H, R, D] over ``keys`` / ``values`` [KVH, S, D]
        (S: at least the last row's position + 1) on layer ``layer``."""
        gqa = q.shape[0] != keys.shape[0]
        heads = [F.scaled_dot_product_attention(q[None, :, b.start:b.stop], keys[None, :, :b.keys],
                                                values[None, :, :b.keys], attn_mask=b.mask, enable_gqa=gqa)[0]
                 for b in self.blocks]  # each [H, R', D]
        return heads[0] if len(heads) == 1 else torch.cat(heads, dim=1)


def row_attention(model: BlendModel, rows: torch.Tensor, total: int) -> Callable[..., torch.Tensor]:
    """The attention a partial layer computes its sorted ``rows`` with, planned once per row set:
    the model's own kernel where it has one, else `SdpaRows`."""
    own = model.row_attention(rows, total)
    return own if own is not None else SdpaRows(rows, model.dtype)


@dataclass
class BlendPrefill:
    """Result of one blended prefill."""

    logits: torch.Tensor                  # [vocab] float32, after the last query token
    selected: torch.Tensor                # chunk positions recomputed on the last layer (sorted)
    rows_per_layer: list[int] = field(default_factory=list)  # tokens computed on each layer
    query_pass_rows: int = 0              # rows a query pass computed before that ...
    query_pass_layers: int = 0            # ... on layers 0 .. query_pass_layers-1

    @property
    def token_layers(self) -> int:
        """Token-layers computed: sum of rows_per_layer, plus the query pass's (a full prefill is
        T * num_layers)."""
        return sum(self.rows_per_layer) + self.query_pass_rows * self.query_pass_layers


def _gather(rows: torch.Tensor, subset: torch.Tensor) -> torch.Tensor:
    """Indices into ``rows`` (sorted) of the positions in ``subset`` (sorted, contained in rows)."""
    return torch.searchsorted(rows, subset)


@torch.inference_mode()
def stale_query_attention(model: BlendModel, kv: BlendCache, layout: BlendLayout, token_ids: torch.Tensor,
                          cos_all: torch.Tensor, sin_all: torch.Tensor, layers: int | None = None) -> torch.Tensor:
    """[L', N] attention mass the query tokens put on each chunk token (N = layout.chunk_positions),
    per layer, when the query is computed over ``kv`` as assembled: the query and glue rows through
    layers 0 .. L'-1 (``layers``, at most the model's; None: every layer; glue has no cached KV),
    each reading the stale chunk KV. Writes those rows' K/V on those layers (the main pass writes
    them again where it computes them); the pass's last layer runs no attention output or MLP.
    ``cos_all``/``sin_all``: RoPE for 0..T-1.
    The attention probabilities are formed once (float32) and give both the mass and the rows'
    attention output (an SDPA call as well cost 2.3 ms a layer for 40 rows over 1,900 keys here),
    a block of rows at a time (`row_blocks`: memory bounded for any query length); for bfloat16 on
    a CPU with AVX512-BF16 by `kernels.query_probs` (the same float32 probabilities, the products
    two at a time in C), else by `attention_probs`."""
    device = model.device
    total = layout.total
    on_host = torch.cat((layout.glue_positions, layout.query_positions)).sort().values  # layout positions: CPU
    rows = on_host.to(device)
    is_query = torch.isin(rows, layout.query_positions.to(device))
    only_query = bool(is_query.all())  # no glue: every row's mass counts
    chunk_pos = layout.chunk_positions.to(device)
    h = model.embed(token_ids.to(device)[rows])
    cos, sin = cos_all[rows], sin_all[rows]  # [R, D] each, shared by every layer
    depth = len(model.layers) if layers is None else max(1, min(layers, len(model.layers)))
    mass = torch.empty(depth, chunk_pos.numel(), dtype=torch.float32, device=device)  # [L', N]
    blocks = row_blocks(rows.numel(), model.config.num_heads, total)
    # [R', T - first] each, for every layer: keys before a block's first row are visible to all of it
    hidden = [hidden_keys(rows[block], total, int(on_host[block][0])) for block in blocks]
    for layer in model.layers[:depth]:
        i = layer.index
        last = i == depth - 1
        q, k, v = layer.qkv(h, cos, sin)
        kv.keys[i].index_copy_(1, rows, k)  # the rows' K/V into the assembled cache
        kv.values[i].index_copy_(1, rows, v)
        keys, values = kv.read(i, total)
        heads, kv_heads = q.shape[0], keys.shape[0]
        if not last:
            values = values.float()  # [KVH, T, D]: GQA by grouping the query heads, no repeat
        layer_mass = torch.zeros(total, dtype=torch.float32, device=device)
        out = []
        for block, masked in zip(blocks, hidden):
            native = query_probs(q[:, block], keys, rows[block], None if only_query else is_query[block])
            if native is not None:  # bfloat16 on a CPU with AVX512-BF16: products, softmax and mass in C
                probs, block_mass = native
                layer_mass += block_mass
            else:
                probs = attention_probs(q[:, block], keys, rows[block], masked)  # [H, R', T]
                layer_mass += (probs if only_query else probs[:, is_query[block]]).sum((0, 1))
            if not last:
                grouped = probs.view(kv_heads, -1, total) @ values  # [KVH, G*R', D]
                out.append(grouped.view(heads, -1, values.shape[-1]))  # [H, R', D]
        mass[i] = layer_mass[chunk_pos]
        if not last:
            h = h + layer.output((out[0] if len(out) == 1 else torch.cat(out, dim=1)).to(h.dtype))
            h = h + layer.feed_forward(h)
    return mass


@torch.inference_mode()
def blend_prefill(model: BlendModel, kv: BlendCache, layout: BlendLayout, token_ids: torch.Tensor,
                  selector: TokenSelector, ratio: float, kv_only: bool = False) -> BlendPrefill:
    """Prefill ``token_ids`` [T] over ``kv``, which holds the assembled cached KV of every
    non-query segment. Writes recomputed K/V into ``kv`` and sets ``kv.length = T``.

    ``kv_only``: recompute the chunk rows' KV only (see the module doc); ``logits`` stays empty and
    the query's KV is written on layers up to the check layer at most."""
    total = layout.total
    if token_ids.shape != (total,):
        raise ValueError(f"token_ids must be [{total}] for this layout, got {tuple(token_ids.shape)}")
    assert 0.0 <= ratio <= 1.0, ratio  # checked where it was read (blend.controller.Ratio)
    if kv.capacity < total:
        kv.reserve(total)
    device = model.device
    chunk_pos = layout.chunk_positions.to(device)
    query_pos = layout.query_positions.to(device)
    budget = round(ratio * chunk_pos.numel())
    check = selector.check_layer if budget > 0 else None
    if check is not None and check >= len(model.layers):
        raise ValueError(f"check layer {check} is past the model's {len(model.layers)} layers")

    glue_pos = layout.glue_positions.to(device)  # no cached KV: each layer writes it before reading
    all_rows = torch.arange(total, device=device)
    # rows computed past the check layer besides the selected ones: glue, and the query unless kv_only
    tail = glue_pos if kv_only else torch.cat((glue_pos, query_pos))
    if kv_only and check is None and budget == 0 and not glue_pos.numel():
        kv.length = total  # naive reuse for an engine that computes the query: nothing to compute
        return BlendPrefill(logits=torch.empty(0), selected=chunk_pos[:0], rows_per_layer=[0] * len(model.layers))
    cos_all, sin_all = model.rope(all_rows)  # [T, D] each
    pass_rows = pass_layers = 0
    if check is None:  # choose before layer 0: sinks, stale_attention, or nothing (naive reuse)
        view = None
        if budget > 0 and selector.query_pass:
            mass = stale_query_attention(model, kv, layout, token_ids, cos_all, sin_all, selector.query_pass_layers)
            view = StaleReadView(layout, mass)
            pass_rows, pass_layers = glue_pos.numel() + query_pos.numel(), mass.shape[0]
        selected = selector.select(layout, view, budget).to(device) if budget > 0 else chunk_pos[:0]
        rows = torch.cat((selected, tail)).sort().values
    else:
        selected, rows = chunk_pos, all_rows
    h = model.embed(token_ids.to(device)[rows])  # [R, hidden]
    out = BlendPrefill(logits=torch.empty(0), selected=selected, query_pass_rows=pass_rows,
                       query_pass_layers=pass_layers)
    last = len(model.layers) - 1
    planned: torch.Tensor | None = None  # the rows `attention`, `cos` and `sin` were made for
    attention = None

    for layer in model.layers:
        i = layer.index
        if rows is not planned:  # rows are rebound only where they change (check layer, refine)
            planned, cos, sin = rows, cos_all[rows], sin_all[rows]
            attention = None if rows.numel() == total else row_attention(model, rows, total)
        q, k, v = layer.qkv(h, cos, sin)  # [H, R, D], [KVH, R, D], [KVH, R, D]
        full = rows.numel() == total
        if check is not None and i == check:
            cached_k, cached_v = kv.read(i, total)
            view = CheckLayerView(layout, q, k, v, cached_k, cached_v)
            selected = selector.select(layout, view, budget).to(device)
            kv.write(i, 0, k, v)  # every token's fresh K/V: exact inputs, computed anyway
            keep = torch.cat((selected, tail)).sort().values
            index = _gather(rows, keep)
            q, h, rows = q[:, index], h[index], keep
        elif full:
            kv.write(i, 0, k, v)
        else:
            step = i - check if check is not None else 0
            if check is not None and selector.wants_refine(step) and selected.numel():
                ctx = _gather(rows, selected)
                deviation = kv_deviation(k[:, ctx], v[:, ctx], kv.keys[i][:, selected], kv.values[i][:, selected],
                                         torch.arange(selected.numel(), device=device))
                narrowed = selector.refine(step, selected, deviation, budget).to(device)
            else:
                narrowed = selected
            kv.keys[i].index_copy_(1, rows, k)  # scatter the recomputed rows into the assembled cache
            kv.values[i].index_copy_(1, rows, v)
            if narrowed.numel() != selected.numel():
                keep = torch.cat((narrowed, tail)).sort().values
                index = _gather(rows, keep)
                q, h, rows, selected = q[:, index], h[index], keep, narrowed
        if kv_only and (i == last or rows.numel() == 0):
            # the last layer's output feeds only the logits; with no rows left, later layers keep
            # the cached KV
            out.rows_per_layer.extend([0] * (last + 1 - i))
            break
        out.rows_per_layer.append(rows.numel())  # rows through attention + MLP (the check layer's
        # q/k/v projections ran for every token)
        keys, values = kv.read(i, total)
        if rows.numel() == total:
            h = h + layer.attend(q, keys, values)
        else:
            if rows is not planned:  # narrowed on this layer: the attention below is for the new rows
                planned, cos, sin = rows, cos_all[rows], sin_all[rows]
                attention = row_attention(model, rows, total)
            h = h + layer.output(attention(i, q, keys, values))
        h = h + layer.feed_forward(h)

    kv.length = total
    if not kv_only:
        out.logits = model.final_logits(h[-1:])[0]
    out.selected = selected
    return out
