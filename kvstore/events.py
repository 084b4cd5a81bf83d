"""KV events: every change of which tier holds which block, in vLLM's KV-event wire format.

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

Replaying every batch from seq 0 rebuilds exactly which tier holds which key. The store's event
loop only appends to a bounded queue (``EVENT_QUEUE_DEPTH`` events; when full, events are dropped
and counted, never waited for); a thread drains it into batches, publishes them and keeps the last
``REPLAY_BATCHES`` for replay. A slow or stalled subscriber costs nothing upstream: ZMQ drops
batches for that subscriber alone (it sees a seq gap and asks for a replay).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Sequence

import msgspec
import zmq

log = logging.getLogger(__name__)

#: Events the store may have queued for the publisher thread before it drops (and counts) them.
EVENT_QUEUE_DEPTH = 100_000
#: Published batches kept for replay (vLLM keeps 10,000 too).
REPLAY_BATCHES = 10_000
#: Most events one batch carries.
BATCH_EVENTS = 1024
#: Batches ZMQ queues per subscriber before dropping them for that subscriber.
SEND_HWM = 100_000
#: The replay socket's end-of-replay seq, as vLLM sends it.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
_MEDIUMS = {"gpu": MEDIUM_GPU, "cpu": MEDIUM_CPU}


# -- the wire format: field names, order and options as vLLM's classes ---------------------------

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


# -- the publisher --------------------------------------------------------------------------------

_STORED, _REMOVED, _CLEARED = 0, 1, 2


class EventPublisher:
    """Publishes tier changes from a thread of its own.

    ``stored`` and ``removed`` are called on the store's event loop (``kvstore.residency``, the
    one path by which the store records a tier change) and only append to a deque; ``start``
    binds the sockets (OSError naming the address when one is taken) and starts the thread;
    ``close`` publishes what is queued and stops it. Counters:
    ``published`` (events sent), ``dropped`` (events refused by the full queue).
    """

    def __init__(self, endpoint: str, tiers: Sequence[tuple[str, bool]], replay_endpoint: str = "",
                 topic: str = "", queue_depth: int = EVENT_QUEUE_DEPTH, replay_batches: int = REPLAY_BATCHES,
                 metrics=None) -> None:
        """``tiers``: (name, shared) of each tier level, top first."""
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._queue_depth = queue_depth
        self._metrics = metrics
        self._levels = [(tier_medium(name), tier_ownership(name), "REMOTE" if shared else "LOCAL")
                        for name, shared in tiers]
        self._pending: deque[tuple[int, int, bytes, int]] = deque()
        self._pending.append((_CLEARED, 0, b"", 0))  # consumers drop what an earlier run published
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self.published = self.dropped = 0
        self._seq = 0
        # The thread sleeps in poll() on the replay socket and this pipe; the loop writes one byte
        # when the thread may be asleep (``_signalled`` clear), not one per event.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._signalled = False
        self._closing = False
        self._context: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None

    # -- the store's side (event loop) ----------------------------------------------------------

    def stored(self, key: bytes, level: int, tokens: int) -> None:
        self._queue((_STORED, level, key, tokens))

    def removed(self, key: bytes, level: int) -> None:
        self._queue((_REMOVED, level, key, 0))

    def _queue(self, event: tuple[int, int, bytes, int]) -> None:
        if len(self._pending) >= self._queue_depth:
            self.dropped += 1
            if self._metrics is not None:
                self._metrics.events_dropped.inc()
            return
        self._pending.append(event)
        if not self._signalled and self._thread is not None:
            self._signalled = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the sockets and start publishing. OSError (one line) when an address cannot be bound."""
        self._context = zmq.Context()
        self._pub = self._bind(zmq.PUB, self.endpoint, "events_listen")
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        if self.replay_endpoint:
            self._replay = self._bind(zmq.ROUTER, self.replay_endpoint, "events_replay")
        self._signalled = True  # what the store queued before the start (the blocks found on disk) goes first
        os.write(self._wake_w, b"\0")
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()
        log.info("publishing KV events on %s%s", self.endpoint,
                 f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    def _bind(self, kind: int, endpoint: str, setting: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self._close_sockets()
            raise OSError(f"cannot publish KV events on {endpoint} ({setting}): {exc.strerror.lower()}") from None
        return sock

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued (for at most ``timeout`` seconds), then close the sockets."""
        if self._thread is not None:
            self._closing = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass
            self._thread.join(timeout)
            self._thread = None
        self._close_sockets()
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=100)  # a moment for the last batches to leave
        self._pub = self._replay = None
        if self._context is not None:
            self._context.term()
            self._context = None

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        encoder = msgspec.msgpack.Encoder()
        while True:
            ready = dict(poller.poll())
            if self._wake_r in ready:
                # Empty the pipe, then clear the flag, then drain: an event queued before the clear
                # is drained below, one queued after it writes a byte that wakes the next poll.
                # (Clearing before the read could swallow that byte and sleep on a queued event.)
                os.read(self._wake_r, 4096)
                self._signalled = False
            try:
                while self._pending:
                    self._publish(encoder)
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
            except zmq.ZMQError:  # never let the thread die: the store would queue into the void
                log.exception("publishing KV events failed")
            if self._closing:
                return

    def _publish(self, encoder: msgspec.msgpack.Encoder) -> None:
        """One batch of at most BATCH_EVENTS queued events; a run of removals from one tier is one
        BlockRemoved."""
        events: list[Any] = []
        removed: list[bytes] = []
        removed_level = -1
        taken = 0
        while self._pending and taken < BATCH_EVENTS:
            kind, level, key, tokens = self._pending.popleft()
            taken += 1
            if removed and (kind != _REMOVED or level != removed_level):
                events.append(self._removed_event(removed, removed_level))
                removed = []
            if kind == _STORED:
                medium, ownership, locality = self._levels[level]
                events.append(BlockStored(block_hashes=[key], parent_block_hash=None, token_ids=[],
                                          block_size=tokens, lora_id=None, medium=medium, lora_name=None,
                                          locality=locality, ownership=ownership))
            elif kind == _REMOVED:
                removed.append(key)
                removed_level = level
            else:
                events.append(AllBlocksCleared())
        if removed:
            events.append(self._removed_event(removed, removed_level))
        payload = encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self._seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.published += taken
        if self._metrics is not None:
            self._metrics.events_published.inc(taken)

    def _removed_event(self, keys: list[bytes], level: int) -> BlockRemoved:
        medium, ownership, locality = self._levels[level]
        return BlockRemoved(block_hashes=keys, medium=medium, locality=locality, ownership=ownership)

    def _serve_replay(self) -> None:
        """Answer every waiting replay request: the buffered batches from its start seq, then END_SEQ."""
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def replay(endpoint: str, start_seq: int = 0, timeout_s: float = 5.0) -> list[tuple[int, KVEventBatch]]:
    """Ask a publisher's replay socket for its buffered batches from ``start_seq`` on, as
    (seq, batch). TimeoutError when it does not answer in ``timeout_s``."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)  # not REQ: a REQ socket takes one reply, and replay sends many
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches = []
        while True:
            try:
                _, _, seq, payload = sock.recv_multipart()
            except zmq.Again:
                raise TimeoutError(f"no KV-event replay from {endpoint} within {timeout_s} s") from None
            if seq == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    finally:
        sock.close()
