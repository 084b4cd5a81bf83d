"""The daemon process: tiers from config, the gRPC server with auth and TLS, health, metrics, and
an orderly shutdown that drains queued writes."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from compression.calibration_store import CALIBRATION_DIR_ENV
from kvstore.arena import arena_socket_path
from kvstore.daemon.arena_registry import ArenaRegistry, ArenaSocket
from kvstore.daemon.auth import TenantDirectory
from kvstore.host import s3_mac_key
from kvstore.daemon.autocal import AUTO_SPEC, MAX_CALIBRATION_BYTES, AutoCalibrator, CalibrationTooLarge
from kvstore.block import BlockHeader, payload_checksum
from kvstore.daemon.config import DaemonConfig, format_size
from kvstore.daemon.data_channel import DataChannel, server_tls
from kvstore.daemon.events import EventPublisher
from kvstore.instance_lock import InstanceLock
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.placement import BlockStore
from kvstore.daemon.probes import ProbeServer
from kvstore.daemon.server import SERVICE_NAME, KVStoreService, add_to_server
from kvstore.daemon.transfers import Transfers
from kvstore.shm_index import KeyIndexWriter, remove_stale_files
from tiers.base import Tier
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.gpu import GpuTier
from tiers.s3 import S3Tier

log = logging.getLogger("kvstore.daemon.process")


class _BearerToken(grpc.aio.ServerInterceptor):
    """Refuse every call without a known tenant's bearer token before reading its request.

    The refusing handlers take the request as a stream they never read: gRPC then fetches no
    message, HTTP/2 flow control holds the rest in the sender, and a peer without a token makes the
    daemon buffer its metadata and at most a flow-control window per call, never a message (a
    unary refusal received and parsed the whole message first: four 200 MiB Puts without a token
    took 1.3 GB). Health checks stay open without a token, answered the same way: for the kvstore
    service as a whole, whatever service the unread request names."""

    def __init__(self, tenants: TenantDirectory) -> None:
        self._tenants = tenants

        async def deny(unread, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.stream_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if self._tenants.resolve(details.invocation_metadata, operator=True) is not None:  # the admin token too
            return await continuation(details)
        if details.method == "/grpc.health.v1.Health/Check":
            check = (await continuation(details)).unary_unary

            async def answer(unread, context):
                return await check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), context)

            return grpc.stream_unary_rpc_method_handler(
                answer, response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        if details.method == "/grpc.health.v1.Health/Watch":
            watch = (await continuation(details)).unary_stream

            async def updates(unread, context):
                await watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), context)

            return grpc.stream_stream_rpc_method_handler(
                updates, response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        return self._deny


def check_settings(config: DaemonConfig) -> None:
    """ValueError naming the setting, before any tier is made, for what would otherwise fail later:
    a CPU tier larger than the memory this machine (or its cgroup) has available (the arena's
    allocation would say only "Cannot allocate memory", or the prefault would take the machine's
    memory), and a disk or S3 codec naming a kvtc calibration this daemon cannot find (every
    write to that tier would fail, logged per write). Calibrations are looked for where this
    process's kvtc codecs look (``CALIBRATION_DIR_ENV``, set by the daemon from calibration_dir)."""
    if config.cpu_capacity:
        from tiers.cpu import memory_shortfall

        short = memory_shortfall(config.cpu_capacity)
        if short:
            raise ValueError(f"cpu_capacity {short}: lower --cpu-capacity")
    from compression import calibration_store

    for setting, spec, used in (("disk_codec", config.disk_codec, bool(config.disk_path)),
                                ("s3_codec", config.s3_codec, bool(config.s3_bucket))):
        head = spec.split("+")[0]
        ref = head.partition("@")[2]
        if not used or not ref or spec == AUTO_SPEC:
            continue
        folder = calibration_store.calibration_dir()
        where = f"{folder} (" + ("calibration_dir" if config.calibration_dir else CALIBRATION_DIR_ENV
                                 if os.environ.get(CALIBRATION_DIR_ENV) else
                                 "the default; calibration_dir names another folder") + ")"
        found = sorted(folder.glob(f"{ref}*{calibration_store.SUFFIX}")) if folder.is_dir() else []
        if not found:
            raise ValueError(f"{setting} {spec}: no calibration {ref} in {where}: make one with `kvstore calibrate "
                             f"FILE...` (it prints the codec spec), or copy its <id>{calibration_store.SUFFIX} "
                             f"file there; or use kvtc@auto")
        try:
            calibration_store.resolve(ref)
        except Exception as exc:  # noqa: BLE001 - ambiguous, unreadable, damaged: named in one line
            raise ValueError(f"{setting} {spec}: the calibration in {folder} cannot be used: {exc}") from None


