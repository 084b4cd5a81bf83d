"""KVStoreConnector: vLLM's v1 KV connector backed by the kvstore daemon.

Start vLLM with it (README: "Using kvstore with vLLM")::

    LLM(model=folder, dtype="bfloat16", kv_transfer_config=KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="engine_adapter.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"address": "unix:/run/kvstore.sock"}))

vLLM builds two instances: the scheduler side (in the engine-core process) and the worker side
(in each worker process). A request's path through them:

    1. keys     get_num_new_matched_tokens  keys of prompt[:-1]: full chunks as the reference engine
                                            computes them, then a tail block up to the last page
    2. lookup                               the daemon's shared key index (no round trip); a hit
                                            vLLM will load is leased (one Lookup RPC, lease_s) so
                                            eviction cannot take it before the load; returns the hit
                                            tokens beyond vLLM's own prefix-cache hit
    3. plan     update_state_after_alloc    which block rows go to which vLLM pages (plan.py)
                build_connector_meta        this step's loads, and the pieces it completes
    4. load     start_load_kv               Get through the shared-memory arena, then the pages are
                                            written before the forward: on CPU by kvstore's native
                                            page writer (kernels/page_copy.c), else by the backend's
                                            own cache-write op with a slot mapping (layerwise: one
                                            layer at a time, awaited in wait_for_layer_load)
    5. compute  vLLM's forward              only the tokens after the hit
    6. save     wait_for_save               copy the whole pages of each completed piece (one
                                            index_select per layer); a thread reorders them into a
                                            block and Puts it (save_mode async), or the step does
                                            (sync / durable, e.g. a kv_producer)

A request with ``{"kvstore_blend": ...}`` in its ``kv_transfer_params``, or whose prompt text marks
its passages with ``blend_separator``, is blended instead (CacheBlend: RAG passages reused at any
position; ``engine_adapter/vllm/blend.py``): every token before its query is an external hit, which
the worker writes with ``BlendEngine.prefill`` over a copy of the weights.

A daemon that is down, slow or wrong costs misses, never a failed request: every call goes through
the engines' shared guard (engine_adapter/prefix_cache.py: counted, each outage and each recovery
logged once, a failed connection retried after ``retry_s``). A block that vanishes between Lookup
and Get is reported to vLLM as a failed load (``get_block_ids_with_load_errors``) and the request's
cached-token count is corrected; with ``kv_load_failure_policy="recompute"`` vLLM then computes
those tokens (its default, "fail", fails the request).

Limits: one KV-cache group of full attention (Llama-family models), tensor and pipeline
parallelism 1 (a block holds every layer and head), KV cache dtype "auto".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_adapter.client import KVStoreClient
from engine_adapter.loader import hf_rope
from engine_adapter.prefix_cache import PrefixCache, fetch_slot_bytes, fetched_tensor
from engine_adapter.vllm.blend import BlendLoad, BlendRequests, BlendSpec, VllmBlender, brief
from engine_adapter.vllm.layout import PagedKV, PagedSpan, PageLayout, measure_page_layout, split_cache_write
from engine_adapter.vllm.plan import ChunkLoad, Planner, StepPlan
from engine_adapter.vllm.trace import AccessTrace
from blend.engine import DEFAULT_RATIO
from blend.select import DEFAULT_SELECTOR, SELECTORS
from kernels.page_copy import PageWriter
from kvstore.config import default_listen
from kvstore.dtypes import TORCH_DTYPE_NAMES, TORCH_DTYPES
from kvstore.keys import KVLayout, Namespace, chunk_key

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of vLLM's logger: the connector's lines go wherever vLLM's go, at vLLM's level.
log = logging.getLogger("vllm.kvstore_connector")

# daemon tier -> where vLLM's metrics say the hit came from
_HIT_SOURCES = {"gpu": CacheHitSource.DEVICE, "cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


SAVE_MODES = ("auto", "async", "sync", "durable")
BLEND_MODES = ("off", "lazy", "start")
BLEND_WEIGHTS = ("vllm", "copy")


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` keys, validated."""

    address: str = ""            # daemon address, e.g. "unix:/run/kvstore.sock"; default: kvstore's default socket
    model_id: str = ""           # namespace model id; default: the model folder's name (the GGUF stem)
    tenant: str = ""             # namespace tenant salt
    chunk_tokens: int = 256      # tokens per block; must match the other engines sharing the cache
    arena_bytes: int = 64 << 20  # worker's shared-memory arena
    timeout_s: float = 5.0       # per daemon call
    retry_s: float = 10.0        # after a failed call, serve without the daemon this long
    save_queue_chunks: int = 16  # completed chunks waiting for Put; beyond it they are dropped (counted)
    tail_blocks: bool = True     # also store/load the tokens after the last full chunk, up to the last page
    lease_s: float = 10.0        # the daemon keeps a reported hit from eviction this long (0: no lease)
    layerwise: bool = False      # write layer i's pages while vLLM computes layer i-1 (docs/vllm.md: measured)
    native_copy: bool = True     # CPU pages written by kvstore's native page writer where it knows the
                                 # layout (kernels/page_copy.c); false: vLLM's own cache-write op
    event_tier: str = "cpu"      # the daemon tier a Put lands in, named in vLLM's KV events (medium, ownership)
    save_mode: str = "auto"      # async: Put from a thread; sync: Put in the step; durable: sync, and on
                                 # disk or S3 when the step ends; auto: sync for kv_producer, else async
    blend: str = "lazy"          # CacheBlend for requests that ask (engine_adapter/vllm/blend.py): "lazy" sets
                                 # the blend's model up on the first such request, "start" at start, "off"
                                 # serves them as plain prompts
    blend_weights: str = "vllm"  # the blend computes with vLLM's own layers (engine_adapter/vllm/model_view.py;
                                 # a second copy where they do not fit), or "copy": its own copy of the
                                 # weights from the model folder
    blend_ratio: float = DEFAULT_RATIO  # fraction of passage tokens recomputed, unless a request says
    blend_selector: str = DEFAULT_SELECTOR  # blend.select name, unless a request says
    blend_controller: bool = False  # the ratio from measured load and compute speed (blend/controller.py)
                                    # for requests that give none (or "auto"); blend_ratio is its floor
    blend_separator: str = ""       # a prompt whose text holds it is a blend of the passages it marks
                                    # (prefix<sep>passage<sep>...<sep>query, e.g. "<|chunk|>"); "": off
                                    # (opt in: quality is below kv_transfer_params', docs/vllm.md)
    blend_max_passages: int = 128   # a request marking more is served as a plain prompt
    token_file: str = ""         # the daemon's bearer token (or one per address, kvstore.connect.TokenBook);
                                 # default: KVSTORE_AUTH_TOKEN
    tls_ca: str = ""             # TLS to a TCP daemon: PEM of the CA that signed its certificate
    tls_cert: str = ""           # client certificate (PEM, with tls_key) for a daemon that asks for one
    tls_key: str = ""
    tls_server_name: str = ""    # the name the daemon's certificate carries, when the address names it otherwise
    insecure: bool = False       # allow the token over plaintext TCP to an address that is not loopback
    trace_file: str = ""         # append the scheduler's block access trace here (engine_adapter/vllm/trace.py)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorSettings":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown} for KVStoreConnector; "
                             f"known keys: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = type(known[name].default)
            try:
                if kind is bool and not isinstance(value, bool):
                    value = {"true": True, "1": True, "false": False, "0": False}[str(value).strip().lower()]
                values[name] = kind(value)
            except (TypeError, ValueError, KeyError):
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be a {kind.__name__}, "
                                 f"got {value!r}") from None
        settings = cls(**values)
        for name in ("chunk_tokens", "arena_bytes", "save_queue_chunks", "blend_max_passages"):
            if getattr(settings, name) <= 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be positive, got {getattr(settings, name)}")
        if settings.save_mode not in SAVE_MODES:
            raise ValueError(f"kv_connector_extra_config['save_mode'] must be one of {SAVE_MODES}, "
                             f"got {settings.save_mode!r}")
        if settings.blend not in BLEND_MODES:
            raise ValueError(f"kv_connector_extra_config['blend'] must be one of {BLEND_MODES}, got {settings.blend!r}")
        if settings.blend_weights not in BLEND_WEIGHTS:
            raise ValueError(f"kv_connector_extra_config['blend_weights'] must be one of {BLEND_WEIGHTS}, "
                             f"got {settings.blend_weights!r}")
        if not 0.0 <= settings.blend_ratio <= 1.0:
            raise ValueError(f"kv_connector_extra_config['blend_ratio'] must be in [0, 1], got {settings.blend_ratio}")
        if settings.blend_selector not in SELECTORS:
            raise ValueError(f"kv_connector_extra_config['blend_selector'] {settings.blend_selector!r} is unknown; "
                             f"known: {sorted(SELECTORS)}")
        if settings.timeout_s <= 0 or settings.retry_s < 0 or settings.lease_s < 0:
            raise ValueError("kv_connector_extra_config 'timeout_s' must be > 0, 'retry_s' and 'lease_s' >= 0")
        return settings


