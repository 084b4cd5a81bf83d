"""KVStoreConnector: vLLM's v1 KV connector backed by the kvstore daemon.

Start vLLM with it (README: "Using kvstore with vLLM")::

    LLM(model=folder, dtype="bfloat16", kv_transfer_config=KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="engine_adapter.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"address": "unix:/run/kvstore.sock"}))

vLLM builds two instances, one per role: the scheduler side (in the engine-core process) and the
worker side (in each worker process). Each builds its role's object and forwards its hooks to it:
``ConnectorScheduler`` (scheduler.py) or ``ConnectorWorker`` (worker.py); the other role's hooks
have nothing to call. A request's path through them:

    1. keys     get_num_new_matched_tokens  keys of prompt[:-1]: full chunks as the reference engine
                                            computes them, then a tail block up to the last page
    2. lookup                               the daemon's shared key index (no round trip); a hit
                                            vLLM will load is leased (one Lookup RPC, lease_s, sent
                                            off the scheduler's thread: leases.py) so eviction
                                            cannot take it before the load; returns the hit tokens
                                            beyond vLLM's own prefix-cache hit
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

Steps 1-3 are the scheduler side's, 4 and 6 the worker side's, which gets step 3's plan as vLLM's
connector metadata.

A request with ``{"kvstore_blend": ...}`` in its ``kv_transfer_params``, or whose prompt text marks
its passages with ``blend_separator``, is blended instead (CacheBlend: RAG passages reused at any
position; ``engine_adapter/vllm/blend.py``): every token before its query is an external hit, which
the worker writes with ``BlendEngine.prefill`` over vLLM's own layers (or a copy of the weights).

A daemon that is down, slow or wrong costs misses, never a failed request: every call goes through
the engines' shared guard (engine_adapter/client/prefix_cache.py: counted, each outage and each recovery
logged once, a failed connection retried after ``retry_s``). A block that vanishes between Lookup
and Get is reported to vLLM as a failed load (``get_block_ids_with_load_errors``) and the request's
cached-token count is corrected; with ``kv_load_failure_policy="recompute"`` vLLM then computes
those tokens (its default, "fail", fails the request).

Limits: one KV-cache group of full attention (Llama-family models), tensor and pipeline
parallelism 1 (a block holds every layer and head), KV cache dtype "auto".
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.client.prefix_cache import STORE_LAG_S, PrefixCache
from engine_adapter.reference.loader import hf_rope
from engine_adapter.vllm.plan import StepPlan
from engine_adapter.vllm.scheduler import ConnectorScheduler
from engine_adapter.vllm.settings import ConnectorSettings
from engine_adapter.vllm.worker import ConnectorWorker, KVStoreEvents
from kvstore.connect import ClientSettings, client_settings
from kvstore.dtypes import TORCH_DTYPE_NAMES
from kvstore.keys import KVLayout, Namespace

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "daemon_cache", "vllm_namespace"]

# A child of vLLM's logger: the connector's lines go wherever vLLM's go, at vLLM's level.
log = logging.getLogger("vllm.kvstore_connector")


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


def daemon_cache(settings: ConnectorSettings, namespace: Namespace, role: KVConnectorRole) -> PrefixCache:
    """The guarded daemon link: connected lazily, stepping aside ``retry_s`` after a failure.
    The worker moves blocks through a shared-memory arena; the scheduler moves none, and on a
    unix socket registers a 1 MiB arena only to map the daemon's key index, so its per-step
    Lookups need no round trip."""
    def link() -> ClientSettings:  # again at each connection: a token file rotated meanwhile is read anew
        return client_settings(settings.address or None, None, settings.token_file or None, settings.tls_ca or None,
                               settings.tls_cert or None, settings.tls_key or None, settings.tls_server_name or None,
                               settings.insecure or None, config_file=settings.config_file or None)

    address = link().address  # a setting that cannot be used fails the connector's start, in one line
    worker = role == KVConnectorRole.WORKER
    arena_bytes = settings.arena_bytes if worker else 2**20

    def connect() -> KVStoreClient:
        client = KVStoreClient(settings=link(), shared_memory=True if worker else None, arena_bytes=arena_bytes,
                               timeout=settings.timeout_s)
        try:
            client.check(timeout=settings.timeout_s)  # why it cannot be used, in the outage's one line
        except BaseException:
            client.close()
            raise
        return client

    return PrefixCache(None, namespace, connect=connect, retry_s=settings.retry_s, address=address,
                       max_queued=settings.save_queue_chunks, max_lag_s=STORE_LAG_S, logger=log)


class KVStoreConnector(KVConnectorBase_V1):
    """Prefix KV from and to the kvstore daemon: this role's object (``scheduler`` or ``worker``;
    the other is None) does the work; see the module docstring for the hooks' roles."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a later miss, not a lost hand-off

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = ConnectorSettings.from_extra_config(dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}))
        namespace = vllm_namespace(vllm_config, settings)
        cache = daemon_cache(settings, namespace, role)
        log.info("KVStoreConnector (%s): model %s, %s, address %s", role.name, namespace.model_id, namespace.layout,
                 cache.address)
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = ConnectorScheduler(vllm_config, settings, namespace, cache)
        else:
            self.worker = ConnectorWorker(vllm_config, settings, namespace, cache)
        # connect now, not on the first request: the channel, the token check, on a unix socket the
        # arena (registered and prefaulted) and the daemon's key index
        began = time.perf_counter()
        connected = cache.client() is not None
        log.info("KVStoreConnector (%s): %s in %.1f ms", role.name,
                 "connected to the daemon" if connected else "daemon not reached", (time.perf_counter() - began) * 1e3)
        if self.scheduler is not None:
            self.scheduler.warm_up()

    def _plan(self) -> StepPlan | None:
        """This step's plan from the scheduler side (vLLM binds it before the forward), or None."""
        return self._get_connector_metadata().plan if self.has_connector_metadata() else None

    # ==== scheduler side: ConnectorScheduler ==================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def take_events(self):
        return self.scheduler.take_events()

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ==== worker side: ConnectorWorker ========================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # pieces are saved whole, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._plan())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVStoreEvents | None:
        return self.worker.get_kv_connector_kv_cache_events()

    # ==== both ================================================================================

    def shutdown(self) -> None:
        (self.scheduler or self.worker).shutdown()
