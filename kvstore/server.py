"""The gRPC handlers of ``kvstore.v1``: request validation, tenants' keys, the shared-memory arenas.

The process around them (tiers, listening, auth, TLS, shutdown) is kvstore/daemon.py.

Every RPC validates its input before touching the store and answers bad input with a status code
and a message that names the problem; an unexpected exception is logged and answered INTERNAL,
and the daemon stays up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import re
from typing import Awaitable, Callable

import grpc

from kvstore.arena import Arena
from kvstore.auth import ANONYMOUS, Tenant, TenantDirectory
from kvstore.block import BlockHeader, payload_checksum
from kvstore.keys import KEY_BYTES, KVLayout
from kvstore.placement import BlockStore, GetResult
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import TierError, TierFullError

log = logging.getLogger("kvstore.server")

MAX_KEYS_PER_CALL = 65536
MAX_ARENAS = 1024
GPU_LEASE_SECONDS = 30.0
#: Client arenas are named kvstore-<client pid>-<random> (kvstore.arena.Arena.create).
_ARENA_PID = re.compile(r"kvstore-(\d+)-[0-9a-f]+")
SERVICE_NAME = "kvstore.v1.KVStore"


class BadRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _rpc(method: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Map exceptions to status codes; never let one escape into grpc as a crash."""

    @functools.wraps(method)
    async def wrapper(self: "KVStoreService", request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except BadRequest as exc:
            await context.abort(exc.code, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TierFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except TierError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: {type(exc).__name__}: {exc}")
        finally:
            self.store.publish_availability()  # clients' local Lookups see a tier going down at once

    return wrapper


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def _check_keys(keys, what: str = "keys") -> list[bytes]:
    if len(keys) > MAX_KEYS_PER_CALL:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{len(keys)} {what} in one call; at most {MAX_KEYS_PER_CALL}")
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{what}[{i}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")
    return list(keys)


def header_from_meta(meta: pb.BlockMeta, payload_len: int) -> BlockHeader:
    """Validate a client's BlockMeta (ValueError with the reason) and build the stored header."""
    if len(meta.key) != KEY_BYTES or len(meta.namespace) != KEY_BYTES:
        raise ValueError(f"meta.key and meta.namespace must be {KEY_BYTES} bytes, got "
                         f"{len(meta.key)} and {len(meta.namespace)}")
    if not meta.HasField("layout"):
        raise ValueError("meta.layout is required")
    layout = KVLayout(meta.layout.num_layers, meta.layout.num_kv_heads, meta.layout.head_dim, meta.layout.dtype)
    if meta.payload_len != payload_len:
        raise ValueError(f"meta.payload_len is {meta.payload_len} but {payload_len} payload bytes were sent")
    try:
        params = json.loads(meta.codec_params_json) if meta.codec_params_json else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"meta.codec_params_json is not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise ValueError("meta.codec_params_json must be a JSON object")
    return BlockHeader(key=meta.key, namespace=meta.namespace, layout=layout, tokens=meta.tokens,
                       payload_len=payload_len, checksum=0, codec=meta.codec or "raw", codec_params=params)


def meta_from_header(header: BlockHeader) -> pb.BlockMeta:
    return pb.BlockMeta(
        key=header.key, namespace=header.namespace,
        layout=pb.Layout(num_layers=header.layout.num_layers, num_kv_heads=header.layout.num_kv_heads,
                         head_dim=header.layout.head_dim, dtype=header.layout.dtype),
        tokens=header.tokens, codec=header.codec,
        codec_params_json=json.dumps(header.codec_params) if header.codec_params else "",
        payload_len=header.payload_len)


class KVStoreService(pb_grpc.KVStoreServicer):
    """The RPC handlers. Keys are mapped to the caller's tenant's stored keys on the way in
    (kvstore/auth.py) and back on the way out, so tenants never see each other's blocks."""

    def __init__(self, store: BlockStore, tenants: TenantDirectory | None = None) -> None:
        self.store = store
        self.tenants = tenants or TenantDirectory([ANONYMOUS], required=False)
        self.arenas: dict[int, Arena] = {}
        #: Arena id -> its client's pid, for clients this daemon can see (same pid namespace).
        self._arena_pids: dict[int, int] = {}
        self._next_arena = 1

    def _tenant(self, context) -> Tenant:
        tenant = self.tenants.resolve(context.invocation_metadata())
        if tenant is None:  # the interceptor already refused it; this is the second line of defence
            raise BadRequest(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        return tenant

    def _stored_keys(self, keys, context, what: str = "keys") -> list[bytes]:
        tenant = self._tenant(context)
        return [tenant.stored_key(k) for k in _check_keys(keys, what)]

    def _slice(self, slice_: pb.ArenaSlice) -> memoryview:
        arena = self.arenas.get(slice_.arena_id)
        if arena is None:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                             f"arena {slice_.arena_id} is not registered (RegisterArena first)")
        return arena.view(slice_.offset, slice_.length)

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        keys = self._stored_keys(request.keys, context)
        await self.store.discover(keys)  # blocks other hosts put in a shared tier since we looked
        result = self.store.lookup(keys)
        return pb.LookupResponse(hits=result.hits, tiers=result.tiers)

    @_rpc
    async def Prefetch(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        keys = self._stored_keys(request.keys, context)
        await self.store.discover(keys)
        return pb.CountResponse(count=sum(self.store.schedule_promotion(k) for k in keys))

    @_rpc
    async def Put(self, request: pb.PutRequest, context) -> pb.PutResponse:
        tenant = self._tenant(context)
        stored_keys = self._stored_keys([item.meta.key for item in request.items], context, "items")
        prepared: list[tuple[BlockHeader, memoryview]] = []
        for i, item in enumerate(request.items):
            which = item.WhichOneof("data")
            if which == "slice":
                payload = self._slice(item.slice)
            elif which == "inline":
                payload = memoryview(item.inline)
            else:
                raise ValueError(f"items[{i}] carries no payload (set inline or slice)")
            try:
                header = header_from_meta(item.meta, len(payload))
            except ValueError as exc:
                raise ValueError(f"items[{i}]: {exc}") from None
            header = dataclasses.replace(header, key=stored_keys[i])
            self.store.check_namespace(header)
            prepared.append((header, payload))
        # Validate everything before storing anything; then checksum and store.
        for header, payload in prepared:
            header = dataclasses.replace(header, checksum=payload_checksum(payload))
            await self.store.put(header, payload, owner=tenant.name, quota=tenant.quota_bytes,
                                 durable=request.durable)
        return pb.PutResponse(stored=len(prepared))

    async def _plan_get(self, request: pb.GetRequest, context, need_dest: bool
                        ) -> tuple[list[bytes], list[tuple[bytes, BlockHeader | None, memoryview | None]]]:
        """Stored keys and, per item, the header found and the validated destination slice."""
        keys = self._stored_keys([item.key for item in request.items], context, "items")
        await self.store.discover(keys)
        if not request.allow_missing:
            missing = self.store.missing(keys)
            if missing:
                raise BadRequest(grpc.StatusCode.NOT_FOUND,
                                 f"{len(missing)} of {len(keys)} keys are not stored "
                                 f"(first: items[{keys.index(missing[0])}]); set allow_missing to get the others")
        plan: list[tuple[bytes, BlockHeader | None, memoryview | None]] = []
        for i, (key, item) in enumerate(zip(keys, request.items)):
            if need_dest and not item.HasField("dest"):
                raise ValueError(f"items[{i}] has no dest: a layer-wise Get writes into a registered arena")
            header = self.store.header(key)
            dest = None
            if header is not None and item.HasField("dest"):
                dest = self._slice(item.dest)
                if len(dest) < header.payload_len:
                    raise ValueError(f"items[{i}].dest has {len(dest)} bytes; the block needs {header.payload_len}")
            plan.append((key, header, dest))
        return keys, plan

    @_rpc
    async def Get(self, request: pb.GetRequest, context) -> pb.GetResponse:
        keys, plan = await self._plan_get(request, context, need_dest=False)
        results: list[pb.GetResult | None] = [None] * len(plan)
        if request.gpu_direct:
            for i, (key, header, _) in enumerate(plan):
                offset = self.store.gpu_offset(key) if header is not None else None
                if offset is not None:  # stays put until Release or the lease ends
                    self.store.lease(key, GPU_LEASE_SECONDS)
                    meta = meta_from_header(header)
                    meta.key = request.items[i].key
                    results[i] = pb.GetResult(found=True, meta=meta, tier="gpu", gpu_offset=offset, on_gpu=True)
        # Read every other block in one batch (disk reads overlap; GPU runs copy once).
        reads: list[tuple[bytes, memoryview]] = []
        buffers: list[bytearray | None] = []  # inline replies: the payload travels in the message
        pending = [i for i, (_, header, _) in enumerate(plan) if header is not None and results[i] is None]
        for i in pending:
            key, header, dest = plan[i]
            buffer = bytearray(header.payload_len) if dest is None else None
            reads.append((key, memoryview(buffer) if dest is None else dest))
            buffers.append(buffer)
        for i, found, buffer in zip(pending, await self.store.get_many_into(reads), buffers):
            results[i] = self._get_one(request.items[i].key, found, buffer)
        return pb.GetResponse(results=[r if r is not None else pb.GetResult(found=False) for r in results])

    async def GetLayers(self, request: pb.GetRequest, context):
        try:
            _, plan = await self._plan_get(request, context, need_dest=True)
            stream = self.store.get_layerwise([(key, dest) for key, header, dest in plan if header is not None])
            async for layer, found in stream:
                if found is None:
                    yield pb.LayerReady(layer=layer)
                    continue
                found_iter = iter(found)
                yield pb.LayerReady(layer=-1, results=[
                    self._get_one(item.key, next(found_iter), None) if header is not None else pb.GetResult(found=False)
                    for item, (_, header, _) in zip(request.items, plan)])
        except BadRequest as exc:
            await context.abort(exc.code, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

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
        return pb.CountResponse(count=self.store.release(self._stored_keys(request.keys, context)))

    @staticmethod
    def _get_one(client_key: bytes, found: GetResult | None, buffer: bytearray | None) -> pb.GetResult:
        if found is None:
            return pb.GetResult(found=False)
        meta = meta_from_header(found.header)
        meta.key = client_key  # the caller's key, not the tenant-derived stored key
        return pb.GetResult(found=True, meta=meta, tier=found.tier,
                            inline=bytes(buffer[: found.header.payload_len]) if buffer is not None else b"")

    @_rpc
    async def Delete(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=await self.store.delete(self._stored_keys(request.keys, context)))

    @_rpc
    async def Pin(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        keys = self._stored_keys(request.keys, context)
        missing = self.store.missing(keys)
        if missing:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, f"cannot pin {len(missing)} keys that are not stored "
                                                        f"(first: keys[{keys.index(missing[0])}])")
        return pb.CountResponse(count=self.store.pin(keys))

    @_rpc
    async def Unpin(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=self.store.unpin(self._stored_keys(request.keys, context)))

    @_rpc
    async def Clear(self, request: pb.ClearRequest, context) -> pb.CountResponse:
        if self._tenant(context).name:
            raise BadRequest(grpc.StatusCode.PERMISSION_DENIED,
                             "Clear would drop every tenant's blocks; a tenant deletes its own with Delete")
        return pb.CountResponse(count=await self.store.clear(list(request.tiers)))

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
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
                                arenas=len(self.arenas), write_errors=self.store.write_errors)

    def reap_arenas(self) -> int:
        """Unmap the arenas of clients that exited without unregistering (crashed, killed): their
        memory would otherwise stay mapped here for good. Only clients whose pid was visible at
        registration are tracked; one in another pid namespace is never reaped. Returns how many."""
        gone = [arena_id for arena_id, pid in self._arena_pids.items() if not _process_alive(pid)]
        for arena_id in gone:
            del self._arena_pids[arena_id]
            arena = self.arenas.pop(arena_id, None)
            if arena is not None:
                arena.close()
        if gone:
            log.info("unmapped %d arenas of clients that exited without unregistering", len(gone))
        return len(gone)

    @_rpc
    async def RegisterArena(self, request: pb.RegisterArenaRequest, context) -> pb.RegisterArenaResponse:
        if len(self.arenas) >= MAX_ARENAS and not self.reap_arenas():
            raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_ARENAS} arenas are registered already")
        arena = Arena.attach(request.name, request.size)
        await asyncio.get_running_loop().run_in_executor(None, arena.prefault)
        arena_id = self._next_arena
        self._next_arena += 1
        self.arenas[arena_id] = arena
        match = _ARENA_PID.fullmatch(request.name)
        if match and _process_alive(int(match.group(1))):
            self._arena_pids[arena_id] = int(match.group(1))
        index = self.store.key_index
        return pb.RegisterArenaResponse(arena_id=arena_id, index_name=index.name if index is not None else "")

    @_rpc
    async def UnregisterArena(self, request: pb.UnregisterArenaRequest, context) -> pb.CountResponse:
        arena = self.arenas.pop(request.arena_id, None)
        self._arena_pids.pop(request.arena_id, None)
        if arena is None:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, f"arena {request.arena_id} is not registered")
        arena.close()
        return pb.CountResponse(count=1)
