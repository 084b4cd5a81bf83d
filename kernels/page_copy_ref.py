"""Torch reference for `kernels/page_copy.c`: a block's tokens written into paged KV caches.

A paged cache layer is ``[pages, kv_heads, page_tokens, 2 * head_dim]``. Each (page, head) plane
of ``2 * N * D`` elements (N = page_tokens, D = head_dim) places K and V by a named layout
(:data:`PLANE_LAYOUTS`); :func:`plane_offsets` is the one statement of each. :func:`write_pages_ref`
has the signature of :meth:`kernels.page_copy.PageWriter.write` and :func:`read_pages_ref` that of
:meth:`~kernels.page_copy.PageWriter.read`; they are what the tests hold the kernel to, bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import torch

PLANE_LAYOUTS = ("kt_halves", "halves", "split", "amx")


def plane_offsets(layout: str, page_tokens: int, head_dim: int) -> torch.Tensor:
    """Flat offset in the plane of K and V (kind 0, 1) of token row r, dim d: int64 [2, N, D].

        kt_halves   K as [D][N] (transposed), then V as [N][D]   vLLM CPU_ATTN, ISA "vec"
        halves      K as [N][D], then V as [N][D]
        split       row r = [K(D) | V(D)]                        FLASH_ATTN / TRITON
        amx         K in tiles of 16 rows, each [D/2][16][2]       vLLM CPU_ATTN, ISA "amx" (bf16)
                    (pairs of dims per row, AMX's VNNI form of K^T);
                    then V in blocks of 16 dims, each [N/2][16][2]
                    (pairs of rows per dim, VNNI form of V)

    ``amx`` needs page_tokens and head_dim multiples of 16 (vLLM uses it at multiples of 32) and
    raises ValueError otherwise, as it does for an unknown name.
    """
    n, d = page_tokens, head_dim
    row = torch.arange(n, dtype=torch.int64).view(-1, 1)  # [N, 1]
    dim = torch.arange(d, dtype=torch.int64).view(1, -1)  # [1, D]
    if layout == "kt_halves":
        key, value = dim * n + row, n * d + row * d + dim
    elif layout == "halves":
        key, value = row * d + dim, n * d + row * d + dim
    elif layout == "split":
        key, value = row * 2 * d + dim, row * 2 * d + d + dim
    elif layout == "amx":
        if n % 16 or d % 16:
            raise ValueError(f"the amx page layout needs page_tokens and head_dim multiples of 16, got {n}, {d}")
        key = (row // 16) * 16 * d + (dim // 2) * 32 + (row % 16) * 2 + dim % 2
        value = n * d + (dim // 16) * 16 * n + (row // 2) * 32 + (dim % 16) * 2 + row % 2
    else:
        raise ValueError(f"unknown page layout {layout!r}; known: {', '.join(PLANE_LAYOUTS)}")
    return torch.stack((key.expand(n, d), value.expand(n, d)))


def write_pages_ref(caches: Sequence[torch.Tensor], layout: str, block: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``block`` [layers, 2, kv_heads, T, head_dim] into ``caches`` (one per layer); token i
    goes to slot ``slots[i]`` = page * page_tokens + row."""
    pages, heads, page_tokens, width = caches[0].shape
    offsets = plane_offsets(layout, page_tokens, width // 2).to(caches[0].device)
    slots = slots.to(caches[0].device)
    page, row = slots // page_tokens, slots % page_tokens  # [T]
    head = torch.arange(heads, device=caches[0].device)
    for cache, layer in zip(caches, block):
        flat = cache.view(pages, heads, page_tokens * width)
        for kind in (0, 1):
            # [T, 1, 1], [1, H, 1], [T, 1, D] -> [T, H, D]
            flat[page.view(-1, 1, 1), head.view(1, -1, 1), offsets[kind][row].unsqueeze(1)] = (
                layer[kind].transpose(0, 1).to(cache.dtype))


def read_pages_ref(caches: Sequence[torch.Tensor], layout: str, slots: torch.Tensor) -> torch.Tensor:
    """The tokens at ``slots`` (page * page_tokens + row) of every layer of ``caches``, as a block
    [layers, 2, kv_heads, T, head_dim]: what `write_pages_ref` wrote there."""
    pages, heads, page_tokens, width = caches[0].shape
    offsets = plane_offsets(layout, page_tokens, width // 2).to(caches[0].device)
    slots = slots.to(caches[0].device)
    page, row = slots // page_tokens, slots % page_tokens  # [T]
    head = torch.arange(heads, device=caches[0].device)
    return torch.stack([
        torch.stack([cache.view(pages, heads, page_tokens * width)[  # [T, H, D] -> [H, T, D]
            page.view(-1, 1, 1), head.view(1, -1, 1), offsets[kind][row].unsqueeze(1)].transpose(0, 1)
            for kind in (0, 1)])
        for cache in caches])
