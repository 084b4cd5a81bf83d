"""Conversions between kvstore's own types and the ``kvstore.v1`` messages, for daemon and client.

Torch-free and gRPC-free (the generated messages only), so the client and the daemon share it; also
the Get reply serialized by hand, so inline payloads are copied once; and the data channel's frames.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from kvstore.keys import KVLayout
from kvstore.proto import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.block import BlockHeader


def layout_message(layout: KVLayout) -> pb.Layout:
    return pb.Layout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                     head_dim=layout.head_dim, dtype=layout.dtype)


def layout_from_message(message: pb.Layout) -> KVLayout:
    """The layout a message names; ValueError (from KVLayout) when it is out of range."""
    return KVLayout(message.num_layers, message.num_kv_heads, message.head_dim, message.dtype)


def meta_from_header(header: BlockHeader) -> pb.BlockMeta:
    """The message of a stored block's header (a Get's result: the daemon sets the caller's key)."""
    return pb.BlockMeta(
        key=header.key, namespace=header.namespace,
        layout=layout_message(header.layout),
        tokens=header.tokens, codec=header.codec,
        codec_params_json=json.dumps(header.codec_params) if header.codec_params else "",
        payload_len=header.payload_len)


def result_messages(keys: Sequence[bytes], found: Sequence[Any | None]) -> list[pb.GetResult]:
    """A Get's results without their payloads (those travel in the arena, or are appended by
    `encode_get_response`): per caller's key (not the tenant-derived stored key) the block found,
    anything with a ``header`` and the ``tier`` it was read from (the daemon's `GetResult`), or None."""
    out = []
    for key, block in zip(keys, found):
        if block is None:
            out.append(pb.GetResult(found=False))
            continue
        meta = meta_from_header(block.header)
        meta.key = key
        out.append(pb.GetResult(found=True, meta=meta, tier=block.tier))
    return out


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


# -- the data channel's frames (kvstore/daemon/data_channel.py, engine_adapter/client/data_channel.py) ---
#
#   frame   = head (kind: u8, body length: u32, big-endian) || body
#   client  HELLO(token)  then  GET(GetRequest)            | PUT(PutRequest) || payloads
#   daemon  READY()       then  GET_REPLY(GetResponse) || payloads | PUT_REPLY(PutResponse)
#           or ERROR(status code: u8 || one line of UTF-8) instead of any of them
#
# Payloads are raw bytes right after the message, in item order, with no frame of their own: a
# PUT's lengths are its items' meta.payload_len, a GET_REPLY's those of its found results.


def data_socket_path(socket_path: str | os.PathLike) -> Path:
    """The data channel's unix socket beside a daemon's gRPC unix socket (``unix:`` prefix allowed):
    where a client on that socket dials the data channel (kvstore/daemon/data_channel.py)."""
    text = str(socket_path)
    return Path((text[len("unix:"):] if text.startswith("unix:") else text) + ".data")

FRAME_HEAD = struct.Struct("!BI")
HELLO, READY, GET, GET_REPLY, PUT, PUT_REPLY, ERROR = 1, 2, 3, 4, 5, 6, 15
#: Longest bearer token a HELLO may carry.
MAX_TOKEN_BYTES = 1024
#: Longest GET or PUT message (payloads excluded): 4096 items of a few hundred bytes each.
MAX_REQUEST_BYTES = 2 * 2**20


def frame(kind: int, body: bytes = b"") -> bytes:
    return FRAME_HEAD.pack(kind, len(body)) + body


def error_frame(code: int, message: str) -> bytes:
    """An ERROR frame: the gRPC status code's number and the message on one line (at most 1 KiB)."""
    line = " ".join(message.split()).encode("utf-8", "replace")[:1024]
    return frame(ERROR, bytes([code]) + line)


def parse_error(body: bytes) -> tuple[int, str]:
    return (body[0] if body else 2), body[1:].decode("utf-8", "replace")  # 2: UNKNOWN


def recv_into_exactly(sock, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ConnectionError when the peer closes first, TimeoutError
    past ``deadline`` (time.monotonic): each recv waits at most until it, and at most the socket's
    timeout."""
    base = sock.gettimeout()
    try:
        while len(view):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the transfer took too long")
                sock.settimeout(left if base is None else min(base, left))
            got = sock.recv_into(view)
            if not got:
                raise ConnectionError("the peer closed the connection mid-frame")
            view = view[got:]
    finally:
        if deadline is not None:
            sock.settimeout(base)


def recv_frame_head(sock, deadline: float | None = None, rest_within: float | None = None) -> tuple[int, int] | None:
    """(kind, body length) of the next frame; None when the peer closed before sending one. The
    first byte waits as the socket's timeout says; the rest until ``deadline``, or at most
    ``rest_within`` seconds after the first (a peer that sends one byte holds nobody long)."""
    head = bytearray(FRAME_HEAD.size)
    got = sock.recv_into(head)
    if not got:
        return None
    if rest_within is not None:
        deadline = time.monotonic() + rest_within
    recv_into_exactly(sock, memoryview(head)[got:], deadline)
    return FRAME_HEAD.unpack(head)
