"""Native page writer: a block's tokens into CPU paged KV caches in one pass (`page_copy.c`).

vLLM's CPU attention stores keys transposed within each page (ISA ``vec``: ``[head_dim,
page_tokens]`` per page and head; ISA ``amx``: dim pairs transposed in 16-row tiles, values with
row pairs interleaved), so a load's bytes are mostly a transpose. vLLM's own cache-write
op does it token by token (about 6x a memcpy of the same bytes); torch's strided copies are no
faster. `page_copy.c` copies whole runs of a page as vector tiles (SSE2, AVX2 where the CPU has
it), reading the block ahead and writing whole stretches of a page with streamed stores: 0.9-1.5x
a one-thread memcpy of the same bytes, `kt_halves` the slowest (`bench/vllm_ttft.py --copy-only
--layout all`; docs/benchmarks.md, "Page writer per layout").

The C file is compiled once per machine by `kernels.native`; :func:`native_library` returns None
where there is no compiler or the build fails, and callers then keep the engine's own op. The
reference with the same signature is `kernels/page_copy_ref.py` ``write_pages_ref``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Sequence

import torch

from kernels.native import build
from kernels.page_copy_ref import PLANE_LAYOUTS, plane_offsets

SOURCE = Path(__file__).with_name("page_copy.c")
_LAYOUT_CODES = {name: code for code, name in enumerate(PLANE_LAYOUTS)}  # the C enum's order
_I64 = ctypes.c_int64


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The compiled page writer, built on first use (`kernels.native.build`); None when it cannot be."""
    library = build(SOURCE, "page writer")
    if library is None:
        return None
    library.kvstore_write_pages.restype = ctypes.c_int
    library.kvstore_write_pages.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, _I64, _I64, _I64, _I64, ctypes.c_void_p, _I64, _I64, ctypes.c_int, ctypes.c_int,
    ]
    library.kvstore_page_copy_avx2.restype = ctypes.c_int
    library.kvstore_page_copy_avx2.argtypes = []
    library.kvstore_read_pages.restype = ctypes.c_int
    library.kvstore_read_pages.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _I64, _I64,
    ]
    return library


def avx2_paths() -> bool:
    """Whether the page writer takes its AVX2 paths on this CPU (False without the library)."""
    library = native_library()
    return library is not None and bool(library.kvstore_page_copy_avx2())


