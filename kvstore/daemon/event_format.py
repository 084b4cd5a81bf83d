"""vLLM's KV-event wire format, as the daemon publishes it (``kvstore/daemon/events.py``).

Routers that place requests by cached prefix (llm-d's KV-cache indexer, Dynamo's KV router) consume
vLLM's event stream; a daemon publishing the same stream is read by them unchanged, whatever engine
fills it. The wire format, as vLLM's ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher``)
defines it:

    PUB socket (events_listen)     multipart [topic, seq: 8-byte big-endian, payload]
    ROUTER socket (events_replay)  request  [b"", start seq: 8 bytes]   (a DEALER client)
                                   replies  [b"", topic, seq, payload]  each buffered batch >= start,
                                            then [b"", b"", -1 as 8 signed bytes, b""]
    payload   msgpack of KVEventBatch(ts, events, data_parallel_rank): an array; each event a map
              tagged "type": BlockStored | BlockRemoved | AllBlocksCleared

What kvstore puts in them (read as published by Dynamo's KV indexer and llm-d's, docs/operations.md):

- ``block_hashes``: unsigned 64-bit integers, as vLLM sends them: a kvstore key's last 8 bytes,
  big-endian (vLLM's rule for byte hashes). These are kvstore keys (``kvstore.keys.prefix_keys``:
  chained blake2b over 256-token chunks in a namespace), not vLLM's block hashes: routers match by
  ``token_ids``, computing their own hashes of a request's tokens, and chain by these ids.
- ``BlockStored``: one event per stored block, with ``parent_block_hash`` (the key before it in its
  chain, as its Put named it; None for a chain's first) and ``token_ids`` (the block's tokens, kept
  in its header: ``kvstore.block``); blocks Put without them are published without them, which
  routers skip. With ``events_block_size`` N, a block is published as its whole runs of N tokens
  (``block_size`` N; `sub_block_hashes`: the last run's id is the block's own, so a child's
  parent id names it); otherwise whole, ``block_size`` = its token count. ``lora_id``/``lora_name``
  None (a LoRA is part of the namespace); no ``ownership`` (Dynamo drops events that name one).
- ``medium``: GPU, CPU or STORAGE (disk and S3); ``locality`` is LOCAL, or REMOTE for a tier other
  hosts share (S3).
- ``BlockRemoved``: the ids of the blocks that left one tier (runs of removals from one tier are one
  event).
- ``AllBlocksCleared``: once, first, when the daemon starts: whatever a consumer knew of an earlier
  run is void; the blocks the daemon found on disk (and in S3) follow as BlockStored.
"""

from __future__ import annotations

import hashlib

import msgspec

#: The replay socket's end-of-replay seq, as vLLM sends it.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
_MEDIUMS = {"gpu": MEDIUM_GPU, "cpu": MEDIUM_CPU}


# -- field names, order and options as vLLM's classes ---------------------------------------------

class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; encoded as a map tagged with the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _DECODER.decode(payload)


def tier_medium(tier_name: str) -> str:
    """vLLM's medium of a kvstore tier: GPU, CPU, or STORAGE (disk, S3)."""
    return _MEDIUMS.get(tier_name, MEDIUM_STORAGE)


def block_hash(key: bytes) -> int:
    """A kvstore key as an event's block hash: its last 8 bytes, big-endian (vLLM's rule)."""
    return int.from_bytes(key[-8:], "big")


def sub_block_hashes(key: bytes, runs: int) -> list[int]:
    """The ids of a block's ``runs`` sub-blocks, in order: each but the last derived from the key
    and its index, the last the block's own `block_hash`, so that the next block's parent id, the
    hash of its parent key, names the run just before it."""
    derived = [int.from_bytes(hashlib.blake2b(key + i.to_bytes(4, "big"), digest_size=8).digest(), "big")
               for i in range(runs - 1)]
    return [*derived, block_hash(key)] if runs > 0 else []
