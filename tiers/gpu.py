"""GPU tier: block payloads in one pre-allocated device pool, written generically over a torch device.

The pool is a ``uint8`` tensor of ``capacity_bytes`` on ``device``; each block's payload occupies
one extent of it (:class:`tiers.allocator.ExtentAllocator`), so a put never allocates device
memory. Headers stay in host memory (the index). With ``device="cpu"`` the same code runs in CI,
so capacity, LRU, demotion and promotion are tested without a GPU; on CUDA the copies run on a
dedicated stream and the host side of a transfer should be pinned for them to be asynchronous.

Batched transfers: :meth:`read_many_into` copies several blocks in one pass, coalescing blocks
whose extents are adjacent in the pool into one copy per contiguous run::

    pool   |--A--|--B--|--C--|....|--D--|
    read   [A, B, C, D]  ->  copies: (A..C in one), (D)   when the host destination is one slab

:meth:`payload_tensor` gives the device view of a block, which the CUDA data plane exports
through CUDA IPC (``torch.multiprocessing`` reductions) to an engine on the same GPU.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from kvstore.block import BlockHeader
from tiers.allocator import ExtentAllocator
from tiers.base import ExtentIndex, Tier, TierFullError

_ALIGN = 256  # CUDA copies and vectorised kernels like 256-byte aligned starts


class GpuTier(ExtentIndex, Tier):
    blocking_io = False

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cuda", name: str = "gpu") -> None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("gpu tier on a CUDA device, but torch sees no CUDA device "
                             "(set gpu_capacity to 0, or gpu_device to 'cpu' for testing)")
        if capacity_bytes < _ALIGN:
            raise ValueError(f"gpu tier capacity must be at least {_ALIGN} bytes, got {capacity_bytes}")
        self.name = name
        self.device = device
        self.capacity_bytes = capacity_bytes
        self.pool = torch.empty(capacity_bytes, dtype=torch.uint8, device=device)
        self._allocator = ExtentAllocator(capacity_bytes, align=_ALIGN)
        self._blocks: dict[bytes, tuple[int, BlockHeader]] = {}  # key -> (offset, header)
        self._used = 0  # payload_len of the indexed blocks (Tier.used_bytes)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # -- index ----------------------------------------------------------------------------------

    def can_fit(self, nbytes: int) -> bool:
        return self._allocator.can_allocate(nbytes)

    # -- data -----------------------------------------------------------------------------------

    def payload_offset(self, key: bytes) -> int:
        return self._blocks[key][0]

    def payload_tensor(self, key: bytes) -> torch.Tensor:
        """The device bytes of a block (a view into the pool; valid until it is deleted)."""
        offset, header = self._blocks[key]
        return self.pool[offset : offset + header.payload_len]

    def payload_source(self, key: bytes) -> torch.Tensor:
        return self.payload_tensor(key)

    def put(self, header: BlockHeader, payload: memoryview | torch.Tensor) -> None:
        if isinstance(payload, torch.Tensor):
            source = payload
        else:
            with warnings.catch_warnings():  # read-only payloads are only read
                warnings.simplefilter("ignore", UserWarning)
                source = torch.frombuffer(payload, dtype=torch.uint8)
        if source.numel() != header.payload_len or source.dtype != torch.uint8:
            raise ValueError(f"payload is {source.numel()} {source.dtype} values, header says {header.payload_len} bytes")
        offset = self._allocator.allocate(header.payload_len)
        if offset is None:
            raise TierFullError(f"{self.name}: no free extent of {header.payload_len} bytes")
        self._copy(self.pool[offset : offset + header.payload_len], source)
        self._sync()  # the caller may reuse the source as soon as put returns
        self.delete(header.key)
        self._blocks[header.key] = (offset, header)
        self._used += header.payload_len

    def read_payload_into(self, key: bytes, dest: memoryview) -> BlockHeader:
        return self.read_many_into([(key, dest)])[0]

    def read_many_into(self, requests: list[tuple[bytes, memoryview | torch.Tensor]]) -> list[BlockHeader]:
        """Copy several payloads out, one copy per run of blocks adjacent both in the pool and in
        the destination (slices of one host buffer, e.g. a client's arena); returns the headers
        in order. Raises KeyError for a missing key, ValueError for a destination too small."""
        entries = [(self._blocks[key], dest) for key, dest in requests]
        targets = [_Destination.of(dest, header.payload_len) for (_, header), dest in entries]
        extents = [(offset, header.payload_len) for (offset, header), _ in entries]
        for run in _runs(extents, targets):
            first, last = run[0], run[-1]
            pool_start = extents[first][0]
            pool_end = extents[last][0] + extents[last][1]
            self._copy(_Destination.join(targets[first], targets[last]), self.pool[pool_start:pool_end])
        self._sync()
        return [header for (_, header), _ in entries]

    def delete(self, key: bytes) -> int:
        entry = self._blocks.pop(key, None)
        if entry is None:
            return 0
        self._used -= entry[1].payload_len
        self._sync()  # a queued copy may still read or write this extent
        self._allocator.free(entry[0])
        return entry[1].payload_len

    def check_integrity(self) -> None:
        self._allocator.check_integrity()
        extents = self._allocator.used_extents()
        if sorted(o for o, _ in self._blocks.values()) != sorted(extents):
            raise RuntimeError(f"{self.name}: index offsets do not match allocated extents")
        if self._used != sum(h.payload_len for _, h in self._blocks.values()):
            raise RuntimeError(f"{self.name}: used-bytes count {self._used} does not match the index")
        for key, (offset, header) in self._blocks.items():
            if extents[offset] < header.payload_len:
                raise RuntimeError(f"{self.name}: block {key.hex()} overruns its extent")
            if header.key != key:
                raise RuntimeError(f"{self.name}: block at {offset} is indexed under another key")

    def close(self) -> None:
        self._sync()
        self._blocks.clear()
        self._used = 0

    # -- copies ---------------------------------------------------------------------------------

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class _Destination:
    """A copy target: its tensor, its start address, and the buffer it is a slice of."""

    def __init__(self, tensor: torch.Tensor, address: int, parent: object, parent_address: int) -> None:
        self.tensor, self.address, self.parent, self.parent_address = tensor, address, parent, parent_address

    @classmethod
    def of(cls, dest: memoryview | torch.Tensor, nbytes: int) -> "_Destination":
        size = dest.numel() if isinstance(dest, torch.Tensor) else len(dest)
        if size < nbytes:
            raise ValueError(f"destination of {size} bytes is smaller than the {nbytes}-byte payload")
        if isinstance(dest, torch.Tensor):
            tensor = dest[:nbytes]
            storage = tensor.untyped_storage()
            return cls(tensor, tensor.data_ptr(), storage, storage.data_ptr())
        view = dest[:nbytes]
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data if nbytes else 0
        parent = view.obj
        parent_address = np.frombuffer(parent, dtype=np.uint8).ctypes.data if len(memoryview(parent)) else 0
        with warnings.catch_warnings():  # read-only sources are fine: we only write into writable ones
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return cls(tensor, address, parent, parent_address)

    def adjacent_to(self, before: "_Destination") -> bool:
        return self.parent is before.parent and before.address + before.tensor.numel() == self.address

    @staticmethod
    def join(first: "_Destination", last: "_Destination") -> torch.Tensor:
        """One tensor from ``first``'s start to ``last``'s end (they share a parent buffer)."""
        if first is last:
            return first.tensor
        start = first.address - first.parent_address
        end = last.address + last.tensor.numel() - first.parent_address
        if isinstance(first.parent, torch.UntypedStorage):
            return torch.as_strided(first.tensor, (end - start,), (1,))
        return torch.frombuffer(memoryview(first.parent).cast("B")[start:end], dtype=torch.uint8)


def _runs(extents: list[tuple[int, int]], targets: list[_Destination]) -> list[list[int]]:
    """Group request indices into runs adjacent both in the pool and in the destinations."""
    runs: list[list[int]] = []
    for i, (offset, _) in enumerate(extents):
        if runs:
            j = runs[-1][-1]
            if extents[j][0] + extents[j][1] == offset and targets[i].adjacent_to(targets[j]):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs
