"""Get and Put through a client's shared-memory arena: `KVStoreClient`'s calls when it has one.

The client chooses the transport (kvstore_client.py) and, when it has an arena, hands these calls an
`ArenaTransport`: the arena, its id and its space, and how to make a gRPC call. A call's extents
stay reserved until its reply has come (the daemon writes or reads them until then), also when the
caller fails or closes a fetch early.

`fetch_ahead` and `put` keep two calls in flight, so the daemon's copy overlaps
the client's. Neither waits for space while a call of its own holds some
(`CallsInFlight.reserve`), so two threads cannot each hold half the arena and wait for the other.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from engine_adapter.client.arena_space import ArenaSpace
from engine_adapter.client.blocks import FetchedBlock, LayerStream, fetched_block
from kvstore.arena import Arena
from kvstore.proto import kvstore_pb2 as pb

#: The least a Put of a pipelined batch carries (about 0.5 ms of copying on a fast host): a
#: smaller batch goes in one Put.
PIPELINE_PART_BYTES = 4 << 20


class CallsInFlight:
    """One thread's Gets or Puts sent and not yet ended, oldest first, each with its arena extents.

    ``on_end``: given the reply of each call `reserve` or `end_all` ends (a Put counts what was
    stored); None when the caller ends each call itself (`end_oldest`) once it has taken the
    reply, so `reserve` never ends one. One thread owns it; the extents go back to the shared
    `ArenaSpace`.
    """

    def __init__(self, space: ArenaSpace, on_end: Callable[[Any], None] | None = None) -> None:
        self._space = space
        self._on_end = on_end
        self._calls: deque[tuple[list[int], Any]] = deque()  # (arena offsets, reply future)

    def __bool__(self) -> bool:
        return bool(self._calls)

    def reserve(self, sizes: Sequence[int]) -> list[int] | None:
        """Extents for the next call: at once if they fit; else once the oldest call has ended
        (with ``on_end``); else None while a call is in flight (a look-ahead waits for nothing);
        else waiting for other threads' space (this thread then holds none)."""
        while (offsets := self._space.try_reserve(sizes)) is None:
            if not self._calls:
                return self._space.reserve_waiting(sizes)
            if self._on_end is None:
                return None
            self._on_end(self.end_oldest())
        return offsets

    def send(self, offsets: list[int], start: Callable[[], Any]) -> None:
        """Start a call on ``offsets`` (``start`` returns its reply future); frees them if it fails."""
        try:
            future = start()
        except BaseException:
            self._space.free(offsets)
            raise
        self._calls.append((offsets, future))

    def oldest(self) -> tuple[list[int], Any]:
        """The oldest call's offsets and reply (waiting for it); it stays in flight."""
        offsets, future = self._calls[0]
        return offsets, future.result()

    def end_oldest(self) -> Any:
        """Wait for the oldest call's reply and free its extents, also when it failed."""
        offsets, future = self._calls.popleft()
        try:
            return future.result()
        finally:
            self._space.free(offsets)

    def end_all(self) -> None:
        """End every call in flight, oldest first, each reply given to ``on_end``."""
        while self._calls:
            self._on_end(self.end_oldest())

    def abandon(self) -> None:
        """After a failure or an early close: each call ends before its extents are freed (the
        daemon no longer writes or reads them); their replies and errors are dropped."""
        while self._calls:
            offsets, future = self._calls.popleft()
            try:
                future.result()
            except Exception:  # noqa: BLE001 - cancelled or failed: the first failure is the one raised
                pass
            self._space.free(offsets)


