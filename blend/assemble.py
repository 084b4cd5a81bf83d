"""Chunk assembly: where each segment of a blended prompt sits, and its cached KV moved there.

A blended prompt is ``[prefix] [chunk 1] ... [chunk n] [query]``. Every segment but the query has
KV computed *alone*, at positions 0..len-1, with nothing before it (no BOS, no prefix), and stored
under its position-independent chunk key (`kvstore.keys.chunk_key`). Assembly loads those blocks
at their place in the prompt and rotates their keys from 0..len-1 to the new positions::

    prompt     |--prefix--|----chunk 1----|--chunk 2--|--query--|
    position    0 .. P-1   P ...... P+n1-1  ...  C-1   C .. T-1
    cached at   0 .. P-1   0 ...... n1-1    0 .. n2-1  (never cached: always computed)
    rotate by   0          +P               +P+n1

The prefix sits where it was computed, so its KV is exactly what a full prefill would give; a
chunk's KV lacks the cross-attention to everything before it, which selective recompute repairs.

A chunk may be preceded by *glue*: tokens that belong to no stored segment (a passage separator
as an engine tokenized it inside the whole prompt, see `engine_adapter/vllm/blend.py`). Glue is
never cached; like the query, it is computed on every layer::

    |--prefix--|-glue-|----chunk 1----|-glue-|--chunk 2--|--query--|
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

import kernels
from blend.model import BlendCache, BlendModel

SEGMENT_KINDS = ("prefix", "glue", "chunk", "query")


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of the prompt; ``kind`` is one of SEGMENT_KINDS."""

    kind: str
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BlendLayout:
    """Segments of one blended prompt, in order, covering 0..total-1 without gaps."""

    segments: tuple[Segment, ...]

    @classmethod
    def from_lengths(cls, prefix: int, chunks: Sequence[int], query: int,
                     glue: Sequence[int] | None = None) -> BlendLayout:
        """``glue[i]``: tokens just before chunk i (None or 0: none)."""
        if query <= 0:
            raise ValueError("the query must have at least one token: its last token's logits are the answer")
        if prefix < 0 or any(n <= 0 for n in chunks):
            raise ValueError(f"prefix length must be >= 0 and every chunk non-empty, got {prefix}, {list(chunks)}")
        glue = [0] * len(chunks) if glue is None else list(glue)
        if len(glue) != len(chunks) or any(n < 0 for n in glue):
            raise ValueError(f"glue must give a count >= 0 for each of the {len(chunks)} chunks, got {glue}")
        segments, start = [], 0
        pieces = [("prefix", prefix), *(p for g, n in zip(glue, chunks) for p in (("glue", g), ("chunk", n))),
                  ("query", query)]
        for kind, n in pieces:
            if n:
                segments.append(Segment(kind, start, start + n))
                start += n
        return cls(tuple(segments))

    @property
    def total(self) -> int:
        return self.segments[-1].end

    @property
    def query(self) -> Segment:
        return self.segments[-1]

    @cached_property
    def cached(self) -> tuple[Segment, ...]:
        """Segments whose KV comes from the cache (prefix and chunks), in order."""
        return tuple(s for s in self.segments[:-1] if s.kind != "glue")

    @property
    def chunks(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.kind == "chunk")

    @cached_property
    def chunk_positions(self) -> torch.Tensor:
        """Positions [N] of every chunk token: the tokens a selector may choose to recompute."""
        spans = [torch.arange(s.start, s.end) for s in self.chunks]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)

    @cached_property
    def query_positions(self) -> torch.Tensor:
        return torch.arange(self.query.start, self.query.end)

    @cached_property
    def glue_positions(self) -> torch.Tensor:
        """Positions of every glue token: never cached, computed on every layer."""
        spans = [torch.arange(s.start, s.end) for s in self.segments if s.kind == "glue"]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)


def rerotate_keys(keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                  inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [..., T, D] moved to new positions: the Triton kernel on CUDA, the native C one on the
    CPU (``$KVSTORE_KERNELS`` overrides, see `kernels.rope_ops`)."""
    return kernels.rope_ops(keys).rerotate_keys(keys, old_positions, new_positions, inv_freq.to(keys.device))


def place_block(model: BlendModel, kv: BlendCache, block: torch.Tensor, segment: Segment) -> None:
    """Write a block computed alone at 0..n-1 ([layers, 2, kv_heads, n, head_dim]) into ``kv`` at
    ``segment``, keys rotated to segment.start..end-1. Any segment order; ``kv.length`` is not moved."""
    n = segment.length
    if block.dim() != 5 or block.shape[3] != n:
        raise ValueError(f"block of shape {tuple(block.shape)} does not hold the {n} tokens of {segment}")
    block = block.to(device=kv.device, dtype=kv.dtype)
    keys = block[:, 0]  # [L, KVH, n, D]
    if segment.start:
        old = torch.arange(n, device=kv.device)
        keys = rerotate_keys(keys, old, old + segment.start, model.inv_freq)
    kv.write_layers(segment.start, keys, block[:, 1])  # one copy for every layer


def rotate_into_place(model: BlendModel, kv: BlendCache, segment: Segment) -> None:
    """Rotate the keys of a block already in ``kv`` at ``segment``, as computed alone at 0..n-1
    (a Get copied it there in rows), to segment.start..end-1, in place: what `place_block` does
    on the way in."""
    if not segment.start:
        return
    keys = kv.data[:, 0, :, segment.start : segment.end]  # [L, KVH, n, D], a view
    old = torch.arange(segment.length, device=kv.device)
    keys.copy_(rerotate_keys(keys, old, old + segment.start, model.inv_freq))


@torch.inference_mode()
def chunk_block(model: BlendModel, token_ids: Sequence[int]) -> torch.Tensor:
    """The KV of ``token_ids`` computed alone at positions 0..n-1, as a block
    [layers, 2, kv_heads, n, head_dim]: what is stored under the tokens' chunk key."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("a chunk needs at least one token")
    kv = model.new_cache(n)
    model(torch.tensor(list(token_ids), dtype=torch.long), kv, 0, last_only=True)
    return kv.export(0, n)
