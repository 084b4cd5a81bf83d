"""Daemon configuration: one frozen dataclass, filled from defaults < config file < environment < flags.

Every field can be set three ways, named alike:

    config file (TOML)   cpu_capacity = "4GiB"
    environment          KVSTORE_CPU_CAPACITY=4GiB
    command line         --cpu-capacity 4GiB

Sizes accept plain bytes or a unit (KiB, MiB, GiB, TiB, KB, MB, GB), booleans true/false (both read
by ``kvstore/user_input.py``). Environment overrides are read here and nowhere else.

A bad value is a ValueError naming where it came from, so ``kvstore serve`` can say it in one line::

    KVSTORE_CPU_CAPACITY: not a size: 'lots' (use e.g. 512MiB, 2GiB or a byte count)
    --disk-fsync: not a boolean: 'maybe' (use true or false)
    /etc/kvstore.toml: cpu_capacity: not a size: 'lots' (...)
    /etc/kvstore.toml: Expected '=' after a key in a key/value pair (at line 3, column 5)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvstore.host import default_cache_dir, default_listen, is_loopback_host, readable_by_others
from kvstore.user_input import parse_bool, parse_size, read_text, read_toml

ENV_PREFIX = "KVSTORE_"
WRITE_POLICIES = ("write-through", "write-back")
#: Eviction orders a tier may keep (kvstore/daemon/residency.py) and which blocks lower tiers take
#: (kvstore/daemon/placement.py); the first of each is the default.
EVICTION_POLICIES = ("prefix-lru", "lru", "adaptive")
ADMISSION_POLICIES = ("all", "reused")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: sun_path holds 108 bytes with the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


@dataclass(frozen=True)
class DaemonConfig:
    #: gRPC address: ``unix:/path/to.sock`` (mode 0600) or ``host:port`` (TCP).
    listen: str = field(default_factory=default_listen)
    #: CPU tier size; 0 disables the tier.
    cpu_capacity: int = 2 * 2**30
    #: Page-lock the CPU arena when CUDA is present (faster host-device copies).
    cpu_pin: bool = True
    #: Disk tier folder; "" disables the tier.
    disk_path: str = field(default_factory=lambda: str(default_cache_dir() / "blocks"))
    disk_capacity: int = 10 * 2**30
    #: fsync each block file before it becomes visible (the disk durability point).
    disk_fsync: bool = True
    #: Read disk blocks with O_DIRECT, bypassing the page cache.
    disk_o_direct: bool = False
    #: Seal every disk block file with AEGIS-256X4 under a key derived from tenant_secret_file
    #: (tiers/at_rest.py): who reads the folder reads no KV bytes, keys' token ids or headers.
    disk_encrypt: bool = False
    #: Codec blocks are re-encoded into when they move down to disk: "raw" (exact), "int8",
    #: "int4", "int8+shuffle+zstd", "kvtc@<calibration id>", "kvtc@auto" (the daemon calibrates
    #: each namespace from its first blocks: kvstore/daemon/autocal.py), ... (see docs/notes/compression-log.md).
    disk_codec: str = "raw"
    #: write-through: every put is also queued for the lower tiers; write-back: blocks move down
    #: only when evicted.
    write_policy: str = "write-through"
    #: Eviction order in each tier (docs/policy.md): "prefix-lru" evicts a chain's last blocks
    #: before its first, so what stays of a prompt is still a hit; "lru" (before 2026-12) ignores
    #: chains; "adaptive" evicts by prefix-lru or by ARC, whichever key-only shadows of both show
    #: hitting more lately (kvstore/daemon/adaptive.py).
    eviction: str = "prefix-lru"
    #: Which blocks lower tiers take (docs/policy.md): "all"; "reused": only blocks read since they
    #: were stored (a block nobody asked for again is not written to disk or S3).
    admission: str = "all"
    #: S3 tier: bucket name; "" disables the tier. Credentials come from boto3's standard chain
    #: (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance or pod role).
    s3_bucket: str = ""
    #: S3-compatible endpoint URL (MinIO, Ceph RGW, ...); "" for AWS S3.
    s3_endpoint: str = ""
    #: Key prefix in the bucket; daemons that share blocks use the same bucket and prefix.
    s3_prefix: str = "kvstore"
    #: "" takes the region from boto3's chain (AWS_REGION), else us-east-1.
    s3_region: str = ""
    #: Bytes this daemon keeps in the bucket before evicting (LRU); 0 = unbounded.
    s3_capacity: int = 0
    #: Codec blocks are re-encoded into when written to S3; "raw" keeps them as they arrive.
    s3_codec: str = "raw"
    #: Seal every S3 object with AEGIS-256X4 under a key derived from tenant_secret_file (tiers/at_rest.py):
    #: who reads the bucket reads no KV bytes. Every host on a bucket and prefix must agree on it.
    s3_encrypt: bool = False
    #: With "kvtc@auto": tokens of a namespace's first blocks the daemon calibrates on (those
    #: blocks, and the namespace's until then, are stored as they are).
    auto_calibration_tokens: int = 8192
    #: With "kvtc@auto": consecutive layers coded as one row, at most (rows of at most 2,048 channels
    #: and calibrations within the size bound; 1 = a row per layer). docs/notes/compression-log.md measures 5.
    auto_layer_group: int = 1
    #: Where calibrations are read from (kvtc@<id>) and the daemon's own are kept (kvtc@auto);
    #: "": $KVSTORE_CALIBRATION_DIR, else ~/.cache/kvstore/calibrations (`kvstore calibrate` writes there).
    calibration_dir: str = ""
    #: Objects larger than this go up as multipart uploads and come down as parallel ranged GETs.
    s3_part_size: int = 8 * 2**20
    #: S3 requests in flight at once.
    s3_concurrency: int = 16
    #: Seconds an S3 request may wait for a response (connecting: at most 1 s).
    s3_timeout: float = 5.0
    #: Bound of each lower tier's write-behind queue; when full, Put skips the copy (counted) and
    #: the block moves down on eviction instead.
    queue_depth: int = 256
    #: Copy a block found in a lower tier up into the top tier on Get.
    promote_on_get: bool = True
    #: Publish which tier holds each key in /dev/shm so same-host clients answer Lookup without an
    #: RPC (kvstore/shm_index.py). Never published when tenants are configured.
    shm_index: bool = True
    #: Largest request or response message (inline payloads included).
    max_message_bytes: int = 256 * 2**20
    #: Inline Get reply bytes the daemon holds at once, all calls together, a gRPC reply counted
    #: with its copies (kvstore.limits.GRPC_GET_COPIES; a Get waits for room, then gets
    #: RESOURCE_EXHAUSTED, at once if its copies alone exceed this); 0: max_message_bytes.
    max_inline_bytes: int = 0
    #: Share of the smallest bounded tier that all pins and leases together may hold, split equally
    #: among named tenants (each also within its quota): the rest is always free for anyone's Put.
    hold_share: float = 0.5
    #: Prometheus /metrics address ``host:port``; "" disables it; an empty host is 127.0.0.1.
    #: /metrics shows the daemon's totals, never a tenant's name, key or traffic of its own
    #: (docs/operations.md).
    metrics_listen: str = ""
    #: Allow a metrics_listen host that is not loopback: whoever reaches it reads the totals.
    metrics_public: bool = False
    #: Seconds between the daemon's one-line INFO summaries (requests, hits, misses, evictions,
    #: promotions, write errors since the last line; queue depth); 0: none.
    summary_interval: float = 60.0
    #: KV events for routers (llm-d, Dynamo) in vLLM's wire format: the ZMQ PUB address the daemon
    #: binds, ``tcp://HOST:PORT`` (or ``ipc:///path``); "" publishes none (kvstore/daemon/events.py).
    #: Not published when tenants are configured. The sockets carry no authentication.
    events_listen: str = ""
    #: ZMQ ROUTER address answering replay requests (a start seq) with the buffered batches.
    events_replay: str = ""
    #: Topic of every published message (llm-d's indexer reads e.g. ``kv@POD@MODEL``).
    events_topic: str = ""
    #: Tokens per published block, the router's block size (Dynamo's ``--block-size``, llm-d's
    #: ``blockSize``): each stored block is published as its whole runs of this many tokens, with
    #: ids derived from its key and chained; 0: each block whole, as stored.
    events_block_size: int = 0
    #: Allow events on TCP that others can read: a host that is not loopback, or TCP at all on a
    #: daemon with an auth_token (every local user reaches loopback; ``ipc://`` sockets are 0600).
    #: Events carry every stored key and its tokens (the prompt's text), and no authentication.
    events_public: bool = False
    #: When set, every call must carry ``authorization: Bearer TOKEN`` (16 characters or more).
    auth_token: str = field(default="", repr=False)
    #: The operator's token (16 characters or more; with auth_token or tenants_file): a call carrying
    #: it may Clear and read the daemon-wide Stats, even with tenants; it is no tenant and stores,
    #: reads or holds no blocks (kvstore/daemon/auth.py).
    admin_token: str = field(default="", repr=False)
    #: A file holding the admin token (one line, mode 0600), so that it is not on a command line.
    admin_token_file: str = ""
    #: TCP without auth_token or tenants_file, allowed on a loopback address only, and only when
    #: this is set: every local user may then read, store and clear blocks. (A unix socket is
    #: mode 0600 and needs no token.)
    allow_anonymous_loopback: bool = False
    #: TOML file of tenants (name, token, quota); every call then needs a tenant's token and sees
    #: only that tenant's blocks (kvstore/daemon/auth.py).
    tenants_file: str = ""
    #: Server secret tenants' stored keys are derived under (kvstore/daemon/auth.py); created (0600) when
    #: missing. Hosts that share a bucket and tenants share this file. "": in the cache folder.
    tenant_secret_file: str = field(default_factory=lambda: str(default_cache_dir() / "tenant-secret"))
    #: Largest shared-memory arena one client may map, arenas one client process may hold, and
    #: bytes of all arenas together (with named tenants, each gets an equal share).
    max_arena_bytes: int = 2 * 2**30
    max_arenas_per_client: int = 8
    max_arena_total_bytes: int = 8 * 2**30
    #: Namespaces whose layout the daemon remembers to check Puts against, all tenants together (a
    #: named tenant at most a quarter); beyond, the least recently put is forgotten
    #: (kvstore/daemon/namespaces.py).
    max_namespaces: int = 65536
    #: The data channel for clients without shared memory (kvstore/daemon/data_channel.py): a TCP
    #: ``host:port`` (port 0: any free one; clients learn it from Stats) where Put and Get payloads
    #: travel as raw bytes beside gRPC, with the same tokens and TLS; "" (default): none.
    data_listen: str = ""
    #: Data-channel connections at once, authenticated or not; more are closed at once.
    data_max_connections: int = 32
    #: PEM certificate chain and private key: TCP listening with TLS.
    tls_cert: str = ""
    tls_key: str = ""
    #: GPU tier size (0: no GPU tier) and its torch device ("cuda", "cuda:1"; "cpu" for testing).
    gpu_capacity: int = 0
    gpu_device: str = "cuda"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.listen or not (self.listen.startswith("unix:") or ":" in self.listen):
            raise ValueError(f"listen must be 'unix:/path' or 'host:port', got {self.listen!r}")
        if self.cpu_capacity and self.cpu_capacity < 2**20:
            raise ValueError(f"cpu_capacity must be 0 (off) or at least 1MiB, got {self.cpu_capacity}")
        if self.disk_path and self.disk_capacity < 2**20:
            raise ValueError(f"disk_capacity must be at least 1MiB, got {self.disk_capacity}")
        if not self.cpu_capacity and not self.disk_path and not self.s3_bucket:
            raise ValueError("no tier configured: set cpu_capacity > 0, a disk_path or an s3_bucket")
        if self.s3_bucket:
            self.s3_config  # ValueError naming the bad S3 setting
        if not 0.0 <= self.hold_share <= 0.9:
            raise ValueError(f"hold_share must be between 0 and 0.9 (a share of the smallest tier), got {self.hold_share}")
        if self.max_inline_bytes < 0:
            raise ValueError(f"max_inline_bytes must be 0 (max_message_bytes) or a size, got {self.max_inline_bytes}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        for name, codec in (("disk_codec", self.disk_codec), ("s3_codec", self.s3_codec)):
            if codec not in ("raw", "kvtc@auto"):
                from compression.transcode import canonical_codec

                try:
                    canonical_codec(codec)  # ValueError naming the known codecs
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if not 512 <= self.auto_calibration_tokens <= 1 << 20:
            raise ValueError(f"auto_calibration_tokens must be in 512..1048576, got {self.auto_calibration_tokens}")
        if not 1 <= self.auto_layer_group <= 64:
            raise ValueError(f"auto_layer_group must be in 1..64, got {self.auto_layer_group}")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, got {self.queue_depth}")
        if self.max_message_bytes < 2**20:
            raise ValueError(f"max_message_bytes must be at least 1MiB, got {self.max_message_bytes}")
        if self.summary_interval != 0 and not 0.1 <= self.summary_interval <= 86400:
            raise ValueError(f"summary_interval must be 0 (off) or 0.1 to 86400 seconds, got {self.summary_interval}")
        if self.metrics_listen and not re.fullmatch(r".*:\d{1,5}", self.metrics_listen):
            raise ValueError(f"metrics_listen must be 'host:port' or empty, got {self.metrics_listen!r}")
        for name in ("events_listen", "events_replay"):
            value = getattr(self, name)
            if value and not re.fullmatch(r"tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):\d{1,5}|ipc:///.+", value):
                raise ValueError(f"{name} must be 'tcp://HOST:PORT', 'ipc:///path' or empty, got {value!r}")
        if not 0 <= self.events_block_size <= 4096:
            raise ValueError(f"events_block_size must be 0 (each block whole) or 1 to 4096 tokens, "
                             f"got {self.events_block_size}")
        if self.events_replay and not self.events_listen:
            raise ValueError("events_replay needs events_listen (replay serves the batches published there)")
        if self.events_listen and self.events_listen == self.events_replay:
            raise ValueError(f"events_listen and events_replay must differ, both are {self.events_listen!r}")
        for name in ("events_listen", "events_replay"):  # events carry every stored key and no token
            value = getattr(self, name)
            if not value.startswith("tcp://") or self.events_public:
                continue
            if not is_loopback_host(value[len("tcp://"):].rpartition(":")[0]):
                raise ValueError(f"{name} {value} is not a loopback address: anyone who reaches it would read every "
                                 f"stored key; set events_public to publish there anyway")
            if self.auth_token:
                raise ValueError(f"{name} {value}: this daemon has an auth_token, and every local user can read "
                                 f"loopback TCP; use ipc:///path (created 0600), or set events_public")
        metrics_host = self.metrics_listen.rpartition(":")[0]
        if metrics_host and not self.metrics_public and not is_loopback_host(metrics_host):
            raise ValueError(f"metrics_listen {self.metrics_listen} is not a loopback address: set metrics_public to "
                             f"serve the daemon's traffic totals there")
        socket_path = self.socket_path
        if socket_path is not None and len(os.fsencode(socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"listen: the unix socket path {socket_path} is {len(os.fsencode(socket_path))} bytes; "
                             f"the limit is {MAX_SOCKET_PATH_BYTES}: choose a shorter path")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not self.listen.startswith("unix:") and not (self.auth_token or self.tenants_file):
            if not is_loopback_host(self.listen.rpartition(":")[0]):
                raise ValueError(f"listening on {self.listen} (not loopback) needs auth_token or tenants_file: set "
                                 f"KVSTORE_AUTH_TOKEN or --auth-token, or listen on a unix socket")
            if not self.allow_anonymous_loopback:
                raise ValueError(f"listening on {self.listen} without a token lets every local user read, store and "
                                 f"clear blocks: set KVSTORE_AUTH_TOKEN, or --allow-anonymous-loopback true, or listen "
                                 f"on a unix socket")
        if self.auth_token:
            from kvstore.daemon.auth import token_too_short

            short = token_too_short(self.auth_token)
            if short:
                raise ValueError(f"auth_token: {short}")
        if self.admin_token and self.admin_token_file:
            raise ValueError("admin_token and admin_token_file are both set: give the admin token one way")
        if self.admin_token:
            from kvstore.daemon.auth import token_too_short

            short = token_too_short(self.admin_token)
            if short:
                raise ValueError(f"admin_token: {short}")
        if (self.admin_token or self.admin_token_file) and not (self.auth_token or self.tenants_file):
            raise ValueError("admin_token needs auth_token or tenants_file: without tokens every caller may already "
                             "clear and read the daemon's Stats")
        if self.admin_token and self.admin_token == self.auth_token:
            raise ValueError("admin_token must differ from auth_token: clients holding the auth token would be the "
                             "operator")
        if self.data_listen:
            if not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):\d{1,5}", self.data_listen):
                raise ValueError(f"data_listen must be 'host:port' or empty, got {self.data_listen!r}")
            # the data channel reads and stores blocks as gRPC does: the same rule as listen
            if not (self.auth_token or self.tenants_file):
                if not is_loopback_host(self.data_listen.rpartition(":")[0]):
                    raise ValueError(f"data_listen {self.data_listen} (not loopback) needs auth_token or "
                                     f"tenants_file: anyone who reaches it would read and store blocks")
                if not self.allow_anonymous_loopback:
                    raise ValueError(f"data_listen {self.data_listen} without a token lets every local user read "
                                     f"and store blocks: set KVSTORE_AUTH_TOKEN, or --allow-anonymous-loopback true")
        if not 1 <= self.max_namespaces <= 2**24:
            raise ValueError(f"max_namespaces must be in 1..{2**24}, got {self.max_namespaces}")
        if not 1 <= self.data_max_connections <= 4096:
            raise ValueError(f"data_max_connections must be in 1..4096, got {self.data_max_connections}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key (PEM files)")
        if self.tls_cert and self.listen.startswith("unix:") and not self.data_listen:
            raise ValueError("TLS applies to TCP listening; a unix socket is already private (mode 0600)")
        if (self.data_listen and not self.tls_cert and (self.auth_token or self.tenants_file)
                and not is_loopback_host(self.data_listen.rpartition(":")[0])):
            raise ValueError(f"data_listen {self.data_listen} is not loopback: set tls_cert and tls_key, or tokens "
                             f"and blocks would cross the network in plaintext")

    def operator_token(self, warn: bool = True) -> str:
        """The admin token: ``admin_token``, or the one line of ``admin_token_file`` (ValueError naming
        the file when it cannot be used; with ``warn``, a warning when others may read it); "" when
        neither is set."""
        if not self.admin_token_file:
            return self.admin_token
        from kvstore.daemon.auth import token_too_short

        where = f"admin_token_file {self.admin_token_file}"
        token = read_text(self.admin_token_file, "admin_token_file").strip()
        if not token or len(token.splitlines()) != 1:
            raise ValueError(f"{where}: it must hold the admin token on one line")
        short = token_too_short(token)
        if short:
            raise ValueError(f"{where}: {short}")
        if token == self.auth_token:
            raise ValueError(f"{where}: the admin token must differ from auth_token")
        warning = readable_by_others(self.admin_token_file) if warn else None
        if warning:
            logging.getLogger("kvstore.daemon.config").warning("admin_token_file %s", warning)
        return token

    @property
    def socket_path(self) -> Path | None:
        return Path(self.listen[len("unix:"):]) if self.listen.startswith("unix:") else None

    @property
    def s3_config(self):
        """The S3 tier's settings (``tiers.s3.S3Config``), validated."""
        from tiers.s3 import S3Config

        return S3Config(bucket=self.s3_bucket, prefix=self.s3_prefix, endpoint_url=self.s3_endpoint,
                        region=self.s3_region, capacity_bytes=self.s3_capacity, part_bytes=self.s3_part_size,
                        concurrency=self.s3_concurrency, read_timeout_s=self.s3_timeout)

    def replace(self, **changes: Any) -> "DaemonConfig":
        return dataclasses.replace(self, **changes)


