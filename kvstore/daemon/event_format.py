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

What kvstore puts in them:

- ``block_hashes``: the block's 16-byte key as ``bytes`` (vLLM's default hash type is bytes too;
  a consumer wanting ints takes ``int.from_bytes(key, "big")``). These are kvstore keys
  (``kvstore.keys.prefix_keys``: chained blake2b over 256-token chunks in a namespace), not vLLM's
  block hashes: a router matches them by computing kvstore keys of its requests.
- ``BlockStored``: one event per block; ``block_size`` = the block's token count (from its header),
  ``parent_block_hash`` None and ``token_ids`` empty: the daemon stores neither (a key already
  names its whole prefix), ``lora_id``/``lora_name`` None (a LoRA is part of the namespace).
- ``medium``: GPU, CPU or STORAGE (disk and S3); ``ownership`` names kvstore's tier
  ("kvstore/disk", "kvstore/s3"), as vLLM's offloading tiers name themselves, so a consumer keeping
  (medium, ownership) residencies tells disk from S3; ``locality`` is LOCAL, or REMOTE for a tier
  other hosts share (S3).
- ``BlockRemoved``: the keys that left one tier (runs of removals from one tier are one event).
- ``AllBlocksCleared``: once, first, when the daemon starts: whatever a consumer knew of an earlier
  run is void; the blocks the daemon found on disk (and in S3) follow as BlockStored.
"""

from __future__ import annotations

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


def tier_ownership(tier_name: str) -> str:
    return f"kvstore/{tier_name}"
