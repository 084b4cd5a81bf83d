"""Conversions between kvstore's own types and the ``kvstore.v1`` messages, for daemon and client.

Torch-free and gRPC-free (the generated messages only), so the client and the daemon share it.
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
