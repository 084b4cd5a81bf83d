"""The gRPC server: request validation, the shared-memory arenas, health, metrics, lifecycle.

Every RPC validates its input before touching the store and answers bad input with a status code
and a message that names the problem; an unexpected exception is logged and answered INTERNAL,
and the daemon stays up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import os
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.arena import Arena
from kvstore.block import BlockHeader, payload_checksum
from kvstore.config import DaemonConfig
from kvstore.keys import KEY_BYTES, KVLayout
from kvstore.metrics import Metrics
from kvstore.placement import BlockStore, GetResult
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tiers.base import Tier, TierError, TierFullError
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.s3 import S3Tier

log = logging.getLogger("kvstore.server")

MAX_KEYS_PER_CALL = 65536
MAX_ARENAS = 1024
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

    return wrapper


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
    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.arenas: dict[int, Arena] = {}
        self._next_arena = 1

    def _slice(self, slice_: pb.ArenaSlice) -> memoryview:
        arena = self.arenas.get(slice_.arena_id)
        if arena is None:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                             f"arena {slice_.arena_id} is not registered (RegisterArena first)")
        return arena.view(slice_.offset, slice_.length)

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        keys = _check_keys(request.keys)
        await self.store.discover(keys)  # blocks other hosts put in a shared tier since we looked
        result = self.store.lookup(keys)
        return pb.LookupResponse(hits=result.hits, tiers=result.tiers)

    @_rpc
    async def Prefetch(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        keys = _check_keys(request.keys)
        await self.store.discover(keys)
        return pb.CountResponse(count=sum(self.store.schedule_promotion(k) for k in keys))

    @_rpc
    async def Put(self, request: pb.PutRequest, context) -> pb.PutResponse:
        _check_keys([item.meta.key for item in request.items], "items")
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
            self.store.check_namespace(header)
            prepared.append((header, payload))
        # Validate everything before storing anything; then checksum and store.
        for header, payload in prepared:
            header = dataclasses.replace(header, checksum=payload_checksum(payload))
            await self.store.put(header, payload)
        return pb.PutResponse(stored=len(prepared))

    @_rpc
    async def Get(self, request: pb.GetRequest, context) -> pb.GetResponse:
        keys = _check_keys([item.key for item in request.items], "items")
        await self.store.discover(keys)
        if not request.allow_missing:
            missing = self.store.missing(keys)
            if missing:
                raise BadRequest(grpc.StatusCode.NOT_FOUND,
                                 f"{len(missing)} of {len(keys)} keys are not stored (first: {missing[0].hex()}); "
                                 f"set allow_missing to get the others")
        # Validate every destination first, then read all blocks in one batch (disk reads overlap).
        plan: list[tuple[bytes, BlockHeader | None, memoryview | None]] = []
        for i, (key, item) in enumerate(zip(keys, request.items)):
            header = self.store.header(key)
            dest = None
            if header is not None and item.HasField("dest"):
                dest = self._slice(item.dest)
                if len(dest) < header.payload_len:
                    raise ValueError(f"items[{i}].dest has {len(dest)} bytes; the block needs {header.payload_len}")
            plan.append((key, header, dest))
        reads: list[tuple[bytes, memoryview]] = []
        buffers: list[bytearray | None] = []  # inline replies: the payload travels in the message
        for key, header, dest in plan:
            if header is None:
                continue
            buffer = bytearray(header.payload_len) if dest is None else None
            reads.append((key, memoryview(buffer) if dest is None else dest))
            buffers.append(buffer)
        found = iter(zip(await self.store.get_many_into(reads), buffers))
        return pb.GetResponse(results=[self._get_one(*next(found)) if header is not None else pb.GetResult(found=False)
                                       for _, header, _ in plan])

    @staticmethod
    def _get_one(found: GetResult | None, buffer: bytearray | None) -> pb.GetResult:
        if found is None:
            return pb.GetResult(found=False)
        return pb.GetResult(found=True, meta=meta_from_header(found.header), tier=found.tier,
                            inline=bytes(buffer[: found.header.payload_len]) if buffer is not None else b"")

    @_rpc
    async def Delete(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=await self.store.delete(_check_keys(request.keys)))

    @_rpc
    async def Pin(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        keys = _check_keys(request.keys)
        missing = self.store.missing(keys)
        if missing:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, f"cannot pin {len(missing)} keys that are not stored "
                                                        f"(first: {missing[0].hex()})")
        return pb.CountResponse(count=self.store.pin(keys))

    @_rpc
    async def Unpin(self, request: pb.KeysRequest, context) -> pb.CountResponse:
        return pb.CountResponse(count=self.store.unpin(_check_keys(request.keys)))

    @_rpc
    async def Clear(self, request: pb.ClearRequest, context) -> pb.CountResponse:
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

    @_rpc
    async def RegisterArena(self, request: pb.RegisterArenaRequest, context) -> pb.RegisterArenaResponse:
        if len(self.arenas) >= MAX_ARENAS:
            raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_ARENAS} arenas are registered already")
        arena = Arena.attach(request.name, request.size)
        await asyncio.get_running_loop().run_in_executor(None, arena.prefault)
        arena_id = self._next_arena
        self._next_arena += 1
        self.arenas[arena_id] = arena
        return pb.RegisterArenaResponse(arena_id=arena_id)

    @_rpc
    async def UnregisterArena(self, request: pb.UnregisterArenaRequest, context) -> pb.CountResponse:
        arena = self.arenas.pop(request.arena_id, None)
        if arena is None:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, f"arena {request.arena_id} is not registered")
        arena.close()
        return pb.CountResponse(count=1)


class _BearerToken(grpc.aio.ServerInterceptor):
    """Require ``authorization: Bearer TOKEN`` on every call but health checks."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(sent, str):
            sent = sent.encode()
        if hmac.compare_digest(sent, self._expected):
            return await continuation(details)
        return self._deny


