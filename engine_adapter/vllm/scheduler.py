"""The connector's scheduler side (vLLM's engine-core process): what to load, what to save.

``KVStoreConnector`` (connector.py) builds one in the scheduler's role and forwards these hooks::

    get_num_new_matched_tokens  keys of prompt[:-1] (plan.py), the daemon's shared key index (no round
                                trip); a hit vLLM will load is leased (one Lookup RPC, lease_s, sent
                                off this thread: leases.py); a blend request (blend.py) reports every
                                token before its query
    update_state_after_alloc    which block rows go to which vLLM pages; a blend's pages
    build_connector_meta        this step's loads, saves and blends: a StepPlan for the workers
    update_connector_output     a load that failed: vLLM's cached-token count corrected; the
                                workers' KV events kept for take_events
    request_finished            the request's state dropped

It moves no KV itself: the worker side (worker.py) does, from the plan. ``warm_up`` (when the
connector is built) makes one empty local Lookup and one empty leasing Lookup, so the first
request's are as fast as any later one's; the first hit's lookup and lease times (the lease's:
queueing it) are logged once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_adapter.client.prefix_cache import PrefixCache
from engine_adapter.vllm.blend import BlendRequest, BlendRequests, BlendSpec, brief
from engine_adapter.vllm.layout import PagedSpan
from engine_adapter.vllm.leases import Leases
from engine_adapter.vllm.plan import Planner, StepPlan
from engine_adapter.vllm.trace import AccessTrace
from kvstore.keys import Namespace, chunk_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from engine_adapter.vllm.settings import ConnectorSettings

log = logging.getLogger("vllm.kvstore_connector")

# daemon tier -> where vLLM's metrics say the hit came from
_HIT_SOURCES = {"gpu": CacheHitSource.DEVICE, "cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`StepPlan`, sent from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class LoadWatch:
    """A load whose outcome the scheduler waits for: pages ``page_ids`` get tokens ``start .. end - 1``.
    Kept for two step outputs (the load's step and, with async scheduling, the one before it)."""

    page_ids: list[int]
    start: int
    end: int
    outputs_seen: int = 0


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
                       lora_id=None, medium=medium, lora_name=None)


