"""The KV cache of one sequence that the reference engine (engine_adapter/reference/model.py) reads and writes:
one tensor for every layer's keys and values, so a block loads or exports in one strided copy.
"""

from __future__ import annotations

from typing import Callable

import torch

#: Makes the one tensor of a cache: (shape, dtype) -> an uninitialised tensor (e.g. in shared memory).
Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class KVCache:
    """Per-layer keys and values of one sequence, each [num_kv_heads, capacity, head_dim].

    Tokens 0..length-1 are valid. Capacity doubles when a write or load needs more room. The block
    format for export and load is [num_layers, 2, num_kv_heads, tokens, head_dim] with K at index
    0 and V at 1; keys are stored after RoPE at their absolute positions.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, allocate: Allocate | None = None):
        """``allocate``: where the cache's tensor comes from, at first and whenever it grows
        (default: ``torch.empty`` on ``device``; engine_adapter/client/shared_kv.py puts it in shared memory)."""
        if capacity <= 0:
            raise ValueError(f"KVCache capacity must be positive, got {capacity}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.length = 0
        self._new = allocate or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))
        self._allocate(self._new((num_layers, 2, num_kv_heads, capacity, head_dim), dtype))

    def _allocate(self, data: torch.Tensor) -> None:
        """One tensor [num_layers, 2, num_kv_heads, capacity, head_dim] holds every layer, so a
        block loads or exports in one strided copy; ``keys[layer]`` and ``values[layer]`` are its
        contiguous [num_kv_heads, capacity, head_dim] views. Tokens past ``length`` are unset."""
        #: The one tensor [num_layers, 2, num_kv_heads, capacity, head_dim], contiguous (a block's
        #: rows lie at one stride: engine_adapter/client/shared_kv.py `rows_in`); replaced when the cache grows.
        self.data = data
        self.capacity = data.shape[3]
        self.keys = [data[layer, 0] for layer in range(self.num_layers)]
        self.values = [data[layer, 1] for layer in range(self.num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def reserve(self, num_tokens: int) -> None:
        """Grow (doubling) until `num_tokens` fit; the valid tokens are copied over."""
        if num_tokens <= self.capacity:
            return
        capacity = self.capacity
        while capacity < num_tokens:
            capacity *= 2
        old = self.data
        self._allocate(self._new((*old.shape[:3], capacity, self.head_dim), old.dtype))
        self.data[:, :, :, : self.length] = old[:, :, :, : self.length]

    def truncate(self, num_tokens: int) -> None:
        """Keep tokens 0..num_tokens-1; the rest become invalid (memory is kept)."""
        if not 0 <= num_tokens <= self.length:
            raise ValueError(f"truncate({num_tokens}) is outside 0..{self.length}")
        self.length = num_tokens

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer's keys and values [num_kv_heads, T, head_dim] at start..start+T.

        Does not move `length`; `LlamaModel.forward` and `load` do.
        """
        end = start + keys.shape[1]
        self.reserve(end)
        self.keys[layer][:, start:end] = keys
        self.values[layer][:, start:end] = values

    def write_layers(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """:meth:`write` for every layer at once: ``keys`` and ``values`` [num_layers, num_kv_heads,
        T, head_dim] at tokens start..start+T, one copy each. Does not move `length`."""
        end = start + keys.shape[2]
        self.reserve(end)
        self.data[:, 0, :, start:end] = keys
        self.data[:, 1, :, start:end] = values

    def clear(self, start: int, end: int) -> None:
        """Zero tokens start..end-1 of every layer (memory past `length` is otherwise unset)."""
        self.data[:, :, :, start:end].zero_()

    def span(self, start: int, end: int) -> torch.Tensor:
        """Tokens start..end-1 as a block [num_layers, 2, num_kv_heads, end-start, head_dim]: a
        view, valid until the cache grows or is written (`export` is the copy)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"span({start}, {end}) is outside the filled range 0..{self.length}")
        return self.data[:, :, :, start:end]

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's keys and values for tokens 0..end-1, each [num_kv_heads, end, head_dim]."""
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def export(self, start: int, end: int) -> torch.Tensor:
        """A copy of tokens start..end-1 as a block [num_layers, 2, num_kv_heads, end-start, head_dim]."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"export({start}, {end}) is outside the filled range 0..{self.length}")
        return self.data[:, :, :, start:end].clone(memory_format=torch.contiguous_format)

    def load(self, block: torch.Tensor, start: int) -> None:
        """Write a block [num_layers, 2, num_kv_heads, n, head_dim] at tokens start..start+n-1.

        The block is cast to this cache's dtype and device. Loading past `length` would leave
        a gap of unset tokens, so `start` must be <= length; length becomes max(length, start+n).
        """
        expected = (self.num_layers, 2, self.num_kv_heads, self.head_dim)
        if block.dim() != 5 or (*block.shape[:3], block.shape[4]) != expected:
            raise ValueError(
                f"block shape {tuple(block.shape)} is not [num_layers={self.num_layers}, 2, "
                f"num_kv_heads={self.num_kv_heads}, tokens, head_dim={self.head_dim}]"
            )
        if not 0 <= start <= self.length:
            raise ValueError(f"load at {start} would leave a gap after length {self.length}; load blocks in order")
        end = start + block.shape[3]
        self.reserve(end)
        self.data[:, :, :, start:end].copy_(block)  # one strided copy, cast to this cache's dtype and device
        self.length = max(self.length, end)
