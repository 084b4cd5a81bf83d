"""The blocks a KVStoreClient's calls carry: payloads to store as bytes, fetched blocks as views.

A Put takes each payload as bytes-like, a numpy array or a CPU torch tensor (`payload_view`, no
copy); a Get gives `FetchedBlock`s whose payload is a view into the client's arena, a data-channel
connection's buffer or the reply, valid as long as the call that fetched it says.
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
    # the payload decoded ahead (`engine_adapter.prefix_cache.fetch_blocks` decodes a batch's
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


def block_token_ids(block: tuple) -> Sequence[int]:
    """The token ids of a block to Put, ``(key, tokens, payload, parent, token_ids)``: its fifth
    item, or none (a shorter tuple). A Put sends them so a daemon publishing KV events can name the
    block's tokens to routers; any count other than the block's own is ignored there."""
    ids = block[4] if len(block) > 4 else None
    if ids is None:
        return ()
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)  # a tensor's or array's as ints