def build_tiers(config: DaemonConfig) -> list[Tier]:
    tiers: list[Tier] = []
    if config.cpu_capacity:
        tiers.append(CpuTier(config.cpu_capacity, pin=config.cpu_pin))
    if config.disk_path:
        tiers.append(DiskTier(config.disk_path, config.disk_capacity, fsync=config.disk_fsync,
                              o_direct=config.disk_o_direct))
    if config.s3_bucket:
        tiers.append(S3Tier(config.s3_config))  # TierError saying what to fix when unusable
    return tiers


class Daemon:
    """One running cache daemon: store, gRPC server, health and metrics."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        tiers = build_tiers(config)
        for tier in tiers:
            corrupt = getattr(tier, "corrupt_on_start", 0)
            if corrupt:
                self.metrics.corrupt.labels(tier.name).inc(corrupt)
        # The top tier keeps what clients send; lower tiers re-encode into their codec ("raw": keep).
        configured = {"disk": config.disk_codec, "s3": config.s3_codec}
        codecs = [None if t is tiers[0] or configured.get(t.name, "raw") == "raw" else configured[t.name]
                  for t in tiers]
        self.store = BlockStore(tiers, self.metrics, write_through=config.write_policy == "write-through",
                                queue_depth=config.queue_depth, promote_on_get=config.promote_on_get,
                                codecs=codecs)
        self.service = KVStoreService(self.store)
        self.server: grpc.aio.Server | None = None

    async def start(self) -> str:
        options = [("grpc.max_receive_message_length", self.config.max_message_bytes),
                   ("grpc.max_send_message_length", self.config.max_message_bytes)]
        interceptors = [_BearerToken(self.config.auth_token)] if self.config.auth_token else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_KVStoreServicer_to_server(self.service, self.server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        address = self.config.listen
        socket_path = self.config.socket_path
        if socket_path is not None:
            socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            socket_path.unlink(missing_ok=True)
        old_umask = os.umask(0o177)  # the socket is born 0600
        try:
            port = self.server.add_insecure_port(address)
        finally:
            os.umask(old_umask)
        if socket_path is None and port == 0:
            raise OSError(f"cannot listen on {address}")
        await self.server.start()
        if socket_path is not None:
            os.chmod(socket_path, 0o600)
        self.store.start()
        await _set_serving(health_servicer)
        if self.config.metrics_listen:
            self._start_metrics()
        if socket_path is None and address.endswith(":0"):
            address = address[:-2] + f":{port}"
        log.info("kvstore serving on %s with tiers %s", address,
                 ", ".join(f"{t.name} ({t.capacity_bytes / 2**30:.2f} GiB)" if t.capacity_bytes
                           else f"{t.name} (unbounded)" for t in self.store.tiers))
        return address

    def _start_metrics(self) -> None:
        from prometheus_client import start_http_server

        host, _, port = self.config.metrics_listen.rpartition(":")
        try:
            start_http_server(int(port), addr=host or "127.0.0.1", registry=self.metrics.registry)
        except OSError as exc:
            log.warning("metrics endpoint %s not started: %s", self.config.metrics_listen, exc)

    async def stop(self, grace: float = 5.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        if self.config.write_policy == "write-back" and len(self.store.tiers) > 1:
            copied = await self.store.demote_all()
            log.info("write-back shutdown: %d blocks written to %s", copied, self.store.tiers[-1].name)
        await self.store.close(flush=True)
        for arena in self.service.arenas.values():
            arena.close()
        if self.config.socket_path is not None:
            self.config.socket_path.unlink(missing_ok=True)


async def _set_serving(servicer) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def keep_freed_memory() -> None:
    """Make glibc reuse freed large buffers instead of unmapping them.

    The daemon allocates multi-MB buffers per request (inline payloads, disk reads); by default
    glibc serves each from a fresh mmap, and every first touch of those pages is a page fault, which
    on virtual machines costs more than the copy itself. Called once by ``kvstore serve`` (the
    daemon owns its process); never at import.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 512 * 2**20)
    libc.mallopt(m_trim_threshold, 1024 * 2**20)


async def run_daemon(config: DaemonConfig, ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then drain queued writes and exit."""
    keep_freed_memory()
    daemon = Daemon(config)
    address = await daemon.start()
    if ready is not None:
        ready(address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining %d queued writes", daemon.store.queue_depth)
    await daemon.stop()
