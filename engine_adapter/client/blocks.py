"""The blocks a KVStoreClient's calls carry: what a Put stores, what a Get found, where rows go.

A Put takes `BlockToPut`s (or plain ``(key, tokens, payload[, parent[, token_ids]])`` tuples, named
on the way in by `BlockToPut.of`), each payload bytes-like, a numpy array or a CPU torch tensor
(`payload_view`, no copy); a Get gives `FetchedBlock`s whose payload is a view into the client's
arena, a data-channel connection's buffer or the reply, valid as long as the call that fetched it
says. A Get or Put in rows (`KVStoreClient.get_rows`, `put_rows`) names where each block's rows lie
in an arena with `Rows`, and a Get in rows answers each key with a `RowsGot`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from kvstore.keys import KVLayout
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import layout_from_message


@dataclass(frozen=True)
class FetchedBlock:
    key: bytes
    layout: KVLayout
    tokens: int
    codec: str
    codec_params: dict[str, Any]
    tier: str
    payload: memoryview
    # the payload decoded ahead (`engine_adapter.client.prefix_cache.fetch_blocks` decodes a batch's
    # coded blocks on its pool); `fetched_tensor` returns it instead of decoding again
    decoded: Any = None


def fetched_block(key: bytes, result: pb.GetResult, payload: memoryview) -> FetchedBlock:
    """The block a Get found for ``key``, its bytes ``payload``."""
    meta = result.meta
    return FetchedBlock(
        key=key,
        layout=layout_from_message(meta.layout),
        tokens=meta.tokens, codec=meta.codec,
        codec_params=json.loads(meta.codec_params_json) if meta.codec_params_json else {},
        tier=result.tier, payload=payload)


class LayerStream:
    """The blocks of a layer-wise fetch and an iterator of the layers as they become ready."""

    def __init__(self, blocks: list[FetchedBlock | None], layers: Iterator[int]) -> None:
        self.blocks = blocks
        self._layers = layers

    def __iter__(self) -> Iterator[int]:
        return self._layers


def payload_view(payload: Any) -> memoryview:
    """Bytes of a payload given as bytes-like, a numpy array or a CPU torch tensor (no copy)."""
    if hasattr(payload, "detach") and hasattr(payload, "is_contiguous"):  # torch.Tensor
        import torch

        tensor = payload.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    if isinstance(payload, np.ndarray):
        return memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))
    return memoryview(payload).cast("B")


@dataclass(frozen=True)
class BlockToPut:
    """One block for a Put: ``key`` holds ``tokens`` tokens whose KV is ``payload``; ``parent`` is the
    key before it in its prefix chain (the daemon then evicts a chain's last blocks before its
    first; b"" for none) and ``token_ids`` its tokens (a daemon publishing KV events names them to
    routers; any count other than ``tokens`` is ignored there)."""
    key: bytes
    tokens: int
    payload: Any
    parent: bytes = b""
    token_ids: Sequence[int] = ()

    @classmethod
    def of(cls, block: BlockToPut | tuple) -> BlockToPut:
        """``block`` named: a `BlockToPut` as it is, or a ``(key, tokens, payload[, parent[, token_ids]])``
        tuple (token ids as a list, an array or a tensor)."""
        if isinstance(block, cls):
            return block
        key, tokens, payload, *rest = block
        parent = (rest[0] or b"") if rest else b""
        ids = rest[1] if len(rest) > 1 and rest[1] is not None else ()
        return cls(key, tokens, payload, parent, ids.tolist() if hasattr(ids, "tolist") else list(ids))


@dataclass(frozen=True)
class Rows:
    """Where one block's payload lies in an arena: row i of ``row_bytes`` at ``offset + i * row_stride``,
    ``rows`` rows in all (a block's ``[layers, 2, kv_heads]`` rows of ``tokens * head_dim`` elements
    where a KV cache keeps them; kvstore/scatter.py copies them on the daemon's side)."""
    offset: int
    row_bytes: int
    row_stride: int
    rows: int

    @property
    def span(self) -> int:
        return (self.rows - 1) * self.row_stride + self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class RowsGot:
    """What a Get in rows did for one key: ``in_place``, the block is in its rows now (it was found,
    raw, of the layout and size asked for); else nothing was copied (a miss when not ``found``; a
    coded block, or one of another layout, otherwise). ``tier``: where it was found."""
    found: bool
    in_place: bool
    tier: str = ""
    codec: str = ""
