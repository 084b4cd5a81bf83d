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

Nothing is lost without a trace:

- Events the full queue dropped cost a seq number that no batch carries, between the batches
  before and after them: subscribers see the gap live, and replay cannot fill it (the events are
  gone: from there on the consumer knows its view of this daemon is incomplete).
- A reply is never thinned out: the replay socket refuses to queue past a peer's limit
  (ROUTER_MANDATORY), and the reply waits for the peer to read. A peer that reads nothing for
  ``REPLY_STALL_S`` loses the rest of its reply, end marker included (counted): what it got is an
  unbroken run of seqs, and it asks again from the next one when its wait times out.

Replay is bounded so that it never holds up live batches: requests are answered at
``REPLAY_RATE`` a second (a token bucket over all peers, bursts of ``REPLAY_BURST``), at most
``MAX_REPLIES`` at once, each reply at most ``REPLY_BATCHES`` batches (the consumer asks again from
the seq after the last it got; ``replay`` below does). Replies go out ``REPLY_STEP`` batches at a
time, with every queued live batch published before each step. A request over the rate, or beyond
``MAX_REPLIES``, gets the end marker alone. Malformed requests, refusals and abandoned replies are
counted (``kvstore_events_replays{outcome}``) and logged once, then at most once a minute with a
count.

Who can read them: the sockets carry no authentication, so the daemon confines them
(``kvstore.daemon.config``): a ``tcp://`` address must be a loopback IP address (a name counts only if
every address it resolves to is loopback), and a daemon with an ``auth_token`` publishes on
``ipc://`` only, since every local user reaches loopback TCP; ``events_public`` lifts both. An
``ipc://`` socket is created 0600 (umask at bind): only the daemon's user can connect.
"""

from __future__ import annotations

import errno
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
#: Published batches kept for replay (vLLM keeps 10,000 too), and at most this many bytes of them.
REPLAY_BATCHES = 10_000
REPLAY_BYTES = 64 * 2**20
#: Most events one batch carries.
BATCH_EVENTS = 1024
#: Batches ZMQ queues per subscriber before dropping them for that subscriber (who sees the seq gap
#: and replays): with batches of at most BATCH_EVENTS events, a stalled subscriber costs the daemon
#: at most about 1,000 x 60 KiB.
SEND_HWM = 1_000
#: The replay socket's end-of-replay seq, as vLLM sends it.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Replay requests answered per second (a token bucket over all peers), and the burst allowed.
REPLAY_RATE, REPLAY_BURST = 10.0, 20
#: Replies in progress at once; a request beyond them gets the end marker alone.
MAX_REPLIES = 8
#: Most batches one reply carries; the consumer asks again from the seq after the last it got.
REPLY_BATCHES = 1000
#: Batches a reply sends per turn; queued live batches are published before every turn.
REPLY_STEP = 32
#: Messages ZMQ queues for one replay peer; past them a reply waits for the peer to read.
REPLAY_SEND_HWM = 64
#: A reply whose peer has read nothing for this long is abandoned (counted, no end marker).
REPLY_STALL_S = 2.0
#: Replay requests read per turn, so that a flood of them cannot hold up live batches either.
REQUESTS_PER_TURN = 64
#: A repeated warning is logged the first time, then at most once per this many seconds.
WARN_EVERY_S = 60.0

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

_STORED, _REMOVED, _CLEARED, _LOST = 0, 1, 2, 3
#: Put in the queue where the full queue dropped events: the batches around it get a seq gap.
_LOST_MARK = (_LOST, 0, b"", 0)


class _Bucket:
    """A token bucket: ``take`` is True at most ``rate`` times a second, ``burst`` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class _RepeatedWarning:
    """A warning that may recur thousands of times a second: logged the first time, then at most
    once every ``WARN_EVERY_S`` with how many times it recurred meanwhile."""

    def __init__(self, first: str, more: str) -> None:
        """``first`` takes the occurrence's detail (``{}``), ``more`` the count since the last line."""
        self._first, self._more = first, more
        self._unlogged = 0
        self._logged_at: float | None = None

    def note(self, detail: str) -> None:
        if self._logged_at is None:
            log.warning(self._first.format(detail) + " (repeats are counted, logged once a minute at most)")
            self._logged_at = time.monotonic()
        else:
            self._unlogged += 1
            self.flush()

    def due(self) -> float | None:
        """When the count of repeats should be logged (monotonic seconds), None if none wait."""
        return self._logged_at + WARN_EVERY_S if self._unlogged else None

    def flush(self, force: bool = False) -> None:
        if self._unlogged and (force or time.monotonic() >= self.due()):
            log.warning(self._more.format(self._unlogged))
            self._unlogged = 0
            self._logged_at = time.monotonic()


