"""Conversions between kvstore's own types and the ``kvstore.v1`` messages, for daemon and client.

Torch-free and gRPC-free (the generated messages only), so the client and the daemon share it; also
the Get reply serialized by hand, so inline payloads are copied once.
"""

from __future__ import annotations

from kvstore.keys import KVLayout
from kvstore.proto import kvstore_pb2 as pb


def layout_message(layout: KVLayout) -> pb.Layout:
    return pb.Layout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                     head_dim=layout.head_dim, dtype=layout.dtype)


def layout_from_message(message: pb.Layout) -> KVLayout:
    """The layout a message names; ValueError (from KVLayout) when it is out of range."""
    return KVLayout(message.num_layers, message.num_kv_heads, message.head_dim, message.dtype)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


#: Wire tags: GetResponse.results (field 1) and GetResult.inline (field 4), both length-delimited.
_RESULTS_TAG, _INLINE_TAG = b"\x0a", b"\x22"


def encode_get_response(replies: list[tuple[pb.GetResult, memoryview | None]]) -> bytes:
    """A serialized GetResponse whose inline payloads are copied once, from the buffers the tiers
    read into straight into the reply (protobuf would copy each into the message, then out again)."""
    pieces: list[bytes | memoryview] = []
    for result, payload in replies:
        head = result.SerializeToString()
        if payload is None:
            pieces += [_RESULTS_TAG, _varint(len(head)), head]
            continue
        inline_head = _INLINE_TAG + _varint(len(payload))
        pieces += [_RESULTS_TAG, _varint(len(head) + len(inline_head) + len(payload)), head, inline_head, payload]
    return b"".join(pieces)
