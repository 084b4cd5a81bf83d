"""Put and Get of blocks for a tenant, shared by both transports: the gRPC handlers
(kvstore/daemon/server.py) and the data channel (kvstore/daemon/data_channel.py).

One ``Transfers`` holds what a transfer needs beyond the store: the tenant directory (tokens to
tenants), the arenas slices name, the message limit, the byte budget inline payloads are charged
to, and each named tenant's own counters (its Stats). Validation, tenants' keys, the bounds on the
bytes a call moves and the store calls live here once, so both transports refuse the same input
with the same status and message (:func:`status_of`).

A transfer's work is bounded before it starts: keys per call, layers per block, and the bytes it
moves (inline bytes within the message limit; bytes through shared memory within the arenas it
names). The coroutines and the methods that touch the store run on the daemon's event loop (the
store is confined to it); the data channel's threads reach them through ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections import defaultdict
from typing import Callable, NamedTuple

import grpc

from kvstore.block import MAX_CHAIN_TOKENS, BlockHeader, pack_token_ids
from kvstore.daemon.arena_registry import ArenaRegistry
from kvstore.daemon.auth import ANONYMOUS, Tenant, TenantDirectory
from kvstore.daemon.budget import BudgetExhausted, ByteBudget
from kvstore.daemon.placement import BlockGoneError, BlockStore, GetResult, HoldRefused
from kvstore.daemon.residency import WalkBudget
from kvstore.keys import KEY_BYTES
from kvstore.limits import MAX_ITEMS_PER_CALL, MAX_KEYS_PER_CALL, MAX_LAYERS, MAX_SKIPPED_REPORT, SKIPPED_STORES_HEADER
from kvstore.lookup_report import (
    MAX_REPORTED_KEYS_PER_S, REPORT_HEADER, REPORT_KEYS_HEADER, KeyRate, parse_report, parse_report_keys)
from kvstore.proto import kvstore_pb2 as pb
from kvstore.scatter import Gather, Scatter, scatters
from compression.transcode import check_codec_params
from kvstore.wire import layout_from_message, meta_from_header, result_messages
from tiers.base import TierError, TierFullError

log = logging.getLogger(__name__)

#: Bytes a reply needs beyond its payloads, per result (metadata, field tags); a generous bound.
RESULT_OVERHEAD = 512
GPU_LEASE_SECONDS = 30.0
#: Longest a Get waits for inline reply bytes to come free before RESOURCE_EXHAUSTED.
INLINE_WAIT_S = 10.0
#: Why a gRPC inline Get larger than the inline budget, with its copies, is refused (it names no
#: figure of the daemon's): there is no waiting it out.
INLINE_GET_TOO_LARGE = ("this Get's inline reply is larger than the daemon lets one gRPC reply hold with its copies; "
                        "read large blocks through a shared-memory arena or the data channel (data_listen), "
                        "or Get fewer blocks per call")


class PlannedRead(NamedTuple):
    """One item of a Get's plan."""
    key: bytes                              # the stored key (the tenant's, kvstore/daemon/auth.py)
    header: BlockHeader | None              # the block found; None: a miss
    dest: memoryview | Scatter | None       # a slice, a slice in rows (kvstore/scatter.py), or None: inline


#: A Get's plan: per item, what it reads and where to.
Plan = list[PlannedRead]
#: A Get's replies, per item: its result and, for one read inline, its payload.
Replies = list[tuple[pb.GetResult, memoryview | None]]


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


