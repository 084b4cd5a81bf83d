"""The native page writer (`kernels/page_copy.c`) against its torch reference and the layout path.

Bit for bit: a page copy moves bytes, so every case compares with ``torch.equal`` on random
irregular inputs (odd head dims and token counts, runs starting mid-page and ending mid-tile,
scattered page tables, strided block views, caches off the vector alignment, pages and heads too
large for the kernel's scratch buffer), for every named layout, 2- and 4-byte dtypes, and both the
AVX2 paths and the ones a CPU without AVX2 takes (``simd=False``).
The vLLM-side tests (the real `cpu_attn_reshape_and_cache` op against this writer) are in
tests/test_vllm.py.
"""

from __future__ import annotations

import pytest
import torch

from engine_adapter.vllm.layout import PagedKV, PagedSpan, PageLayout
from kernels.page_copy import PageWriter, avx2_paths, native_library, page_runs
from kernels.page_copy_ref import PLANE_LAYOUTS, plane_offsets, read_pages_ref, write_pages_ref


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


def test_the_avx2_paths_run_where_the_cpu_has_avx2():
    """So that the tests below hold both paths to the reference on such a host."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags here")
    assert avx2_paths() == ("avx2" in flags)


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("layout", PLANE_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_tokens,head_dim,tokens,offset", [
    (16, 24, 37, 5),     # a run ending mid-tile, head_dim a multiple of 8
    (128, 64, 300, 50),  # vLLM's CPU page and SmolLM2's head size, a mid-page start
    (13, 10, 61, 12),    # nothing a multiple of 8
    (32, 8, 1, 31),      # one token, in the last row of a page
])
def test_native_writer_matches_the_reference(layout, dtype, page_tokens, head_dim, tokens, offset, simd):
    if layout == "amx" and (page_tokens % 16 or head_dim % 16):
        pytest.skip("the amx layout holds page_tokens and head_dim multiples of 16 only (tested below)")
    check_against_reference(layout, dtype, page_tokens, head_dim, tokens, offset, simd=simd)


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_tokens,head_dim,tokens,offset", [
    (32, 64, 77, 3),     # odd start row (a lone V row first), mid-tile ends, runs across 16-row tiles
    (128, 64, 300, 50),  # vLLM's CPU page and SmolLM2's head size
    (48, 16, 50, 17),    # one 16-dim V block, an odd start and an odd length
    (16, 32, 2, 15),     # two tokens over a page edge: two runs of one row each
    (64, 128, 128, 0),   # whole pages only: every stretch streamed
])
def test_native_amx_writer_matches_the_reference(dtype, page_tokens, head_dim, tokens, offset, simd):
    check_against_reference("amx", dtype, page_tokens, head_dim, tokens, offset, simd=simd)


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("layout", PLANE_LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_random_irregular_writes_match_the_reference(layout, seed, simd):
    """Random shapes, dtypes, page tables and several blocks' worth of runs: a block's tokens in
    pieces of random length at random rows, so runs start and end anywhere, some pages whole."""
    rng = torch.Generator().manual_seed(1000 + seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=rng))]

    if layout == "amx":  # multiples of 16 only
        page_tokens, head_dim = pick(16, 32, 48, 64, 128), pick(16, 32, 48, 64, 80, 128)
    else:
        page_tokens, head_dim = pick(7, 8, 13, 16, 29, 64), pick(6, 16, 24, 40, 64, 96, 128)
    dtype = pick(torch.bfloat16, torch.float16, torch.float32)
    layers, heads, pages, pad = pick(1, 2, 3), pick(1, 2, 3, 5), 12, pick(0, 0, 3, 8)
    caches = random_caches(layers, pages, heads, page_tokens, head_dim, dtype, seed=seed)
    expected = [cache.clone() for cache in caches]
    writer = PageWriter(caches, layout, threads=pick(1, 2), simd=simd)
    for _ in range(4):  # pieces: up to 3 pages of consecutive rows from a random row of a random page table
        tokens = int(torch.randint(1, 3 * page_tokens + 2, (1,), generator=rng))
        row = pick(0, 0, 1, page_tokens // 2, page_tokens - 1)
        slots = scattered_slots(tokens, pages, page_tokens, row, seed=int(torch.randint(1 << 30, (1,), generator=rng)))
        # rows of a token not contiguous with the next (pad) and a block cut out of a longer one
        source = torch.randn(layers, 2, heads, tokens + 5, head_dim + pad, generator=rng).to(dtype)
        block = source[:, :, :, 3 : 3 + tokens, :head_dim]
        writer.write(block, slots)
        write_pages_ref(expected, layout, block, slots)
    assert all(torch.equal(got, want) for got, want in zip(caches, expected))


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("layout", PLANE_LAYOUTS)
def test_caches_off_the_vector_alignment(layout, simd):
    """Caches whose memory starts 2 bytes past a 64-byte line: the streamed stores' edges go plainly."""
    layers, pages, heads, page_tokens, head_dim = 2, 5, 2, 32, 64
    storage = [torch.randn(pages * heads * page_tokens * 2 * head_dim + 1).to(torch.bfloat16) for _ in range(layers)]
    caches = [flat[1:].view(pages, heads, page_tokens, 2 * head_dim) for flat in storage]
    assert all(cache.data_ptr() % 32 == 2 for cache in caches)
    expected = [cache.clone() for cache in caches]
    block = torch.randn(layers, 2, heads, 70, head_dim).to(torch.bfloat16)
    slots = scattered_slots(70, pages, page_tokens, 0, seed=5)  # two whole pages and a part
    PageWriter(caches, layout, simd=simd).write(block, slots)
    write_pages_ref(expected, layout, block, slots)
    assert all(torch.equal(got, want) for got, want in zip(caches, expected))


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("layout,page_tokens,head_dim", [
    ("kt_halves", 2112, 8),  # a page whose K half holds fewer than 8 dims in scratch: plain transpose
    ("split", 4, 4200),      # a [K | V] row larger than scratch
    ("halves", 4, 8200),     # a K row larger than scratch, from rows not contiguous in the block
    ("amx", 16, 528),        # a 16-row K tile larger than scratch
])
def test_pages_and_heads_larger_than_the_scratch_buffer(layout, page_tokens, head_dim, simd):
    check_against_reference(layout, torch.float32, page_tokens, head_dim, 2 * page_tokens + 3, 1, simd=simd,
                            layers=1, heads=1, pad=8)