def page_runs(slots: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """Consecutive tokens whose slots follow each other within one page, as int64 [runs, 4]:
    (first token, page, first row, length). What `page_copy.c` copies as one tile per head; here
    for tests and for reading."""
    slots = slots.to(torch.int64).cpu()
    if slots.numel() == 0:
        return torch.empty(0, 4, dtype=torch.int64)
    starts = torch.ones_like(slots, dtype=torch.bool)
    starts[1:] = (slots[1:] != slots[:-1] + 1) | (slots[1:] % page_tokens == 0)
    first = torch.nonzero(starts).flatten()  # [R]
    length = torch.diff(first, append=torch.tensor([slots.numel()]))
    return torch.stack((first, slots[first] // page_tokens, slots[first] % page_tokens, length), dim=1).contiguous()


class PageWriter:
    """Writes blocks into one worker's CPU paged caches (one tensor per layer) with the native kernel,
    and reads them back out (`read`, a save's copy).

    Every check is made before a byte is written: here, caches contiguous, on the CPU, of one shape
    ``[pages, kv_heads, page_tokens, 2 * head_dim]`` and dtype, and a block of the caches' dtype
    with head_dim contiguous; in the C code (one pass, no torch op per call), every slot inside the
    caches.

    ``threads`` share out the layers. One is the default: a copy is bound by memory bandwidth, vLLM
    binds its worker's threads to cores (threads started from one inherit its single core), and on
    this project's busy 2-core VM two threads were slower than one (1.4-2.3x memcpy against 2.0-3.4x).
    ``simd`` False keeps the kernel to the paths a CPU without AVX2 takes (same bytes; the tests
    compare both on any host).
    """

    def __init__(self, caches: Sequence[torch.Tensor], layout: str, threads: int = 1, simd: bool = True) -> None:
        if layout not in _LAYOUT_CODES:
            raise ValueError(f"unknown page layout {layout!r}; known: {', '.join(PLANE_LAYOUTS)}")
        if not caches:
            raise ValueError("PageWriter needs at least one layer cache")
        first = caches[0]
        for cache in caches:
            if cache.device.type != "cpu" or not cache.is_contiguous() or cache.dim() != 4:
                raise ValueError("PageWriter writes contiguous CPU caches [pages, kv_heads, page_tokens, 2*head_dim]")
            if cache.shape != first.shape or cache.dtype != first.dtype:
                raise ValueError(f"layer caches differ: {tuple(cache.shape)} {cache.dtype} against "
                                 f"{tuple(first.shape)} {first.dtype}")
        if first.element_size() not in (2, 4) or first.shape[3] % 2:
            raise ValueError(f"PageWriter needs 2- or 4-byte elements and an even last dim, got {first.dtype} "
                             f"{tuple(first.shape)}")
        plane_offsets(layout, first.shape[2], first.shape[3] // 2)  # raises for a shape the layout cannot hold
        library = native_library()
        if library is None:
            raise RuntimeError("the native page writer could not be built (see the log)")
        self._write = library.kvstore_write_pages
        self._read = library.kvstore_read_pages
        offsets = plane_offsets(layout, first.shape[2], first.shape[3] // 2)  # [2, N, D]
        self._offsets = offsets.to(torch.int32).contiguous()
        # rows whose D offsets run on (one memcpy a row when read): every row of split and halves, V of kt_halves
        self._runs = (offsets == offsets[..., :1] + torch.arange(offsets.shape[-1])).all(-1).to(torch.uint8).contiguous()
        self.caches = list(caches)
        self.layout = layout
        self.pages, self.heads, self.page_tokens, width = first.shape
        self.head_dim = width // 2
        self.dtype = first.dtype
        self.threads = max(1, threads)
        self.simd = bool(simd)
        self._pointers = (ctypes.c_uint64 * len(caches))(*(cache.data_ptr() for cache in caches))

    def write(self, block: torch.Tensor, slots: torch.Tensor, first_layer: int = 0) -> None:
        """Write ``block`` [layers, 2, kv_heads, T, head_dim] into the caches of layers
        ``first_layer ..``; token i goes to slot ``slots[i]`` (page * page_tokens + row)."""
        layers = block.shape[0] if block.dim() == 5 else 0
        if (block.dim() != 5 or block.shape[1] != 2 or block.shape[2] != self.heads or block.shape[4] != self.head_dim
                or not 0 <= first_layer <= len(self.caches) - layers):
            raise ValueError(f"block {tuple(block.shape)} from layer {first_layer} does not fit {len(self.caches)} "
                             f"layer caches of [pages, {self.heads}, {self.page_tokens}, 2*{self.head_dim}]")
        if block.device.type != "cpu" or block.dtype != self.dtype or block.stride(4) != 1:
            raise ValueError(f"block must be a CPU {self.dtype} tensor with head_dim contiguous, got "
                             f"{block.device} {block.dtype} strides {block.stride()}")
        if slots.dim() != 1 or slots.numel() != block.shape[3]:
            raise ValueError(f"{slots.numel()} slots for a block of {block.shape[3]} tokens")
        if slots.device.type != "cpu" or slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to("cpu", torch.int64).contiguous()
        if not slots.numel() or not layers:
            return
        pointers = ctypes.addressof(self._pointers) + first_layer * ctypes.sizeof(ctypes.c_uint64)
        s_layer, s_kind, s_head, s_token, _ = block.stride()
        slot_count = self.pages * self.page_tokens
        if self._write(_LAYOUT_CODES[self.layout], block.element_size(), pointers, layers, self.heads,
                       self.page_tokens, self.head_dim, block.data_ptr(), s_layer, s_kind, s_head, s_token,
                       slots.data_ptr(), slots.numel(), slot_count, self.threads, int(self.simd)) != 0:
            raise ValueError(f"slots {int(slots.min())}..{int(slots.max())} outside the caches' {slot_count} slots")

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """A new block [layers, 2, kv_heads, T, head_dim] of every layer's tokens at ``slots`` (page *
        page_tokens + row): one pass, on this thread (ctypes lets other Python threads run), no torch
        op, so it never starts threads of its own beside the engine's. ValueError for a slot outside
        the caches."""
        if slots.dim() != 1:
            raise ValueError(f"slots must be one-dimensional, got shape {tuple(slots.shape)}")
        if slots.device.type != "cpu" or slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to("cpu", torch.int64).contiguous()
        block = torch.empty((len(self.caches), 2, self.heads, slots.numel(), self.head_dim), dtype=self.dtype)
        if not slots.numel():
            return block
        slot_count = self.pages * self.page_tokens
        if self._read(block.element_size(), ctypes.addressof(self._pointers), len(self.caches), self.heads,
                      self.page_tokens, self.head_dim, self._offsets.data_ptr(), self._runs.data_ptr(),
                      block.data_ptr(), slots.data_ptr(), slots.numel(), slot_count) != 0:
            raise ValueError(f"slots {int(slots.min())}..{int(slots.max())} outside the caches' {slot_count} slots")
        return block
