"""Re-encoding a block for the tier it moves into (the per-tier codec chain).

Clients put blocks in whatever codec they like (engines send ``raw``); when the daemon copies a
block down into a tier configured with another codec (``disk_codec = "int8+shuffle+zstd"``), it
decodes and re-encodes it here. Promotion keeps a block's codec: the engine decodes on load, since
the codec and its parameters travel in the header.
"""

from __future__ import annotations

import dataclasses

import torch

from compression import get_codec
from kvstore.block import BlockHeader, payload_checksum
from kvstore.dtypes import TORCH_DTYPES
from kvstore.keys import KVLayout


def canonical_codec(spec: str) -> str:
    """The canonical name of a codec spec ("int4" -> "int4-g32"); ValueError for unknown specs."""
    return get_codec(spec).name


def payload_tensor(payload: bytes | memoryview, codec: str, codec_params: dict, layout: KVLayout,
                   tokens: int) -> torch.Tensor:
    """A block payload as a tensor ``[layers, 2, kv_heads, tokens, head_dim]`` in the layout's
    dtype: for ``raw``, a zero-copy view of a writable ``payload`` (an arena; valid while it is)
    or a copy of a read-only one (``bytes``, a tier's read-only view: torch has no read-only
    tensors, so a view would let a write change immutable bytes, and it warns "buffer is not
    writable"); decoded for any other codec."""
    shape = layout.block_shape(tokens)
    dtype = TORCH_DTYPES[layout.dtype]
    if codec == "raw":
        if memoryview(payload).readonly:
            payload = bytearray(payload)
        return torch.frombuffer(payload, dtype=dtype).view(shape)
    return get_codec(codec).decode(bytes(payload), codec_params, shape, dtype)


def check_codec_params(header: BlockHeader) -> None:
    """ValueError naming the parameter when a block's codec params do not fit its layout, tokens and
    payload length (the checks every decoder makes before it allocates, `Codec.check_params`), so a
    Put of such a block is refused at the door. Blocks of a codec this daemon does not know, or of a
    calibrated one (its calibration may live with the client only), are checked when decoded."""
    if header.codec == "raw" or "@" in header.codec or header.codec.startswith("kvtc"):
        return
    try:
        codec = get_codec(header.codec)
    except ValueError:
        return
    codec.check_params(header.codec_params, header.layout.block_shape(header.tokens), TORCH_DTYPES[header.layout.dtype])


def decode_payload(header: BlockHeader, payload: bytes | memoryview) -> torch.Tensor:
    """A stored block as a tensor (see `payload_tensor`)."""
    return payload_tensor(payload, header.codec, header.codec_params, header.layout, header.tokens)


def transcode(header: BlockHeader, payload: bytes | memoryview, spec: str) -> tuple[BlockHeader, memoryview]:
    """``(header, payload)`` re-encoded with codec ``spec``; unchanged when it already is, or when
    the block must stay bit-exact (``codec_params["exact"]``: a codec's calibration, say)."""
    codec = get_codec(spec)
    if codec.name == header.codec or header.codec_params.get("exact"):
        return header, memoryview(payload)
    encoded = codec.encode(decode_payload(header, payload))
    new_payload = memoryview(encoded.payload)
    new_header = dataclasses.replace(header, codec=encoded.codec, codec_params=encoded.params,
                                     payload_len=len(new_payload), checksum=payload_checksum(new_payload))
    return new_header, new_payload