def _coerce(name: str, value: Any) -> Any:
    kind = {f.name: f.type for f in dataclasses.fields(DaemonConfig)}[name]
    if kind == "int" and name.endswith(("_capacity", "_bytes", "_part_size")):
        return parse_size(value)
    if kind == "int":  # a count (tokens, items, connections): no units
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a whole number, got {value!r}") from None
    if kind == "bool":
        return parse_bool(value)
    if kind == "float":
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    return str(value)


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(DaemonConfig)]


def load_config(file: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """Defaults, then the TOML ``file`` (else ``KVSTORE_CONFIG``'s; its ``[client]`` table is the
    clients', skipped here), then ``KVSTORE_*`` variables, then ``overrides`` (flags).

    Raises ValueError naming the source of a bad value: the file and key, the variable, or the flag
    (see the module docstring). A ``tenants_file`` is read here once too, so that a missing,
    non-UTF-8 or malformed one, or a bad tenant in it, is named before the daemon starts
    (kvstore/daemon/auth.py parses it). A ``file`` holding an auth_token that others may read is a warning.
    """
    values: dict[str, Any] = {}
    #: Where each value came from, as the error messages name it.
    sources: dict[str, str] = {}
    names = field_names()
    environ = os.environ if environ is None else environ
    file = file or environ.get(ENV_PREFIX + "CONFIG") or None  # the clients read it too (kvstore/connect.py)
    if file:
        table = read_toml(file, "config file")
        table.pop("client", None)  # how clients reach this daemon: kvstore.connect.read_client_table checks it
        unknown = set(table) - set(names)
        if unknown:
            raise ValueError(f"config file {file}: unknown keys {sorted(unknown)}; known: {names}")
        values.update(table)
        sources.update({name: f"config file {file}: {name}" for name in table})
    for name in names:
        env = ENV_PREFIX + name.upper()
        if env in environ:
            values[name] = environ[env]
            sources[name] = env
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
            sources[name] = "--" + name.replace("_", "-")
    coerced = {}
    for name, value in values.items():
        try:
            coerced[name] = _coerce(name, value)
        except ValueError as exc:
            raise ValueError(f"{sources[name]}: {exc}") from None
    try:
        config = DaemonConfig(**coerced)
    except ValueError as exc:
        # "cpu_capacity must be ...": say which setting gave it.
        named = next((n for n in sorted(sources, key=len, reverse=True) if str(exc).startswith(n)), None)
        raise ValueError(f"{exc} (from {sources[named]})" if named else str(exc)) from None
    admin = config.operator_token(warn=False)  # ValueError naming admin_token_file; the daemon warns
    if config.tenants_file:
        from kvstore.daemon.auth import admin_token_clash, read_tenants

        tenants = read_tenants(config.tenants_file)  # ValueError naming the file, the tenant and the key
        clash = admin_token_clash(admin, tenants, config.tenants_file)
        if clash:
            raise ValueError(clash)
    if file and ("auth_token" in table or "admin_token" in table):

        warning = readable_by_others(file)  # as for a tenants file: a warning at start (kvstore/daemon/auth.py)
        if warning:
            logging.getLogger("kvstore.daemon.config").warning("config file %s", warning)
    return config
