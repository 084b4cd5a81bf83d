"""KV-event replay: the batches published last, and the ROUTER socket that sends them again.

A subscriber that saw a seq gap, or joins late, asks the replay socket (``events_replay``) for
every batch from a start seq on (the format: ``kvstore/daemon/event_format.py``); replaying from
seq 0 rebuilds exactly which tier holds which key. ``ReplayServer`` keeps the last
``REPLAY_BATCHES`` batches (at most ``REPLAY_BYTES``) and answers on the publisher's thread
(``kvstore/daemon/events.py``), which owns the socket; ``replay`` is a consumer's side.

A request from a seq older than the oldest batch kept (a router joining a daemon that has run for
a while) is answered with a snapshot first: what the tiers hold now, as ``AllBlocksCleared`` and a
``BlockStored`` per block with parents before children (the publisher's `snapshot`), in the seqs
just before the oldest batch kept, then the kept batches. Applied in order they give the state
the stream describes now: every block whose residency changed since is settled by its last event
in the kept batches, every other one by the snapshot.

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
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from typing import Callable

import zmq

from kvstore.daemon.event_format import END_SEQ, KVEventBatch, decode_batch

log = logging.getLogger(__name__)

#: Published batches kept for replay (vLLM keeps 10,000 too), and at most this many bytes of them.
REPLAY_BATCHES = 10_000
REPLAY_BYTES = 64 * 2**20
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
#: The replay socket's options, set before its bind: a full peer queue raises Again (the reply
#: waits) instead of dropping the batch unseen.
SOCKET_OPTIONS = {zmq.SNDHWM: REPLAY_SEND_HWM, zmq.ROUTER_MANDATORY: 1}
#: A reply whose peer has read nothing for this long is abandoned (counted, no end marker).
REPLY_STALL_S = 2.0
#: Replay requests read per turn, so that a flood of them cannot hold up live batches either.
REQUESTS_PER_TURN = 64
#: A repeated warning is logged the first time, then at most once per this many seconds.
WARN_EVERY_S = 60.0


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

    __slots__ = ("peer", "next_seq", "sent", "waiting_since", "asked_again", "snapshot")

    def __init__(self, peer: bytes, start: int) -> None:
        self.peer = peer
        self.next_seq = start
        #: (seq, payload) of the snapshot batches still to send, oldest first.
        self.snapshot: deque[tuple[int, bytes]] = deque()
        self.sent = 0
        #: When the peer's queue was first found full (monotonic), None while it takes messages.
        self.waiting_since: float | None = None
        #: A start seq the same peer asked for while this reply ran: the next reply.
        self.asked_again: int | None = None


class ReplayServer:
    """The last published batches, numbered, and the replies that send them again.

    Every call is made on the publisher's thread. ``keep`` numbers each batch (the stream's seqs
    are given here, kept whether or not a replay socket is bound); ``sock`` is the ROUTER socket
    the publisher bound with ``SOCKET_OPTIONS`` (None: no replay is served). Counters: ``replays``
    (requests by outcome: served, refused, malformed; replies abandoned).
    """

    def __init__(self, topic: bytes, replay_batches: int = REPLAY_BATCHES, metrics=None,
                 snapshot: Callable[[int], list[bytes]] | None = None) -> None:
        """``snapshot(batches)``: the payloads of at most that many batches saying what the tiers
        hold now (None: replies hold kept batches only)."""
        self._topic = topic
        self._snapshot = snapshot
        self._metrics = metrics
        self.sock: zmq.Socket | None = None
        #: The seq the next batch gets.
        self.next_seq = 0
        #: (seq, payload) of the last batches, oldest first, one entry per seq: a seq lost to the full
        #: queue has payload None, so that a seq's entry is at index seq - first seq. Within
        #: ``replay_batches`` batches and REPLAY_BYTES bytes (`keep`).
        self._buffer: deque[tuple[int, bytes | None]] = deque()
        self._buffer_bytes, self._replay_batches = 0, replay_batches
        self.replays = {"served": 0, "refused": 0, "malformed": 0, "abandoned": 0}
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

    def keep(self, payload: bytes | None) -> int:
        """Keep the next batch for replay (None: a seq lost to the full queue, which no batch
        carries), dropping the oldest past ``replay_batches`` or REPLAY_BYTES; its seq."""
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        self._buffer_bytes += len(payload or b"")
        while len(self._buffer) > 1 and (len(self._buffer) > self._replay_batches
                                         or self._buffer_bytes > REPLAY_BYTES):
            _, dropped = self._buffer.popleft()
            self._buffer_bytes -= len(dropped or b"")
        return seq

    def poll_timeout_ms(self) -> int | None:
        """How long the publisher's thread may sleep: 0 while a reply can send, 10 ms while every
        reply waits for its peer to read, else until a warning's count is due (None: until woken)."""
        if any(r.waiting_since is None for r in self._replies.values()):
            return 0
        timeout = 10.0 if self._replies else None
        for warning in (self._malformed, self._refused, self._abandoned):
            due = warning.due()
            if due is not None:
                wait_ms = max(0.0, (due - time.monotonic()) * 1000) + 1
                timeout = wait_ms if timeout is None else min(timeout, wait_ms)
        return None if timeout is None else int(timeout)

    def flush_warnings(self, force: bool = False) -> None:
        """Log the counts of repeated warnings that are due (``force``: all of them, at close)."""
        for warning in (self._malformed, self._refused, self._abandoned):
            warning.flush(force)

    def _count(self, outcome: str) -> None:
        self.replays[outcome] += 1
        if self._metrics is not None:
            self._metrics.events_replays.labels(outcome).inc()

    def take_requests(self) -> None:
        """Read up to REQUESTS_PER_TURN requests; start a reply for each the bounds allow."""
        for _ in range(REQUESTS_PER_TURN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
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
                self.sock.send_multipart((peer, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # its queue is full, or it left: it waits, then asks again
                pass

    def step_replies(self, publish_queued: Callable[[], None]) -> None:
        """Each reply in progress sends up to REPLY_STEP batches, live batches first
        (``publish_queued`` publishes them)."""
        for reply in list(self._replies.values()):
            publish_queued()
            if not self._step(reply):
                del self._replies[reply.peer]

    def _step(self, reply: _Reply) -> bool:
        """Send the reply's next batches; False when it is over (ended, abandoned, or its peer left)."""
        for _ in range(REPLY_STEP):
            done = reply.sent >= REPLY_BATCHES or reply.next_seq >= self.next_seq
            if done:
                frames = (reply.peer, b"", b"", END_SEQ, b"")
            else:
                first = self._buffer[0][0]
                if reply.next_seq < first:  # before the oldest batch kept: a snapshot stands for them
                    if not reply.snapshot and self._snapshot is not None:
                        payloads = self._snapshot(min(first - reply.next_seq, REPLY_BATCHES // 2))
                        reply.snapshot.extend(zip(range(first - len(payloads), first), payloads))
                    reply.next_seq = first
                if reply.snapshot:
                    seq, payload = reply.snapshot[0]
                else:
                    seq, payload = self._buffer[reply.next_seq - first]
                if payload is None:  # a seq lost to the full queue: nothing to send
                    reply.next_seq += 1
                    continue
                frames = (reply.peer, b"", self._topic, seq.to_bytes(8, "big"), payload)
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
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
                reply.snapshot.clear()
                continue
            if reply.snapshot:
                reply.snapshot.popleft()
            else:
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