def stored_keys(tenant: Tenant, keys, what: str = "keys") -> list[bytes]:
    """The tenant's stored keys for a call's client keys; BadRequest past the call's limit
    (``what`` "keys": a key-only call's; "items": a Put's or Get's) or for a key of the wrong size."""
    most = MAX_KEYS_PER_CALL if what == "keys" else MAX_ITEMS_PER_CALL
    if len(keys) > most:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} {what} in one call; at most {most}")
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{what}[{i}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")
    return [tenant.stored_key(k) for k in keys]


def with_chain(header: BlockHeader, parent: bytes, token_ids) -> BlockHeader:
    """``header`` keeping the block's parent and its token ids (only a list of exactly ``tokens``
    ids, at most MAX_CHAIN_TOKENS; any other is dropped, not refused: the ids serve routers only)."""
    ids = pack_token_ids(token_ids) if len(token_ids) == header.tokens <= MAX_CHAIN_TOKENS else b""
    return dataclasses.replace(header, parent=parent, token_ids=ids) if parent or ids else header


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


class Usage:
    """One named tenant's own counters, for its Stats (it sees nobody else's traffic)."""

    def __init__(self) -> None:
        self.requested = self.misses = 0
        self.hits: dict[str, int] = defaultdict(int)
        self.bytes_out: dict[str, int] = defaultdict(int)
        self.bytes_in: dict[str, int] = defaultdict(int)


class Transfers:
    """Puts and Gets for a tenant over any transport. Keys and namespaces are mapped to the
    tenant's stored ones on the way in (kvstore/daemon/auth.py) and keys back on the way out, so
    tenants never see each other's blocks. Mutates the store, ``inline`` and ``usage``."""

    def __init__(self, store: BlockStore, tenants: TenantDirectory | None = None,
                 arenas: ArenaRegistry | None = None, max_message_bytes: int = 256 * 2**20,
                 autocal=None, max_inline_bytes: int = 0, keep_chain: bool = False) -> None:
        self.store = store
        #: Keep each Put's parent and token ids in the block's header, for the KV events routers
        #: read (kvstore/daemon/events.py): on only where events are published, since token ids
        #: are the prompt's text in every tier, disk and S3 included.
        self.keep_chain = keep_chain
        #: kvtc@auto's calibrator (kvstore/daemon/autocal.py), told which tenant Puts each namespace
        self.autocal = autocal
        self.tenants = tenants or TenantDirectory([ANONYMOUS], required=False)
        #: Arenas handed out on the arena socket (kvstore/daemon/arena_registry.py); empty without one.
        self.arenas = arenas if arenas is not None else ArenaRegistry(max_arena_bytes=0, max_arenas_per_client=0)
        self.max_message_bytes = max_message_bytes
        #: Inline Get reply bytes and data-channel transfers in flight, all calls together
        #: (default: one message's worth).
        #: With named tenants, each holds at most its share while others wait (kvstore/daemon/budget.py).
        self.inline = ByteBudget(max_inline_bytes or max_message_bytes, "inline payloads",
                                 shared=any(t.name for t in self.tenants.tenants))
        #: Each named tenant's own counters (the anonymous tenant and the operator have none).
        self.usage: dict[str, Usage] = defaultdict(Usage)
        #: Keys of clients' local Lookups counted as uses, all clients together (kvstore/lookup_report.py).
        self.reported_keys = KeyRate(MAX_REPORTED_KEYS_PER_S)

    def tenant_of(self, metadata, operator: bool = False) -> Tenant:
        """The tenant of a call's metadata (gRPC's, or the data channel's HELLO, from its thread);
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
        self._add_skipped_stores(metadata)
        return tenant

    def _add_skipped_stores(self, metadata) -> None:
        """Count the stores a client skipped because its store queue was behind (engine_adapter/
        prefix_cache.py): the call's first such report, if a decimal within MAX_SKIPPED_REPORT."""
        for name, value in metadata or ():
            if name == SKIPPED_STORES_HEADER:
                if isinstance(value, str) and 0 < len(value) <= 7 and value.isascii() and value.isdigit() \
                        and int(value) <= MAX_SKIPPED_REPORT:
                    self.store.metrics.stores_skipped.inc(int(value))
                return

    def _add_local_lookups(self, metadata) -> None:
        """Count the Lookups a client answered from the key index (kvstore/lookup_report.py)
        as if they had been RPCs: its first report on this call, if well formed, and its first
        report of hit keys, each a use for eviction ``adaptive`` within `reported_keys`' rate (the
        rest counted as dropped). Only while the index is published, so only the anonymous tenant's
        clients have any (with tenants: none)."""
        counted = keys_counted = False
        m = self.store.metrics
        for name, value in metadata or ():
            if name == REPORT_HEADER and not counted:
                counted = True
                report = parse_report(value) if isinstance(value, str) else None
                if report is not None:
                    keys, hits, calls = report
                    m.requested.labels("lookup").inc(keys)
                    m.misses.inc(keys - hits)
                    m.lookup_hits.inc(hits)
                    m.lookups.labels("local").inc(calls)
            elif name == REPORT_KEYS_HEADER and not keys_counted:
                keys_counted = True
                hit_keys = parse_report_keys(value)
                if hit_keys:
                    admitted = self.reported_keys.admit(len(hit_keys))
                    used = self.store.note_looked_up(hit_keys[:admitted])
                    m.reported_keys.labels("held").inc(used)
                    m.reported_keys.labels("not_held").inc(admitted - used)
                    m.reported_keys.labels("dropped").inc(len(hit_keys) - admitted)

    def _slice(self, slice_: pb.ArenaSlice, tenant: Tenant) -> memoryview:
        return self.arenas.view(slice_.arena_id, tenant, slice_.offset, slice_.length)

    def _check_bytes(self, tenant: Tenant, what: str, inline: int, shared: int, arena_bytes: int) -> None:
        """Refuse a call before any copy when it would move more than it may: inline bytes within
        the message limit, bytes through shared memory within the ``arena_bytes`` of the arenas it
        names (a call naming one slice many times cannot make the daemon copy without end)."""
        if inline > self.max_message_bytes:
            raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{what} would carry {inline} inline bytes; the message limit is "
                             f"{self.max_message_bytes} (max_message_bytes): ask for fewer blocks per call")
        if shared > arena_bytes:
            raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{what} would copy {shared} bytes through shared memory, more than the "
                             f"{arena_bytes} bytes of the arenas it names")

    def count(self, tenant: Tenant, rpc: str, results: list[GetResult | None], requested: int | None = None) -> None:
        """Keys asked for (``requested``, default one per result) and the tenant's own counters of
        its results (the store counts the misses)."""
        requested = len(results) if requested is None else requested
        self.store.metrics.requested.labels(rpc).inc(requested)
        if tenant.name:
            usage = self.usage[tenant.name]
            usage.requested += requested
            for found in results:
                if found is None:
                    usage.misses += 1
                else:
                    usage.hits[found.tier] += 1
                    usage.bytes_out[found.tier] += found.header.payload_len

    async def put_blocks(self, tenant: Tenant, request: pb.PutRequest,
                         payloads: list[memoryview] | None = None) -> int:
        """Validate every item, then store them; the number stored. Payloads are the items' own
        (inline or an arena slice), or ``payloads``, one per item, as the data channel received
        them (kvstore/daemon/data_channel.py; its items then carry neither)."""
        keys = stored_keys(tenant, [item.meta.key for item in request.items], "items")
        prepared: list[tuple[BlockHeader, memoryview, bytes]] = []
        inline = shared = 0
        arena_ids: set[int] = set()
        for i, item in enumerate(request.items):
            if item.parent and len(item.parent) != KEY_BYTES:
                raise ValueError(f"items[{i}].parent is {len(item.parent)} bytes; keys are {KEY_BYTES} bytes")
            # the tenant's own key space, like the block's: a parent names no other tenant's block
            parent = tenant.stored_key(item.parent) if item.parent else b""
            which = item.WhichOneof("data")
            if item.row_stride and not item.row_bytes:
                raise ValueError(f"items[{i}] has row_stride but no row_bytes")
            if item.row_bytes and (payloads is not None or which != "slice"):
                raise ValueError(f"items[{i}] has row_bytes: rows are read from a registered arena's slice")
            if payloads is not None:
                if which is not None:
                    raise ValueError(f"items[{i}] sets {which}: on the data channel payloads follow the message")
                payload = payloads[i]
                inline += len(payload)
            elif which == "slice":
                payload = self._slice(item.slice, tenant)
                if item.row_bytes:
                    try:
                        payload = Gather(payload, item.row_bytes, item.row_stride, item.meta.payload_len)
                    except ValueError as exc:
                        raise ValueError(f"items[{i}]: {exc}") from None
                shared += len(payload)
                arena_ids.add(item.slice.arena_id)
            elif which == "inline":
                payload = memoryview(item.inline)
                inline += len(payload)
            else:
                raise ValueError(f"items[{i}] carries no payload (set inline or slice)")
            try:
                header = header_from_meta(item.meta, len(payload), tenant, keys[i])
            except ValueError as exc:
                raise ValueError(f"items[{i}]: {exc}") from None
            if self.keep_chain:
                header = with_chain(header, parent, item.token_ids)
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
        self._check_bytes(tenant, "this Put", 0, shared, self.arenas.bytes_of(arena_ids, tenant))
        # Validate everything before storing anything; then store, the checksum computed as the
        # payload is copied. (A client that rewrites its arena during the call spoils only this
        # block of its own, stored under its tenant's keys: in the CPU tier the checksum is of the
        # copy, so the block holds whatever was copied; in a tier that hashes first, it fails its
        # checksum and reads as a counted corrupt miss.)
        in_rows = any(isinstance(payload, Gather) for _, payload, _ in prepared)
        if self.store.tiers[0].scatters or not in_rows:
            stored: list[BlockHeader | None] = [None] * len(prepared)
            try:
                # Puts in rows and from the data channel copy in worker threads, whose client waits
                # idle meanwhile. Whole payloads in an arena (a client that copies its next payload
                # in while this one is stored) or in a gRPC message copy on the event loop: in
                # threads they were 0.87x (one client, arena) and 0.81-0.85x (eight, inline) as fast
                # in bench/ab_pairs.py runs, the threads' copies competing with the clients' work
                # (for the second, we think, with the loop parsing the next large messages).
                await self.store.put_many(prepared, owner=tenant.name, quota=tenant.quota_bytes,
                                          durable=request.durable, stored=stored,
                                          offload=payloads is not None or in_rows)
            finally:
                if tenant.name:
                    for header in stored:
                        if header is not None:
                            self.usage[tenant.name].bytes_in[self.store.tiers[0].name] += header.payload_len
            return len(prepared)
        walk = WalkBudget()  # one for the call: many blocks naming deep parents cost one bounded walk
        for header, payload, parent in prepared:
            held = 0
            if isinstance(payload, Gather) and not self.store.tiers[0].scatters:
                # a top tier that takes payloads in one run only: the rows are copied into a buffer
                # first, off the event loop, and held in the inline budget like a message's bytes
                held = len(payload)
                await self.inline.acquire(held, INLINE_WAIT_S, tenant.name)
            try:
                if held:
                    payload = await asyncio.to_thread(payload.tobytes)
                await self.store.put(header, payload, owner=tenant.name, quota=tenant.quota_bytes,
                                     durable=request.durable, hash_payload=True, parent=parent, walk=walk)
            finally:
                if held:
                    self.inline.release(held, tenant.name)
            if tenant.name:
                self.usage[tenant.name].bytes_in[self.store.tiers[0].name] += header.payload_len
        return len(prepared)

    async def plan_get(self, request: pb.GetRequest, tenant: Tenant, need_dest: bool) -> tuple[list[bytes], Plan, int]:
        """Stored keys; per item, the header found and the validated destination slice; and the
        inline bytes the reply needs. The bytes the call would move are checked against its limits
        before anything is copied."""
        keys = stored_keys(tenant, [item.key for item in request.items], "items")
        await self.store.discover(keys, tenant.name)
        self.store.claim(keys, tenant.name)
        if not request.allow_missing:
            missing = self.store.missing(keys)
            if missing:
                self.store.metrics.misses.inc(len(missing))
                self.count(tenant, "get", [None] * len(missing), requested=len(keys))
                raise BadRequest(grpc.StatusCode.NOT_FOUND,
                                 f"{len(missing)} of {len(keys)} keys are not stored "
                                 f"(first: items[{keys.index(missing[0])}]); set allow_missing to get the others")
        headers = [self.store.header(key) for key in keys]
        for i, item in enumerate(request.items):  # what is refused before any arena is looked at
            if not item.HasField("dest"):
                if need_dest:
                    raise ValueError(f"items[{i}] has no dest: a layer-wise Get writes into a registered arena")
                if item.row_bytes:
                    raise ValueError(f"items[{i}] has row_bytes but no dest: rows go into a registered arena")
            elif item.row_bytes and need_dest:
                raise ValueError(f"items[{i}] has row_bytes: GetLayers copies into plain slices only")
            if item.row_stride and not item.row_bytes:
                raise ValueError(f"items[{i}] has row_stride but no row_bytes")
        # every destination in one call to the arenas, and those in rows in one call to scatter.py
        with_dest = [i for i, item in enumerate(request.items) if item.HasField("dest")]
        views, arena_bytes = self.arenas.views(
            [(request.items[i].dest.arena_id, request.items[i].dest.offset, request.items[i].dest.length)
             for i in with_dest], tenant) if with_dest else ([], 0)
        dests: dict[int, memoryview | Scatter] = dict(zip(with_dest, views))
        in_rows = [i for i in with_dest if request.items[i].row_bytes]
        made = scatters([(dests[i], request.items[i].row_bytes, request.items[i].row_stride,
                          None if headers[i] is None else headers[i].payload_len) for i in in_rows]) if in_rows else []
        for i, scatter in zip(in_rows, made):
            if isinstance(scatter, ValueError):
                raise ValueError(f"items[{i}]: {scatter}") from None
            dests[i] = scatter
        plan: Plan = []
        inline = shared = 0
        for i, (key, header) in enumerate(zip(keys, headers)):
            dest = dests.get(i)
            if header is not None:
                if dest is None:
                    inline += header.payload_len + RESULT_OVERHEAD
                elif isinstance(dest, Scatter):
                    shared += header.payload_len if dest.fit else 0
                elif len(dest) < header.payload_len:
                    raise ValueError(f"items[{i}].dest has {len(dest)} bytes; the block needs {header.payload_len}")
                else:
                    shared += header.payload_len
            plan.append(PlannedRead(key, header, dest))
        self._check_bytes(tenant, "this Get", inline, shared, arena_bytes)
        return keys, plan, inline

    async def get_for(self, metadata, request: pb.GetRequest, copies: int = 1) -> tuple[Tenant, Replies, int]:
        """:meth:`get_blocks` for the tenant of a call's ``metadata`` (:meth:`tenant_of`), returned with them."""
        tenant = self.tenant_of(metadata)
        return (tenant, *await self.get_blocks(tenant, request, copies=copies))

    async def get_blocks(self, tenant: Tenant, request: pb.GetRequest,
                         allocate: Callable[[int], bytearray] = bytearray, copies: int = 1) -> tuple[Replies, int]:
        """Per item its result and, for one read inline (no dest), its payload (read into a buffer
        from ``allocate``, which may be larger; called on the loop); and the inline bytes taken
        from ``self.inline`` for them (``copies`` times the payloads: the copies the caller's reply
        makes), which the caller releases, as ``tenant.name``'s, once it sent them. A Get with
        ``copies`` > 1 whose bytes exceed the whole budget is refused (BudgetExhausted) at once."""
        _, plan, inline = await self.plan_get(request, tenant, need_dest=False)
        inline *= copies
        if copies > 1 and inline > self.inline.total:  # its copies alone would overrun the budget
            raise BudgetExhausted(INLINE_GET_TOO_LARGE)
        if inline:
            await self.inline.acquire(inline, INLINE_WAIT_S, tenant.name)
        try:
            return await self._read_blocks(request, tenant, plan, allocate), inline
        except BaseException:
            if inline:
                self.inline.release(inline, tenant.name)
            raise

    async def _read_blocks(self, request: pb.GetRequest, tenant: Tenant, plan: Plan,
                           allocate: Callable[[int], bytearray]) -> Replies:
        by_reference = self._gpu_direct(request, plan, tenant) if request.gpu_direct else {}
        # Read every other found block in one batch (disk reads overlap; GPU runs copy once).
        # Inline payloads are read into buffers that go into the reply as they are (encode_get_response).
        results: list[GetResult | None] = [None] * len(plan)
        # A block that is not whole rows of a scatter item's destination: found, its meta in the
        # reply, nothing copied (the caller Gets it into a plain slice); neither a hit nor a miss.
        unfit = {i: GetResult(read.header, "") for i, read in enumerate(plan) if read.header is not None
                 and isinstance(read.dest, Scatter) and not read.dest.fit}
        found_at = [i for i, read in enumerate(plan)
                    if read.header is not None and i not in by_reference and i not in unfit]
        buffers = {i: allocate(plan[i].header.payload_len) for i in found_at if plan[i].dest is None}
        reads = [(plan[i].key, memoryview(buffers[i])[: plan[i].header.payload_len] if i in buffers else plan[i].dest)
                 for i in found_at]
        for i, found in zip(found_at, await self.store.reads.get_many_into(reads)):
            results[i] = found
        self.store.metrics.misses.inc(sum(read.header is None for read in plan))
        self.count(tenant, "get", [by_reference[i][1] if i in by_reference else r
                                   for i, r in enumerate(results) if i not in unfit], requested=len(plan))
        results = [unfit.get(i, r) for i, r in enumerate(results)]
        messages = result_messages([item.key for item in request.items], results)
        return [(by_reference[i][0] if i in by_reference else message,
                 None if found is None or i not in buffers else memoryview(buffers[i])[: found.header.payload_len])
                for i, (message, found) in enumerate(zip(messages, results))]

    def _gpu_direct(self, request: pb.GetRequest, plan: Plan, tenant: Tenant
                    ) -> dict[int, tuple[pb.GetResult, GetResult]]:
        """Blocks in the GPU tier, by reference: their offsets in the exported pool, no copy. Only
        blocks the tenant may lease (within its bound) go by reference; the others are copied."""
        out = {}
        for i, read in enumerate(plan):
            offset = self.store.gpu_offset(read.key) if read.header is not None else None
            # stays put until Release or the lease ends
            if offset is not None and self.store.lease(read.key, GPU_LEASE_SECONDS, tenant.name):
                self.store.metrics.hits.labels("gpu").inc()  # served by reference: a Get hit all the same
                meta = meta_from_header(read.header)
                meta.key = request.items[i].key
                out[i] = (pb.GetResult(found=True, meta=meta, tier="gpu", gpu_offset=offset, on_gpu=True),
                          GetResult(read.header, "gpu"))
        return out
