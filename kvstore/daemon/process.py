"""The daemon process: tiers from config, the gRPC server with auth and TLS, health, metrics, and
an orderly shutdown that drains queued writes.

Its parts live beside it: the tiers a config names, checked and made (``tier_setup.py``); where and
to whom gRPC listens, the bearer-token interceptor and TLS (``grpc_listener.py``). ``Daemon`` puts
them together with the store, the service, the data channel, the probes and KV events, and
``run_daemon`` serves until a signal."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from compression.calibration_store import CALIBRATION_DIR_ENV
from kvstore.arena import arena_socket_path
from kvstore.block import BlockHeader, payload_checksum
from kvstore.daemon.arena_registry import ArenaRegistry, ArenaSocket
from kvstore.daemon.auth import TenantDirectory
from kvstore.daemon.autocal import AUTO_SPEC, AutoCalibrator, CalibrationTooLarge
from kvstore.daemon.autocal_bounds import MAX_CALIBRATION_BYTES
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.data_channel import DataChannel, server_tls
from kvstore.daemon.events import EventPublisher
from kvstore.daemon.grpc_listener import (BoundedHealth, bind, claim_socket, grpc_server, refuse_busy_port,
                                          server_credentials)
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.placement import BlockStore
from kvstore.daemon.probes import ProbeServer
from kvstore.daemon.server import SERVICE_NAME, KVStoreService, add_to_server
from kvstore.daemon.transfers import Transfers
from kvstore.daemon.tier_setup import TIER_KINDS, build_tiers, check_settings
from kvstore.instance_lock import InstanceLock
from kvstore.shm_index import KeyIndexWriter, remove_stale_files
from kvstore.user_input import format_size
from kvstore.wire import data_socket_path
from tiers.base import Tier
from tiers.disk import DiskTier

log = logging.getLogger("kvstore.daemon.process")


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
            if tier.corrupt_on_start and not tier.shared:  # a shared tier's listing: take_refused
                self.metrics.corrupt.labels(tier.name).inc(tier.corrupt_on_start)
        # The top tier keeps what clients send; lower tiers re-encode into their codec ("raw": keep).
        configured = {kind.name: kind.codec(config) for kind in TIER_KINDS.values()}
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
                                tenants=sum(1 for t in self.tenants.tenants if t.name),
                                max_namespaces=config.max_namespaces)
        self.arenas = ArenaRegistry(config.max_arena_bytes, config.max_arenas_per_client,
                                    config.max_arena_total_bytes, len(self.tenants.tenants))
        #: Put and Get for both transports: the gRPC handlers and the data channel.
        self.transfers = Transfers(self.store, self.tenants, self.arenas, config.max_message_bytes,
                                   autocal=self.autocal, max_inline_bytes=config.max_inline_bytes,
                                   keep_chain=self.events is not None)
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
        """Store an auto-calibration in the cache as blocks of ``tenant`` (its parts, through every
        tier, S3 too; durably where a durable tier exists), so engines and other hosts decode its blocks
        (`calibration_store.client_source`). Called from the calibrator's own thread, never from the
        event loop or under the store's lock: it waits for the Put and raises if it failed."""
        from compression.calibration_store import calibration_blocks, calibration_namespace

        namespace = calibration_namespace()
        headers = [(BlockHeader(key=tenant.stored_key(key), namespace=tenant.stored_key(namespace.id),
                                layout=namespace.layout, tokens=tokens, payload_len=len(payload),
                                checksum=payload_checksum(payload), codec="raw", codec_params={"exact": True}), payload)
                   for key, tokens, payload in calibration_blocks(calibration)]
        top = self.store.tiers[0]
        total = sum(header.block_len for header, _ in headers)
        if total > top.capacity_bytes // 4:  # making room for it would empty the top tier
            raise CalibrationTooLarge(f"a {total >> 20} MiB calibration is over a quarter of the {top.name} tier")
        durable = any(t.durable for t in self.store.tiers)
        if self._loop is None:
            raise RuntimeError("the daemon is not serving yet")
        for header, payload in reversed(headers):  # part 0 last: a reader that finds it finds every part
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
                              block_size=self.config.events_block_size, metrics=self.metrics)

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        if self.events is not None:
            self.events.start()  # first: a taken events address fails the start before anything listens
        self.server = grpc_server(self.config.max_message_bytes, self.tenants)
        add_to_server(self.service, self.server)
        health_servicer = BoundedHealth()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        address = self.config.listen
        socket_path = self.config.socket_path
        if socket_path is not None:
            self._socket_lock = claim_socket(address, socket_path)
        else:
            refuse_busy_port(address)
        if self.config.metrics_listen:  # before gRPC: /readyz says "starting" until it serves
            self._start_metrics()
        credentials = None
        if self.config.tls_cert and socket_path is None:  # on a unix socket, TLS is the data channel's alone
            credentials = server_credentials(self.config.tls_cert, self.config.tls_key)
        port = bind(self.server, address, credentials, unix=socket_path is not None)
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
        unix_path = data_socket_path(config.socket_path) if config.socket_path is not None else None
        self.data_channel = DataChannel(config.data_listen, self.transfers, self._loop, tls,
                                        max_connections=config.data_max_connections,
                                        max_message_bytes=config.max_message_bytes, unix_path=unix_path)
        try:
            self.service.data_port = self.data_channel.start()
        except OSError as exc:
            self.data_channel = None
            reason = "address in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc)).lower()
            raise OSError(f"cannot listen on data_listen {config.data_listen}: {reason}") from None
        self.service.data_host = self.data_channel.host

    def _start_metrics(self) -> None:
        """/metrics, /healthz and /readyz on metrics_listen (kvstore/daemon/probes.py), and the heartbeat
        /healthz watches; an address that cannot be served fails the start."""
        try:
            self.probes = ProbeServer(self.config.metrics_listen, self.metrics.registry,
                                      not_ready=self.store.health.not_ready, degraded=self.store.health.degraded_text)
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
        if config.admin_token_file:  # the operator's token for `kvstore clear` and daemon-wide stats
            auth += f", admin token from {config.admin_token_file}"
        elif config.admin_token:
            auth += ", admin token set"
        elif config.tenants_file:
            auth += ", no admin token (kvstore clear and daemon-wide stats need --admin-token-file)"
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
            unix = f" and {self.data_channel.unix_path}" if self.data_channel.unix_path is not None else ""
            lines.append(f"data channel on {host}:{self.data_channel.port}{unix}, TLS "
                         f"{'on' if config.tls_cert else 'off'}, at most {config.data_max_connections} connections")
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
            sealed = ", encrypted" if tier.at_rest is not None else ""
            tiers.append(f"{tier.name} {size}, codec {codec}{sealed}{found}")
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