def check_against_reference(layout, dtype, page_tokens, head_dim, tokens, offset, simd=True, layers=3, heads=3,
                            pad=0):
    pages = 3 + (offset + tokens) // page_tokens
    caches = random_caches(layers, pages, heads, page_tokens, head_dim, dtype, seed=tokens)
    expected = [cache.clone() for cache in caches]
    generator = torch.Generator().manual_seed(offset)
    source = torch.randn(layers, 2, heads, tokens + 9, head_dim + pad, generator=generator).to(dtype)
    block = source[:, :, :, 4 : 4 + tokens, :head_dim]  # a strided view, as an arena block cut to a piece is
    slots = scattered_slots(tokens, pages, page_tokens, offset, seed=tokens + offset)
    PageWriter(caches, layout, threads=2, simd=simd).write(block, slots)
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


# -- reading pages back (a save's copy: PageWriter.read) --------------------------------------------

@pytest.mark.parametrize("layout", PLANE_LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_reading_pages_matches_the_reference_on_random_irregular_caches(layout, seed):
    """Random shapes, dtypes and slots (consecutive runs from random rows of a random page table,
    and slots in no order at all): the block read is the reference's, bit for bit, and is what a
    write of a random block to those slots put there."""
    rng = torch.Generator().manual_seed(2000 + seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=rng))]

    if layout == "amx":
        page_tokens, head_dim = pick(16, 32, 48, 128), pick(16, 32, 64, 80)
    else:
        page_tokens, head_dim = pick(7, 13, 16, 29, 128), pick(6, 24, 40, 64, 96)
    dtype = pick(torch.bfloat16, torch.float16, torch.float32)
    layers, heads, pages = pick(1, 2, 3), pick(1, 2, 3, 5), 12
    caches = random_caches(layers, pages, heads, page_tokens, head_dim, dtype, seed=seed)
    reader = PageWriter(caches, layout)
    tokens = int(torch.randint(1, 3 * page_tokens + 2, (1,), generator=rng))
    runs = scattered_slots(tokens, pages, page_tokens, pick(0, 1, page_tokens // 2, page_tokens - 1), seed)
    anywhere = torch.randperm(pages * page_tokens, generator=rng)[: int(torch.randint(1, 40, (1,), generator=rng))]
    for slots in (runs, anywhere):
        got = reader.read(slots)
        assert got.shape == (layers, 2, heads, slots.numel(), head_dim) and got.dtype == dtype
        assert torch.equal(got, read_pages_ref(caches, layout, slots))
    block = torch.randn(layers, 2, heads, runs.numel(), head_dim, generator=rng).to(dtype)
    reader.write(block, runs)
    assert torch.equal(reader.read(runs), block)


def test_reading_pages_refuses_slots_outside_the_caches():
    caches = random_caches(2, 4, 2, 16, 8, torch.bfloat16, seed=7)
    reader = PageWriter(caches, "kt_halves")
    for bad in (torch.tensor([0, 64]), torch.tensor([-1])):
        with pytest.raises(ValueError, match="outside the caches"):
            reader.read(bad)
    assert reader.read(torch.tensor([], dtype=torch.int64)).shape == (2, 2, 2, 0, 8)


def test_a_save_copies_the_same_block_with_and_without_the_native_reader():
    """PagedKV.copy_out: the native read (the connector's path) and the torch path (a plain copy
    permuted later) give one block, for spans starting mid-page over a scattered page table."""
    caches = random_caches(3, 10, 3, 16, 24, torch.bfloat16, seed=8)
    layout = PageLayout.named("kt_halves", 16, 24)
    native = PagedKV(caches, layout, 3, 32, native=PageWriter(caches, "kt_halves"))
    plain = PagedKV(caches, layout, 3, 32)
    for span in (PagedSpan((3, 1, 4), 5, 70), PagedSpan((2,), 0, 32), PagedSpan((0, 4), 31, 2)):
        block, none = native.copy_out(span)
        assert none is None
        assert torch.equal(native.block_of_pages(block, none), plain.block_of_pages(*plain.copy_out(span)))
        assert torch.equal(block, plain.gather(span))
