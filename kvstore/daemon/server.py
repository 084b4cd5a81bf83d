"""The gRPC handlers of ``kvstore.v1``: request validation, tenants' keys, the shared-memory arenas.

The process around them (tiers, listening, auth, TLS, shutdown) is kvstore/daemon/process.py.

Every RPC validates its input before touching the store and answers bad input with a status code
and a message that names the problem; an unexpected exception is logged and answered INTERNAL,
and the daemon stays up. Every RPC's work is bounded before it starts: keys per call, layers per
block, and the bytes a Put or Get moves (inline bytes within the message limit; bytes through
shared memory within the arenas it names).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import defaultdict
from typing import Awaitable, Callable

import grpc

from kvstore.daemon.arena_registry import ArenaNotFound, ArenaRegistry
from kvstore.daemon.auth import ANONYMOUS, Tenant, TenantDirectory
from kvstore.block import BlockHeader
from kvstore.daemon.budget import BudgetExhausted, ByteBudget
from kvstore.keys import KEY_BYTES
from kvstore.limits import MAX_ITEMS_PER_CALL, MAX_KEYS_PER_CALL, MAX_LAYER_COPIES, MAX_LAYERS, MAX_LEASE_MS
from kvstore.daemon.log_limit import LogLimit
from kvstore.daemon.placement import STREAM_HOLD_S, BlockGoneError, BlockStore, GetResult, HoldRefused
from kvstore.daemon.residency import WalkBudget
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shm_index import REPORT_HEADER, parse_report
from kvstore.transcode import check_codec_params
from kvstore.wire import encode_get_response, layout_from_message, layout_message
from tiers.base import TierError, TierFullError

log = logging.getLogger("kvstore.daemon.server")

#: Bytes a reply needs beyond its payloads, per result (metadata, field tags); a generous bound.
RESULT_OVERHEAD = 512
GPU_LEASE_SECONDS = 30.0
#: Longest a Get waits for inline reply bytes to come free before RESOURCE_EXHAUSTED.
INLINE_WAIT_S = 10.0
SERVICE_NAME = "kvstore.v1.KVStore"


class BadRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


#: The status each kind of handler error answers with (the first that matches); any other error
#: is a bug: INTERNAL, logged with its traceback.
_STATUS_OF = (
    (BlockGoneError, grpc.StatusCode.ABORTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    ((TierFullError, HoldRefused, BudgetExhausted), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TierError, grpc.StatusCode.UNAVAILABLE),
)


def status_of(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message ``exc`` answers with (the one mapping for unary and streamed RPCs
    and the data channel's error frames); an unexpected error is logged with its traceback."""
    if isinstance(exc, BadRequest):
        return exc.code, str(exc)
    for kinds, code in _STATUS_OF:
        if isinstance(exc, kinds):
            return code, str(exc)
    log.error("%s failed", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{method}: {type(exc).__name__}: {exc}"


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
            self.store.publish_availability()  # clients' local Lookups see a tier going down at once
            histogram.observe(time.perf_counter() - started)

    return wrapper


def _check_keys(keys, what: str = "keys") -> list[bytes]:
    most = MAX_KEYS_PER_CALL if what == "keys" else MAX_ITEMS_PER_CALL
    if len(keys) > most:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} {what} in one call; at most {most}")
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{what}[{i}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")
    return list(keys)


def header_from_meta(meta: pb.BlockMeta, payload_len: int, tenant: Tenant, stored_key: bytes) -> BlockHeader:
    """Validate a client's BlockMeta (ValueError with the reason) and build the header stored:
    under ``stored_key`` and the tenant's namespace, its checksum still 0 (the store computes it)."""
    if len(meta.key) != KEY_BYTES or len(meta.namespace) != KEY_BYTES:
        raise ValueError(f"meta.key and meta.namespace must be {KEY_BYTES} bytes, got "
                         f"{len(meta.key)} and {len(meta.namespace)}")
    if not meta.HasField("layout"):
        raise ValueError("meta.layout is required")
    if meta.layout.num_layers > MAX_LAYERS:
        raise ValueError(f"meta.layout.num_layers is {meta.layout.num_layers}; at most {MAX_LAYERS}")
    layout = layout_from_message(meta.layout)
    if meta.payload_len != payload_len:
        raise ValueError(f"meta.payload_len is {meta.payload_len} but {payload_len} payload bytes were sent")
    try:
        params = json.loads(meta.codec_params_json) if meta.codec_params_json else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"meta.codec_params_json is not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise ValueError("meta.codec_params_json must be a JSON object")
    # A tenant's namespace is its own: its layout binding is invisible to other tenants.
    return BlockHeader(key=stored_key, namespace=tenant.stored_key(meta.namespace), layout=layout,
                       tokens=meta.tokens, payload_len=payload_len, checksum=0, codec=meta.codec or "raw",
                       codec_params=params)


def meta_from_header(header: BlockHeader) -> pb.BlockMeta:
    return pb.BlockMeta(
        key=header.key, namespace=header.namespace,
        layout=layout_message(header.layout),
        tokens=header.tokens, codec=header.codec,
        codec_params_json=json.dumps(header.codec_params) if header.codec_params else "",
        payload_len=header.payload_len)


class _Usage:
    """One named tenant's own counters, for its Stats (it sees nobody else's traffic)."""

    def __init__(self) -> None:
        self.requested = self.misses = 0
        self.hits: dict[str, int] = defaultdict(int)
        self.bytes_out: dict[str, int] = defaultdict(int)
        self.bytes_in: dict[str, int] = defaultdict(int)


class KVStoreService(pb_grpc.KVStoreServicer):
    """The RPC handlers. Keys and namespaces are mapped to the caller's tenant's stored ones on the
    way in (kvstore/daemon/auth.py) and keys back on the way out, so tenants never see each other's blocks."""

    def __init__(self, store: BlockStore, tenants: TenantDirectory | None = None,
                 arenas: ArenaRegistry | None = None, max_message_bytes: int = 256 * 2**20,
                 autocal=None, max_inline_bytes: int = 0) -> None:
        self.store = store
        #: kvtc@auto's calibrator (kvstore/daemon/autocal.py), told which tenant Puts each namespace
        self.autocal = autocal
        self.tenants = tenants or TenantDirectory([ANONYMOUS], required=False)
        #: Arenas handed out on the arena socket (kvstore/daemon/arena_registry.py); empty without one.
        self.arenas = arenas if arenas is not None else ArenaRegistry(max_arena_bytes=0, max_arenas_per_client=0)
        self.max_message_bytes = max_message_bytes
        #: Inline Get reply bytes and data-channel transfers in flight, all calls together
        #: (default: one message's worth).
        self.inline = ByteBudget(max_inline_bytes or max_message_bytes, "inline payloads")
        #: The data channel's TCP port, told to clients in Stats (kvstore/daemon/data_channel.py); 0: none.
        self.data_port = 0
        self._usage: dict[str, _Usage] = defaultdict(_Usage)
        #: Lines about refused holds: one per tenant a minute (a client renewing leases in a loop).
        self._refusals = LogLimit()

    def _tenant(self, context, operator: bool = False) -> Tenant:
        """The caller's tenant; the operator (admin token) only where ``operator`` (Clear, Stats)."""
        return self.tenant_of(context.invocation_metadata(), operator)

    def tenant_of(self, metadata, operator: bool = False) -> Tenant:
        """The tenant of a call's metadata (for gRPC, or the data channel's first frame);
        BadRequest when the token is missing or wrong, or is the admin token outside ``operator``."""
        tenant = self.tenants.resolve(metadata, operator=True)
        if tenant is None:  # the interceptor already refused it; this is the second line of defence
            raise BadRequest(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        if tenant.operator and not operator:
            raise BadRequest(grpc.StatusCode.PERMISSION_DENIED,
                             "this call carries the admin token, which is the operator's: it may Clear and read "
                             "Stats, and stores, reads or holds no blocks (it is no tenant); use a tenant's token")
        if self.store.key_index is not None and not tenant.name:
            self._add_local_lookups(metadata)
        return tenant

    def _add_local_lookups(self, metadata) -> None:
        """Count the Lookups a client answered from the key index (kvstore/shm_index.py, "Counting")
        as if they had been RPCs: its first report on this call, if well formed. Only while the
        index is published, so only the anonymous tenant's clients have any (with tenants: none)."""
        for name, value in metadata or ():
            if name == REPORT_HEADER:
                report = parse_report(value) if isinstance(value, str) else None
                if report is not None:
                    keys, hits, calls = report
                    m = self.store.metrics
                    m.requested.labels("lookup").inc(keys)
                    m.misses.inc(keys - hits)
                    m.lookup_hits.inc(hits)
                    m.lookups.labels("local").inc(calls)
                return

    @staticmethod
    def _stored_keys(tenant: Tenant, keys, what: str = "keys") -> list[bytes]:
        return [tenant.stored_key(k) for k in _check_keys(keys, what)]

    def _slice(self, slice_: pb.ArenaSlice, tenant: Tenant) -> memoryview:
        return self.arenas.view(slice_.arena_id, tenant, slice_.offset, slice_.length)

    def _check_bytes(self, tenant: Tenant, what: str, inline: int, shared: int, arena_ids: set[int]) -> None:
        """Refuse a call before any copy when it would move more than it may: inline bytes within
        the message limit, bytes through shared memory within the arenas it names (a call naming
        one slice many times cannot make the daemon copy without end)."""
        if inline > self.max_message_bytes:
            raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{what} would carry {inline} inline bytes; the message limit is "
                             f"{self.max_message_bytes} (max_message_bytes): ask for fewer blocks per call")
        budget = sum(self.arenas.size(arena_id, tenant) for arena_id in arena_ids)
        if shared > budget:
            raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{what} would copy {shared} bytes through shared memory, more than the "
                             f"{budget} bytes of the arenas it names")

    def _count(self, tenant: Tenant, rpc: str, results: list[GetResult | None], requested: int | None = None) -> None:
        """Keys asked for (``requested``, default one per result) and the tenant's own counters of
        its results (the store counts the misses)."""
        requested = len(results) if requested is None else requested
        self.store.metrics.requested.labels(rpc).inc(requested)
        if tenant.name:
            usage = self._usage[tenant.name]
            usage.requested += requested
            for found in results:
                if found is None:
                    usage.misses += 1
                else:
                    usage.hits[found.tier] += 1
                    usage.bytes_out[found.tier] += found.header.payload_len

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        tenant = self._tenant(context)
        keys = self._stored_keys(tenant, request.keys)
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
            usage = self._usage[tenant.name]
            usage.requested += len(keys)
            usage.misses += len(keys) - result.hits
        return pb.LookupResponse(hits=result.hits, tiers=result.tiers)

    @_rpc
    async def Prefetch(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        tenant = self._tenant(context)
        keys = self._stored_keys(tenant, request.keys)
        await self.store.discover(keys, tenant.name)
        self.store.claim(keys, tenant.name)  # promoted copies are charged to it, within its quota
        return pb.CountResponse(count=sum(self.store.schedule_promotion(k) for k in keys))

    @_rpc
    async def Put(self, request: pb.PutRequest, context) -> pb.PutResponse:
        return pb.PutResponse(stored=await self.put_blocks(self._tenant(context), request))

    async def put_blocks(self, tenant: Tenant, request: pb.PutRequest,
                         payloads: list[memoryview] | None = None) -> int:
        """Validate every item, then store them; the number stored. Payloads are the items' own
        (inline or an arena slice), or ``payloads``, one per item, as the data channel received
        them (kvstore/daemon/data_channel.py; its items then carry neither)."""
        stored_keys = self._stored_keys(tenant, [item.meta.key for item in request.items], "items")
        prepared: list[tuple[BlockHeader, memoryview, bytes]] = []
        inline = shared = 0
        arena_ids: set[int] = set()
        for i, item in enumerate(request.items):
            if item.parent and len(item.parent) != KEY_BYTES:
                raise ValueError(f"items[{i}].parent is {len(item.parent)} bytes; keys are {KEY_BYTES} bytes")
            # the tenant's own key space, like the block's: a parent names no other tenant's block
            parent = tenant.stored_key(item.parent) if item.parent else b""
            which = item.WhichOneof("data")
            if payloads is not None:
                if which is not None:
                    raise ValueError(f"items[{i}] sets {which}: on the data channel payloads follow the message")
                payload = payloads[i]
                inline += len(payload)
            elif which == "slice":
                payload = self._slice(item.slice, tenant)
                shared += len(payload)
                arena_ids.add(item.slice.arena_id)
            elif which == "inline":
                payload = memoryview(item.inline)
                inline += len(payload)
            else:
                raise ValueError(f"items[{i}] carries no payload (set inline or slice)")
            try:
                header = header_from_meta(item.meta, len(payload), tenant, stored_keys[i])
            except ValueError as exc:
                raise ValueError(f"items[{i}]: {exc}") from None
            self.store.check_namespace(header)
            if header.codec != "raw" and header.layout.block_bytes(header.tokens) > self.max_message_bytes:
                # a coded block decodes to its layout's size wherever the daemon re-encodes it
                raise ValueError(f"items[{i}]: a {header.codec} block of {header.tokens} tokens decodes to "
                                 f"{header.layout.block_bytes(header.tokens)} bytes, over max_message_bytes "
                                 f"({self.max_message_bytes})")
            try:
                check_codec_params(header)
            except ValueError as exc:
                raise ValueError(f"items[{i}]: {exc}") from None
            if self.autocal is not None:
                self.autocal.note(header.namespace, tenant)
            prepared.append((header, payload, parent))
        self._check_bytes(tenant, "this Put", 0, shared, arena_ids)
        # Validate everything before storing anything; then store, the checksum computed as the
        # payload is copied. (A client that rewrites its arena during the call spoils only this
        # block of its own, stored under its tenant's keys: in the CPU tier the checksum is of the
        # copy, so the block holds whatever was copied; in a tier that hashes first, it fails its
        # checksum and reads as a counted corrupt miss.)
        walk = WalkBudget()  # one for the call: many blocks naming deep parents cost one bounded walk
        for header, payload, parent in prepared:
            await self.store.put(header, payload, owner=tenant.name, quota=tenant.quota_bytes,
                                 durable=request.durable, hash_payload=True, parent=parent, walk=walk)
            if tenant.name:
                self._usage[tenant.name].bytes_in[self.store.tiers[0].name] += header.payload_len
        return len(prepared)

    async def _plan_get(self, request: pb.GetRequest, tenant: Tenant, need_dest: bool
                        ) -> tuple[list[bytes], list[tuple[bytes, BlockHeader | None, memoryview | None]], int]:
        """Stored keys; per item, the header found and the validated destination slice; and the
        inline bytes the reply needs. The bytes the call would move are checked against its limits
        before anything is copied."""
        keys = self._stored_keys(tenant, [item.key for item in request.items], "items")
        await self.store.discover(keys, tenant.name)
        self.store.claim(keys, tenant.name)
        if not request.allow_missing:
            missing = self.store.missing(keys)
            if missing:
                self.store.metrics.misses.inc(len(missing))
                self._count(tenant, "get", [None] * len(missing), requested=len(keys))
                raise BadRequest(grpc.StatusCode.NOT_FOUND,
                                 f"{len(missing)} of {len(keys)} keys are not stored "
                                 f"(first: items[{keys.index(missing[0])}]); set allow_missing to get the others")
        plan: list[tuple[bytes, BlockHeader | None, memoryview | None]] = []
        inline = shared = 0
        arena_ids: set[int] = set()
        for i, (key, item) in enumerate(zip(keys, request.items)):
            if need_dest and not item.HasField("dest"):
                raise ValueError(f"items[{i}] has no dest: a layer-wise Get writes into a registered arena")
            header = self.store.header(key)
            dest = None
            if item.HasField("dest"):
                dest = self._slice(item.dest, tenant)
                arena_ids.add(item.dest.arena_id)
            if header is not None:
                if dest is None:
                    inline += header.payload_len + RESULT_OVERHEAD
                elif len(dest) < header.payload_len:
                    raise ValueError(f"items[{i}].dest has {len(dest)} bytes; the block needs {header.payload_len}")
                else:
                    shared += header.payload_len
            plan.append((key, header, dest))
        self._check_bytes(tenant, "this Get", inline, shared, arena_ids)
        return keys, plan, inline

    @_rpc
    async def Get(self, request: pb.GetRequest, context) -> pb.GetResponse | bytes:
        replies, inline = await self.get_blocks(self._tenant(context), request)
        if inline:
            # Replies' buffers in flight are bounded across calls; they are freed once gRPC sent them.
            context.add_done_callback(lambda _: self.inline.release(inline))
        if any(payload is not None for _, payload in replies):
            return encode_get_response(replies)
        return pb.GetResponse(results=[r for r, _ in replies])

    async def get_blocks(self, tenant: Tenant, request: pb.GetRequest,
                         allocate: Callable[[int], bytearray] = bytearray
                         ) -> tuple[list[tuple[pb.GetResult, memoryview | None]], int]:
        """Per item its result and, for one read inline (no dest), its payload (read into a buffer
        from ``allocate``, which may be larger); and the inline bytes taken from ``self.inline``
        for them, which the caller releases once it sent them."""
        keys, plan, inline = await self._plan_get(request, tenant, need_dest=False)
        if inline:
            await self.inline.acquire(inline, INLINE_WAIT_S)
        try:
            return await self._read_blocks(request, tenant, plan, allocate), inline
        except BaseException:
            if inline:
                self.inline.release(inline)
            raise

    async def _read_blocks(self, request: pb.GetRequest, tenant: Tenant, plan, allocate: Callable[[int], bytearray]
                           ) -> list[tuple[pb.GetResult, memoryview | None]]:
        by_reference = self._gpu_direct(request, plan, tenant) if request.gpu_direct else {}
        # Read every other found block in one batch (disk reads overlap; GPU runs copy once).
        # Inline payloads are read into buffers that go into the reply as they are (encode_get_response).
        found_at = [i for i, (_, header, _) in enumerate(plan) if header is not None and i not in by_reference]
        buffers = {i: allocate(plan[i][1].payload_len) for i in found_at if plan[i][2] is None}
        reads = [(plan[i][0], plan[i][2] if i not in buffers else memoryview(buffers[i])[: plan[i][1].payload_len])
                 for i in found_at]
        results: list[GetResult | None] = [None] * len(plan)
        for i, found in zip(found_at, await self.store.get_many_into(reads)):
            results[i] = found
        self.store.metrics.misses.inc(sum(header is None for _, header, _ in plan))
        self._count(tenant, "get", [by_reference[i][1] if i in by_reference else r for i, r in enumerate(results)])
        return [(by_reference[i][0] if i in by_reference else self._result(item.key, found),
                 None if found is None or i not in buffers else memoryview(buffers[i])[: found.header.payload_len])
                for i, (item, found) in enumerate(zip(request.items, results))]

    def _gpu_direct(self, request: pb.GetRequest, plan, tenant: Tenant) -> dict[int, tuple[pb.GetResult, GetResult]]:
        """Blocks in the GPU tier, by reference: their offsets in the exported pool, no copy. Only
        blocks the tenant may lease (within its bound) go by reference; the others are copied."""
        out = {}
        for i, (key, header, _) in enumerate(plan):
            offset = self.store.gpu_offset(key) if header is not None else None
            # stays put until Release or the lease ends
            if offset is not None and self.store.lease(key, GPU_LEASE_SECONDS, tenant.name):
                self.store.metrics.hits.labels("gpu").inc()  # served by reference: a Get hit all the same
                meta = meta_from_header(header)
                meta.key = request.items[i].key
                out[i] = (pb.GetResult(found=True, meta=meta, tier="gpu", gpu_offset=offset, on_gpu=True),
                          GetResult(header, "gpu"))
        return out

    async def GetLayers(self, request: pb.GetRequest, context) -> None:
        """Stream through ``context.write``, each send bounded by ``STREAM_HOLD_S``: a reader that
        takes no message for that long loses the call (and its blocks' hold, and its arenas)."""
        started = time.perf_counter()
        stream = None
        try:
            tenant = self._tenant(context)
            _, plan, _ = await self._plan_get(request, tenant, need_dest=True)
            copies = sum(header.layout.num_layers for _, header, _ in plan if header is not None)
            if copies > MAX_LAYER_COPIES:
                raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"this GetLayers would make {copies} layer copies; at most {MAX_LAYER_COPIES}")
            stream = self.store.get_layerwise([(key, dest) for key, header, dest in plan if header is not None],
                                              tenant.name)
            async for layer, found in stream:
                if found is None:
                    await _write(context, pb.LayerReady(layer=layer))
                    continue
                found_iter = iter(found)
                ordered = [next(found_iter) if header is not None else None for _, header, _ in plan]
                self.store.metrics.misses.inc(sum(header is None for _, header, _ in plan))
                self._count(tenant, "get", ordered)
                await _write(context, pb.LayerReady(layer=-1, results=[self._result(item.key, r)
                                                                       for item, r in zip(request.items, ordered)]))
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
        return pb.CountResponse(count=self.store.release(self._stored_keys(self._tenant(context), request.keys)))

    @staticmethod
    def _result(client_key: bytes, found: GetResult | None) -> pb.GetResult:
        """A result without its payload (which travels in the arena, or is appended by encode_get_response)."""
        if found is None:
            return pb.GetResult(found=False)
        meta = meta_from_header(found.header)
        meta.key = client_key  # the caller's key, not the tenant-derived stored key
        return pb.GetResult(found=True, meta=meta, tier=found.tier)

    @_rpc
    async def Delete(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=await self.store.delete(self._stored_keys(self._tenant(context), request.keys)))

    @_rpc
    async def Pin(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        tenant = self._tenant(context)
        keys = self._stored_keys(tenant, request.keys)
        missing = self.store.missing(keys)
        if missing:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, f"cannot pin {len(missing)} keys that are not stored "
                                                        f"(first: keys[{keys.index(missing[0])}])")
        self.store.claim(keys, tenant.name)
        return pb.CountResponse(count=self.store.pin(keys, tenant.name))

    @_rpc
    async def Unpin(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=self.store.unpin(self._stored_keys(self._tenant(context), request.keys)))

    @_rpc
    async def Clear(self, request: pb.ClearRequest, context) -> pb.CountResponse:
        if self._tenant(context, operator=True).name:
            raise BadRequest(grpc.StatusCode.PERMISSION_DENIED,
                             "Clear would drop every tenant's blocks; a tenant deletes its own with Delete "
                             "(the operator clears with the daemon's admin token)")
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
                                queue_depth=self.store.queue_depth, queue_dropped=m.value(m.queue_dropped),
                                arenas=len(self.arenas), write_errors=self.store.write_errors,
                                requested=m.total(m.requested), events_published=m.value(m.events_published),
                                events_dropped=m.value(m.events_dropped), data_port=self.data_port,
                                inline_bytes=self.inline.in_flight)

    def _tenant_stats(self, tenant: Tenant) -> pb.StatsResponse:
        """A named tenant's own traffic; nothing that moves with other tenants' use."""
        usage = self._usage[tenant.name]
        tiers = [pb.TierStats(name=t.name, capacity_bytes=t.capacity_bytes, hits=usage.hits[t.name],
                              bytes_in=usage.bytes_in[t.name], bytes_out=usage.bytes_out[t.name])
                 for t in self.store.tiers]
        return pb.StatsResponse(tiers=tiers, misses=usage.misses, requested=usage.requested,
                                arenas=self.arenas.count(tenant.name), data_port=self.data_port)

    @_rpc
    async def RegisterArena(self, request: pb.RegisterArenaRequest, context) -> pb.RegisterArenaResponse:
        raise BadRequest(grpc.StatusCode.FAILED_PRECONDITION,
                         "arenas are handed out on the arena socket beside the daemon's unix socket "
                         "(SOCKET.arena, see kvstore/arena.py), never mapped from a name")

    @_rpc
    async def UnregisterArena(self, request: pb.UnregisterArenaRequest, context) -> pb.CountResponse:
        try:
            await self.arenas.release(request.arena_id, self._tenant(context))
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
