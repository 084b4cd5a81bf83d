"""The gRPC handlers of ``kvstore.v1``: each RPC resolves its tenant, validates its input, and
answers from the store or through the transfers both transports share (kvstore/daemon/transfers.py:
Put and Get, validation, tenants' keys, the bytes a call moves, the error-to-status map).

The process around them is kvstore/daemon/process.py; where gRPC listens, its TLS and the bearer-token
interceptor that admits each call, kvstore/daemon/grpc_listener.py.

Every RPC validates its input before touching the store and answers bad input with a status code
and a message that names the problem; an unexpected exception is logged and answered INTERNAL,
and the daemon stays up. Every RPC's work is bounded before it starts (transfers.py); a layer-wise
Get also in layer copies, and each of its sends in time. The handlers run on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Awaitable, Callable

import grpc

from kvstore.daemon.arena_registry import ArenaNotFound
from kvstore.daemon.auth import Tenant
from kvstore.daemon.log_limit import LogLimit
from kvstore.daemon.placement import STREAM_HOLD_S
from kvstore.daemon.transfers import BadRequest, Transfers, status_of, stored_keys
from kvstore.limits import GRPC_GET_COPIES, MAX_LAYER_COPIES, MAX_LEASE_MS
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import encode_get_response, result_messages

log = logging.getLogger("kvstore.daemon.server")

SERVICE_NAME = "kvstore.v1.KVStore"


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    """End the call with the status ``exc`` maps to (:func:`status_of`)."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    await context.abort(*status_of(method, exc))


