"""The blend's row-exact attention on vLLM's own CPU attention kernel.

A partial layer of the blend (`blend.recompute`) computes a few hundred scattered rows of a prompt,
each over the keys up to its own position. vLLM's CPU kernel (``cpu_attention_with_kv_cache``)
computes a batch of requests, each a run of consecutive query positions ending its own sequence,
causally over paged keys. So the rows, cut into runs of consecutive positions, are requests that
share one set of pages holding the layer's whole cache::

    rows (positions)   3 4 5 | 9 | 14 15          the blend's rows, sorted
    requests           seq_len 6, 3 queries | seq_len 10, 1 query | seq_len 16, 2 queries
    block table        every request: pages 0 .. n-1 of one scratch cache (the layer's keys 0 .. total-1)

Each row then reads exactly the keys up to its position, as vLLM's own prefill reads them, at
that kernel's speed: on a 2-core AVX-512 host, 7-8 ms a layer for ~280 rows of a 1,900-token
prompt against 10-12 ms for the SDPA calls over row blocks (`blend.recompute.SdpaRows`; vLLM's
whole causal prefill of the layer: 27-31 ms). The scratch cache is refilled from the blend's own
cache on every layer (vLLM's own cache-write op, `layout.cpu_cache_write`; ~0.1-0.3 ms), so the blend's
cache stays the one truth and vLLM's pages are not touched before the blend is done.

Only for vLLM's CPU backend, with what its kernel takes here: no sliding window, ALiBi, soft cap,
sinks or quantized KV, and SDPA's scale. Other backends (CUDA's) keep the SDPA calls, and so does a
blend whose kernel raised (`model_view.KernelRows`).
"""

from __future__ import annotations

import torch
from torch import nn

REQUESTS_PER_CALL = 256  # runs per kernel call: bounds the block table at 256 x pages (int32)


NO_ISA_YET = "the CPU backend chose no ISA yet"  # vLLM sets it when it builds its metadata: asked again later


def row_attention_problem(attention: nn.Module, head_dim: int) -> str | None:
    """Why vLLM's attention layer ``attention`` cannot lend its kernel to the blend's rows of a model
    with ``head_dim``-wide heads, or None."""
    impl = getattr(attention, "impl", None)
    if type(impl).__name__ != "CPUAttentionBackendImpl":
        return f"backend {type(impl).__name__} (the row kernel is the CPU backend's)"
    if getattr(attention, "isa", None) is None:
        return NO_ISA_YET
    if impl.alibi_slopes is not None or impl.sliding_window not in (None, -1) or impl.logits_soft_cap or \
            getattr(impl, "sinks", None) is not None or impl.kv_cache_dtype != "auto":
        return "ALiBi, a sliding window, a soft cap, sinks or a quantized KV cache"
    if abs(impl.scale * head_dim ** 0.5 - 1) > 1e-6:  # every other attention of the blend is SDPA's 1/sqrt(D)
        return f"attention scale {impl.scale} is not 1/sqrt({head_dim})"
    cache = getattr(attention, "kv_cache", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.shape[3] != 2 * head_dim:
        return "no paged KV cache [blocks, kv heads, block size, 2 x head size]"
    return None


class PagedRows:
    """Row-exact attention of sorted ``rows`` (positions < ``total``) on vLLM's CPU kernel, planned
    once per row set and called per layer like `blend.recompute.SdpaRows`. ``attention``: any of
    vLLM's attention layers of the model (the ISA and block size are the ones vLLM runs with; every
    layer shares them)."""

    def __init__(self, attention: nn.Module, rows: torch.Tensor, total: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        from vllm import _custom_ops as ops
        from vllm import envs

        from engine_adapter.vllm.layout import cpu_cache_write

        self._ops = ops
        self.isa = attention.isa
        self._write = cpu_cache_write(self.isa)
        self.scale = attention.impl.scale
        split_kv = bool(envs.VLLM_CPU_ATTN_SPLIT_KV)  # as vLLM's own metadata builder plans its calls
        block = attention.kv_cache.shape[2]
        pages = -(-total // block)
        self.total = total
        device = rows.device
        # the layer's whole cache as vLLM pages it, refilled per layer: [pages, KVH, block, 2 x D];
        # zeros past the prompt, never written: the kernel reads a page whole (a NaN there, times 0, is NaN)
        self.plane = torch.zeros(pages, num_kv_heads, block, 2 * head_dim, dtype=dtype, device=device)
        self.key_cache, self.value_cache = self.plane.view(pages, num_kv_heads, 2 * block, head_dim).chunk(2, dim=2)
        self.slots = torch.arange(total, dtype=torch.int64, device=device)
        count = rows.numel()
        cuts = torch.nonzero(rows[1:] != rows[:-1] + 1).flatten() + 1  # where a run of positions breaks
        starts = torch.cat((torch.zeros(1, dtype=torch.long, device=device), cuts))[: count]  # no rows: no run
        ends = torch.cat((cuts, torch.full((1,), count, dtype=torch.long, device=device)))[: count]
        seq_lens = (rows[ends - 1] + 1).to(torch.int32)
        runs = starts.numel()
        self.table = torch.arange(pages, dtype=torch.int32, device=device)[None].expand(
            max(1, min(runs, REQUESTS_PER_CALL)), pages).contiguous()
        self.calls = []  # (first row, last row + 1, query_start_loc, seq_lens, scheduler metadata)
        for first in range(0, runs, REQUESTS_PER_CALL):
            last = min(runs, first + REQUESTS_PER_CALL)
            row0, row1 = int(starts[first]), int(ends[last - 1])
            query_start = (torch.cat((starts[first:last], ends[last - 1:last])) - row0).to(torch.int32)
            lens = seq_lens[first:last].contiguous()
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=last - first, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                seq_lens=lens, dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1,
                isa=self.isa, enable_kv_split=split_kv)
            self.calls.append((row0, row1, query_start, lens, meta))
        self.out = torch.empty(count, num_heads, head_dim, dtype=dtype, device=device)

    def __call__(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Per-head outputs [H, R, D] (a view of a buffer reused by the next call) of ``q`` [H, R, D]
        over ``keys`` / ``values`` [KVH, S >= total, D]."""
        ops = self._ops
        self._write(keys[:, :self.total].transpose(0, 1), values[:, :self.total].transpose(0, 1), self.plane, self.slots)
        query = q.transpose(0, 1).contiguous()  # [R, H, D]
        for row0, row1, query_start, lens, meta in self.calls:
            ops.cpu_attention_with_kv_cache(
                query=query[row0:row1], key_cache=self.key_cache, value_cache=self.value_cache,
                output=self.out[row0:row1], query_start_loc=query_start, seq_lens=lens, scale=self.scale, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=self.table[: query_start.numel() - 1], softcap=0.0,
                scheduler_metadata=meta, s_aux=None)
        return self.out.transpose(0, 1)