class ConnectorScheduler:
    """The scheduler side's state: each request's keys, hit and plan, its blend, the loads whose
    outcome is not yet known, the KV events the workers reported, and the access trace."""

    def __init__(self, vllm_config: "VllmConfig", settings: "ConnectorSettings", namespace: Namespace,
                 cache: PrefixCache) -> None:
        self.settings = settings
        self.namespace = namespace
        self.cache = cache
        self.leases = Leases(lambda keys, lease_s: cache.lookup(keys, lease_s=lease_s))
        self.page_tokens = vllm_config.cache_config.block_size
        # a consumer (prefill/decode through the cache) only loads
        kv_role = vllm_config.kv_transfer_config.kv_role or "kv_both"
        self.planner = Planner(namespace, self.page_tokens, tails=settings.tail_blocks, saves=kv_role != "kv_consumer")
        # every request being served: its cached-token count is corrected after a failed load,
        # and its page hashes name the pieces it stores in vLLM's KV events
        self._requests: dict[str, "Request"] = {}
        events = vllm_config.kv_events_config
        self._events_on = bool(events is not None and events.enable_kv_cache_events)
        self._events: list = []  # stored pieces reported by the worker, for take_events
        self._loading: dict[str, LoadWatch] = {}
        # blend requests, then those whose pages are allocated, planned for the next step
        self._blends: dict[str, BlendRequest] = {}
        self._blend_loads: list[BlendRequest] = []
        model_config = vllm_config.model_config
        self._blend_requests = BlendRequests(settings.blend_separator, model_config.tokenizer or model_config.model,
                                             settings.blend_max_passages, log)
        self._trace = (AccessTrace(settings.trace_file, namespace.layout, namespace.chunk_tokens)
                       if settings.trace_file else None)
        self.warm_up_ms: dict[str, float] = {}  # what `warm_up` did, and how long each took
        self.first_hit_ms: dict[str, float] | None = None  # the first request with a hit: lookup, lease

    def warm_up(self) -> None:
        """Pay the lookups' one-time costs before the first request (outside its TTFT): an empty
        Lookup from the daemon's key index and an empty leasing Lookup RPC (the first leasing call
        of a process took 18 ms here, later ones under 1 ms). Neither names a key, so the daemon's
        lookup counts are unchanged. A failure is skipped: the first request meets it, guarded."""
        client = self.cache.client()
        if client is None:
            return
        steps = [("lookup", lambda: client.lookup([]))]
        if self.settings.lease_s > 0:
            steps.append(("lease", lambda: client.lookup([], lease_s=self.settings.lease_s)))
        for step, call in steps:
            began = time.perf_counter()
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - a warm-up never fails the scheduler
                log.debug("KVStoreConnector: warm-up %s failed (%s)", step, exc)
                continue
            self.warm_up_ms[step] = (time.perf_counter() - began) * 1e3
        log.info("KVStoreConnector scheduler: lookups warmed before the first request (%s)",
                 ", ".join(f"{step} {ms:.1f} ms" for step, ms in self.warm_up_ms.items()))

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        request_id = request.request_id
        spec = self._blend_spec(request)
        self._blends.pop(request_id, None)  # a request asked again (preempted, or the daemon went down)
        if spec is not None:  # a blend: the worker writes every token before the query
            self._blends[request_id] = BlendRequest.of(request_id, prompt, spec, num_computed_tokens,
                                                       self.settings.default_blend_ratio, self.settings.blend_selector)
            self._requests[request_id] = request
            return max(0, spec.cached_tokens - num_computed_tokens), False
        started = time.perf_counter()
        keys = self.planner.keys_of(request_id, prompt)
        hits, tiers = 0, ()
        asked = time.perf_counter()
        found = self.cache.lookup(keys)  # the local key index: no round trip
        looked = time.perf_counter()
        leased = None
        if found is not None and found.hits and self.settings.lease_s > 0 \
                and self.planner.loadable(request_id, found.hits, num_computed_tokens) > 0:
            # a hit vLLM will load: kept from eviction until the load, by a lease sent off this thread
            self.leases.lease(request_id, keys[: found.hits], self.settings.lease_s)
            leased = time.perf_counter()
        if self.first_hit_ms is None and found is not None and found.hits:
            self.first_hit_ms = {"keys": (asked - started) * 1e3, "lookup": (looked - asked) * 1e3}
            if leased is not None:
                self.first_hit_ms["lease"] = (leased - looked) * 1e3
            log.info("KVStoreConnector scheduler: first hit: %s",
                     ", ".join(f"{step} {ms:.1f} ms" for step, ms in self.first_hit_ms.items()))
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
            page_ids = blocks.get_block_ids()[0]
            start, end = blend.hit, blend.hit + num_external_tokens
            self._blend_loads.append(replace(blend, span=PagedSpan.of(page_ids, self.page_tokens, start, end)))
            self._loading[request.request_id] = LoadWatch(list(page_ids), start, end)
        elif num_external_tokens > 0:
            page_ids = blocks.get_block_ids()[0]
            self.planner.plan_load(request.request_id, page_ids, num_external_tokens)
            start = self.planner.requests[request.request_id].local_tokens
            self._loading[request.request_id] = LoadWatch(list(page_ids), start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
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

        def tokens_of(request_id: str, start: int, end: int) -> list[int] | None:
            request = self._requests.get(request_id)
            return list(request.all_token_ids[start:end]) if request is not None else None

        plan = self.planner.plan_step([(rid, before, counts.get(rid, 0)) for rid, before in scheduled], page_ids_of,
                                      event_of if self._events_on else None, tokens_of)
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
        for request_id, watch in list(self._loading.items()):
            watch.outputs_seen += 1
            if watch.outputs_seen >= 2:
                del self._loading[request_id]
            page = self.page_tokens
            failed = [i for i in range(watch.start // page, (watch.end + page - 1) // page)
                      if watch.page_ids[i] in invalid]
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
                        brief(request_id), max(0, kept - watch.start), watch.end - watch.start)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.forget(request.request_id)
        self.leases.forget(request.request_id)
        self._requests.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._blends.pop(request.request_id, None)
        self._blend_requests.forget(request.request_id)
        return False, None  # saves copy their pages within the step: vLLM may free them now

    def shutdown(self) -> None:
        self.leases.stop()
        self.cache.close(timeout=30.0)
        if self._trace is not None:
            self._trace.close()