def build_tiers(config: DaemonConfig) -> list[Tier]:
    tiers: list[Tier] = []
    if config.gpu_capacity:
        tiers.append(GpuTier(config.gpu_capacity, device=config.gpu_device))
    if config.cpu_capacity:
        tiers.append(CpuTier(config.cpu_capacity, pin=config.cpu_pin))
    if config.disk_path:
        tiers.append(DiskTier(config.disk_path, config.disk_capacity, fsync=config.disk_fsync,
                              o_direct=config.disk_o_direct))
    if config.s3_bucket:
        mac_key = s3_mac_key(config.tenant_secret_file)  # objects are MAC'd under the hosts' shared secret
        tiers.append(S3Tier(config.s3_config, mac_key=mac_key))  # TierError saying what to fix when unusable
    return tiers


class Daemon:
    """One running cache daemon: store, gRPC server, health and metrics."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        if config.calibration_dir:  # this process's kvtc codecs read it (compression/calibration_store.py)
            os.environ[CALIBRATION_DIR_ENV] = config.calibration_dir
        check_settings(config)  # before any tier is made: what would fail later, named now
        tiers = build_tiers(config)
        for tier in tiers:
            if tier.corrupt_on_start:
                self.metrics.corrupt.labels(tier.name).inc(tier.corrupt_on_start)
        # The top tier keeps what clients send; lower tiers re-encode into their codec ("raw": keep).
        configured = {"disk": config.disk_codec, "s3": config.s3_codec}
        codecs = [None if t is tiers[0] or configured.get(t.name, "raw") == "raw" else configured[t.name]
                  for t in tiers]
        #: kvtc@auto: the daemon calibrates each namespace from its first blocks (kvstore/daemon/autocal.py)
        self.autocal = AutoCalibrator(config.auto_calibration_tokens, publish=self._publish_calibration,
                                      metrics=self.metrics, layer_group=config.auto_layer_group,
                                      max_calibration_bytes=min(MAX_CALIBRATION_BYTES, config.max_message_bytes // 2)
                                      ) if AUTO_SPEC in codecs else None
        codecs = [self.autocal if c == AUTO_SPEC else c for c in codecs]
        self._loop: asyncio.AbstractEventLoop | None = None
        self.tenants = TenantDirectory.from_config(config.tenants_file, config.auth_token,
                                                   config.tenant_secret_file, admin_token=config.operator_token())
        self.events = self._events(tiers)
        self.store = BlockStore(tiers, self.metrics, write_through=config.write_policy == "write-through",
                                queue_depth=config.queue_depth, promote_on_get=config.promote_on_get,
                                codecs=codecs, key_index=self._key_index(tiers), events=self.events,
                                quotas={t.name: t.quota_bytes for t in self.tenants.tenants if t.name and t.quota_bytes},
                                hold_share=config.hold_share, eviction=config.eviction, admission=config.admission,
                                tenants=sum(1 for t in self.tenants.tenants if t.name))
        self.arenas = ArenaRegistry(config.max_arena_bytes, config.max_arenas_per_client,
                                    config.max_arena_total_bytes, len(self.tenants.tenants))
        #: Put and Get for both transports: the gRPC handlers and the data channel.
        self.transfers = Transfers(self.store, self.tenants, self.arenas, config.max_message_bytes,
                                   autocal=self.autocal, max_inline_bytes=config.max_inline_bytes)
        self.service = KVStoreService(self.transfers)
        self.server: grpc.aio.Server | None = None
        #: Shared memory is offered on unix sockets only (kvstore/arena.py).
        self.arena_socket: ArenaSocket | None = None
        self._socket_lock: InstanceLock | None = None
        #: Raw Put/Get payloads for clients without shared memory, on data_listen (kvstore/daemon/data_channel.py).
        self.data_channel: DataChannel | None = None
        #: /metrics, /healthz, /readyz on metrics_listen (kvstore/daemon/probes.py); its heartbeat and the periodic summary.
        self.probes: ProbeServer | None = None
        self._chores: list[asyncio.Task] = []

    def _publish_calibration(self, calibration, tenant) -> None:
        """Store an auto-calibration in the cache as a block of ``tenant`` (through every tier, S3
        too; durably where a durable tier exists), so engines and other hosts decode its blocks
        (`calibration_store.client_source`). Called from the calibrator's own thread, never from the
        event loop or under the store's lock: it waits for the Put and raises if it failed."""
        from compression.calibration_store import calibration_block, calibration_namespace

        key, tokens, payload = calibration_block(calibration)
        namespace = calibration_namespace()
        header = BlockHeader(key=tenant.stored_key(key), namespace=tenant.stored_key(namespace.id),
                             layout=namespace.layout, tokens=tokens, payload_len=len(payload),
                             checksum=payload_checksum(payload), codec="raw", codec_params={"exact": True})
        top = self.store.tiers[0]
        if header.block_len > top.capacity_bytes // 4:  # making room for it would empty the top tier
            raise CalibrationTooLarge(f"a {header.block_len >> 20} MiB calibration is over a quarter of the {top.name} "
                                      f"tier")
        durable = any(t.durable for t in self.store.tiers)
        if self._loop is None:
            raise RuntimeError("the daemon is not serving yet")
        asyncio.run_coroutine_threadsafe(self.store.put(header, memoryview(payload), durable=durable),
                                         self._loop).result(timeout=120)

    def _key_index(self, tiers: list[Tier]) -> KeyIndexWriter | None:
        """The shared-memory key index, unless turned off, unsupported here, or tenants are set: it
        holds stored keys, which for a named tenant are not the keys its clients know (and one
        tenant must not see what another stores)."""
        if not self.config.shm_index or any(t.name for t in self.tenants.tenants):
            return None
        try:
            remove_stale_files()
            return KeyIndexWriter([t.name for t in tiers], shared_tier=any(t.shared for t in tiers))
        except OSError as exc:
            log.warning("shared-memory key index not published (%s); clients will Lookup over gRPC", exc)
            return None

    def _events(self, tiers: list[Tier]) -> EventPublisher | None:
        """The KV-event publisher, unless none is asked for or tenants are set: events carry stored
        keys, which for a named tenant are derived (unknown to its clients, and one tenant must not
        see what another stores); the daemon then says so and publishes nothing."""
        if not self.config.events_listen:
            return None
        if any(t.name for t in self.tenants.tenants):
            log.warning("KV events are not published (events_listen %s): tenants are configured, and events "
                        "would show one tenant's keys to every subscriber", self.config.events_listen)
            return None
        if self.config.socket_path is not None and not self.config.events_public and "tcp://" in (
                self.config.events_listen + self.config.events_replay):  # kvstore/daemon/config.py refuses wider ones
            log.warning("KV events on %s are readable by every local user, unlike the unix socket: use ipc:///path "
                        "(created 0600) to keep them to this user, or set events_public", self.config.events_listen)
        return EventPublisher(self.config.events_listen, [(t.name, t.shared) for t in tiers],
                              replay_endpoint=self.config.events_replay, topic=self.config.events_topic,
                              metrics=self.metrics)

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        if self.events is not None:
            self.events.start()  # first: a taken events address fails the start before anything listens
        options = [("grpc.max_receive_message_length", self.config.max_message_bytes),
                   ("grpc.max_send_message_length", self.config.max_message_bytes),
                   # gRPC's default SO_REUSEPORT would let a second daemon share a busy port.
                   ("grpc.so_reuseport", 0)]
        interceptors = [_BearerToken(self.tenants)] if self.tenants.required else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        add_to_server(self.service, self.server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        address = self.config.listen
        socket_path = self.config.socket_path
        if socket_path is not None:
            # A file someone put at the socket path is never removed. Checked before the lock, so
            # that a failed start (which removes the socket path) never holds it.
            try:
                found = os.lstat(socket_path).st_mode
            except OSError:
                found = None
            if found is not None and not stat.S_ISSOCK(found):
                raise OSError(f"cannot listen on {address}: {socket_path} exists and is not a socket")
            # One daemon per socket: only the lock's holder may remove a stale socket file.
            try:
                self._socket_lock = InstanceLock(socket_path.with_name(socket_path.name + ".lock"),
                                                 f"unix socket {socket_path}")
            except OSError as exc:  # its folder cannot be created or written
                raise OSError(f"cannot listen on {address}: {exc.filename}: {exc.strerror}") from None
            socket_path.unlink(missing_ok=True)
        else:
            # Checked first: gRPC's own refusal ("Failed to bind") says no why, and logs a C++ line.
            reason = _why_cannot_listen(address, busy_only=True)
            if reason:
                raise OSError(f"cannot listen on {address}: {reason}")
        if self.config.metrics_listen:  # before gRPC: /readyz says "starting" until it serves
            self._start_metrics()
        credentials = None
        if self.config.tls_cert and socket_path is None:  # on a unix socket, TLS is the data channel's alone
            try:
                credentials = grpc.ssl_server_credentials([(Path(self.config.tls_key).read_bytes(),
                                                             Path(self.config.tls_cert).read_bytes())])
            except OSError as exc:
                raise OSError(f"cannot read the TLS key or certificate {exc.filename}: {exc.strerror}") from None
        old_umask = os.umask(0o177)  # the socket is born 0600
        try:
            if credentials is not None:
                port = self.server.add_secure_port(address, credentials)
            else:
                port = self.server.add_insecure_port(address)
        except RuntimeError:  # "Failed to bind to address": find out why
            port = 0
        finally:
            os.umask(old_umask)
        if port == 0:
            reason = None if socket_path is not None else _why_cannot_listen(address, busy_only=False)
            raise OSError(f"cannot listen on {address}: {reason or 'gRPC could not bind it'}")
        await self.server.start()
        if socket_path is not None:
            os.chmod(socket_path, 0o600)
        if self.config.data_listen:
            self._start_data_channel()
        self.store.start()
        if socket_path is not None:
            index = self.store.key_index
            self.arena_socket = ArenaSocket(arena_socket_path(socket_path), self.arenas, self.tenants,
                                            lambda: index.name if index is not None else "")
            self.arena_socket.start()
        await _set_serving(health_servicer)
        if socket_path is None and address.endswith(":0"):
            address = address[:-2] + f":{port}"
        for line in self._describe(address, tls=credentials is not None):
            log.info("%s", line)
        if self.config.summary_interval > 0:
            self._chores.append(asyncio.create_task(self._log_summaries(self.config.summary_interval)))
        if self.probes is not None:
            self.probes.ready()
        return address

    def _start_data_channel(self) -> None:
        """The data channel on data_listen, TLS with the gRPC listener's certificate when it has one;
        an address that cannot be bound fails the start."""
        config = self.config
        tls = server_tls(config.tls_cert, config.tls_key) if config.tls_cert else None
        self.data_channel = DataChannel(config.data_listen, self.transfers, self._loop, tls,
                                        max_connections=config.data_max_connections,
                                        max_message_bytes=config.max_message_bytes)
        try:
            self.service.data_port = self.data_channel.start()
        except OSError as exc:
            self.data_channel = None
            reason = "address in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc)).lower()
            raise OSError(f"cannot listen on data_listen {config.data_listen}: {reason}") from None

    def _start_metrics(self) -> None:
        """/metrics, /healthz and /readyz on metrics_listen (kvstore/daemon/probes.py), and the heartbeat
        /healthz watches; an address that cannot be served fails the start."""
        top = self.store.tiers[0]
        try:
            self.probes = ProbeServer(self.config.metrics_listen, self.metrics.registry,
                                      not_ready=lambda: None if top.available else f"tier {top.name} unavailable")
        except OSError as exc:  # asked for and not served: refuse to start rather than run unwatched
            reason = "address in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc)).lower()
            raise OSError(f"cannot serve metrics on {self.config.metrics_listen}: {reason}") from None
        self.probes.start()
        self._chores.append(asyncio.create_task(self.probes.heartbeat()))

    def _describe(self, address: str, tls: bool) -> list[str]:
        """The start log: what this daemon is (addresses, TLS, auth, events, tiers, what was found on disk)."""
        config = self.config
        named = sum(1 for t in self.tenants.tenants if t.name)
        auth = (f"tenants file {config.tenants_file}" if config.tenants_file
                else "bearer token" if self.tenants.required else "no token")
        metrics = (f"http://{_http_host(config.metrics_listen)}:{self.probes.port} (/metrics, /healthz, /readyz)"
                   if self.probes is not None else "off")
        events = "off"
        if self.events is not None:
            events = f"on {config.events_listen}" + (f", replay {config.events_replay}" if config.events_replay else "")
        elif config.events_listen:
            events = "off (tenants are configured)"
        summary = f"every {config.summary_interval:g} s" if config.summary_interval > 0 else "off"
        lines = [f"kvstore serving on {address}, TLS {'on' if tls else 'off'}, auth: {auth}, tenants: {named}; "
                 f"metrics and probes: {metrics}; KV events: {events}; summary: {summary}"]
        if self.data_channel is not None:
            host = config.data_listen.rpartition(":")[0]
            lines.append(f"data channel on {host}:{self.data_channel.port}, TLS {'on' if tls else 'off'}, at most "
                         f"{config.data_max_connections} connections")
        if self.arena_socket is not None:
            lines.append(f"shared-memory arenas on {arena_socket_path(config.socket_path)}, shared key index "
                         f"{'on' if self.store.key_index is not None else 'off'}")
        tiers = []
        for level, tier in enumerate(self.store.tiers):
            codec = self.store.codecs[level]
            codec = ("as put" if level == 0 else "raw" if codec is None
                     else codec if isinstance(codec, str) else AUTO_SPEC)
            size = format_size(tier.capacity_bytes) if tier.capacity_bytes else "unbounded"
            found = ""
            if isinstance(tier, DiskTier):  # what its index rebuild found
                found = f" at {tier.root}: {len(tier)} blocks ({format_size(tier.used_bytes)}) found on disk"
                if tier.corrupt_on_start:
                    found += f", {tier.corrupt_on_start} corrupt ones deleted"
            elif tier.shared:
                found = f" ({len(tier)} blocks listed so far, the rest in the background)"
            tiers.append(f"{tier.name} {size}, codec {codec}{found}")
        lines.append("tiers: " + "; ".join(tiers))
        return lines

    def _counts(self) -> dict[str, object]:
        """The counters the periodic summary reports the change of."""
        m = self.metrics
        return {"requested": _by_label(m.requested), "hits": _by_label(m.hits), "misses": m.total(m.misses),
                "evictions": m.total(m.evictions), "promotions": m.total(m.promotions),
                "write errors": m.total(m.write_errors), "copies dropped": m.total(m.queue_dropped)}

    async def _log_summaries(self, interval: float) -> None:
        """Every ``interval`` seconds, one INFO line: what changed since the last line, and the queue depth."""
        last = self._counts()
        while True:
            await asyncio.sleep(interval)
            now = self._counts()
            parts = []
            for name, value in now.items():
                if isinstance(value, dict):
                    delta = {k: v - last[name].get(k, 0) for k, v in value.items()}
                    detail = ", ".join(f"{k} {v}" for k, v in sorted(delta.items()) if v)
                    parts.append(f"{name} {sum(delta.values())}" + (f" ({detail})" if detail else ""))
                else:
                    parts.append(f"{name} {value - last[name]}")
            log.info("summary of the last %g s: %s; queue depth %d", interval, ", ".join(parts),
                     self.store.write_behind.depth)
            last = now

    async def stop(self, grace: float = 5.0) -> None:
        if self.probes is not None:
            self.probes.stopping()  # /readyz: 503 "stopping" while queued writes drain
        if self.arena_socket is not None:
            await self.arena_socket.stop()
        if self.data_channel is not None:
            # its threads wait on this loop: close (and join them) off it
            await asyncio.get_running_loop().run_in_executor(None, self.data_channel.close)
        if self.server is not None:
            await self.server.stop(grace)
        if self.config.write_policy == "write-back" and len(self.store.tiers) > 1:
            copied = await self.store.demote_all()
            log.info("write-back shutdown: %d blocks written to %s", copied, self.store.tiers[-1].name)
        await self.store.close(flush=True)
        if self.events is not None:
            self.events.close()  # after the store: the last changes (drained writes) go out too
        self.arenas.close()
        if self.config.socket_path is not None:
            self.config.socket_path.unlink(missing_ok=True)
            if self._socket_lock is not None:
                self._socket_lock.release()
        for task in self._chores:
            task.cancel()
        await asyncio.gather(*self._chores, return_exceptions=True)
        self._chores = []
        if self.probes is not None:
            self.probes.close()


def _http_host(address: str) -> str:
    host = address.rpartition(":")[0]
    return host if host else "127.0.0.1"


def _by_label(counter) -> dict[str, int]:
    """A counter with one label, as {label value: count}."""
    return {next(iter(s.labels.values()), ""): int(s.value) for m in counter.collect() for s in m.samples
            if s.name.endswith("_total")}


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


def raise_fd_limit() -> None:
    """Lift the soft open-file limit to the hard one: every arena and connection holds fds, and a
    daemon out of fds can serve no block (called once by ``kvstore serve``, never at import)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _why_cannot_listen(address: str, busy_only: bool) -> str | None:
    """Why TCP ``host:port`` cannot be bound, found by binding it as gRPC does (SO_REUSEADDR, no
    SO_REUSEPORT); None if it can. ``busy_only``: report only "address in use" (a host name may
    resolve to an address family this host lacks, which gRPC skips)."""
    host, _, port = address.rpartition(":")
    try:
        candidates = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)
    except (socket.gaierror, ValueError) as exc:
        return None if busy_only else f"cannot resolve it: {exc}"
    for family, kind, proto, _, sockaddr in candidates:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return "address in use"
                if not busy_only:
                    return (exc.strerror or str(exc)).lower()
    return None


async def run_daemon(config: DaemonConfig, ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then drain queued writes and exit."""
    keep_freed_memory()
    raise_fd_limit()
    daemon = Daemon(config)
    try:
        address = await daemon.start()
    except BaseException:
        # Undo what started (store workers, tiers, the key index, arenas, our socket). Not stop()
        # without the socket's lock: stop() removes the socket path, which may then be another
        # daemon's socket or someone's file.
        if config.socket_path is None or daemon._socket_lock is not None:
            await daemon.stop(grace=0)
        else:
            await daemon.store.close(flush=False)
            if daemon.events is not None:
                daemon.events.close()
        raise
    if ready is not None:
        ready(address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining %d queued writes", daemon.store.write_behind.depth)
    await daemon.stop()