def vllm_namespace(vllm_config: "VllmConfig", settings: ConnectorSettings) -> Namespace:
    """The namespace of this vLLM instance's KV; equals the reference engine's ``model_namespace``
    (and ``hf_namespace``) for the same weights, dtype, model id and tenant."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("KVStoreConnector needs tensor_parallel_size=1 and pipeline_parallel_size=1 "
                         "(a kvstore block holds every layer and KV head)")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ValueError(f"KVStoreConnector stores the model dtype's KV; set kv_cache_dtype='auto' "
                         f"(got {vllm_config.cache_config.cache_dtype!r})")
    if model_config.dtype not in TORCH_DTYPE_NAMES:
        raise ValueError(f"model dtype {model_config.dtype} has no kvstore layout; use one of {list(TORCH_DTYPE_NAMES)}")
    layout = KVLayout(model_config.get_num_layers(parallel), model_config.get_num_kv_heads(parallel),
                      model_config.get_head_size(), TORCH_DTYPE_NAMES[model_config.dtype])
    theta, scaling = hf_rope(model_config.hf_config.to_dict())
    rope = Namespace.rope_params(theta=theta, scaling=scaling)
    model_id = settings.model_id or Path(model_config.model).name
    return Namespace(model_id, layout, rope=rope, tenant=settings.tenant, chunk_tokens=settings.chunk_tokens)


def cpu_cache_write(isa: str):
    """vLLM's CPU cache-write op for ``isa`` in :func:`measure_page_layout`'s signature."""
    from vllm import _custom_ops as ops

    def write(key: torch.Tensor, value: torch.Tensor, plane: torch.Tensor, slots: torch.Tensor) -> None:
        pages, heads, page_tokens, _ = plane.shape
        key_cache, value_cache = plane.view(pages, heads, 2 * page_tokens, -1).chunk(2, dim=2)  # as CPU_ATTN does
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


class LayerwiseLoad:
    """One step's loads, layer by layer: the daemon streams each layer of every block into the arena
    (GetLayers) and a thread writes that layer's pages; vLLM's attention for layer i waits only for
    layer i (``wait``). Any failure fails every piece from the first one not fully written."""

    def __init__(self, connector: "KVStoreConnector", client: KVStoreClient, pieces: list[ChunkLoad], slot: int) -> None:
        self.connector = connector
        self.pieces = pieces
        layers = connector.namespace.layout.num_layers
        self.ready = [threading.Event() for _ in range(layers)]
        self.failed = False
        self._stack = contextlib.ExitStack()
        self._thread: threading.Thread | None = None
        try:
            stream = self._stack.enter_context(client.fetch_layers([p.key for p in pieces], slot))
            layout = connector.namespace.layout
            for piece, block in zip(pieces, stream.blocks):
                if block is None or block.tokens != piece.tokens or block.layout != layout or block.codec != "raw":
                    raise LookupError(f"block {piece.key.hex()} vanished or is not a raw block of this layout")
        except Exception as exc:  # noqa: BLE001
            self._fail("get", exc)
            return
        self._thread = threading.Thread(target=self._run, args=(stream,), name="kvstore-layer-load", daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        paged = self.connector.paged
        jobs = [(fetched_tensor(block)[:, :, :, p.lo : p.hi], paged.slots(p.span)) for p, block in zip(self.pieces, stream.blocks)]
        began = time.perf_counter()
        try:
            for layer in stream:
                for tensor, slots in jobs:
                    paged.write_layers(tensor, slots, layer)
                self.ready[layer].set()
            if not all(event.is_set() for event in self.ready):
                raise LookupError("the daemon's layer stream ended early")
        except Exception as exc:  # noqa: BLE001
            self._fail("get", exc)
        self.connector.load_copy_s += time.perf_counter() - began

    def _fail(self, what: str, exc: BaseException) -> None:
        self.failed = True
        self.connector.cache.failed(what, exc)
        for event in self.ready:
            event.set()  # never leave the forward waiting; the pages are reported failed

    def wait(self, layer: int) -> None:
        if not self.ready[layer].wait(self.connector.settings.timeout_s):
            self._fail("get", TimeoutError(f"layer {layer} not loaded within {self.connector.settings.timeout_s} s"))

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join(self.connector.settings.timeout_s)
            if self._thread.is_alive():
                self._fail("get", TimeoutError("the layer-wise load did not finish"))
        self._stack.close()
        connector = self.connector
        if self.failed:
            for piece in self.pieces:
                connector._failed_pages.update(piece.span.page_ids)
        else:
            connector.loaded_chunks += len(self.pieces)
            connector.load_bytes += sum(connector.namespace.layout.block_bytes(p.hi - p.lo) for p in self.pieces)
            connector.cache.ok()


class KVStoreEvents(KVConnectorKVEvents):
    """The KV events of pieces the worker stored, carried to the scheduler in vLLM's connector
    output (one worker: tensor and pipeline parallelism are 1)."""

    def __init__(self, events: list | None = None) -> None:
        self._events = list(events or [])

    def add_events(self, events: list) -> None:
        self._events.extend(events)

    def aggregate(self) -> "KVStoreEvents":
        return self

    def increment_workers(self, count: int = 1) -> None:
        return

    def get_all_events(self) -> list:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return 1

    def clear_events(self) -> None:
        self._events.clear()


def stored_event(request: "Request", piece_start: int, piece_end: int, page_tokens: int, tier: str):
    """vLLM's ``BlockStored`` for a piece kvstore now holds, in vLLM's own page hashes (a router
    matches them to its own); None when the request has no hashes for those pages (vLLM computes
    them only with its prefix cache on) or the piece does not cover whole pages."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    first, last = piece_start // page_tokens, piece_end // page_tokens
    hashes = list(getattr(request, "block_hashes", ()) or ())
    if len(hashes) < last or piece_start % page_tokens or piece_end % page_tokens:
        return None
    medium = {"gpu": "GPU", "cpu": "CPU"}.get(tier, "STORAGE")
    return BlockStored(block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
                       parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                       token_ids=list(request.prompt_token_ids[piece_start:piece_end]), block_size=page_tokens,
                       lora_id=None, medium=medium, lora_name=None, ownership=f"kvstore/{tier}")


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`StepPlan`, sent from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVStoreConnector(KVConnectorBase_V1):
    """Prefix KV from and to the kvstore daemon; see the module docstring for the hooks' roles."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a later miss, not a lost hand-off

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(
            dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}))
        self.namespace = vllm_namespace(vllm_config, self.settings)
        self.page_tokens = vllm_config.cache_config.block_size
        # prefill/decode through the cache: a producer stores what it computes before its request
        # returns; a consumer only loads; kv_both does both, storing in the background
        self.kv_role = vllm_config.kv_transfer_config.kv_role or "kv_both"
        mode = self.settings.save_mode
        self.save_mode = ("sync" if self.kv_role == "kv_producer" else "async") if mode == "auto" else mode
        self.cache = self._daemon_cache(role)
        log.info("KVStoreConnector (%s): model %s, %s, address %s", role.name, self.namespace.model_id,
                 self.namespace.layout, self.cache.address)
        if role == KVConnectorRole.SCHEDULER:
            self.planner = Planner(self.namespace, self.page_tokens, tails=self.settings.tail_blocks,
                                   saves=self.kv_role != "kv_consumer")
            # every request being served: its cached-token count is corrected after a failed load,
            # and its page hashes name the pieces it stores in vLLM's KV events
            self._requests: dict[str, "Request"] = {}
            events = vllm_config.kv_events_config
            self._events_on = bool(events is not None and events.enable_kv_cache_events)
            self._events: list = []  # stored pieces reported by the worker, for take_events
            # request -> (page ids, load start, end, step outputs seen): kept for two step outputs
            # (the load's step and, with async scheduling, the one before it)
            self._loading: dict[str, list] = {}
            # blend requests: request -> (spec, vLLM's own hit), then the loads planned for the next step
            self._blends: dict[str, tuple[BlendSpec, int]] = {}
            self._blend_loads: list[BlendLoad] = []
            model_config = vllm_config.model_config
            self._blend_requests = BlendRequests(self.settings.blend_separator,
                                                 model_config.tokenizer or model_config.model,
                                                 self.settings.blend_max_passages, log)
            self._trace = (AccessTrace(self.settings.trace_file, self.namespace.layout, self.namespace.chunk_tokens)
                           if self.settings.trace_file else None)
        else:
            self.paged: PagedKV | None = None
            self.loaded_chunks = 0
            self.saved_chunks = 0
            self.dropped_chunks = 0  # completed chunks not saved (daemon down, or the save queue full)
            self.load_copy_s = 0.0   # time in the page writes of loads (after the Get)
            self.load_s = 0.0        # time in start_load_kv's loads, Gets included
            self.load_bytes = 0
            self._failed_pages: set[int] = set()
            self._layer_index: dict[str, int] = {}
            self._stored_events: list = []  # BlockStored of pieces Put since the last step (save thread appends)
            self._layerwise: LayerwiseLoad | None = None  # this step's layer-wise load, until wait_for_save
            self.blender: VllmBlender | None = None  # set in register_kv_caches unless blend is off
            self._blend_stores: list = []  # passages a blend computed alone, stored after the forward
        self.cache.client()  # connect (and map the arena) now, not on the first request

    def _daemon_cache(self, role: KVConnectorRole) -> PrefixCache:
        """The guarded daemon link: connected lazily, stepping aside ``retry_s`` after a failure.
        The worker moves blocks through a shared-memory arena; the scheduler moves none, and on a
        unix socket registers a 1 MiB arena only to map the daemon's key index, so its per-step
        Lookups need no round trip."""
        settings = self.settings
        address = settings.address or default_listen()
        worker = role == KVConnectorRole.WORKER
        arena_bytes = settings.arena_bytes if worker else 2**20

        def connect() -> KVStoreClient:
            client = KVStoreClient(address, shared_memory=True if worker else None, arena_bytes=arena_bytes,
                                   timeout=settings.timeout_s, token_file=settings.token_file or None,
                                   tls_ca=settings.tls_ca or None, tls_cert=settings.tls_cert or None,
                                   tls_key=settings.tls_key or None, tls_server_name=settings.tls_server_name,
                                   insecure=settings.insecure)
            try:
                client.check(timeout=settings.timeout_s)  # why it cannot be used, in the outage's one line
            except BaseException:
                client.close()
                raise
            return client

        return PrefixCache(None, self.namespace, connect=connect, retry_s=settings.retry_s, address=address,
                           max_queued=settings.save_queue_chunks, logger=log)

    # ==== scheduler side ======================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        request_id = request.request_id
        spec = self._blend_spec(request)
        self._blends.pop(request_id, None)  # a request asked again (preempted, or the daemon went down)
        if spec is not None:  # a blend: the worker writes every token before the query
            self._blends[request_id] = (spec, num_computed_tokens)
            self._requests[request_id] = request
            return max(0, spec.cached_tokens - num_computed_tokens), False
        started = time.perf_counter()
        keys = self.planner.keys_of(request_id, prompt)
        hits, tiers = 0, ()
        found = self.cache.lookup(keys)  # the local key index: no round trip
        if found is not None and found.hits and self.settings.lease_s > 0 \
                and self.planner.record_hit(request_id, found.hits, num_computed_tokens) > 0:
            # a hit vLLM will load: confirm it and keep it from eviction until the load
            found = self.cache.lookup(keys[: found.hits], lease_s=self.settings.lease_s)
        if found is not None:
            hits, tiers = found.hits, found.tiers
        first = request_id not in self._requests  # vLLM asks again while a request waits for pages
        self._requests[request_id] = request
        tokens = self.planner.record_hit(request_id, hits, num_computed_tokens, tiers)
        if self._trace is not None and first:
            self._trace.record(request_id, keys, self.planner.requests[request_id].tail, num_computed_tokens,
                               hits, tiers, time.perf_counter() - started)
        return tokens, False

    def _blend_spec(self, request: "Request") -> BlendSpec | None:
        """The blend a request asks for (``kv_transfer_params``, or ``blend_separator`` in its
        text; ``BlendRequests``), or None: it asks for none, blend is off, it cannot be blended
        (logged once, served as a plain prompt), or the daemon is down (then blending would compute
        every passage alone: vLLM's own prefill is faster)."""
        if self.settings.blend == "off":
            return None
        prompt = request.prompt_token_ids
        spec = self._blend_requests.spec(request.request_id, prompt, getattr(request, "kv_transfer_params", None))
        if spec is None:
            return None
        # the daemon must answer (a client is made before any call, so a down daemon shows only in
        # a call): one Lookup of the passages' keys, from the local key index on a unix socket
        prefix, passages, _, _ = spec.parts(prompt)
        if self.cache.lookup([chunk_key(self.namespace, p) for p in ([prefix] if prefix else []) + passages]) is None:
            return None
        return spec

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        sources: dict[CacheHitSource, int] = {}
        if num_external_tokens > 0 and request.request_id in self.planner.requests:
            for tier, tokens in self.planner.hit_sources(request.request_id, num_external_tokens).items():
                source = _HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
                sources[source] = sources.get(source, 0) + tokens
        return sources

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        blend = self._blends.get(request.request_id)
        if blend is not None and num_external_tokens > 0:
            spec, start = blend
            page_ids = blocks.get_block_ids()[0]
            end = start + num_external_tokens
            self._blend_loads.append(BlendLoad(request.request_id, tuple(request.prompt_token_ids), spec, start,
                                               PagedSpan.of(page_ids, self.page_tokens, start, end)))
            self._loading[request.request_id] = [list(page_ids), start, end, 0]
        elif num_external_tokens > 0:
            page_ids = blocks.get_block_ids()[0]
            self.planner.plan_load(request.request_id, page_ids, num_external_tokens)
            start = self.planner.requests[request.request_id].local_tokens
            self._loading[request.request_id] = [list(page_ids), start, start + num_external_tokens, 0]

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        scheduled = [(req.req_id, req.num_computed_tokens) for req in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens))
        counts = scheduler_output.num_scheduled_tokens
        block_state = scheduler_output.kv_connector_block_state

        def page_ids_of(request_id: str) -> list[int]:
            block_ids = block_state.get_block_ids(request_id) if block_state is not None else None
            if block_ids is None:
                raise RuntimeError(f"vLLM gave no page table for request {brief(request_id)}")
            return block_ids[0]

        if scheduler_output.preempted_req_ids:
            log.info("KVStoreConnector: %d requests preempted; their stored pieces are hits when they resume",
                     len(scheduler_output.preempted_req_ids))
        def event_of(request_id: str, start: int, end: int):
            request = self._requests.get(request_id)
            return stored_event(request, start, end, self.page_tokens, self.settings.event_tier) if request else None

        plan = self.planner.plan_step([(rid, before, counts.get(rid, 0)) for rid, before in scheduled], page_ids_of,
                                      event_of if self._events_on else None)
        plan.blends, self._blend_loads = self._blend_loads, []
        return KVStoreConnectorMetadata(plan)

    def take_events(self):
        events, self._events = self._events, []
        yield from events

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """After a step: for a load that failed, vLLM recomputes from the first failed page; make
        its cached-token count say so, and save the recomputed pieces."""
        if connector_output.kv_cache_events is not None:
            self._events.extend(connector_output.kv_cache_events.get_all_events())
        invalid = connector_output.invalid_block_ids or set()
        for request_id, entry in list(self._loading.items()):
            page_ids, start, end, seen = entry
            entry[3] = seen + 1
            if entry[3] >= 2:
                del self._loading[request_id]
            page = self.page_tokens
            failed = [i for i in range(start // page, (end + page - 1) // page) if page_ids[i] in invalid]
            if not failed:
                continue
            self._loading.pop(request_id, None)
            kept = failed[0] * page  # vLLM truncates the computed tokens at the first failed page
            self.planner.lost(request_id, kept)
            request = self._requests.get(request_id)
            stats = getattr(request, "prefill_stats", None) if request is not None else None
            if stats is not None and hasattr(stats, "set"):
                local = stats.num_local_cached_tokens
                stats.set(num_prompt_tokens=stats.num_prompt_tokens, num_local_cached_tokens=local,
                          num_external_cached_tokens=max(0, kept - local))
            log.warning("KVStoreConnector: request %s loaded %d of %d hit tokens; vLLM computes the rest",
                        brief(request_id), max(0, kept - start), end - start)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.forget(request.request_id)
        self._requests.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._blends.pop(request.request_id, None)
        self._blend_requests.forget(request.request_id)
        return False, None  # saves copy their pages within the step: vLLM may free them now

    # ==== worker side =========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.platforms import current_platform

        layout = self.namespace.layout
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != layout.num_layers:
            raise ValueError(f"vLLM has {len(names)} KV-cache layers, the namespace {layout.num_layers}")
        caches = [kv_caches[name] for name in names]
        if caches[0].dtype != self.namespace_dtype:
            raise ValueError(f"vLLM's KV cache is {caches[0].dtype}, the namespace says {layout.dtype}")
        kernel_tokens = caches[0].shape[2]
        if current_platform.is_cpu():
            if not all(cache.is_contiguous() for cache in caches):
                raise ValueError("KVStoreConnector expects CPU KV caches laid out [pages, kv_heads, page_tokens, 2*head_dim]")
            isa = self._cpu_isa(names[0], kernel_tokens)
            write = cpu_cache_write(isa)
            page_layout = measure_page_layout(write, layout.num_kv_heads, kernel_tokens, layout.head_dim, caches[0].dtype)
            native = self._native_writer(caches, page_layout)
            log.info("KVStoreConnector: CPU attention ISA %s, page layout %s; page writes by %s", isa,
                     page_layout.name() or "measured", "kvstore's native writer" if native else "vLLM's cache-write op")
        else:
            page_layout, write, native = PageLayout.split(kernel_tokens, layout.head_dim), split_cache_write, None
        self.paged = PagedKV(caches, page_layout, layout.num_kv_heads, self.page_tokens, write=write, native=native)
        self._layer_index = {name: i for i, name in enumerate(names)}
        if self.settings.blend != "off":
            settings = self.settings
            vllm_model = None
            if settings.blend_weights == "vllm":
                attention = self._vllm_config.compilation_config.static_forward_context.get(names[0])

                def vllm_model():
                    from engine_adapter.vllm.model_view import find_vllm_model

                    return None if attention is None else find_vllm_model(names[0], attention)

            self.blender = VllmBlender(self._vllm_config.model_config.model, self.namespace_dtype, self.cache,
                                       self.namespace, settings.blend_ratio, settings.blend_selector,
                                       settings.blend_controller, device=caches[0].device, vllm_model=vllm_model)
            if settings.blend == "start":
                self.blender.engine()

    def _native_writer(self, caches: list[torch.Tensor], page_layout: PageLayout) -> PageWriter | None:
        """The native page writer for these CPU caches, or None (turned off, a layout it does not
        know, or no C compiler: then vLLM's own op writes the pages)."""
        name = page_layout.name()
        if not self.settings.native_copy or name is None:
            return None
        try:
            return PageWriter(caches, name)
        except (RuntimeError, ValueError) as exc:
            log.warning("KVStoreConnector: native page writer unavailable (%s); vLLM's cache-write op writes pages", exc)
            return None

    def _cpu_isa(self, layer_name: str, kernel_tokens: int) -> str:
        """The ISA the CPU attention backend chose for this model (it packs pages by it)."""
        layer = self._vllm_config.compilation_config.static_forward_context.get(layer_name)
        isa = getattr(layer, "isa", None)
        if isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(self.namespace_dtype, kernel_tokens, self.namespace.layout.head_dim,
                                self._vllm_config.cache_config.cache_dtype)
        return isa

    @property
    def namespace_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.namespace.layout.dtype]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        plan: StepPlan = self._get_connector_metadata().plan
        began = time.perf_counter()
        pieces = [chunk for chunks in plan.loads.values() for chunk in chunks]
        if self.settings.layerwise and pieces and self._start_layerwise(pieces):
            self.load_s += time.perf_counter() - began
            return
        for chunks in plan.loads.values():
            self._load(chunks)
        for blend in plan.blends:
            self._blend(blend)
        self.load_s += time.perf_counter() - began

    def _blend(self, load: BlendLoad) -> None:
        """Blend one request into its pages; on any failure its pages are reported failed (vLLM
        recomputes them) and the request is served as a plain prompt."""
        try:
            if self.blender is None or self.paged is None:
                raise RuntimeError("blend is off in this worker")
            blended = self.blender.run(load, self.paged)
        except Exception as exc:  # noqa: BLE001 - a blend that fails is a prefill, never a failed request
            log.warning("KVStoreConnector: blend of request %s failed (%s: %s); vLLM prefills it",
                        brief(load.request_id), type(exc).__name__, exc)
            self._failed_pages.update(load.span.page_ids)
            return
        self._blend_stores.extend(blended.missing)

    def _start_layerwise(self, pieces: list[ChunkLoad]) -> bool:
        """Start this step's loads layer by layer (GetLayers, then a thread writing each layer's
        pages as it lands); False when they do not fit the arena at once (then they load whole)."""
        client = self.cache.client()
        if client is None or self.paged is None:
            return False
        slot = fetch_slot_bytes(self.namespace.layout, self.namespace.chunk_tokens)
        if len(pieces) > client.max_fetch_blocks(slot):
            return False
        self._layerwise = LayerwiseLoad(self, client, pieces, slot)
        return True

    def _load(self, chunks: list[ChunkLoad]) -> None:
        """Load one request's pieces in order; the pages of any piece not loaded are reported failed."""
        layout = self.namespace.layout
        loaded = 0

        def take(index: int, block) -> bool:
            nonlocal loaded
            chunk = chunks[index]
            if block is None or block.tokens != chunk.tokens or block.layout != layout:
                log.info("KVStoreConnector: block %s vanished or has another layout", chunk.key.hex())
                return False
            tensor = fetched_tensor(block)  # [L, 2, H, n, D]; a view of the arena for raw
            began = time.perf_counter()
            self.paged.scatter(tensor[:, :, :, chunk.lo : chunk.hi], chunk.span)
            self.load_copy_s += time.perf_counter() - began
            self.load_bytes += layout.block_bytes(chunk.hi - chunk.lo)
            loaded += 1
            return True

        if self.paged is not None:
            self.cache.fetch_blocks([c.key for c in chunks], fetch_slot_bytes(layout, self.namespace.chunk_tokens), take)
        self.loaded_chunks += loaded
        for chunk in chunks[loaded:]:
            self._failed_pages.update(chunk.span.page_ids)

    def get_kv_connector_kv_cache_events(self) -> KVStoreEvents | None:
        if not self._stored_events:
            return None
        events, self._stored_events = self._stored_events, []  # a swap: the save thread appends to the new list
        return KVStoreEvents(events)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_pages = self._failed_pages, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layerwise is not None:  # otherwise loads finished in start_load_kv
            self._layerwise.wait(self._layer_index.get(layer_name, self.namespace.layout.num_layers - 1))

    def _finish_layerwise(self) -> None:
        if self._layerwise is not None:
            self._layerwise.finish()
            self._layerwise = None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # pieces are saved whole, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self._finish_layerwise()  # before vLLM asks for load errors
        if self._blend_stores:  # passages blends computed alone, stored now that the forward is done
            stores, self._blend_stores = self._blend_stores, []
            self.cache.store_blocks_async(len(stores), stores.__getitem__)
        if not self.has_connector_metadata() or self.paged is None:
            return
        saves = self._get_connector_metadata().plan.saves
        if not saves:
            return
        if self.cache.client() is None:
            self.dropped_chunks += len(saves)
            return
        if self.save_mode != "async":  # stored before this step ends (and its request returns)
            copies = [(save.key, *self.paged.copy_pages(save.span), save.event, save.parent) for save in saves]
            self._saved(copies, len(copies) if self.cache.put(self._blocks(copies), self.save_mode == "durable") else 0)
            return
        room = self.cache.store_room()
        self.dropped_chunks += max(0, len(saves) - room)
        # a plain copy of the pages (vLLM may reuse them after this step); the store thread permutes
        copies = [(save.key, *self.paged.copy_pages(save.span), save.event, save.parent) for save in saves[:room]]
        self.cache.store_blocks_async(len(copies), lambda i: self._blocks(copies[i : i + 1])[0],
                                      stored=lambda n: self._saved(copies, n))

    def _blocks(self, copies: list) -> list:
        """Copied pages ``(key, pages, span, event, parent)`` as blocks ``(key, tokens, payload, parent)``."""
        return [(key, span.tokens, self.paged.block_of_pages(pages, span), parent)
                for key, pages, span, _, parent in copies]

    def _saved(self, copies: list, stored: int) -> None:
        """The daemon took the first ``stored`` of ``copies``: counted, their events reported."""
        self.saved_chunks += stored
        self.dropped_chunks += len(copies) - stored
        self._stored_events.extend(copy[3] for copy in copies[:stored] if copy[3] is not None)

    def shutdown(self) -> None:
        self.cache.close(timeout=30.0)  # after the chunks already queued
        if self.role == KVConnectorRole.SCHEDULER and self._trace is not None:
            self._trace.close()
        if self.role == KVConnectorRole.WORKER:
            log.info("KVStoreConnector worker: loaded %d pieces (%.1f MB, page writes %.1f ms, loads %.1f ms in all), "
                     "saved %d, dropped %d, daemon errors %d in %d outages; blended %d requests (%.1f ms)",
                     self.loaded_chunks, self.load_bytes / 1e6, self.load_copy_s * 1e3, self.load_s * 1e3,
                     self.saved_chunks, self.dropped_chunks, self.cache.errors, self.cache.outages,
                     self.blender.blended if self.blender else 0, (self.blender.seconds if self.blender else 0) * 1e3)