class _Reply:
    """A replay in progress to one peer: the next seq to send and how many batches went out."""

    __slots__ = ("peer", "next_seq", "sent", "waiting_since", "asked_again")

    def __init__(self, peer: bytes, start: int) -> None:
        self.peer = peer
        self.next_seq = start
        self.sent = 0
        #: When the peer's queue was first found full (monotonic), None while it takes messages.
        self.waiting_since: float | None = None
        #: A start seq the same peer asked for while this reply ran: the next reply.
        self.asked_again: int | None = None


class EventPublisher:
    """Publishes tier changes from a thread of its own.

    ``stored`` and ``removed`` are called on the store's event loop (``kvstore.daemon.residency``, the
    one path by which the store records a tier change) and only append to a deque; ``start``
    binds the sockets (OSError naming the address when one is taken) and starts the thread;
    ``close`` publishes what is queued and stops it. Counters: ``published`` (events sent),
    ``dropped`` (events refused by the full queue), ``replays`` (requests by outcome: served,
    refused, malformed; replies abandoned).
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
        #: (seq, payload) of the last batches, oldest first, one entry per seq: a seq lost to the full
        #: queue has payload None, so that a seq's entry is at index seq - first seq. Within
        #: ``replay_batches`` batches and REPLAY_BYTES bytes (`_keep`).
        self._buffer: deque[tuple[int, bytes | None]] = deque()
        self._buffer_bytes, self._replay_batches = 0, replay_batches
        self.published = self.dropped = 0
        self.replays = {"served": 0, "refused": 0, "malformed": 0, "abandoned": 0}
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._bucket = _Bucket(REPLAY_RATE, REPLAY_BURST)
        self._replies: dict[bytes, _Reply] = {}
        self._malformed = _RepeatedWarning("ignored a malformed KV-event replay request ({})",
                                           "ignored {} more malformed KV-event replay requests")
        self._refused = _RepeatedWarning(
            "refused a KV-event replay request ({})",
            f"refused {{}} more KV-event replay requests (over {REPLAY_RATE:g} a second or {MAX_REPLIES} replies "
            f"at once)")
        self._abandoned = _RepeatedWarning("abandoned a KV-event replay ({})",
                                           "abandoned {} more KV-event replays (peers that read nothing or left)")
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
            # One mark per run of drops (the queue may pass its depth by this one entry); the
            # thread only pops from the left, so the last entry stays put while we look at it.
            try:
                marked = self._pending[-1] is _LOST_MARK
            except IndexError:
                marked = False
            if not marked:
                self._pending.append(_LOST_MARK)
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
        self._pub = self._bind(zmq.PUB, self.endpoint, "events_listen", {zmq.SNDHWM: SEND_HWM})
        if self.replay_endpoint:
            # A full peer queue raises Again (the reply waits) instead of dropping the batch unseen.
            self._replay = self._bind(zmq.ROUTER, self.replay_endpoint, "events_replay",
                                      {zmq.SNDHWM: REPLAY_SEND_HWM, zmq.ROUTER_MANDATORY: 1})
        self._signalled = True  # what the store queued before the start (the blocks found on disk) goes first
        os.write(self._wake_w, b"\0")
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()
        log.info("publishing KV events on %s%s", self.endpoint,
                 f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    def _bind(self, kind: int, endpoint: str, setting: str, options: dict[int, int]) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in options.items():  # before the bind: a peer's queue takes them when it connects
            sock.setsockopt(option, value)
        # An ipc socket is born 0600: only this user can connect (the events carry no token).
        old_umask = os.umask(0o177) if endpoint.startswith("ipc://") else None
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self._close_sockets()
            raise OSError(f"cannot publish KV events on {endpoint} ({setting}): {exc.strerror.lower()}") from None
        finally:
            if old_umask is not None:
                os.umask(old_umask)
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
        for warning in (self._malformed, self._refused, self._abandoned):
            warning.flush(force=True)
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
        while True:
            ready = dict(poller.poll(self._poll_timeout_ms()))
            if self._wake_r in ready:
                # Empty the pipe, then clear the flag, then drain: an event queued before the clear
                # is drained below, one queued after it writes a byte that wakes the next poll.
                # (Clearing before the read could swallow that byte and sleep on a queued event.)
                os.read(self._wake_r, 4096)
                self._signalled = False
            try:
                self._publish_queued()
                if self._replay is not None:
                    if self._replay in ready:
                        self._take_requests()
                    self._step_replies()
                for warning in (self._malformed, self._refused, self._abandoned):
                    warning.flush()
            except zmq.ZMQError:  # never let the thread die: the store would queue into the void
                log.exception("publishing KV events failed")
            if self._closing:
                return

    def _poll_timeout_ms(self) -> int | None:
        """0 while a reply can send, 10 ms while every reply waits for its peer to read, else until
        a warning's count is due (None: until woken)."""
        if any(r.waiting_since is None for r in self._replies.values()):
            return 0
        timeout = 10.0 if self._replies else None
        for warning in (self._malformed, self._refused, self._abandoned):
            due = warning.due()
            if due is not None:
                wait_ms = max(0.0, (due - time.monotonic()) * 1000) + 1
                timeout = wait_ms if timeout is None else min(timeout, wait_ms)
        return None if timeout is None else int(timeout)

    def _publish_queued(self) -> None:
        while self._pending:
            self._publish()

    def _publish(self) -> None:
        """One batch of at most BATCH_EVENTS queued events; a run of removals from one tier is one
        BlockRemoved. Where the full queue dropped events, the batch ends and a seq goes unused."""
        events: list[Any] = []
        removed: list[bytes] = []
        removed_level = -1
        taken = 0
        lost = False
        while self._pending and taken < BATCH_EVENTS:
            kind, level, key, tokens = self._pending.popleft()
            if kind == _LOST:
                lost = True
                break
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
        if events:
            payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
            seq = self._seq
            # Kept for replay before it is sent: a failed send is a gap a replay fills.
            self._keep(seq, payload)
            self._seq += 1
            self.published += taken
            if self._metrics is not None:
                self._metrics.events_published.inc(taken)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        if lost:  # a seq no batch carries: subscribers see the gap, live and in replay
            self._keep(self._seq, None)
            self._seq += 1

    def _keep(self, seq: int, payload: bytes | None) -> None:
        """Keep a batch for replay, dropping the oldest past ``replay_batches`` or REPLAY_BYTES."""
        self._buffer.append((seq, payload))
        self._buffer_bytes += len(payload or b"")
        while len(self._buffer) > 1 and (len(self._buffer) > self._replay_batches
                                         or self._buffer_bytes > REPLAY_BYTES):
            _, dropped = self._buffer.popleft()
            self._buffer_bytes -= len(dropped or b"")

    def _removed_event(self, keys: list[bytes], level: int) -> BlockRemoved:
        medium, ownership, locality = self._levels[level]
        return BlockRemoved(block_hashes=keys, medium=medium, locality=locality, ownership=ownership)

    # -- replay ---------------------------------------------------------------------------------

    def _count(self, outcome: str) -> None:
        self.replays[outcome] += 1
        if self._metrics is not None:
            self._metrics.events_replays.labels(outcome).inc()

    def _take_requests(self) -> None:
        """Read up to REQUESTS_PER_TURN requests; start a reply for each the bounds allow."""
        for _ in range(REQUESTS_PER_TURN):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                self._count("malformed")
                self._malformed.note(f"{len(frames)} frames, {sum(map(len, frames))} bytes")
                continue
            peer, _, start = frames
            first = int.from_bytes(start, "big")
            running = self._replies.get(peer)
            if not self._bucket.take():
                self._refuse(peer, running, f"more than {REPLAY_RATE:g} a second")
            elif running is not None:  # the same peer again: its reply follows the one in progress
                running.asked_again = first
                self._count("served")
            elif len(self._replies) >= MAX_REPLIES:
                self._refuse(peer, None, f"{MAX_REPLIES} replies in progress")
            else:
                self._replies[peer] = _Reply(peer, first)
                self._count("served")

    def _refuse(self, peer: bytes, running: _Reply | None, why: str) -> None:
        """The end marker alone, unless a reply to the peer is in progress (a marker would cut it)."""
        self._count("refused")
        self._refused.note(why)
        if running is None:
            try:
                self._replay.send_multipart((peer, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # its queue is full, or it left: it waits, then asks again
                pass

    def _step_replies(self) -> None:
        """Each reply in progress sends up to REPLY_STEP batches, live batches first."""
        for reply in list(self._replies.values()):
            self._publish_queued()
            if not self._step(reply):
                del self._replies[reply.peer]

    def _step(self, reply: _Reply) -> bool:
        """Send the reply's next batches; False when it is over (ended, abandoned, or its peer left)."""
        for _ in range(REPLY_STEP):
            done = reply.sent >= REPLY_BATCHES or reply.next_seq >= self._seq
            if done:
                frames = (reply.peer, b"", b"", END_SEQ, b"")
            else:
                first = self._buffer[0][0]
                if reply.next_seq < first:  # fell out of the buffer meanwhile: the seqs show the jump
                    reply.next_seq = first
                seq, payload = self._buffer[reply.next_seq - first]
                if payload is None:  # a seq lost to the full queue: nothing to send
                    reply.next_seq += 1
                    continue
                frames = (reply.peer, b"", self._topic, seq.to_bytes(8, "big"), payload)
            try:
                self._replay.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # the peer's queue is full: wait for it to read
                now = time.monotonic()
                if reply.waiting_since is None:
                    reply.waiting_since = now
                    return True
                if now - reply.waiting_since < REPLY_STALL_S:
                    return True
                self._count("abandoned")
                self._abandoned.note(f"its peer read nothing for {REPLY_STALL_S:g} s, {reply.sent} batches sent")
                return False
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                self._count("abandoned")
                self._abandoned.note(f"its peer left after {reply.sent} batches")
                return False
            reply.waiting_since = None
            if done:
                if reply.asked_again is None:
                    return False
                reply.next_seq, reply.sent, reply.asked_again = reply.asked_again, 0, None
                continue
            reply.next_seq += 1
            reply.sent += 1
        return True


def replay(endpoint: str, start_seq: int = 0, timeout_s: float = 5.0) -> list[tuple[int, KVEventBatch]]:
    """Ask a publisher's replay socket for its buffered batches from ``start_seq`` on, as
    (seq, batch), asking again after each full reply (REPLY_BATCHES). TimeoutError when it does not
    answer in ``timeout_s``."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)  # not REQ: a REQ socket takes one reply, and replay sends many
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        batches: list[tuple[int, KVEventBatch]] = []
        while True:
            sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            got = 0
            while True:
                try:
                    _, _, seq, payload = sock.recv_multipart()
                except zmq.Again:
                    raise TimeoutError(f"no KV-event replay from {endpoint} within {timeout_s} s") from None
                if seq == END_SEQ:
                    break
                batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))
                got += 1
            if got < REPLY_BATCHES:
                return batches
            start_seq = batches[-1][0] + 1
    finally:
        sock.close()
