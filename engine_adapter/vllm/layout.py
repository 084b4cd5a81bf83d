"""vLLM's paged KV cache <-> kvstore blocks, in pure torch (no vLLM import).

vLLM keeps one tensor per attention layer, cut into fixed-size pages ("blocks" in vLLM's words;
here *pages*, to keep *block* for kvstore's one-chunk-of-KV). vLLM 0.32 gives every backend the
same logical per-layer shape ``[num_pages, kv_heads, page_tokens, 2 * head_dim]``; each backend
places a token's K and V inside a (page, head) plane ``[page_tokens, 2 * head_dim]`` its own way:

    split  (FLASH_ATTN, TRITON)  row r is token r: K in columns 0..D-1, V in D..2D-1
    cpu    (CPU_ATTN)            the plane's memory is two halves, K then V, each packed by the
                                 kernel of the CPU's ISA (vec, vec16, amx, neon ...), e.g. keys
                                 transposed or interleaved for the SIMD width

A :class:`PageLayout` is that placement as two index tables: for K (kind 0) and V (kind 1), the
plane row and column of (token row r, dim d). ``split`` is written down; a CPU layout is measured
by :func:`measure_page_layout`, which runs the backend's own cache-write op on numbered values.

A kvstore block is ``[layers, 2, kv_heads, chunk_tokens, head_dim]`` (K after RoPE, as vLLM stores
it). One 256-token chunk spans several pages, and need not start at a page boundary::

    prompt tokens   0 ........ 255 | 256 ....... 511 | 512 ...
    kvstore chunks  |--- chunk 0 ---|--- chunk 1 ----|
    vLLM pages      |p7 |p2 |p9 |p4 |p1 |p3 |p8 |p6 |        (page_tokens = 64; ids from the page table)

A :class:`PagedSpan` names a run of consecutive tokens by the pages that hold them: token i of the
span sits in page ``page_ids[(offset + i) // page_tokens]`` at row ``(offset + i) % page_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from kernels.page_copy_ref import PLANE_LAYOUTS, plane_offsets

if TYPE_CHECKING:
    from kernels.page_copy import PageWriter


@dataclass(frozen=True)
class PagedSpan:
    """``tokens`` consecutive tokens starting at row ``offset`` of ``page_ids[0]``."""

    page_ids: tuple[int, ...]
    offset: int
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.offset < 0:
            raise ValueError(f"PagedSpan needs tokens >= 0 and offset >= 0, got {self.tokens}, {self.offset}")

    @classmethod
    def of(cls, page_ids: Sequence[int], page_tokens: int, start: int, end: int) -> "PagedSpan":
        """The span of tokens start..end-1 of a sequence whose page table is ``page_ids``."""
        if not 0 <= start <= end:
            raise ValueError(f"bad token range {start}..{end}")
        first, last = start // page_tokens, (end + page_tokens - 1) // page_tokens
        if last > len(page_ids):
            raise ValueError(f"tokens {start}..{end} need {last} pages; the page table has {len(page_ids)}")
        return cls(tuple(int(p) for p in page_ids[first:last]), start - first * page_tokens, end - start)

    def rows(self, page_tokens: int, kernel_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel page, row) of each token, as two int64 tensors [tokens].

        The cache tensor may be cut into kernel pages smaller than the scheduler's pages: scheduler
        page p is then kernel pages p*k .. p*k+k-1, k = page_tokens // kernel_tokens.
        """
        position = torch.arange(self.tokens, dtype=torch.int64) + self.offset  # [T], from page_ids[0]'s start
        pages = torch.tensor(self.page_ids, dtype=torch.int64)[position // page_tokens]
        within = position % page_tokens
        return pages * (page_tokens // kernel_tokens) + within // kernel_tokens, within % kernel_tokens


@dataclass(frozen=True)
class PageLayout:
    """Where K and V of token row r, dim d sit in a (page, head) plane [page_tokens, 2 * head_dim]."""

    plane_rows: torch.Tensor  # [2, page_tokens, head_dim] int64; kind 0 = K, 1 = V
    plane_cols: torch.Tensor  # [2, page_tokens, head_dim] int64

    @property
    def page_tokens(self) -> int:
        return self.plane_rows.shape[1]

    @property
    def head_dim(self) -> int:
        return self.plane_rows.shape[2]

    @classmethod
    def from_offsets(cls, offsets: torch.Tensor) -> "PageLayout":
        """From flat offsets [2, page_tokens, head_dim] into the plane's memory (row-major)."""
        _, page_tokens, head_dim = offsets.shape
        flat = offsets.to(torch.int64)
        if sorted(flat.flatten().tolist()) != list(range(2 * page_tokens * head_dim)):
            raise ValueError("a page layout must place every K and V element exactly once")
        return cls(flat // (2 * head_dim), flat % (2 * head_dim))

    @classmethod
    def named(cls, name: str, page_tokens: int, head_dim: int) -> "PageLayout":
        """One of `kernels/page_copy_ref.py`'s named plane layouts (``split``: FLASH_ATTN / TRITON,
        token row r is [K | V]; ``halves``: K rows, then V rows; ``kt_halves``: CPU ``vec``; ``amx``: CPU ``amx``)."""
        return cls.from_offsets(plane_offsets(name, page_tokens, head_dim))

    @classmethod
    def split(cls, page_tokens: int, head_dim: int) -> "PageLayout":
        return cls.named("split", page_tokens, head_dim)

    @classmethod
    def halves(cls, page_tokens: int, head_dim: int) -> "PageLayout":
        return cls.named("halves", page_tokens, head_dim)

    def name(self) -> str | None:
        """The named layout this one is (the native page writer knows those), or None."""
        offsets = self.plane_rows * (2 * self.head_dim) + self.plane_cols
        for name in PLANE_LAYOUTS:
            try:
                named = plane_offsets(name, self.page_tokens, self.head_dim)
            except ValueError:  # a layout that cannot hold this page shape
                continue
            if torch.equal(offsets, named):
                return name
        return None


# (key [T, H, D], value [T, H, D], layer cache [pages, H, page_tokens, 2D] to write, slots [T]) -> None;
# slot = kernel page * page_tokens + row. key and value may be strided views.
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def split_cache_write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The :meth:`PageLayout.split` placement as a :data:`CacheWrite`: one indexed copy per K and V,
    on the cache's device (FLASH_ATTN / TRITON pages on CUDA; the reference for any ``split`` cache)."""
    page_tokens, d = cache.shape[2], key.shape[-1]
    pages, rows = slots // page_tokens, slots % page_tokens
    cache[pages, :, rows, :d] = key.to(cache.dtype)  # advanced indices around a slice: [T, H, D]
    cache[pages, :, rows, d:] = value.to(cache.dtype)


def cpu_cache_write(isa: str):
    """vLLM's CPU cache-write op for ``isa`` in :func:`measure_page_layout`'s signature."""
    from vllm import _custom_ops as ops

    def write(key: torch.Tensor, value: torch.Tensor, plane: torch.Tensor, slots: torch.Tensor) -> None:
        pages, heads, page_tokens, _ = plane.shape
        key_cache, value_cache = plane.view(pages, heads, 2 * page_tokens, -1).chunk(2, dim=2)  # as CPU_ATTN does
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


def measure_page_layout(write: CacheWrite, num_kv_heads: int, page_tokens: int, head_dim: int,
                        dtype: torch.dtype) -> PageLayout:
    """Find a backend's page layout by letting its own cache-write op place numbered elements.

    Each K and V element gets a number (its canonical index, written in base-64 digits, one pass
    per digit, so every value is exact in bf16); after the passes, each memory position of the
    page says which element landed there.
    """
    count = 2 * page_tokens * head_dim  # elements of one (page, head) plane
    base = 64
    digits = 1
    while base**digits < count:
        digits += 1
    index = torch.arange(count).view(2, page_tokens, head_dim)  # canonical: [kind, row, dim]
    found = torch.zeros(num_kv_heads, count, dtype=torch.int64)
    slots = torch.arange(page_tokens, dtype=torch.int64)
    for digit in range(digits):
        plane = torch.zeros(1, num_kv_heads, page_tokens, 2 * head_dim, dtype=dtype)
        values = (index // base**digit % base + 1).to(dtype)  # 1..64: 0 marks a position never written
        key = values[0].unsqueeze(1).expand(page_tokens, num_kv_heads, head_dim).contiguous()  # [T, H, D]
        value = values[1].unsqueeze(1).expand(page_tokens, num_kv_heads, head_dim).contiguous()
        write(key, value, plane, slots)
        written = plane.reshape(num_kv_heads, count).to(torch.int64)  # [H, plane memory]
        if (written == 0).any() or (written > base).any():
            raise ValueError("the cache-write op did not place every element of the page once")
        found += (written - 1) * base**digit
    if not (found == found[0]).all():
        raise ValueError("the cache-write op places heads differently; no single page layout fits")
    offsets = torch.empty(count, dtype=torch.int64)
    offsets[found[0]] = torch.arange(count)  # element found[0][j] sits at memory position j
    return PageLayout.from_offsets(offsets.view(2, page_tokens, head_dim))


class PagedKV:
    """All layers' paged caches of one vLLM worker, and the block <-> page copies.

    A load's page writes take the fastest path given: the native page writer
    (`kernels/page_copy.py`, CPU caches of a named layout), else the backend's own cache-write op
    (``write``), else the layout's index tables, which are the reference the others are tested
    against. On the last path whole kernel pages of a span move as planes (one permuting copy per
    page and layer, through the layout's flat offsets); the rows of a partly covered page go
    element by element::

        span     |..rows..|=====page=====|=====page=====|..rows..|
                  per-element           whole planes           per-element
    """

    def __init__(self, layer_caches: Sequence[torch.Tensor], layout: PageLayout, num_kv_heads: int,
                 page_tokens: int, write: CacheWrite | None = None, native: "PageWriter | None" = None) -> None:
        if not layer_caches:
            raise ValueError("PagedKV needs at least one layer")
        kernel_tokens, head_dim = layout.page_tokens, layout.head_dim
        for cache in layer_caches:
            if cache.dim() != 4 or tuple(cache.shape[1:]) != (num_kv_heads, kernel_tokens, 2 * head_dim):
                raise ValueError(f"paged cache shape {tuple(cache.shape)} is not [pages, kv_heads={num_kv_heads}, "
                                 f"page_tokens={kernel_tokens}, 2*head_dim={2 * head_dim}]")
        if page_tokens % kernel_tokens:
            raise ValueError(f"scheduler page of {page_tokens} tokens is not a multiple of the cache's "
                             f"{kernel_tokens}-token kernel page")
        self.caches = list(layer_caches)
        self.layout = layout
        self.page_tokens = page_tokens
        self.write = write  # the backend's own cache-write op (one call per layer)
        self.native = native  # the native page writer (one call per block, all layers)
        device = self.caches[0].device
        self._plane_rows = layout.plane_rows.to(device)
        self._plane_cols = layout.plane_cols.to(device)
        # flat plane offset of each canonical element [2, N, D] -> [2ND], and its inverse
        self._plane_of = (layout.plane_rows * (2 * head_dim) + layout.plane_cols).flatten().to(device)
        self._canonical_of = torch.argsort(self._plane_of)
        self._page_rows = torch.arange(page_tokens, dtype=torch.int64)  # [page_tokens], for slots

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    def _pieces(self, span: PagedSpan) -> tuple[torch.Tensor, slice, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(whole kernel pages, their token slice, then kernel page, row, token index of the other tokens)."""
        page, row = span.rows(self.page_tokens, self.layout.page_tokens)
        n = self.layout.page_tokens
        starts = torch.nonzero(row == 0).flatten()
        first = int(starts[0]) if len(starts) else span.tokens
        count = max(span.tokens - first, 0) // n
        whole = slice(first, first + count * n)
        rest = torch.cat((torch.arange(0, first), torch.arange(whole.stop, span.tokens)))
        device = self._plane_rows.device
        return page[first : whole.stop : n].to(device), whole, page[rest].to(device), row[rest].to(device), rest

    def gather(self, span: PagedSpan) -> torch.Tensor:
        """A copy of the span's KV as a block ``[layers, 2, kv_heads, span.tokens, head_dim]``."""
        pages, whole, page, row, rest = self._pieces(span)
        heads, n, d = self.caches[0].shape[1], self.layout.page_tokens, self.layout.head_dim
        block = self.caches[0].new_empty((self.num_layers, 2, heads, span.tokens, d))
        if len(pages):
            planes = torch.stack([cache[pages] for cache in self.caches])  # [L, P, H, N, 2D], a copy
            flat = planes.flatten(3)[..., self._plane_of]  # [L, P, H, 2ND] canonical order (faster than index_select)
            kv = flat.view(self.num_layers, len(pages), heads, 2, n, d).permute(0, 3, 2, 1, 4, 5)  # [L, 2, H, P, N, D]
            block[:, :, :, whole] = kv.reshape(self.num_layers, 2, heads, len(pages) * n, d)
        if len(rest):
            page = page.unsqueeze(1)
            for layer, cache in enumerate(self.caches):
                for kind in (0, 1):
                    # cache[page, :, plane_row, plane_col]: advanced indices around a slice -> [T, D, H]
                    values = cache[page, :, self._plane_rows[kind][row], self._plane_cols[kind][row]]
                    block[layer, kind][:, rest] = values.permute(2, 0, 1)  # [H, T, D]
        return block

    def slots(self, span: PagedSpan) -> torch.Tensor:
        """Each token's slot in the layer caches (kernel page * kernel page tokens + row), on their device.

        Kernel pages tile a scheduler page in order, so a token's slot is its scheduler page times
        the scheduler page's tokens plus its row there: each page's slots one run, cut to the span.
        Three small tensor ops per call, not :meth:`PagedSpan.rows`' ten (134 us a block, an eighth
        of its page write, on the 2-core VM)."""
        first = torch.tensor(span.page_ids, dtype=torch.int64) * self.page_tokens  # [P]
        slots = (first.unsqueeze(1) + self._page_rows).flatten()[span.offset : span.offset + span.tokens]  # [T]
        return slots.to(self.caches[0].device)

    def copy_pages(self, span: PagedSpan) -> tuple[torch.Tensor, PagedSpan]:
        """A plain copy of the kernel pages holding ``span`` ([layers, pages, H, N, 2D]), and the span
        within that copy: the save's only work in vLLM's step; :meth:`block_of_pages` permutes later."""
        k = self.page_tokens // self.layout.page_tokens
        kernel_pages = torch.tensor([p * k + j for p in span.page_ids for j in range(k)], dtype=torch.int64,
                                    device=self.caches[0].device)
        first = self.caches[0]
        pages = torch.empty((len(self.caches), len(kernel_pages), *first.shape[1:]), dtype=first.dtype,
                            device=first.device)
        for layer, cache in enumerate(self.caches):  # one copy per layer, straight into the result
            torch.index_select(cache, 0, kernel_pages, out=pages[layer])
        return pages, PagedSpan(tuple(range(len(span.page_ids))), span.offset, span.tokens)

    def block_of_pages(self, pages: torch.Tensor, span: PagedSpan | None) -> torch.Tensor:
        """The block ``[layers, 2, kv_heads, span.tokens, head_dim]`` of a :meth:`copy_pages` result
        (or of :meth:`copy_out`'s: a block already where ``span`` is None)."""
        if span is None:
            return pages
        return PagedKV(list(pages), self.layout, pages.shape[2], self.page_tokens).gather(span)

    def copy_out(self, span: PagedSpan) -> tuple[torch.Tensor, PagedSpan | None]:
        """A save's copy, made within its step (vLLM may reuse the pages after it): with the native
        writer, the block itself, read out of the pages in one pass on this thread (`PageWriter.read`),
        and None; else :meth:`copy_pages`, whose permute (:meth:`block_of_pages`) the store thread makes
        later with torch ops, whose threads then compete with the engine's own."""
        if self.native is not None:
            return self.native.read(self.slots(span)), None
        return self.copy_pages(span)

    def write_layers(self, block: torch.Tensor, slots: torch.Tensor, layer: int | None = None) -> None:
        """Write every layer of ``block`` [layers, 2, kv_heads, T, head_dim], or only ``layer``, to
        the pages at ``slots`` (:meth:`slots`) with the native writer or the backend's op."""
        layers = range(self.num_layers) if layer is None else range(layer, layer + 1)
        part = block[layers.start : layers.stop].to(self.caches[0].device, self.caches[0].dtype)  # a view if it is
        if self.native is not None:
            self.native.write(part, slots, first_layer=layers.start)
            return
        if self.write is None:
            raise ValueError("write_layers needs the native page writer or the backend's cache-write op")
        for index, kv in zip(layers, part):
            self.write(kv[0].transpose(0, 1), kv[1].transpose(0, 1), self.caches[index], slots)  # [T, H, D] views

    def scatter(self, block: torch.Tensor, span: PagedSpan) -> None:
        """Write a block ``[layers, 2, kv_heads, span.tokens, head_dim]`` into the span's pages."""
        if block.dim() != 5 or block.shape[0] != self.num_layers or block.shape[3] != span.tokens:
            raise ValueError(f"block shape {tuple(block.shape)} is not [layers={self.num_layers}, 2, kv_heads, "
                             f"tokens={span.tokens}, head_dim]")
        if self.native is not None or self.write is not None:
            self.write_layers(block, self.slots(span))
            return
        pages, whole, page, row, rest = self._pieces(span)
        heads, n, d = block.shape[2], self.layout.page_tokens, self.layout.head_dim
        block = block.to(self.caches[0].dtype)
        if len(pages):
            kv = block[:, :, :, whole].reshape(self.num_layers, 2, heads, len(pages), n, d)
            flat = kv.permute(0, 3, 2, 1, 4, 5).reshape(self.num_layers, len(pages), heads, 2 * n * d)
            planes = flat[..., self._canonical_of].view(self.num_layers, len(pages), heads, n, 2 * d)
            page_list = pages.tolist()
            for cache, layer_planes in zip(self.caches, planes):
                for page_id, plane in zip(page_list, layer_planes):
                    cache[page_id].copy_(plane)
        if len(rest):
            page = page.unsqueeze(1)
            for cache, layer in zip(self.caches, block):
                for kind in (0, 1):
                    values = layer[kind][:, rest].permute(1, 2, 0)  # [H, T, D] -> [T, D, H]
                    cache[page, :, self._plane_rows[kind][row], self._plane_cols[kind][row]] = values
