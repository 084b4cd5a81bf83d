"""KVStoreClient: what an engine process uses to talk to the kvstore daemon.

Transport is chosen at connect time. On a unix socket the client asks the daemon for a shared-memory
arena (a sealed memfd handed over the arena socket, kvstore/arena.py); Put and Get then move block
bytes through it (arena_calls.py; its space: arena_space.py) and gRPC carries offsets only. Without
one (TCP, another host) the bytes travel on the daemon's data channel when it offers one (raw bytes
beside gRPC, same token and TLS: engine_adapter/client/data_channel.py), else inline in the messages. The
calls are the same either way.

A same-host client also maps the daemon's key index (kvstore/shm_index.py) and answers ``lookup``
from it without a round trip; it asks the daemon when the index cannot answer (the daemon stopped,
a miss that a shared S3 tier may still hold, a key of the wrong size), and reports those Lookups
to the daemon (kvstore/lookup_report.py).

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
from typing import Any, Iterator, Sequence

import grpc

from engine_adapter.client.arena_space import ArenaSpace, batches, slot_bytes
from engine_adapter.client.arena_calls import ArenaTransport
from engine_adapter.client.blocks import BlockToPut, FetchedBlock, LayerStream, Rows, RowsGot, fetched_block, payload_view
from engine_adapter.client.data_channel import DataChannelError, DataChannelPool, DataEndpoint, open_pool
from kvstore.arena import ArenaLease, arena_socket_path
from kvstore.connect import (PYTHON_OPTIONS, ClientSettings, DaemonError, OptionNames, client_settings, explain,
                             is_unix, open_channel, plaintext_token_refusal)
from kvstore.keys import KEY_BYTES, KVLayout, LookupResult, Namespace
from kvstore.limits import GRPC_GET_COPIES, MAX_ITEMS_PER_CALL, MAX_LEASE_MS, MAX_SKIPPED_REPORT, SKIPPED_STORES_HEADER
from kvstore.lookup_report import REPORT_TIMEOUT_S, LookupTally
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shm_index import KeyIndexReader
from kvstore.wire import layout_message

log = logging.getLogger(__name__)


#: Data-channel refusals a call answers by going inline in gRPC instead: connections or bytes at
#: their cap, or the daemon stopping its channel.
BUSY = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class KVStoreClient:
    def __init__(self, address: str | None = None, *, shared_memory: bool | None = None,
                 arena_bytes: int = 256 * 2**20, token: str | None = None,
                 token_file: str | os.PathLike | None = None, timeout: float = 60.0,
                 max_message_bytes: int = 256 * 2**20, tls_ca: str | bytes | None = None,
                 tls_cert: str | bytes | None = None, tls_key: str | bytes | None = None,
                 tls_server_name: str | None = None, insecure: bool | None = None, local_lookup: bool = True,
                 config_file: str | os.PathLike | None = None, settings: ClientSettings | None = None) -> None:
        """Connect to the daemon at ``address``.

        Each setting is the argument given, else the ``KVSTORE_*`` environment, else the daemon's
        config file (``config_file`` else ``KVSTORE_CONFIG``), as every client resolves them
        (`kvstore.connect.client_settings`; ``settings``: resolved already): the address (else
        ``KVSTORE_LISTEN``, the file's ``listen``, the socket ``kvstore serve`` listens on by
        default). Token: ``token``, else ``token_file``'s (one token, or one per address:
        `kvstore.connect.TokenBook`), else ``KVSTORE_AUTH_TOKEN``, else the file's. TLS, for TCP
        addresses (a unix socket is always plaintext): ``tls_ca`` (PEM path or bytes: the CA of the
        daemon's certificate; else ``KVSTORE_TLS_CA``), optionally a client certificate ``tls_cert``
        + ``tls_key``, and ``tls_server_name`` when the certificate names the host otherwise. A
        token over plaintext TCP to an address that is not loopback is refused (ValueError) unless
        ``insecure``. A call the daemon cannot answer (none there, TLS or not, a refused token)
        raises `kvstore.connect.DaemonError`, a `grpc.RpcError` whose text is one line with the fix.
        """
        settings = settings or client_settings(address, token, token_file, tls_ca, tls_cert, tls_key,
                                               tls_server_name, insecure, config_file=config_file)
        self.address = settings.address
        self.timeout = timeout
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        token, insecure = settings.token, settings.insecure
        self.tls = None if is_unix(self.address) else settings.tls
        refusal = plaintext_token_refusal(self.address, self.tls, token, insecure)
        if refusal:
            raise ValueError(refusal)
        self._channel = open_channel(self.address, self.tls, options)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._arena: ArenaTransport | None = None  # the shared-memory arena's calls, once there is one
        self._lease: ArenaLease | None = None
        self._token = token
        self._index: KeyIndexReader | None = None
        self._index_lock = threading.Lock()
        self._local_lookup = local_lookup
        #: Lookups answered from the shared key index and over gRPC (for tests and benchmarks).
        self.local_lookups = self.rpc_lookups = 0
        self._tally = LookupTally()  # local Lookups the daemon has not counted yet
        #: Each namespace layout's message, made once (every Put and Get in rows names one).
        self._layouts: dict[KVLayout, pb.Layout] = {}
        self._skipped_stores = 0  # stores skipped for a slow store queue, reported on the next call
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
        lease = self.lease_arena(size)
        self._lease = lease
        self._arena = ArenaTransport(lease.arena, lease.arena_id, ArenaSpace(size), _weakly(self._call),
                                     _weakly(self._stream), self._stub)
        if lease.index_name and self._local_lookup:
            try:
                self._index = KeyIndexReader.attach(lease.index_name)
            except ValueError:
                self._index = None  # another user's daemon, or gone: Lookup goes over gRPC

    def lease_arena(self, size: int) -> ArenaLease:
        """A shared-memory arena of ``size`` bytes from the daemon (over the arena socket beside its unix
        socket), every page faulted in; held until the lease is closed. OSError or ConnectionError when
        the daemon refuses one (its caps) or cannot be reached."""
        lease = ArenaLease.request(arena_socket_path(self.address), size, self._token, timeout=self.timeout)
        lease.arena.prefault()
        return lease

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

    def _locate_data_channel(self) -> DataEndpoint | None:
        """Where the daemon says its data channel is (asked over gRPC, the channel whose peer is
        authenticated); None when it offers none. ValueError when the token must not go there."""
        reply = self._call(self._stub.Stats, pb.StatsRequest())
        endpoint = DataEndpoint.advertised(self.address, reply.data_port, reply.data_host)
        if endpoint is not None and not endpoint.unix_path:
            refusal = plaintext_token_refusal(str(endpoint), self.tls, self._token, self._insecure)
            if refusal:
                raise ValueError(refusal)
        return endpoint

    def _open_data_channel(self) -> DataChannelPool | None:
        try:
            endpoint = self._locate_data_channel()
        except grpc.RpcError:
            return None  # the calls that follow meet the same problem and say it
        except (OSError, ValueError) as exc:
            log.warning("the data channel of %s cannot be used (%s); block bytes travel inline in gRPC",
                        self.address, exc)
            return None
        if endpoint is None:
            return None
        try:
            return open_pool(endpoint, self._locate_data_channel, self._token, self.tls, self.timeout,
                             self._max_message_bytes)
        except (OSError, ValueError, grpc.RpcError) as exc:
            log.warning("the data channel of %s cannot be used (%s); block bytes travel inline in gRPC",
                        self.address, exc)
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
        self._tally.stop()
        try:
            self._report(timeout=REPORT_TIMEOUT_S, calls=8)  # the last tally: a closed client loses none
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
        if self._tally:
            metadata += self._tally.take()
        if self._skipped_stores:
            skipped, self._skipped_stores = min(self._skipped_stores, MAX_SKIPPED_REPORT), 0
            metadata += ((SKIPPED_STORES_HEADER, str(skipped)),)
        try:
            return method(request, timeout=timeout or self.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
                raise
            reason = explain(exc, self.address, self.tls, self._token, probe_timeout=0.5)
            raise DaemonError(exc, reason or f"{self.address}: {exc.code().name}: "
                                             f"{' '.join((exc.details() or '').split())}") from None

    def count_skipped_stores(self, blocks: int) -> None:
        """``blocks`` stores the caller skipped (its store queue was behind): the next call tells
        the daemon (``kvstore_client_stores_skipped_total``). A hint: a call that fails loses it."""
        self._skipped_stores += blocks

    def _stream(self, method, request):
        """A streaming call with this client's token and timeout (its replies, an iterator)."""
        return method(request, timeout=self.timeout, metadata=self._metadata)

    def _report(self, timeout: float, calls: int = 1) -> None:
        """Send the tally now, if any, in up to ``calls`` empty Lookups (which count as nothing else)."""
        for _ in range(calls):
            if not self._tally:
                return
            self._call(self._stub.Lookup, pb.LookupRequest(), timeout=timeout)

    def _planned_bytes(self) -> int:
        """Bytes one call is planned to take: half the arena (arena_space.py), else half a message."""
        return self._arena.space.capacity // 2 if self._arena else self._max_message_bytes // 2

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
                if local is not None:  # the daemon counts it when it gets the tally
                    self._tally.count(len(keys), local[0], self._report, keys[: local[0]])
            if local is not None:
                self.local_lookups += 1
                return LookupResult(*local)
        self.rpc_lookups += 1
        reply = self._call(self._stub.Lookup, pb.LookupRequest(keys=keys))
        return LookupResult(reply.hits, tuple(reply.tiers))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        return self._call(self._stub.Prefetch, pb.KeysRequest(keys=keys)).count

    def put(self, namespace: Namespace, blocks: Sequence[BlockToPut | tuple], codec: str = "raw",
            codec_params: dict[str, Any] | None = None, durable: bool = False) -> int:
        """Store blocks of one namespace: `BlockToPut`s, or ``(key, tokens, payload[, parent[,
        token_ids]])`` tuples (`BlockToPut.of`); returns how many were stored.

        ``durable``: return only once a durable tier (fsynced disk, S3) holds them; otherwise a
        Put is acknowledged once the daemon's top tier holds them (see docs/guarantees.md).
        """
        blocks = [BlockToPut.of(block) for block in blocks]
        layout = self._layout_message(namespace.layout)
        params = json.dumps(codec_params) if codec_params else ""
        views = [payload_view(block.payload) for block in blocks]
        stored = 0
        data = self._data_channel()
        for batch in batches([len(v) for v in views], self._planned_bytes()):
            metas = [pb.BlockMeta(key=blocks[i].key, namespace=namespace.id, tokens=blocks[i].tokens,
                                  layout=layout,
                                  codec=codec, codec_params_json=params, payload_len=len(views[i]))
                     for i in batch]
            if data is not None:  # payloads follow the message as they are
                items = [_put_item(meta, blocks[i]) for meta, i in zip(metas, batch)]
                try:
                    stored += data.put(pb.PutRequest(items=items, durable=durable), [views[i] for i in batch])
                    continue
                except DataChannelError as exc:
                    if exc.code() not in BUSY:
                        raise  # else the channel is full or stopping: this batch goes inline in gRPC
            if self._arena is None:
                items = [_put_item(meta, blocks[i], inline=views[i].tobytes()) for meta, i in zip(metas, batch)]
                stored += self._call(self._stub.Put, pb.PutRequest(items=items, durable=durable)).stored
                continue
            stored += self._arena.put({i: _put_item(meta, blocks[i]) for meta, i in zip(metas, batch)}, views, durable)
        return stored

    def put_rows(self, namespace: Namespace, blocks: Sequence[BlockToPut], durable: bool = False) -> int:
        """Put raw blocks (`BlockToPut`s or their tuples) whose payloads lie in rows of an arena of this
        client's (each payload has ``arena_id``, ``place``: `Rows`, ``nbytes`` and ``retire()``;
        `shared_kv.RowsInRegion`): the daemon copies each one's rows out of the arena into its top
        tier, no copy here. Returns how many were stored. A call that fails retires its blocks'
        payloads (the daemon may still be reading them after a timeout: that memory is lent to
        nothing else), then raises."""
        blocks = [BlockToPut.of(block) for block in blocks]
        layout = self._layout_message(namespace.layout)
        stored = 0
        for batch in batches([block.payload.nbytes for block in blocks], self._planned_bytes()):
            items = []
            for i in batch:
                block, place = blocks[i], blocks[i].payload.place
                meta = pb.BlockMeta(key=block.key, namespace=namespace.id, tokens=block.tokens, layout=layout,
                                    codec="raw", payload_len=block.payload.nbytes)
                item = _put_item(meta, block)
                item.slice.CopyFrom(pb.ArenaSlice(arena_id=block.payload.arena_id, offset=place.offset,
                                                  length=place.span))
                item.row_bytes, item.row_stride = place.row_bytes, place.row_stride
                items.append(item)
            try:
                stored += self._call(self._stub.Put, pb.PutRequest(items=items, durable=durable)).stored
            except BaseException:
                for i in batch:  # the daemon may still be copying out of them after a timeout
                    blocks[i].payload.retire()
                raise
        return stored

    def get_rows(self, arena_id: int, keys: Sequence[bytes], places: Sequence[Rows], layout: KVLayout,
                 leading_run: bool = False) -> list[RowsGot]:
        """Get ``keys`` into rows of the arena ``arena_id`` (one of this client's), ``places[i]`` for
        ``keys[i]``, in one copy (the daemon's, from its tier straight into the rows). Per key a
        `RowsGot`: a block is in place when it is raw, of ``layout`` and exactly ``places[i].nbytes``;
        for any other the daemon copied nothing (a coded block: Get it with :meth:`fetch`).

        ``leading_run``: only the longest leading run of ``keys`` the daemon holds, found by
        :meth:`lookup` first (from the shared key index where there is one), and a `RowsGot` for
        each of those alone: a load's lookup and Get in one call."""
        if leading_run:
            hits = self.lookup(keys).hits
            keys, places = keys[:hits], places[:hits]
        expected = self._layout_message(layout)
        got: list[RowsGot] = []
        for start in range(0, len(keys), MAX_ITEMS_PER_CALL):
            batch = range(start, min(start + MAX_ITEMS_PER_CALL, len(keys)))
            items = [pb.GetItem(key=keys[i], row_bytes=places[i].row_bytes, row_stride=places[i].row_stride,
                                dest=pb.ArenaSlice(arena_id=arena_id, offset=places[i].offset, length=places[i].span))
                     for i in batch]
            reply = self._call(self._stub.Get, pb.GetRequest(items=items, allow_missing=True))
            for i, r in zip(batch, reply.results):
                in_place = (r.found and r.meta.codec == "raw" and r.meta.payload_len == places[i].nbytes
                            and r.meta.layout == expected)
                got.append(RowsGot(r.found, in_place, r.tier, r.meta.codec))
        return got

    def _layout_message(self, layout: KVLayout) -> pb.Layout:
        """``layout``'s message, made once per layout (read only: requests copy it in)."""
        message = self._layouts.get(layout)
        if message is None:
            if len(self._layouts) >= 64:  # a client of many layouts: start over, no unbounded map
                self._layouts.clear()
            message = self._layouts[layout] = layout_message(layout)
        return message

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
                    yield [fetched_block(k, r, p) if r.found else None
                           for k, r, p in zip(keys, reply.results, payloads)]
                finally:
                    data.give_back(conn)
                return
        if self._arena is None or inline:
            reply = self._call(self._stub.Get, pb.GetRequest(
                items=[pb.GetItem(key=k) for k in keys], allow_missing=allow_missing))
            yield [fetched_block(k, r, memoryview(r.inline)) if r.found else None
                   for k, r in zip(keys, reply.results)]
            return
        with self._arena.fetch(keys, max_payload_bytes, allow_missing) as blocks:
            yield blocks

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
        if self._arena is None or len(keys) <= batch:
            for first in range(0, len(keys), batch):
                with self.fetch(keys[first : first + batch], max_payload_bytes) as blocks:
                    yield first, blocks
            return
        yield from self._arena.fetch_ahead(keys, max_payload_bytes, batch)

    @contextlib.contextmanager
    def fetch_layers(self, keys: Sequence[bytes], max_payload_bytes: int,
                     allow_missing: bool = True) -> Iterator[LayerStream]:
        """Like :meth:`fetch`, but the daemon reports each layer as soon as it is in place.

            with client.fetch_layers(keys, slot) as stream:
                blocks = stream.blocks            # FetchedBlock or None, as for fetch
                for layer in stream:              # 0, 1, ... as each layer of every block lands
                    start_layer(layer)            # payload[layer * size:(layer + 1) * size] is valid

        Needs the shared-memory data plane (a unix socket).
        """
        if self._arena is None:
            raise ValueError("a layer-wise fetch needs the shared-memory data plane (connect over a unix socket)")
        with self._arena.fetch_layers(keys, max_payload_bytes, allow_missing) as stream:
            yield stream

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
        """How many blocks one :meth:`fetch` can carry: through the arena, else in half a message
        over the copies the daemon holds of an inline reply (it refuses a Get whose copies exceed
        its inline budget, by default one message: so two such Gets fit at once)."""
        planned = self._planned_bytes() if self._arena else self._planned_bytes() // GRPC_GET_COPIES
        return max(1, min(MAX_ITEMS_PER_CALL, planned // slot_bytes(max_payload_bytes)))

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


def _weakly(method):
    """``method`` (a client's) as a callable that does not keep the client alive: the arena's
    calls hold it, and the client holds them."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        if bound is None:
            raise ValueError("the KVStoreClient is gone")
        return bound(*args, **kwargs)

    return call


def _put_item(meta: pb.BlockMeta, block: BlockToPut, inline: bytes | None = None) -> pb.PutItem:
    """The Put item of ``block`` under ``meta``: its parent and token ids, the payload ``inline`` if
    given (else the caller names where it is: a slice, or the data channel's frames)."""
    ids = block.token_ids
    item = pb.PutItem(meta=meta, parent=block.parent or b"",
                      token_ids=ids.tolist() if hasattr(ids, "tolist") else ids)  # a tensor's or array's as ints
    if inline is not None:
        item.inline = inline
    return item
