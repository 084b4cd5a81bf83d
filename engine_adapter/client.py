"""KVStoreClient: what an engine process uses to talk to the kvstore daemon.

Transport is chosen at connect time. On a unix socket the client asks the daemon for a shared-memory
arena (a sealed memfd handed over the arena socket, kvstore/arena.py); Put and Get then move block
bytes through it and gRPC carries offsets only. Without one (TCP, another host) the bytes travel
on the daemon's data channel when it offers one (raw bytes beside gRPC, same token and TLS:
engine_adapter/data_channel.py), else inline in the messages. The calls are the same either way.

A same-host client also maps the daemon's key index (kvstore/shm_index.py) and answers ``lookup``
from it without a round trip; it asks the daemon when the index cannot answer (the daemon stopped,
a miss that a shared S3 tier may still hold, a key of the wrong size).

    client = KVStoreClient("unix:/run/user/1000/kvstore.sock")
    hits = client.lookup(keys)                               # LookupResult(hits, tiers)
    client.put(namespace, [(key, tokens, payload)])          # payload: bytes, numpy or torch
    with client.fetch(keys[:hits.hits], max_payload) as blocks:
        for block in blocks:                                 # FetchedBlock or None (a miss)
            use(block.payload)                               # a view into the arena, valid inside

The client is thread-safe: an engine may store blocks from a background thread while it fetches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import grpc
import numpy as np

from kvstore.arena import Arena, ArenaLease, arena_socket_path
from kvstore.host import default_listen
from engine_adapter.data_channel import DataChannelError, DataChannelPool, open_pool
from kvstore.connect import (PYTHON_OPTIONS, OptionNames, client_tls, data_channel_address, explain, is_unix,
                             open_channel, plaintext_token_refusal, resolve_token)
from kvstore.keys import KEY_BYTES, KVLayout, LookupResult, Namespace
from kvstore.limits import MAX_ITEMS_PER_CALL, MAX_LEASE_MS
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shm_index import MAX_REPORT, REPORT_HEADER, REPORT_S, KeyIndexReader, format_report
from kvstore.wire import layout_from_message, layout_message
from tiers.allocator import ExtentAllocator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedBlock:
    key: bytes
    layout: KVLayout
    tokens: int
    codec: str
    codec_params: dict[str, Any]
    tier: str
    payload: memoryview
    # the payload decoded ahead (`engine_adapter.prefix_cache.fetch_blocks` decodes a batch's
    # coded blocks on its pool); `fetched_tensor` returns it instead of decoding again
    decoded: Any = None


def payload_view(payload: Any) -> memoryview:
    """Bytes of a payload given as bytes-like, a numpy array or a CPU torch tensor (no copy)."""
    if hasattr(payload, "detach") and hasattr(payload, "is_contiguous"):  # torch.Tensor
        import torch

        tensor = payload.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    if isinstance(payload, np.ndarray):
        return memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))
    return memoryview(payload).cast("B")


#: Data-channel refusals a call answers by going inline in gRPC instead: connections or bytes at
#: their cap, or the daemon stopping its channel.
BUSY = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)

#: The least a Put of a pipelined batch carries (about 0.5 ms of copying on a fast host): a
#: smaller batch goes in one Put.
PIPELINE_PART_BYTES = 4 << 20


class KVStoreClient:
    def __init__(self, address: str | None = None, *, shared_memory: bool | None = None,
                 arena_bytes: int = 256 * 2**20, token: str | None = None,
                 token_file: str | os.PathLike | None = None, timeout: float = 60.0,
                 max_message_bytes: int = 256 * 2**20, tls_ca: str | bytes | None = None,
                 tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None,
                 tls_server_name: str = "", insecure: bool = False, local_lookup: bool = True) -> None:
        """Connect to the daemon at ``address`` (default: the socket ``kvstore serve`` listens on).

        Token: ``token``, else ``token_file``'s (one token, or one per address: `kvstore.connect.TokenBook`),
        else ``KVSTORE_AUTH_TOKEN``. TLS, for TCP addresses (a unix socket is always plaintext):
        ``tls_ca`` (PEM path or bytes: the CA of the daemon's certificate), optionally a client
        certificate ``tls_cert`` + ``tls_key``, and ``tls_server_name`` when the certificate names
        the host otherwise. A token over plaintext TCP to an address that is not loopback is
        refused (ValueError) unless ``insecure``.
        """
        self.address = address or default_listen()
        self.timeout = timeout
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        token = resolve_token(token, token_file, self.address)
        self.tls = None if is_unix(self.address) else client_tls(tls_ca, tls_cert, tls_key, tls_server_name)
        refusal = plaintext_token_refusal(self.address, self.tls, token, insecure)
        if refusal:
            raise ValueError(refusal)
        self._channel = open_channel(self.address, self.tls, options)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._arena: Arena | None = None
        self._lease: ArenaLease | None = None
        self._token = token
        self._arena_id = 0
        self._allocator: ExtentAllocator | None = None
        self._space = threading.Condition()
        self._index: KeyIndexReader | None = None
        self._index_lock = threading.Lock()
        self._local_lookup = local_lookup
        #: Lookups answered from the shared key index and over gRPC (for tests and benchmarks).
        self.local_lookups = self.rpc_lookups = 0
        #: Local Lookups not yet reported to the daemon: keys asked, hits, calls (under _index_lock).
        #: The next call to the daemon carries them (`_call`), or the reporter thread after REPORT_S.
        self._unreported = [0, 0, 0]
        self._reporter: threading.Thread | None = None
        self._closing = threading.Event()
        self._insecure, self._max_message_bytes = insecure, max_message_bytes
        #: The daemon's data channel, asked for at the first Put or Get without an arena
        #: (`_data_channel`); False: it offers none, or it cannot be used from here.
        self._data: DataChannelPool | None | bool = None
        self._data_lock = threading.Lock()
        if shared_memory is None and self.address.startswith("unix:"):
            try:
                self._register_arena(arena_bytes)
            except (OSError, ConnectionError) as exc:  # refused or unreachable: bytes go inline instead
                log.warning("no shared-memory arena from %s (%s); block bytes travel inline", self.address, exc)
        elif shared_memory:
            self._register_arena(arena_bytes)

    # -- connection ---------------------------------------------------------------------------

    def _register_arena(self, size: int) -> None:
        if not self.address.startswith("unix:"):
            raise ValueError(f"shared memory needs a unix socket address; {self.address} is TCP")
        lease = ArenaLease.request(arena_socket_path(self.address), size, self._token, timeout=self.timeout)
        lease.arena.prefault()
        self._lease, self._arena, self._arena_id = lease, lease.arena, lease.arena_id
        self._allocator = ExtentAllocator(size, align=_ARENA_ALIGN)
        if lease.index_name and self._local_lookup:
            try:
                self._index = KeyIndexReader.attach(lease.index_name)
            except ValueError:
                self._index = None  # another user's daemon, or gone: Lookup goes over gRPC

    @property
    def shared_memory(self) -> bool:
        return self._arena is not None

    def _data_channel(self) -> DataChannelPool | None:
        """The data channel for payloads when there is no arena: its port from Stats, its first
        connection opened (the token checked); None when the daemon offers none or it cannot be
        used (said once; payloads then go inline)."""
        if self._arena is not None or self._data is False:
            return None
        if self._data is not None:
            return self._data
        with self._data_lock:
            if self._data is None:
                self._data = self._open_data_channel() or False
        return self._data or None

    def _open_data_channel(self) -> DataChannelPool | None:
        try:
            port = self._call(self._stub.Stats, pb.StatsRequest()).data_port
        except grpc.RpcError:
            return None  # the calls that follow meet the same problem and say it
        if not port:
            return None
        address = data_channel_address(self.address, port)
        refusal = plaintext_token_refusal(address, self.tls, self._token, self._insecure)
        try:
            if refusal:
                raise ValueError(refusal)
            return open_pool(address, self._token, self.tls, self.timeout, self._max_message_bytes)
        except (OSError, ValueError, grpc.RpcError) as exc:
            log.warning("the data channel of %s at %s cannot be used (%s); block bytes travel inline in gRPC",
                        self.address, address, exc)
            return None

    @property
    def data_channel(self) -> bool:
        """Whether payloads travel on the daemon's data channel (asks the daemon the first time)."""
        return self._data_channel() is not None

    def wait_ready(self, timeout: float = 10.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def check(self, timeout: float = 5.0, names: OptionNames = PYTHON_OPTIONS) -> None:
        """Ask the daemon once (an empty Lookup: it checks the token too); ConnectionError with one
        line saying what is wrong and the fix ("no daemon at ...", "... speaks TLS: ...", a refused
        token) when it cannot be used. ``names``: how the fix spells the settings."""
        try:
            self._stub.Lookup(pb.LookupRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.DEADLINE_EXCEEDED):
                return  # it answered: the daemon is there and took the token
            reason = explain(exc, self.address, self.tls, self._token, probe_timeout=min(timeout, 2.0), names=names)
            if reason is None and code == grpc.StatusCode.DEADLINE_EXCEEDED:
                reason = f"{self.address} did not answer within {timeout:g} s"
            raise ConnectionError(reason or f"{self.address}: {code.name}: {' '.join((exc.details() or '').split())}") \
                from None

    def close(self) -> None:
        self._closing.set()
        if self._reporter is not None:
            self._reporter.join(timeout=_REPORT_TIMEOUT_S)
        try:
            self._report(timeout=_REPORT_TIMEOUT_S, calls=8)  # the last tally: a closed client loses none
        except (grpc.RpcError, ValueError):  # the daemon is gone (its counts with it), or closed already
            pass
        if self._lease is not None:
            self._lease.close()  # the daemon unmaps the arena when this connection closes
            self._lease = self._arena = None
        with self._index_lock:
            if self._index is not None:
                self._index.close()
                self._index = None
        with self._data_lock:
            if self._data:
                self._data.close()
            self._data = False
        self._channel.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout: float | None = None):
        metadata = self._metadata
        if self._unreported[0] or self._unreported[2]:
            metadata += self._take_report()
        return method(request, timeout=timeout or self.timeout, metadata=metadata)

    # -- local Lookups' tally (kvstore/shm_index.py, "Counting") -----------------------------

    def _take_report(self) -> tuple[tuple[str, str], ...]:
        """The unreported tally as metadata for one call (at most MAX_REPORT of each; the rest
        waits for the next call). Taken once: if the call fails, the daemon never counts it."""
        with self._index_lock:
            tally = self._unreported
            keys, calls = min(tally[0], MAX_REPORT), min(tally[2], MAX_REPORT)
            hits = min(tally[1], keys)
            if not keys and not calls:
                return ()
            tally[0] -= keys
            tally[1] -= hits
            tally[2] -= calls
        return ((REPORT_HEADER, format_report(keys, hits, calls)),)

    def _report(self, timeout: float, calls: int = 1) -> None:
        """Send the tally now, if any, in up to ``calls`` empty Lookups (which count as nothing else)."""
        for _ in range(calls):
            if not (self._unreported[0] or self._unreported[2]):
                return
            self._call(self._stub.Lookup, pb.LookupRequest(), timeout=timeout)

    def _start_reporter(self) -> None:
        """The thread that sends a tally no other call carried within REPORT_S (started with the
        first local Lookup, an empty one included; it holds no reference to the client, so an
        unclosed client is collected)."""
        self._reporter = threading.Thread(target=_report_loop, args=(weakref.ref(self), self._closing),
                                          name="kvstore-lookup-report", daemon=True)
        self._reporter.start()

    # -- arena slices -------------------------------------------------------------------------
    #
    # The arena budget, one way for put, fetch and fetch_layers: a call needs the sum of
    # `_slot_bytes` of its items. A call may take the whole arena (`_slices` refuses more: it could
    # never be served); put's batches and `max_fetch_blocks` plan for half of it, so that a
    # background store and a load share the arena instead of queueing behind each other.

    @contextlib.contextmanager
    def _slices(self, sizes: Sequence[int]) -> Iterator[list[int]]:
        """Reserve arena extents for one call, waiting while other threads hold the space;
        ValueError when the call needs more than the whole arena."""
        offsets = self._reserve_waiting(sizes)
        try:
            yield offsets
        finally:
            self._free(offsets)

    def _reserve_waiting(self, sizes: Sequence[int]) -> list[int]:
        """Arena extents for ``sizes``, waiting while other threads hold the space (the caller
        holds none); ValueError when they need more than the whole arena."""
        assert self._allocator is not None
        needed = sum(_slot_bytes(s) for s in sizes)
        if needed > self._allocator.capacity:
            raise ValueError(f"{len(sizes)} blocks of up to {max(sizes)} bytes need {needed} arena bytes; the "
                             f"arena has {self._allocator.capacity}: move fewer blocks per call (see "
                             f"max_fetch_blocks) or create the client with a larger arena_bytes")
        with self._space:
            while (offsets := self._reserve(sizes)) is None:
                self._space.wait()
        return offsets

    def _reserve_beside(self, sizes: Sequence[int], end_own: Callable[[], bool]) -> list[int]:
        """Arena extents for ``sizes``: at once if they fit, else once ``end_own()`` has ended a
        call of this thread's (it returns False when there is none), else waiting for other
        threads' space (this thread then holds none, so two threads cannot wait on each other)."""
        while True:
            with self._space:
                offsets = self._reserve(sizes)
            if offsets is not None:
                return offsets
            if not end_own():
                return self._reserve_waiting(sizes)

    def _reserve(self, sizes: Sequence[int]) -> list[int] | None:
        """Arena extents for ``sizes`` now, or None (nothing kept) when they do not fit; under ``_space``."""
        assert self._allocator is not None
        offsets: list[int] = []
        for size in sizes:
            offset = self._allocator.allocate(max(size, 1))
            if offset is None:
                for taken in offsets:
                    self._allocator.free(taken)
                return None
            offsets.append(offset)
        return offsets

    def _free(self, offsets: Sequence[int]) -> None:
        with self._space:
            for offset in offsets:
                self._allocator.free(offset)
            self._space.notify_all()

    def _planned_bytes(self) -> int:
        """Bytes one call is planned to take: half the arena, else half a message."""
        return self._allocator.capacity // 2 if self._allocator else self._max_message_bytes // 2

    def _batches(self, sizes: Sequence[int]) -> Iterator[range]:
        """Split items into runs that fit `_planned_bytes` (a single larger item goes alone)."""
        budget = self._planned_bytes()
        start, used = 0, 0
        for i, size in enumerate(sizes):
            if i > start and (used + _slot_bytes(size) > budget or i - start == MAX_ITEMS_PER_CALL):
                yield range(start, i)
                start, used = i, 0
            used += _slot_bytes(size)
        if start < len(sizes):
            yield range(start, len(sizes))

    # -- API ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], lease_s: float = 0.0) -> LookupResult:
        """The longest run of leading ``keys`` the daemon holds, and the highest tier of each.

        ``lease_s`` > 0: the daemon also keeps the hit blocks from eviction and demotion for that
        long (at most ``kvstore.limits.MAX_LEASE_MS``), so a hit reported now is there at the load;
        such a lookup is an RPC, never the local index.
        """
        if lease_s > 0:
            self.rpc_lookups += 1
            lease_ms = max(1, min(int(lease_s * 1000), MAX_LEASE_MS))
            reply = self._call(self._stub.Lookup, pb.LookupRequest(keys=keys, lease_ms=lease_ms))
            return LookupResult(reply.hits, tuple(reply.tiers))
        if self._index is not None and all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
            with self._index_lock:
                local = self._index.lookup(keys) if self._index is not None else None
                if local is not None and keys:  # the daemon counts it when it gets the tally
                    tally = self._unreported
                    tally[0] += len(keys)
                    tally[1] += local[0]
                    tally[2] += 1
                if local is not None and self._reporter is None:  # an empty Lookup starts it too (a warm-up)
                    self._start_reporter()
            if local is not None:
                self.local_lookups += 1
                return LookupResult(*local)
        self.rpc_lookups += 1
        reply = self._call(self._stub.Lookup, pb.LookupRequest(keys=keys))
        return LookupResult(reply.hits, tuple(reply.tiers))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        return self._call(self._stub.Prefetch, pb.KeysRequest(keys=keys)).count

    def put(self, namespace: Namespace, blocks: Sequence[tuple[bytes, int, Any]], codec: str = "raw",
            codec_params: dict[str, Any] | None = None, durable: bool = False) -> int:
        """Store ``(key, tokens, payload)`` blocks of one namespace, or ``(key, tokens, payload,
        parent)`` with the key before it in its prefix chain (the daemon then evicts a chain's last
        blocks before its first); returns how many were stored.

        ``durable``: return only once a durable tier (fsynced disk, S3) holds them; otherwise a
        Put is acknowledged once the daemon's top tier holds them (see docs/guarantees.md).
        """
        layout = layout_message(namespace.layout)
        params = json.dumps(codec_params) if codec_params else ""
        views = [payload_view(block[2]) for block in blocks]
        parents = [(block[3] or b"") if len(block) > 3 else b"" for block in blocks]
        stored = 0
        data = self._data_channel()
        for batch in self._batches([len(v) for v in views]):
            metas = [pb.BlockMeta(key=blocks[i][0], namespace=namespace.id, tokens=blocks[i][1],
                                  layout=layout,
                                  codec=codec, codec_params_json=params, payload_len=len(views[i]))
                     for i in batch]
            if data is not None:  # payloads follow the message as they are
                items = [pb.PutItem(meta=meta, parent=parents[i]) for meta, i in zip(metas, batch)]
                try:
                    stored += data.put(pb.PutRequest(items=items, durable=durable), [views[i] for i in batch])
                    continue
                except DataChannelError as exc:
                    if exc.code() not in BUSY:
                        raise  # else the channel is full or stopping: this batch goes inline in gRPC
            if self._arena is None:
                items = [pb.PutItem(meta=meta, inline=views[i].tobytes(), parent=parents[i])
                         for meta, i in zip(metas, batch)]
                stored += self._call(self._stub.Put, pb.PutRequest(items=items, durable=durable)).stored
                continue
            stored += self._put_through_arena(dict(zip(batch, metas)), views, parents, durable)
        return stored

    def _put_through_arena(self, metas: dict[int, pb.BlockMeta], views: list[memoryview], parents: list[bytes],
                           durable: bool) -> int:
        """Put blocks ``metas`` (index -> meta) in Puts of about a quarter of them (each of at least
        PIPELINE_PART_BYTES): while the daemon checksums and stores one, this thread copies the next
        into the arena, so a Put costs about the slower of the two copies, not their sum::

            client  |copy 0|copy 1|copy 2|copy 3|
            daemon         |store 0|store 1|store 2|store 3|

        A Put is sent once the one before it is stored: the daemon stores the batch in its order,
        as one Put would (an LRU's recency follows it). A part's space is taken without waiting
        while a Put is in flight (two threads' batches cannot each hold half the arena and wait
        for the other half)."""
        order = list(metas)
        sizes = [len(v) for v in views]
        # a part under PIPELINE_PART_BYTES gains less from the overlap than its own call costs
        parts = max(1, min(4, sum(sizes[i] for i in order) // PIPELINE_PART_BYTES))
        step = max(1, -(-len(order) // parts))
        in_flight: tuple[list[int], Any] | None = None  # (arena offsets, reply future) of the Put being stored
        stored = 0

        def finish() -> bool:
            """End the Put in flight, if any; whether there was one."""
            nonlocal in_flight, stored
            if in_flight is None:
                return False
            (offsets, future), in_flight = in_flight, None
            try:
                stored += future.result().stored
            finally:
                self._free(offsets)
            return True

        try:
            for first in range(0, len(order), step):
                part = order[first : first + step]
                offsets = self._reserve_beside([sizes[i] for i in part], finish)
                try:
                    items = []
                    for i, offset in zip(part, offsets):
                        self._arena.buffer[offset : offset + sizes[i]] = views[i]
                        items.append(pb.PutItem(meta=metas[i], slice=pb.ArenaSlice(
                            arena_id=self._arena_id, offset=offset, length=sizes[i]), parent=parents[i]))
                    finish()
                    future = self._call(self._stub.Put.future, pb.PutRequest(items=items, durable=durable))
                except BaseException:
                    self._free(offsets)
                    raise
                in_flight = (offsets, future)
            finish()
        finally:
            if in_flight is not None:  # a failure: the Put ends before its space is reused
                offsets, future = in_flight
                try:
                    future.result()
                except Exception:  # noqa: BLE001 - the first failure is the one raised
                    pass
                self._free(offsets)
        return stored

    @contextlib.contextmanager
    def fetch(self, keys: Sequence[bytes], max_payload_bytes: int,
              allow_missing: bool = True, inline: bool = False) -> Iterator[list[FetchedBlock | None]]:
        """Get blocks; payload views stay valid until the ``with`` block ends.

        ``max_payload_bytes`` bounds one payload (for raw blocks, ``layout.block_bytes(tokens)``).
        Keys whose blocks vanished since a Lookup come back as None when ``allow_missing``.
        ``inline``: payloads in the reply, not the arena (a Get made while this thread holds
        arena space, which it could otherwise wait for forever).
        """
        data = self._data_channel()
        if data is not None:
            try:  # the payloads land in the connection's buffer; it is reused once this block ends
                conn, reply, payloads = data.get(pb.GetRequest(items=[pb.GetItem(key=k) for k in keys],
                                                               allow_missing=allow_missing))
            except DataChannelError as exc:
                if exc.code() not in BUSY:
                    raise
                conn = None  # the channel is full or stopping: this Get goes inline in gRPC
            if conn is not None:
                try:
                    yield [_fetched(k, r, p) if r.found else None for k, r, p in zip(keys, reply.results, payloads)]
                finally:
                    data.give_back(conn)
                return
        if self._arena is None or inline:
            reply = self._call(self._stub.Get, pb.GetRequest(
                items=[pb.GetItem(key=k) for k in keys], allow_missing=allow_missing))
            yield [_fetched(k, r, memoryview(r.inline)) if r.found else None
                   for k, r in zip(keys, reply.results)]
            return
        with self._slices([max_payload_bytes] * len(keys)) as offsets:
            items = [pb.GetItem(key=k, dest=pb.ArenaSlice(arena_id=self._arena_id, offset=o,
                                                          length=max_payload_bytes))
                     for k, o in zip(keys, offsets)]
            reply = self._call(self._stub.Get, pb.GetRequest(items=items, allow_missing=allow_missing))
            yield [_fetched(k, r, self._arena.buffer[o : o + r.meta.payload_len]) if r.found else None
                   for k, r, o in zip(keys, reply.results, offsets)]

    def fetch_ahead(self, keys: Sequence[bytes], max_payload_bytes: int, batch: int
                    ) -> Iterator[tuple[int, list[FetchedBlock | None]]]:
        """:meth:`fetch` of ``keys`` in Gets of ``batch`` blocks, yielding ``(index of the batch's
        first key, its blocks)`` in order, misses as None. While the caller takes one batch, the
        next Get is in flight whenever the arena has room for it at once, so the daemon's copy into
        the arena overlaps the caller's copy out of it (a load then costs about one copy, not two)::

            daemon  |copy 0|copy 1|copy 2|copy 3|
            caller         |take 0|take 1|take 2|take 3|

        A batch's views are valid until the generator moves on or is closed (``with
        contextlib.closing(...)`` or running it to the end). A look-ahead never waits for space,
        so two threads' fetches cannot each hold half the arena and wait for the other half."""
        batch = max(1, min(batch, self.max_fetch_blocks(max_payload_bytes)))
        starts = range(0, len(keys), batch)
        if self._arena is None or len(starts) < 2:
            for first in starts:
                with self.fetch(keys[first : first + batch], max_payload_bytes) as blocks:
                    yield first, blocks
            return
        sent: list[tuple[int, list[int], Any]] = []  # (first, arena offsets, reply future), oldest first

        def send(first: int, wait: bool) -> bool:
            part = keys[first : first + batch]
            sizes = [max_payload_bytes] * len(part)
            if wait:  # reserved here, freed once the caller has taken the batch
                offsets = self._reserve_waiting(sizes)
            else:
                with self._space:
                    offsets = self._reserve(sizes)
                if offsets is None:
                    return False
            items = [pb.GetItem(key=k, dest=pb.ArenaSlice(arena_id=self._arena_id, offset=o, length=max_payload_bytes))
                     for k, o in zip(part, offsets)]
            try:
                future = self._call(self._stub.Get.future, pb.GetRequest(items=items, allow_missing=True))
            except BaseException:
                self._free(offsets)
                raise
            sent.append((first, offsets, future))
            return True

        following = iter(starts)
        try:
            send(next(following), wait=True)
            upcoming = next(following, None)
            while sent:
                if upcoming is not None and send(upcoming, wait=False):  # the look-ahead
                    upcoming = next(following, None)
                first, offsets, future = sent[0]
                reply = future.result()
                part = keys[first : first + batch]
                yield first, [_fetched(k, r, self._arena.buffer[o : o + r.meta.payload_len]) if r.found else None
                              for k, r, o in zip(part, reply.results, offsets)]
                sent.pop(0)
                self._free(offsets)
                if not sent and upcoming is not None:  # no room for a look-ahead: the next in turn
                    send(upcoming, wait=True)
                    upcoming = next(following, None)
        finally:
            for _, offsets, future in sent:  # closed early or failed: each Get ends before its space is reused
                try:
                    future.result()
                except Exception:  # noqa: BLE001 - cancelled or failed: the daemon no longer writes
                    pass
                self._free(offsets)

    @contextlib.contextmanager
    def fetch_layers(self, keys: Sequence[bytes], max_payload_bytes: int,
                     allow_missing: bool = True) -> Iterator["LayerStream"]:
        """Like :meth:`fetch`, but the daemon reports each layer as soon as it is in place.

            with client.fetch_layers(keys, slot) as stream:
                blocks = stream.blocks            # FetchedBlock or None, as for fetch
                for layer in stream:              # 0, 1, ... as each layer of every block lands
                    start_layer(layer)            # payload[layer * size:(layer + 1) * size] is valid

        Needs the shared-memory data plane (a unix socket).
        """
        if self._arena is None:
            raise ValueError("a layer-wise fetch needs the shared-memory data plane (connect over a unix socket)")
        with self._slices([max_payload_bytes] * len(keys)) as offsets:
            items = [pb.GetItem(key=k, dest=pb.ArenaSlice(arena_id=self._arena_id, offset=o, length=max_payload_bytes))
                     for k, o in zip(keys, offsets)]
            replies = self._stub.GetLayers(pb.GetRequest(items=items, allow_missing=allow_missing),
                                           timeout=self.timeout, metadata=self._metadata)
            try:
                first = next(replies)
                blocks = [_fetched(k, r, self._arena.buffer[o : o + r.meta.payload_len]) if r.found else None
                          for k, r, o in zip(keys, first.results, offsets)]
                yield LayerStream(blocks, (reply.layer for reply in replies))
            finally:
                replies.cancel()

    def map_gpu_pool(self):
        """Map the daemon's GPU pool into this process once (CUDA IPC); returns the pool tensor.

        The handle is unpickled: only map the pool of a daemon you trust (your own, on this host).
        """
        if getattr(self, "_gpu_pool", None) is None:
            import pickle

            reply = self._call(self._stub.ExportGpuPool, pb.ExportGpuPoolRequest())
            rebuild, args = pickle.loads(reply.handle)
            self._gpu_pool = rebuild(*args)
        return self._gpu_pool

    @contextlib.contextmanager
    def fetch_gpu(self, keys: Sequence[bytes]) -> Iterator[list[Any]]:
        """Device views (uint8 tensors into the mapped pool) of blocks in the daemon's GPU tier,
        None for blocks elsewhere; they stay in place until the ``with`` block ends."""
        pool = self.map_gpu_pool()
        reply = self._call(self._stub.Get, pb.GetRequest(items=[pb.GetItem(key=k) for k in keys],
                                                         allow_missing=True, gpu_direct=True))
        on_gpu = [k for k, r in zip(keys, reply.results) if r.on_gpu]
        try:
            yield [pool[r.gpu_offset : r.gpu_offset + r.meta.payload_len] if r.on_gpu else None
                   for r in reply.results]
        finally:
            if on_gpu:
                self._call(self._stub.Release, pb.KeysRequest(keys=on_gpu))

    def max_fetch_blocks(self, max_payload_bytes: int) -> int:
        """How many blocks one :meth:`fetch` can carry: through the arena, else in half a message."""
        return max(1, min(MAX_ITEMS_PER_CALL, self._planned_bytes() // _slot_bytes(max_payload_bytes)))

    def get(self, keys: Sequence[bytes], max_payload_bytes: int, inline: bool = False) -> list[bytes | None]:
        """Convenience: payload copies (None for misses); ``inline``: see `fetch`."""
        out: list[bytes | None] = []
        step = 1 if inline else self.max_fetch_blocks(max_payload_bytes)
        for start in range(0, len(keys), step):
            with self.fetch(keys[start : start + step], max_payload_bytes, inline=inline) as blocks:
                out.extend(None if b is None else b.payload.tobytes() for b in blocks)
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._call(self._stub.Delete, pb.KeysRequest(keys=keys)).count

    def pin(self, keys: Sequence[bytes]) -> int:
        return self._call(self._stub.Pin, pb.KeysRequest(keys=keys)).count

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._call(self._stub.Unpin, pb.KeysRequest(keys=keys)).count

    def clear(self, tiers: Sequence[str] = ()) -> int:
        return self._call(self._stub.Clear, pb.ClearRequest(tiers=tiers)).count

    def stats(self) -> dict[str, Any]:
        reply = self._call(self._stub.Stats, pb.StatsRequest())
        tiers = {t.name: {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields if f.name != "name"}
                 for t in reply.tiers}
        top = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields if f.name != "tiers"}
        return {"tiers": tiers, **top}


#: Longest wait for a report of local Lookups (the reporter thread's call, and close's).
_REPORT_TIMEOUT_S = 2.0


def _report_loop(client_ref: "weakref.ref[KVStoreClient]", closing: threading.Event) -> None:
    """Every REPORT_S, send the client's unreported tally unless another call carried it."""
    while not closing.wait(REPORT_S):
        client = client_ref()
        if client is None:
            return
        try:
            client._report(timeout=_REPORT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the tally is lost (at most once), the thread goes on
            log.debug("report of local Lookups failed: %s", exc)
        del client


#: The client's allocator aligns extents to 4 KiB (and rounds the arena down to it).
_ARENA_ALIGN = 4096


def _slot_bytes(size: int) -> int:
    """Arena bytes one item of ``size`` bytes takes: its extent, rounded up to the alignment, so
    calls that fill the arena exactly (e.g. 16 x 4 MiB in 64 MiB) still fit."""
    return -(-max(size, 1) // _ARENA_ALIGN) * _ARENA_ALIGN


class LayerStream:
    """The blocks of a layer-wise fetch and an iterator of the layers as they become ready."""

    def __init__(self, blocks: list[FetchedBlock | None], layers: Iterator[int]) -> None:
        self.blocks = blocks
        self._layers = layers

    def __iter__(self) -> Iterator[int]:
        return self._layers


def _fetched(key: bytes, result: pb.GetResult, payload: memoryview) -> FetchedBlock:
    meta = result.meta
    return FetchedBlock(
        key=key,
        layout=layout_from_message(meta.layout),
        tokens=meta.tokens, codec=meta.codec,
        codec_params=json.loads(meta.codec_params_json) if meta.codec_params_json else {},
        tier=result.tier, payload=payload)