@dataclass(frozen=True)
class ArenaTransport:
    """A client's shared-memory arena and what its calls through it need: ``call(method, request)``
    makes a unary call and ``stream(method, request)`` a streaming one as the client does (its
    token, its current timeout, its errors in words), methods of ``stub``. The client hands it out
    holding it weakly, so a client dropped without ``close`` is still freed at once."""
    arena: Arena
    arena_id: int
    space: ArenaSpace
    call: Callable[..., Any]
    stream: Callable[..., Any]
    stub: Any

    def _get_items(self, keys: Sequence[bytes], offsets: Sequence[int], length: int
                   ) -> list[pb.GetItem]:
        """Get items that land each block of ``keys`` at its arena offset (``length`` bytes at most)."""
        return [pb.GetItem(key=k, dest=pb.ArenaSlice(arena_id=self.arena_id, offset=o, length=length))
                for k, o in zip(keys, offsets)]

    def _blocks(self, keys: Sequence[bytes], results: Sequence[pb.GetResult], offsets: Sequence[int]
                ) -> list[FetchedBlock | None]:
        """The blocks a Get of `_get_items` put in the arena, views into it; None for misses."""
        return [fetched_block(k, r, self.arena.buffer[o : o + r.meta.payload_len]) if r.found else None
                for k, r, o in zip(keys, results, offsets)]

    @contextlib.contextmanager
    def fetch(self, keys: Sequence[bytes], max_payload_bytes: int, allow_missing: bool
              ) -> Iterator[list[FetchedBlock | None]]:
        """`KVStoreClient.fetch` through the arena: one Get, its extents freed when the block ends."""
        with self.space.slices([max_payload_bytes] * len(keys)) as offsets:
            items = self._get_items(keys, offsets, max_payload_bytes)
            reply = self.call(self.stub.Get, pb.GetRequest(items=items, allow_missing=allow_missing))
            yield self._blocks(keys, reply.results, offsets)

    @contextlib.contextmanager
    def fetch_layers(self, keys: Sequence[bytes], max_payload_bytes: int, allow_missing: bool
                     ) -> Iterator[LayerStream]:
        """`KVStoreClient.fetch_layers`: one GetLayers, cancelled and its extents freed when the block ends."""
        with self.space.slices([max_payload_bytes] * len(keys)) as offsets:
            items = self._get_items(keys, offsets, max_payload_bytes)
            replies = self.stream(self.stub.GetLayers, pb.GetRequest(items=items, allow_missing=allow_missing))
            try:
                first = next(replies)
                yield LayerStream(self._blocks(keys, first.results, offsets), (reply.layer for reply in replies))
            finally:
                replies.cancel()

    def fetch_ahead(self, keys: Sequence[bytes], max_payload_bytes: int, batch: int
                    ) -> Iterator[tuple[int, list[FetchedBlock | None]]]:
        """`KVStoreClient.fetch_ahead` through the arena, for more than one ``batch`` of ``keys``: the
        next Get in flight while the caller takes one, when the arena has room for it at once. A
        look-ahead never waits for space, and never ends the oldest Get before the caller took it."""
        calls = CallsInFlight(self.space)

        def send(first: int) -> bool:
            """Send the Get of the batch at ``first``: at once if it fits; with no Get of ours in
            flight, once it fits. Its extents are freed once the caller has taken it."""
            part = keys[first : first + batch]
            offsets = calls.reserve([max_payload_bytes] * len(part))
            if offsets is None:
                return False
            request = pb.GetRequest(items=self._get_items(part, offsets, max_payload_bytes), allow_missing=True)
            calls.send(offsets, functools.partial(self.call, self.stub.Get.future, request))
            return True

        following = iter(range(0, len(keys), batch))
        try:
            send(next(following))
            upcoming = next(following, None)
            first = 0  # of the oldest Get: they are taken in the order they were sent
            while calls:
                if upcoming is not None and send(upcoming):  # the look-ahead
                    upcoming = next(following, None)
                offsets, reply = calls.oldest()
                yield first, self._blocks(keys[first : first + batch], reply.results, offsets)
                calls.end_oldest()
                first += batch
                if not calls and upcoming is not None:  # no room for a look-ahead: the next in turn
                    send(upcoming)
                    upcoming = next(following, None)
        finally:
            calls.abandon()

    def put(self, items: dict[int, pb.PutItem], views: list[memoryview], durable: bool) -> int:
        """Put the blocks of ``items`` (index -> Put item, its slice left to fill) in Puts of about a quarter of them (each of at least
        PIPELINE_PART_BYTES): while the daemon checksums and stores one, this thread copies the next
        into the arena, so a Put costs about the slower of the two copies, not their sum::

            client  |copy 0|copy 1|copy 2|copy 3|
            daemon         |store 0|store 1|store 2|store 3|

        A Put is sent once the one before it is stored: the daemon stores the batch in its order,
        as one Put would (an LRU's recency follows it). Returns how many blocks were stored."""
        order = list(items)
        sizes = [len(v) for v in views]
        # a part under PIPELINE_PART_BYTES gains less from the overlap than its own call costs
        parts = max(1, min(4, sum(sizes[i] for i in order) // PIPELINE_PART_BYTES))
        step = max(1, -(-len(order) // parts))
        replies: list[pb.PutResponse] = []
        calls = CallsInFlight(self.space, on_end=replies.append)

        def start(part: list[int], offsets: list[int]) -> Any:
            """Copy ``part`` into its extents, then Put it once the Put before it is stored."""
            sent = []
            for i, offset in zip(part, offsets):
                self.arena.buffer[offset : offset + sizes[i]] = views[i]
                items[i].slice.CopyFrom(pb.ArenaSlice(arena_id=self.arena_id, offset=offset, length=sizes[i]))
                sent.append(items[i])
            calls.end_all()
            return self.call(self.stub.Put.future, pb.PutRequest(items=sent, durable=durable))

        try:
            for first in range(0, len(order), step):
                part = order[first : first + step]
                offsets = calls.reserve([sizes[i] for i in part])
                calls.send(offsets, functools.partial(start, part, offsets))
            calls.end_all()
        finally:
            calls.abandon()
        return sum(reply.stored for reply in replies)