def _rpc(method: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Map exceptions to status codes; never let one escape into grpc as a crash."""

    histogram = None

    @functools.wraps(method)
    async def wrapper(self: "KVStoreService", request, context: grpc.aio.ServicerContext):
        nonlocal histogram
        if histogram is None:
            histogram = self.store.metrics.rpc_seconds.labels(method.__name__)
        started = time.perf_counter()
        try:
            return await method(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status, none a crash
            await _abort(context, method.__name__, exc)
        finally:
            histogram.observe(time.perf_counter() - started)

    return wrapper


class KVStoreService(pb_grpc.KVStoreServicer):
    """The RPC handlers. Keys and namespaces are mapped to the caller's tenant's stored ones on the
    way in (kvstore/daemon/auth.py) and keys back on the way out, so tenants never see each other's
    blocks. Puts and Gets go through ``transfers``, which the data channel holds too."""

    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self.store = transfers.store
        #: The data channel's TCP port, told to clients in Stats (kvstore/daemon/data_channel.py); 0: none.
        self.data_port = 0
        self.data_host = ""  # advertised with the port (data_channel.advertised_host)
        #: Lines about refused holds: one per tenant a minute (a client renewing leases in a loop).
        self._refusals = LogLimit()

    def _tenant(self, context, operator: bool = False) -> Tenant:
        """The caller's tenant; the operator (admin token) only where ``operator`` (Clear, Stats)."""
        return self.transfers.tenant_of(context.invocation_metadata(), operator)

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        tenant = self._tenant(context)
        keys = stored_keys(tenant, request.keys)
        # blocks other hosts put in a shared tier since we looked, up to the first absent one
        await self.store.discover(keys, tenant.name, stop_at_absent=True)
        result = self.store.lookup(keys)  # counts the keys asked and the misses
        if keys:
            self.store.metrics.lookup_hits.inc(result.hits)
            self.store.metrics.lookups.labels("rpc").inc()
        self.store.claim(keys[: result.hits], tenant.name)
        if request.lease_ms and result.hits:
            seconds = min(request.lease_ms, MAX_LEASE_MS) / 1000
            refused = sum(not self.store.lease(key, seconds, tenant.name) for key in keys[: result.hits])
            if refused and self._refusals.admit(tenant.name) is not None:
                log.warning("%s: %d of %d leases refused: they would take it past its bound of %d held bytes",
                            f"tenant {tenant.name!r}" if tenant.name else "anonymous client", refused, result.hits,
                            self.store.hold_bound(tenant.name))
        if tenant.name:
            usage = self.transfers.usage[tenant.name]
            usage.requested += len(keys)
            usage.misses += len(keys) - result.hits
        return pb.LookupResponse(hits=result.hits, tiers=result.tiers)

    @_rpc
    async def Prefetch(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        tenant = self._tenant(context)
        keys = stored_keys(tenant, request.keys)
        await self.store.discover(keys, tenant.name)
        self.store.claim(keys, tenant.name)  # promoted copies are charged to it, within its quota
        return pb.CountResponse(count=sum(self.store.promoter.schedule(k) for k in keys))

    @_rpc
    async def Put(self, request: pb.PutRequest, context) -> pb.PutResponse:
        return pb.PutResponse(stored=await self.transfers.put_blocks(self._tenant(context), request))

    @_rpc
    async def Get(self, request: pb.GetRequest, context) -> pb.GetResponse | bytes:
        # one call: the tenant of the call's token and its reads (transfers.get_for)
        tenant, replies, inline = await self.transfers.get_for(context.invocation_metadata(), request,
                                                               copies=GRPC_GET_COPIES)
        if inline:
            # Replies' buffers in flight are bounded across calls; they are freed once gRPC sent them.
            context.add_done_callback(lambda _: self.transfers.inline.release(inline, tenant.name))
        if any(payload is not None for _, payload in replies):
            reply = encode_get_response(replies)
            replies.clear()  # the read buffers are free before gRPC copies the reply
            return reply
        return pb.GetResponse(results=[r for r, _ in replies])

    async def GetLayers(self, request: pb.GetRequest, context) -> None:
        """Stream through ``context.write``, each send bounded by ``STREAM_HOLD_S``: a reader that
        takes no message for that long loses the call (and its blocks' hold, and its arenas)."""
        started = time.perf_counter()
        stream = None
        try:
            tenant = self._tenant(context)
            _, plan, _ = await self.transfers.plan_get(request, tenant, need_dest=True)
            copies = sum(read.header.layout.num_layers for read in plan if read.header is not None)
            if copies > MAX_LAYER_COPIES:
                raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"this GetLayers would make {copies} layer copies; at most {MAX_LAYER_COPIES}")
            stream = self.store.reads.get_layerwise(
                [(read.key, read.dest) for read in plan if read.header is not None], tenant.name)
            async for layer, found in stream:
                if found is None:
                    await _write(context, pb.LayerReady(layer=layer))
                    continue
                found_iter = iter(found)
                ordered = [next(found_iter) if read.header is not None else None for read in plan]
                self.store.metrics.misses.inc(sum(read.header is None for read in plan))
                self.transfers.count(tenant, "get", ordered)
                await _write(context, pb.LayerReady(layer=-1, results=result_messages(
                    [item.key for item in request.items], ordered)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - as every unary RPC (_rpc)
            await _abort(context, "GetLayers", exc)
        finally:
            if stream is not None:
                await stream.aclose()  # the blocks' hold ends now, not when the generator is collected
            self.store.metrics.rpc_seconds.labels("GetLayers").observe(time.perf_counter() - started)

    @_rpc
    async def ExportGpuPool(self, request: pb.ExportGpuPoolRequest, context) -> pb.ExportGpuPoolResponse:
        self._tenant(context)
        pool = self.store.gpu_pool()
        if pool is None or pool.device.type != "cuda":
            raise BadRequest(grpc.StatusCode.FAILED_PRECONDITION,
                             "this daemon has no GPU tier on a CUDA device (set gpu_capacity)")
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        return pb.ExportGpuPoolResponse(handle=pickle.dumps(reduce_tensor(pool)), size=pool.numel(),
                                        device=str(pool.device))

    @_rpc
    async def Release(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=self.store.release(stored_keys(self._tenant(context), request.keys)))

    @_rpc
    async def Delete(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=await self.store.delete(stored_keys(self._tenant(context), request.keys)))

    @_rpc
    async def Pin(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        tenant = self._tenant(context)
        keys = stored_keys(tenant, request.keys)
        missing = self.store.missing(keys)
        if missing:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, f"cannot pin {len(missing)} keys that are not stored "
                                                        f"(first: keys[{keys.index(missing[0])}])")
        self.store.claim(keys, tenant.name)
        return pb.CountResponse(count=self.store.pin(keys, tenant.name))

    @_rpc
    async def Unpin(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=self.store.unpin(stored_keys(self._tenant(context), request.keys)))

    @_rpc
    async def Clear(self, request: pb.ClearRequest, context) -> pb.CountResponse:
        tenant = self._tenant(context, operator=True)
        if tenant.name:
            raise BadRequest(grpc.StatusCode.PERMISSION_DENIED,
                             "Clear would drop every tenant's blocks; a tenant deletes its own with Delete "
                             "(the operator clears with the daemon's admin token)")
        if self.transfers.tenants.operator is not None and not tenant.operator:
            # beside an admin token the shared auth_token is a client's, not the operator's
            raise BadRequest(grpc.StatusCode.PERMISSION_DENIED,
                             "this daemon has an admin token: only it may Clear (clients' tokens Delete their keys)")
        return pb.CountResponse(count=await self.store.clear(list(request.tiers)))

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        tenant = self._tenant(context, operator=True)  # the operator sees the daemon's, a tenant its own
        if tenant.name:
            return self._tenant_stats(tenant)
        m = self.store.metrics
        tiers = []
        for tier in self.store.tiers:
            n = tier.name
            tiers.append(pb.TierStats(
                name=n, blocks=len(tier), used_bytes=tier.used_bytes, capacity_bytes=tier.capacity_bytes,
                hits=m.value(m.hits, tier=n), evictions=m.value(m.evictions, tier=n),
                promotions_in=m.value(m.promotions, tier=n), demotions_in=m.value(m.demotions, tier=n),
                corrupt=m.value(m.corrupt, tier=n), bytes_in=m.value(m.bytes_in, tier=n),
                bytes_out=m.value(m.bytes_out, tier=n)))
        return pb.StatsResponse(tiers=tiers, misses=m.value(m.misses), pinned=self.store.pinned,
                                queue_depth=self.store.write_behind.depth, queue_dropped=m.value(m.queue_dropped),
                                arenas=len(self.transfers.arenas), write_errors=self.store.write_errors,
                                requested=m.total(m.requested), events_published=m.value(m.events_published),
                                events_dropped=m.value(m.events_dropped), data_port=self.data_port,
                                data_host=self.data_host, inline_bytes=self.transfers.inline.in_flight)

    def _tenant_stats(self, tenant: Tenant) -> pb.StatsResponse:
        """A named tenant's own traffic; nothing that moves with other tenants' use."""
        usage = self.transfers.usage[tenant.name]
        tiers = [pb.TierStats(name=t.name, capacity_bytes=t.capacity_bytes, hits=usage.hits[t.name],
                              bytes_in=usage.bytes_in[t.name], bytes_out=usage.bytes_out[t.name])
                 for t in self.store.tiers]
        return pb.StatsResponse(tiers=tiers, misses=usage.misses, requested=usage.requested,
                                arenas=self.transfers.arenas.count(tenant.name), data_port=self.data_port,
                                data_host=self.data_host)

    @_rpc
    async def RegisterArena(self, request: pb.RegisterArenaRequest, context) -> pb.RegisterArenaResponse:
        raise BadRequest(grpc.StatusCode.FAILED_PRECONDITION,
                         "arenas are handed out on the arena socket beside the daemon's unix socket "
                         "(SOCKET.arena, see kvstore/arena.py), never mapped from a name")

    @_rpc
    async def UnregisterArena(self, request: pb.UnregisterArenaRequest, context) -> pb.CountResponse:
        try:
            await self.transfers.arenas.release(request.arena_id, self._tenant(context))
        except ArenaNotFound as exc:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        return pb.CountResponse(count=1)


async def _write(context, message) -> None:
    try:
        await asyncio.wait_for(context.write(message), STREAM_HOLD_S)
    except asyncio.TimeoutError:
        raise BadRequest(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"the reader took no message for {STREAM_HOLD_S:.0f} s") from None


def _serializer(message_type) -> Callable[[object], bytes]:
    def serialize(message) -> bytes:
        return message if isinstance(message, bytes) else message_type.SerializeToString(message)
    return serialize


def add_to_server(service: KVStoreService, server: grpc.aio.Server) -> None:
    """Register the handlers, like the generated ``add_KVStoreServicer_to_server``, except that a
    handler may return its reply already serialized (Get does, see :func:`kvstore.wire.encode_get_response`)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["KVStore"].methods:
        request_type = getattr(pb, method.input_type.name)
        reply_type = getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(service, method.name), request_deserializer=request_type.FromString,
                                     response_serializer=_serializer(reply_type))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
