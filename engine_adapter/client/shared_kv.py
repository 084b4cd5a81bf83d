"""KV memory in a shared-memory arena, which the daemon's Get fills in rows: a load in one copy.

Without it a load copies every byte twice: the daemon from its tier into the client's staging
arena, then the client from there into its KV cache. A KV cache allocated here is itself in an
arena of the client's (a second one, beside the staging arena, with the same caps and the same
tenant), so a Get whose items carry ``row_bytes`` (kvstore/scatter.py) puts each raw block's rows
straight where the cache keeps them::

    block c   [L0 K][L0 V][L1 K] ...          rows of tokens * head_dim elements
    KV cache  [L0 K: tokens 0 .. capacity) [L0 V: ...) ...   block c's rows at c * tokens

`SharedRegion.request` asks for the arena (None where there is no shared memory: a remote daemon, or
a cap reached), `SharedRegion.tensor` views it, and `KVStoreClient.get_rows` makes the Get
(`PrefixCache.load` decides when). Stores go the other way in one copy too: `block_to_store` names a
chunk's rows where the cache keeps them and `KVStoreClient.put_rows` sends Put items with
``row_bytes``, which the daemon copies out of the region into its tier (a Put of a private tensor
copies it into the staging arena first, then the daemon copies it again).

A KV cache here is the reference engine's `KVCache` or anything with its attributes: ``data``
(one contiguous tensor [layers, 2, kv_heads, capacity, head_dim]), ``capacity``, ``length``,
``head_dim``, and ``export(start, end)``.

The region's arena is released when the region is closed or collected; tensors over it keep this
process's mapping until they go (kvstore/arena.py), so a view never outlives its memory.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine_adapter.client.blocks import Rows
from kvstore.arena import ArenaLease
from kvstore.scatter import MIN_ROW_BYTES, Gather

log = logging.getLogger(__name__)


class SharedRegion:
    """One arena of the client's own memory (not the staging arena), for tensors Gets fill in rows."""

    def __init__(self, lease: ArenaLease) -> None:
        self.arena_id, self.size = lease.arena_id, lease.arena.size
        self._array = np.frombuffer(lease.arena.buffer, dtype=np.uint8)  # keeps the mapping while viewed
        self._lease = lease
        self._retired = False
        self._close = weakref.finalize(self, lease.close)

    @property
    def alive(self) -> bool:
        """Whether the daemon still holds the region (not closed, the daemon not gone or restarted)
        and it was not retired: a Get into a region it no longer holds fails."""
        return not self._retired and self._close.alive and self._lease.held()

    def retire(self) -> None:
        """Lend this region to no later cache: a Put in rows out of it failed (a timeout, the
        daemon busy), and the daemon may still be reading it. Its tensors keep working; `alive` is
        False from now on, so caches in it are replaced and it is released once they are gone."""
        self._retired = True

    @classmethod
    def request(cls, client: Any, nbytes: int) -> SharedRegion | None:
        """A region of at least ``nbytes`` from the daemon of ``client`` (a `KVStoreClient`), every
        page faulted in; None when the client has no shared memory or the daemon refuses one (its caps)."""
        if not client.shared_memory:
            return None
        size = -(-nbytes // 4096) * 4096
        try:
            lease = client.lease_arena(size)
        except (OSError, ConnectionError) as exc:
            log.info("no shared KV memory of %d bytes from %s (%s): loads copy twice", size, client.address, exc)
            return None
        return cls(lease)

    def bytes(self, count: int) -> np.ndarray:
        """A new uint8 array over the region's first ``count`` bytes (tensors over it keep it, and
        so this process's mapping, alive)."""
        if not 0 < count <= self.size:
            raise ValueError(f"{count} bytes do not fit the {self.size}-byte region")
        return self._array[:count]

    def tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over the region's first bytes."""
        return torch.from_numpy(self.bytes(_nbytes(shape, dtype))).view(dtype).view(*shape)

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of ``tensor``'s first element in the region; ValueError for one outside it."""
        offset = tensor.data_ptr() - self._array.ctypes.data
        if not 0 <= offset < self.size:
            raise ValueError("the tensor is not in this region")
        return offset

    def close(self) -> None:
        """Release the arena in the daemon now (tensors over it keep this process's mapping)."""
        self._close()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class SharedKVMemory:
    """A `KVCache` allocator (``allocate``) that puts each cache tensor in a region of its own, so
    loads into it take one copy (`region_of` finds the region). Where the daemon gives no region
    (no shared memory, a cap reached), or for a device other than the CPU, a plain tensor.

    A new region costs what a new arena costs (the daemon allocates every page: ~160 ms per 200 MB
    here, where ``torch.empty`` costs nothing until first touch), so a region whose tensor is gone
    (its last view included) is kept for the next cache that fits in it: up to ``keep`` idle
    regions, the larger ones first.
    """

    def __init__(self, client: Any | Callable[[], Any | None], device: torch.device | str = "cpu",
                 keep: int = 2) -> None:
        """``client``: the daemon's client, or a callable giving the current one (None: not connected,
        a plain tensor then), e.g. `PrefixCache.client`."""
        self.client = client if callable(client) else (lambda: client)
        self.device, self.keep = torch.device(device), keep
        self._idle: list[SharedRegion] = []  # under _lock
        self._lock = threading.Lock()
        # Regions whose tensors went: put by finalizers, which may run inside any allocation, this
        # class's own under _lock included, so they only queue (SimpleQueue is reentrant).
        self._returned: queue.SimpleQueue[SharedRegion] = queue.SimpleQueue()

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        nbytes = _nbytes(shape, dtype)
        client = self.client()
        region = self._reuse(nbytes) or (SharedRegion.request(client, nbytes) if client is not None else None)
        if region is None:
            return torch.empty(shape, dtype=dtype)
        array = region.bytes(nbytes)
        weakref.finalize(array, self._give_back, region)  # once the tensor and every view of it are gone
        tensor = torch.from_numpy(array).view(dtype).view(*shape)
        _regions[id(tensor)] = region
        weakref.finalize(tensor, _regions.pop, id(tensor), None)
        return tensor

    def _reuse(self, nbytes: int) -> SharedRegion | None:
        """The smallest idle region of at least ``nbytes``, taken; None if none fits."""
        with self._lock:
            self._take_returned()
            for dead in [r for r in self._idle if not r.alive]:  # the daemon restarted, or is gone
                self._idle.remove(dead)
                dead.close()
            fitting = [r for r in self._idle if r.size >= nbytes]
            if not fitting:
                return None
            region = min(fitting, key=lambda r: r.size)
            self._idle.remove(region)
            return region

    def _give_back(self, region: SharedRegion) -> None:
        self._returned.put(region)

    def _take_returned(self) -> None:
        """Returned regions become idle, the largest ``keep`` kept and the others released; under _lock."""
        while True:
            try:
                self._idle.append(self._returned.get_nowait())
            except queue.Empty:
                break
        self._idle.sort(key=lambda r: r.size, reverse=True)
        for extra in self._idle[self.keep :]:
            extra.close()
        del self._idle[self.keep :]

    def close(self) -> None:
        """Release the idle regions now; those in use are released when their tensors go."""
        with self._lock:
            self.keep = 0
            self._take_returned()


#: The region of each live tensor `SharedKVMemory` made, by the tensor's id (dropped when it goes).
_regions: dict[int, SharedRegion] = {}


def region_of(tensor: torch.Tensor) -> SharedRegion | None:
    """The region a `SharedKVMemory` tensor lives in; None for any other tensor (views included)."""
    return _regions.get(id(tensor))


def rows_in(kv: Any, region: SharedRegion, start: int, tokens: int, data: torch.Tensor | None = None) -> Rows:
    """Where a block of ``tokens`` tokens at ``start`` of ``kv`` (whose tensor, or ``data`` as read
    before, is in ``region``) goes: in the contiguous [layers, 2, kv_heads, capacity, head_dim]
    tensor, a row of ``tokens * head_dim`` elements per (layer, K/V, head), one capacity apart."""
    data = kv.data if data is None else data
    capacity, head_dim = data.shape[-2:]
    if not 0 <= start <= start + tokens <= capacity:
        raise ValueError(f"tokens {start}..{start + tokens} are outside the capacity {capacity}")
    size = data.element_size() * head_dim
    rows = data.numel() // (capacity * head_dim)
    return Rows(region.offset_of(data) + start * size, tokens * size, capacity * size, rows)


@dataclass(frozen=True)
class RowsInRegion:
    """A block to Put from where a KV cache keeps it (`block_to_store`): the daemon copies its rows
    out of the region, one copy in all (`put_rows`). ``tensor`` is the cache's, held so that the
    region is not handed to another cache while the Put reads it."""
    tensor: torch.Tensor
    region: SharedRegion
    place: Rows

    @property
    def nbytes(self) -> int:
        return self.place.nbytes

    @property
    def arena_id(self) -> int:
        return self.region.arena_id

    def retire(self) -> None:
        """A Put of it failed: lend its region to no later cache (`SharedRegion.retire`)."""
        self.region.retire()

    def copy(self) -> memoryview:
        """The block in one run, copied here (for a daemon that no longer holds the region): what
        the daemon's `Gather` would have read."""
        source = memoryview(self.region.bytes(self.place.offset + self.place.span)[self.place.offset :])
        return Gather(source, self.place.row_bytes, self.place.row_stride, self.nbytes).tobytes()


def block_to_store(kv: Any, start: int, tokens: int) -> RowsInRegion | torch.Tensor:
    """What to Put for tokens ``start .. start + tokens`` of ``kv``: its rows where they lie when
    ``kv`` is in a region the daemon holds and the rows fit, else a copy (`KVCache.export`)."""
    data = kv.data  # one tensor throughout, though the cache may grow (a new tensor) meanwhile
    region = region_of(data)
    if region is None or not region.alive or not rows_fit(kv, tokens):
        return kv.export(start, start + tokens)
    if not 0 <= start <= start + tokens <= kv.length:
        raise ValueError(f"tokens {start}..{start + tokens} are outside the filled range 0..{kv.length}")
    place = rows_in(kv, region, start, tokens, data)
    if kv.data is not data:  # grown meanwhile: the rows above are the new tensor's
        return kv.export(start, start + tokens)
    return RowsInRegion(data, region, place)


@dataclass(frozen=True)
class ChunkRows:
    """Where a KV cache's chunks go in rows: its ``region`` and each chunk's ``places``."""
    region: SharedRegion
    places: list[Rows]


def chunk_rows(kv: Any, tokens: int, count: int) -> ChunkRows | None:
    """Where chunks 0, 1, ... of ``tokens`` tokens each go in ``kv``'s region, for the first ``count``
    of them that its capacity holds: a Get in rows fills them in one copy. None when ``kv`` is not
    in a region the daemon holds, or its rows are too small for the daemon to copy (`rows_region`):
    the caller then loads the two-copy way."""
    region = rows_region(kv, tokens)
    if region is None:
        return None
    return ChunkRows(region, [rows_in(kv, region, c * tokens, tokens) for c in range(min(count, kv.capacity // tokens))])


def rows_region(kv: Any, tokens: int) -> SharedRegion | None:
    """The region blocks of ``tokens`` tokens can be copied into ``kv`` in rows (a Get in rows, one
    copy); None when ``kv`` is not in a region the daemon still holds or the rows are too small
    (`rows_fit`): a load then takes two copies. Every load's one-copy decision is this one."""
    region = region_of(kv.data)
    return region if region is not None and region.alive and rows_fit(kv, tokens) else None


def rows_fit(kv: Any, tokens: int) -> bool:
    """Whether blocks of ``tokens`` tokens can go into ``kv`` in rows: a row (tokens * head_dim
    elements) of at least the daemon's `MIN_ROW_BYTES` (tiny test layouts load the two-copy way)."""
    return tokens * kv.head_dim * kv.data.element_size() >= MIN_ROW_BYTES
