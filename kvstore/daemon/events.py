"""KV events: every change of which tier holds which block, published for routers from a thread.

Routers that place requests by cached prefix (llm-d, Dynamo) read the stream in vLLM's KV-event
wire format (``kvstore/daemon/event_format.py``: the sockets' frames, the events, what kvstore puts
in them); a subscriber that missed batches asks the replay socket for them again
(``kvstore/daemon/event_replay.py``: what is kept, the replies' bounds, ``replay``).

The store's event loop only appends to a bounded queue (``EVENT_QUEUE_DEPTH`` events; when full,
events are dropped and counted, never waited for, and cost a seq no batch carries); a thread drains
it into batches, publishes them and keeps them for replay. A slow or stalled subscriber costs
nothing upstream: ZMQ drops batches for that subscriber alone (it sees a seq gap and asks for a
replay).

Who can read them: the sockets carry no authentication, so the daemon confines them
(``kvstore.daemon.config``): a ``tcp://`` address must be a loopback IP address (a name counts only if
every address it resolves to is loopback), and a daemon with an ``auth_token`` publishes on
``ipc://`` only, since every local user reaches loopback TCP; ``events_public`` lifts both. An
``ipc://`` socket is created 0600 (umask at bind): only the daemon's user can connect.
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

from kvstore.block import BlockHeader
from kvstore.keys import parents_first
from kvstore.daemon.event_format import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hash,
                                         sub_block_hashes, tier_medium)
from kvstore.daemon.event_replay import REPLAY_BATCHES, SOCKET_OPTIONS, ReplayServer

log = logging.getLogger(__name__)

#: Events the store may have queued for the publisher thread before it drops (and counts) them.
EVENT_QUEUE_DEPTH = 100_000
#: Most events one batch carries.
BATCH_EVENTS = 1024
#: Seconds without a batch after which the publisher sends an empty one: a router that subscribed
#: meanwhile sees the next seq, finds it missed the ones before, and asks for them (Dynamo's
#: indexer does), instead of learning nothing until the daemon's next change.
HEARTBEAT_S = 2.0
#: Bytes of encoded BlockStored events the publisher keeps for replay's snapshot (one per block and
#: tier held, about 1 KiB with 256 token ids); past them it keeps none, and says so once. Replies
#: in progress at once share one snapshot while nothing changes, and hold at most MAX_REPLIES.
SNAPSHOT_BYTES = 128 * 2**20
#: Batches ZMQ queues per subscriber before dropping them for that subscriber (who sees the seq gap
#: and replays): with batches of at most BATCH_EVENTS events, a stalled subscriber costs the daemon
#: at most about 1,000 x 60 KiB.
SEND_HWM = 1_000

class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A KVEventBatch of events encoded already (the snapshot's)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_STORED, _REMOVED, _CLEARED, _LOST = 0, 1, 2, 3
#: Put in the queue where the full queue dropped events: the batches around it get a seq gap.
_LOST_MARK = (_LOST, 0, b"", None)


class EventPublisher:
    """Publishes tier changes from a thread of its own.

    ``stored`` and ``removed`` are called on the store's event loop (``kvstore.daemon.residency``, the
    one path by which the store records a tier change) and only append to a deque; ``start``
    binds the sockets (OSError naming the address when one is taken) and starts the thread;
    ``close`` publishes what is queued and stops it. Counters: ``published`` (events sent),
    ``dropped`` (events refused by the full queue), ``replays`` (the replay socket's requests by
    outcome: served, refused, malformed; replies abandoned).
    """

    def __init__(self, endpoint: str, tiers: Sequence[tuple[str, bool]], replay_endpoint: str = "",
                 topic: str = "", queue_depth: int = EVENT_QUEUE_DEPTH, replay_batches: int = REPLAY_BATCHES,
                 block_size: int = 0, metrics=None) -> None:
        """``tiers``: (name, shared) of each tier level, top first. ``block_size``: tokens per
        published block (each stored block as its whole runs of that many), or 0: blocks whole."""
        self.block_size = block_size
        #: With block_size: each published key's sub-block count and how many tiers hold it, so a
        #: removal names the same ids (bounded by the blocks the tiers hold; the loop's alone).
        self._runs: dict[bytes, list[int]] = {}
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._queue_depth = queue_depth
        self._metrics = metrics
        self._levels = [(tier_medium(name), "REMOTE" if shared else "LOCAL") for name, shared in tiers]
        self._pending: deque[tuple[int, int, bytes, BlockHeader | int | None]] = deque()
        self._pending.append((_CLEARED, 0, b"", None))  # consumers drop what an earlier run published
        #: What the tiers hold as the stream told it: (level, block id) -> (parent id, the encoded
        #: BlockStored), for replay's snapshot; None past SNAPSHOT_BYTES. The thread's alone.
        self._held: dict[tuple[int, int], tuple[int | None, bytes]] | None = {}
        self._held_bytes = 0
        #: (changes to _held so far, batches asked, the payloads): the last snapshot, shared by
        #: replies asked for while nothing changed.
        self._held_changes = 0
        self._last_snapshot: tuple[int, int, list[bytes]] | None = None
        #: The published batches kept for replay (it numbers them) and the replies it serves.
        self._replay = ReplayServer(self._topic, replay_batches, metrics, snapshot=self.snapshot)
        self.published = self.dropped = 0
        self._encoder = msgspec.msgpack.Encoder()
        # The thread sleeps in poll() on the replay socket and this pipe; the loop writes one byte
        # when the thread may be asleep (``_signalled`` clear), not one per event.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._signalled = False
        self._closing = False
        self._last_sent = time.monotonic()
        self._context: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._thread: threading.Thread | None = None

    # -- the store's side (event loop) ----------------------------------------------------------

    def stored(self, key: bytes, level: int, header: BlockHeader | None) -> None:
        """Tier ``level`` now holds ``key``, whose header (None: unreadable) says its tokens,
        parent and token ids."""
        if self.block_size and header is not None:
            runs = self._runs.setdefault(key, [header.tokens // self.block_size, 0])
            runs[1] += 1
        self._queue((_STORED, level, key, header))

    def removed(self, key: bytes, level: int) -> None:
        runs = 1
        if self.block_size and (held := self._runs.get(key)) is not None:
            runs = held[0]
            held[1] -= 1
            if held[1] <= 0:
                del self._runs[key]
        self._queue((_REMOVED, level, key, runs))

    def _queue(self, event: tuple[int, int, bytes, BlockHeader | int | None]) -> None:
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
            self._replay.sock = self._bind(zmq.ROUTER, self.replay_endpoint, "events_replay", SOCKET_OPTIONS)
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
        self._replay.flush_warnings(force=True)
        self._close_sockets()
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay.sock):
            if sock is not None:
                sock.close(linger=100)  # a moment for the last batches to leave
        self._pub = self._replay.sock = None
        if self._context is not None:
            self._context.term()
            self._context = None

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay.sock is not None:
            poller.register(self._replay.sock, zmq.POLLIN)
        while True:
            timeout = self._replay.poll_timeout_ms()
            heartbeat_ms = max(0, int((self._last_sent + HEARTBEAT_S - time.monotonic()) * 1000)) + 1
            ready = dict(poller.poll(heartbeat_ms if timeout is None else min(timeout, heartbeat_ms)))
            if self._wake_r in ready:
                # Empty the pipe, then clear the flag, then drain: an event queued before the clear
                # is drained below, one queued after it writes a byte that wakes the next poll.
                # (Clearing before the read could swallow that byte and sleep on a queued event.)
                os.read(self._wake_r, 4096)
                self._signalled = False
            try:
                self._publish_queued()
                if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                    self._send([])
                if self._replay.sock is not None:
                    if self._replay.sock in ready:
                        self._replay.take_requests()
                    self._replay.step_replies(self._publish_queued)  # live batches first
                self._replay.flush_warnings()
            except Exception:  # noqa: BLE001 - never let the thread die: the store would queue into the void
                log.exception("publishing KV events failed")
            if self._closing:
                return

    def _publish_queued(self) -> None:
        while self._pending:
            self._publish()

    def _publish(self) -> None:
        """One batch of at most BATCH_EVENTS queued events; a run of removals from one tier is one
        BlockRemoved. Where the full queue dropped events, the batch ends and a seq goes unused."""
        events: list[Any] = []
        removed: list[int] = []
        removed_level = -1
        taken = 0
        lost = False
        while self._pending and taken < BATCH_EVENTS:
            kind, level, key, detail = self._pending.popleft()
            if kind == _LOST:
                lost = True
                break
            taken += 1
            if removed and (kind != _REMOVED or level != removed_level):
                events.append(self._removed_event(removed, removed_level))
                removed = []
            if kind == _STORED:
                if detail is not None and (event := self._stored_event(key, level, detail)) is not None:
                    events.append(event)
                    self._hold(level, event)
            elif kind == _REMOVED:
                ids = self._ids(key, detail)
                if not ids:  # shorter than one published block: it was never announced
                    continue
                removed.extend(ids)
                removed_level = level
                if self._held is not None and (gone := self._held.pop((level, ids[-1]), None)) is not None:
                    self._held_bytes -= len(gone[1])
                    self._held_changes += 1
            else:
                events.append(AllBlocksCleared())
                if self._held is not None:
                    self._held.clear()
                    self._held_bytes = 0
                    self._held_changes += 1
        if removed:
            events.append(self._removed_event(removed, removed_level))
        if events:
            self._send(events)
            self.published += taken
            if self._metrics is not None:
                self._metrics.events_published.inc(taken)
        if lost:  # a seq no batch carries: subscribers see the gap, live and in replay
            self._replay.keep(None)

    def _send(self, events: list[Any]) -> None:
        """Publish one batch (an empty one: the heartbeat), kept for replay before it is sent: a
        failed send is a gap a replay fills."""
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self._replay.keep(payload)
        self._last_sent = time.monotonic()
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    def _hold(self, level: int, event: BlockStored) -> None:
        """Keep ``event`` for the snapshot (its last id is the block's own, `sub_block_hashes`)."""
        if self._held is None:
            return
        raw = self._encoder.encode(event)
        self._held_changes += 1
        old = self._held.get((level, event.block_hashes[-1]))
        self._held[level, event.block_hashes[-1]] = (event.parent_block_hash, raw)
        self._held_bytes += len(raw) - (len(old[1]) if old is not None else 0)
        if self._held_bytes > SNAPSHOT_BYTES:
            log.warning("KV-event replay keeps no snapshot past %d MiB of events: a router joining late learns "
                        "only the batches kept", SNAPSHOT_BYTES >> 20)
            self._held, self._held_bytes = None, 0

    def snapshot(self, batches: int) -> list[bytes]:
        """What the tiers hold now, as the payloads of at most ``batches`` batches: AllBlocksCleared,
        then every held block's BlockStored, a block's parent (in its tier) before it, since routers
        drop a block whose parent they do not know. [] when none is kept."""
        if self._held is None or batches < 1:
            return []
        if self._last_snapshot is not None and self._last_snapshot[:2] == (self._held_changes, batches):
            return self._last_snapshot[2]
        parent_of = {(level, block): (level, parent) if parent is not None else None
                     for (level, block), (parent, _) in self._held.items()}
        ordered = [self._held[entry][1] for entry in parents_first(parent_of)]
        per = max(BATCH_EVENTS, -(-(len(ordered) + 1) // batches))
        cleared = self._encoder.encode(AllBlocksCleared())
        events = [cleared, *ordered]
        payloads = [self._encoder.encode(_RawBatch(ts=time.time(), events=[msgspec.Raw(e) for e in events[i : i + per]],
                                                   data_parallel_rank=0))
                    for i in range(0, len(events), per)]
        self._last_snapshot = (self._held_changes, batches, payloads)
        return payloads

    def _ids(self, key: bytes, runs: int) -> list[int]:
        return sub_block_hashes(key, runs) if self.block_size else [block_hash(key)]

    def _stored_event(self, key: bytes, level: int, header: BlockHeader) -> BlockStored | None:
        """``header``'s block as one BlockStored: whole, or its whole runs of ``block_size`` tokens
        (None when it has none)."""
        medium, locality = self._levels[level]
        size = self.block_size or header.tokens
        runs = header.tokens // size
        if runs == 0:
            return None
        token_ids = header.token_id_list()[: runs * size]
        return BlockStored(block_hashes=self._ids(key, runs),
                           parent_block_hash=block_hash(header.parent) if header.parent else None,
                           token_ids=token_ids, block_size=size, lora_id=None, medium=medium, lora_name=None,
                           locality=locality)

    def _removed_event(self, ids: list[int], level: int) -> BlockRemoved:
        medium, locality = self._levels[level]
        return BlockRemoved(block_hashes=ids, medium=medium, locality=locality)

    @property
    def replays(self) -> dict[str, int]:
        """Replay requests by outcome (served, refused, malformed) and replies abandoned."""
        return self._replay.replays
