"""The native page writer (`kernels/page_copy.c`) against its torch reference and the layout path.

Bit for bit: a page copy moves bytes, so every case compares with ``torch.equal`` on random
irregular inputs (odd head dims and token counts, runs starting mid-page and ending mid-tile,
scattered page tables, strided block views), for every named layout and 2- and 4-byte dtypes.
The vLLM-side tests (the real `cpu_attn_reshape_and_cache` op against this writer) are in
tests/test_vllm.py.
"""

from __future__ import annotations

import pytest
import torch

from engine_adapter.vllm.layout import PagedKV, PagedSpan, PageLayout
from kernels.page_copy import PageWriter, native_library, page_runs
from kernels.page_copy_ref import PLANE_LAYOUTS, plane_offsets, write_pages_ref


def random_caches(layers: int, pages: int, heads: int, page_tokens: int, head_dim: int, dtype: torch.dtype,
                  seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(pages, heads, page_tokens, 2 * head_dim, generator=generator).to(dtype) for _ in range(layers)]


def scattered_slots(tokens: int, pages: int, page_tokens: int, offset: int, seed: int) -> torch.Tensor:
    """Slots of `tokens` consecutive tokens from row `offset` of a random page table."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(pages, generator=generator)
    position = torch.arange(tokens) + offset
    return table[position // page_tokens] * page_tokens + position % page_tokens


def test_the_library_builds_here():
    # CI and every supported host have a C compiler; without one the connector falls back (logged)
    assert native_library() is not None


@pytest.mark.parametrize("layout", PLANE_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_tokens,head_dim,tokens,offset", [
    (16, 24, 37, 5),     # a run ending mid-tile, head_dim a multiple of 8
    (128, 64, 300, 50),  # vLLM's CPU page and SmolLM2's head size, a mid-page start
    (13, 10, 61, 12),    # nothing a multiple of 8
    (32, 8, 1, 31),      # one token, in the last row of a page
])
def test_native_writer_matches_the_reference(layout, dtype, page_tokens, head_dim, tokens, offset):
    if layout == "amx" and (page_tokens % 16 or head_dim % 16):
        pytest.skip("the amx layout holds page_tokens and head_dim multiples of 16 only (tested below)")
    check_against_reference(layout, dtype, page_tokens, head_dim, tokens, offset)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_tokens,head_dim,tokens,offset", [
    (32, 64, 77, 3),     # odd start row (a lone V row first), mid-tile ends, runs across 16-row tiles
    (128, 64, 300, 50),  # vLLM's CPU page and SmolLM2's head size
    (48, 16, 50, 17),    # one 16-dim V block, an odd start and an odd length
    (16, 32, 2, 15),     # two tokens over a page edge: two runs of one row each
])
def test_native_amx_writer_matches_the_reference(dtype, page_tokens, head_dim, tokens, offset):
    check_against_reference("amx", dtype, page_tokens, head_dim, tokens, offset)


def check_against_reference(layout, dtype, page_tokens, head_dim, tokens, offset):
    layers, heads, pages = 3, 3, 3 + (offset + tokens) // page_tokens
    caches = random_caches(layers, pages, heads, page_tokens, head_dim, dtype, seed=tokens)
    expected = [cache.clone() for cache in caches]
    generator = torch.Generator().manual_seed(offset)
    source = torch.randn(layers, 2, heads, tokens + 9, head_dim, generator=generator).to(dtype)
    block = source[:, :, :, 4 : 4 + tokens]  # a strided view, as an arena block cut to a piece is
    slots = scattered_slots(tokens, pages, page_tokens, offset, seed=tokens + offset)
    PageWriter(caches, layout, threads=2).write(block, slots)
    write_pages_ref(expected, layout, block, slots)
    assert all(torch.equal(got, want) for got, want in zip(caches, expected))


def test_slots_out_of_order_and_single_layers():
    layers, heads, page_tokens, head_dim, pages = 4, 2, 16, 16, 6
    caches = random_caches(layers, pages, heads, page_tokens, head_dim, torch.bfloat16, seed=1)
    expected = [cache.clone() for cache in caches]
    block = torch.randn(layers, 2, heads, 40, head_dim).to(torch.bfloat16)
    slots = torch.randperm(pages * page_tokens)[:40]  # no runs at all: every token its own
    writer = PageWriter(caches, "kt_halves", threads=3)
    for layer in (2, 0, 3, 1):  # layer-wise, as a layer-wise load writes them
        writer.write(block[layer : layer + 1], slots, first_layer=layer)
    write_pages_ref(expected, "kt_halves", block, slots)
    assert all(torch.equal(got, want) for got, want in zip(caches, expected))


def test_page_runs():
    page_tokens = 4
    slots = torch.tensor([5, 6, 7, 8, 9, 20, 2, 3])  # 5..7 | 8..9 (a new page) | 20 | 2..3
    assert page_runs(slots, page_tokens).tolist() == [[0, 1, 1, 3], [3, 2, 0, 2], [5, 5, 0, 1], [6, 0, 2, 2]]
    assert page_runs(torch.tensor([], dtype=torch.int64), page_tokens).shape == (0, 4)


def test_bad_inputs_are_refused_before_the_kernel_runs():
    caches = random_caches(2, 4, 2, 8, 8, torch.bfloat16, seed=2)
    writer = PageWriter(caches, "halves")
    block = torch.randn(2, 2, 2, 5, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="outside"):
        writer.write(block, torch.tensor([0, 1, 2, 3, 32]))  # 4 pages x 8 rows = 32 slots
    with pytest.raises(ValueError, match="outside"):
        writer.write(block, torch.tensor([-1, 0, 1, 2, 3]))
    with pytest.raises(ValueError, match="slots for a block"):
        writer.write(block, torch.arange(4))
    with pytest.raises(ValueError, match="bfloat16"):
        writer.write(block.float(), torch.arange(5))
    with pytest.raises(ValueError, match="contiguous"):
        writer.write(torch.randn(2, 2, 2, 8, 5).to(torch.bfloat16).transpose(3, 4), torch.arange(5))
    with pytest.raises(ValueError, match="does not fit"):
        writer.write(block, torch.arange(5), first_layer=1)
    with pytest.raises(ValueError, match="unknown page layout"):
        PageWriter(caches, "tiled")
    with pytest.raises(ValueError, match="differ"):
        PageWriter([caches[0], caches[1].float()], "halves")
    with pytest.raises(ValueError, match="contiguous CPU"):
        PageWriter([caches[0].transpose(2, 3)], "halves")
    with pytest.raises(ValueError, match="multiples of 16"):
        PageWriter(random_caches(1, 2, 2, 24, 16, torch.bfloat16, seed=4), "amx")


@pytest.mark.parametrize("name", PLANE_LAYOUTS)
def test_layouts_are_named_and_the_paged_kv_paths_agree(name):
    """PagedKV with the native writer writes what the per-element layout path writes, including
    kernel pages smaller than the scheduler's page; a layout is recognised by name."""
    layers, heads, head_dim, page_tokens, kernel_tokens = 3, 2, 16, 64, 32
    layout = PageLayout.named(name, kernel_tokens, head_dim)
    assert layout.name() == name
    base = random_caches(layers, 40, heads, kernel_tokens, head_dim, torch.bfloat16, seed=3)
    span = PagedSpan((17, 3, 9, 8), 30, 150)
    block = torch.randn(layers, 2, heads, 150, head_dim).to(torch.bfloat16)
    reference, native = [c.clone() for c in base], [c.clone() for c in base]
    PagedKV(reference, layout, heads, page_tokens).scatter(block, span)
    paged = PagedKV(native, layout, heads, page_tokens, native=PageWriter(native, name))
    paged.scatter(block, span)
    assert all(torch.equal(a, b) for a, b in zip(reference, native))
    assert torch.equal(paged.gather(span), block)


def test_an_unnamed_layout_has_no_name():
    offsets = plane_offsets("halves", 8, 4)
    swapped = torch.stack((offsets[1], offsets[0]))  # V first: a real layout, but not a named one
    assert PageLayout.from_offsets(swapped).name() is None
