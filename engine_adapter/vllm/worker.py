"""The connector's worker side (each vLLM worker process): KV between the daemon and vLLM's pages.

``KVStoreConnector`` (connector.py) builds one in the worker's role and forwards these hooks, with
the step's plan from the scheduler side (scheduler.py)::

    register_kv_caches    vLLM's pages: their layout measured (CPU) and the page writer chosen;
                          the blend's model found (blend.py, model_view.py); the load path warmed
                          (`warm_up`: an empty Get through the arena, a page write into a scratch
                          page), so a fresh worker's first hit pays none of it
    start_load_kv         Get through the shared-memory arena, then the pages are written before the
                          forward: on CPU by kvstore's native page writer (kernels/page_copy.c), else
                          by the backend's own cache-write op with a slot mapping (layerwise: one
                          layer at a time, awaited in wait_for_layer_load); then the step's blends
    wait_for_save         copy the whole pages of each completed piece (one index_select per layer);
                          a thread reorders them into a block and Puts it (save_mode async), or the
                          step does (sync / durable, e.g. a kv_producer)
    get_block_ids_with_load_errors / get_kv_connector_kv_cache_events
                          pages that failed to load (vLLM recomputes them); pieces stored, as KV events
    shutdown              queued saves finished; one line of counts
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_events import KVConnectorKVEvents

from engine_adapter.client.blocks import BlockToPut
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.client.prefix_cache import PrefixCache, fetch_slot_bytes, fetched_tensor
from engine_adapter.vllm.blend import BlendRequest, VllmBlender, brief
from engine_adapter.vllm.layout import PagedKV, PageLayout, cpu_cache_write, measure_page_layout, split_cache_write
from engine_adapter.vllm.plan import ChunkLoad, StepPlan
from kernels.page_copy import PageWriter
from kvstore.dtypes import TORCH_DTYPES
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from engine_adapter.vllm.settings import ConnectorSettings

log = logging.getLogger("vllm.kvstore_connector")


def _find_vllm_model(layer_name: str, attention: object | None):
    """vLLM's live model, found from its registered attention layer (model_view.py); None: no layer."""
    from engine_adapter.vllm.model_view import find_vllm_model

    return None if attention is None else find_vllm_model(layer_name, attention)


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


@dataclass(frozen=True)
class FirstLoad:
    """The worker's first step that loaded pieces: how many, its loads' time in all and the part
    of it in page writes (the rest is the Gets); logged once, read by bench/vllm_ttft.py."""

    pieces: int
    load_s: float
    page_writes_s: float

    def __str__(self) -> str:
        return (f"first load: {self.pieces} pieces in {self.load_s * 1e3:.1f} ms "
                f"(Gets {(self.load_s - self.page_writes_s) * 1e3:.1f} ms, page writes {self.page_writes_s * 1e3:.1f} ms)")


class ConnectorWorker:
    """The worker side's state: vLLM's pages, this step's layer-wise load, pages that failed to
    load, stored pieces' events, the blender, and the counts of the shutdown line."""

    def __init__(self, vllm_config: "VllmConfig", settings: "ConnectorSettings", namespace: Namespace,
                 cache: PrefixCache) -> None:
        self._vllm_config = vllm_config
        self.settings = settings
        self.namespace = namespace
        self.cache = cache
        self.page_tokens = vllm_config.cache_config.block_size
        # prefill/decode through the cache: a producer stores what it computes before its request
        # returns; kv_both stores in the background
        kv_role = vllm_config.kv_transfer_config.kv_role or "kv_both"
        mode = settings.save_mode
        self.save_mode = ("sync" if kv_role == "kv_producer" else "async") if mode == "auto" else mode
        self.paged: PagedKV | None = None
        self.loaded_chunks = 0
        self.saved_chunks = 0
        self.dropped_chunks = 0  # completed chunks not saved (daemon down or failed, or the save queue full)
        self.skipped_chunks = 0  # of those, skipped for a full or late save queue (PrefixCache.store_room)
        self.load_copy_s = 0.0   # time in the page writes of loads (after the Get)
        self.load_s = 0.0        # time in start_load_kv's loads, Gets included
        self.load_bytes = 0
        self.warm_up_ms: dict[str, float] = {}  # what `warm_up` did at registration, and how long each took
        self.first_load: FirstLoad | None = None  # the first step that loaded anything, once it has
        self.failed_pages: set[int] = set()
        self._layer_index: dict[str, int] = {}
        self._stored_events: list = []  # BlockStored of pieces Put since the last step (save thread appends)
        self._layerwise: LayerwiseLoad | None = None  # this step's layer-wise load, until wait_for_save
        self.blender: VllmBlender | None = None  # set in register_kv_caches unless blend is off
        self._blend_stores: list = []  # passages a blend computed alone, stored after the forward

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
                vllm_model = functools.partial(_find_vllm_model, names[0], attention)
            self.blender = VllmBlender(self._vllm_config.model_config.model, self.namespace_dtype, self.cache,
                                       self.namespace, settings.blend_ratio, settings.blend_selector,
                                       settings.blend_controller, device=caches[0].device, vllm_model=vllm_model)
            if settings.blend == "start":
                self.blender.engine()
        self.warm_up()

    def warm_up(self) -> None:
        """Pay the load path's one-time costs now, before the first request (outside its TTFT):
        the first Get through the arena (an empty one: the client's and the daemon's Get path,
        the message classes), the page writer's first call (into a one-page scratch cache, never
        vLLM's pages) and, with blending on, the build of its query-pass kernel
        (`kernels/query_probs.c`, compiled on a machine's first use). Each step's time goes to
        ``warm_up_ms`` and the start-up line; a step that fails is skipped (the first request meets
        the failure through the guard, as without it)."""
        client = self.cache.client()  # connected when the connector was built (unless that failed)
        if client is not None:
            began = time.perf_counter()
            try:
                with client.fetch([], fetch_slot_bytes(self.namespace.layout, self.namespace.chunk_tokens)):
                    pass
                self.warm_up_ms["Get"] = (time.perf_counter() - began) * 1e3
            except Exception as exc:  # noqa: BLE001 - a warm-up never fails the worker
                log.debug("KVStoreConnector: warm-up Get failed (%s)", exc)
        if self.paged is not None and (self.paged.native is not None or self.paged.write is not None):
            began = time.perf_counter()
            try:
                self._warm_page_write()
                self.warm_up_ms["page write"] = (time.perf_counter() - began) * 1e3
            except Exception as exc:  # noqa: BLE001
                log.debug("KVStoreConnector: warm-up page write failed (%s)", exc)
        if self.blender is not None and self.blender.dtype == torch.bfloat16 and self.blender.device.type == "cpu":
            began = time.perf_counter()  # the blend's query-pass kernel, compiled once per machine
            from kernels.query_probs import native_library

            if native_library() is not None:
                self.warm_up_ms["query-pass kernel"] = (time.perf_counter() - began) * 1e3
        log.info("KVStoreConnector worker: load path warmed before the first request (%s)",
                 ", ".join(f"{step} {ms:.1f} ms" for step, ms in self.warm_up_ms.items()))

    def _warm_page_write(self) -> None:
        """One page's rows of one layer written into a scratch copy of a page by this worker's
        page-write path (the native writer's or the backend op's first call)."""
        paged = self.paged
        cache = paged.caches[0]
        scratch = torch.zeros((1, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)  # one kernel page
        heads, n, d = cache.shape[1], paged.layout.page_tokens, paged.layout.head_dim
        block = torch.zeros((1, 2, heads, n, d), dtype=cache.dtype, device=cache.device)  # [1, 2, H, N, D]
        slots = torch.arange(n, device=cache.device)
        scratch_kv = PagedKV([scratch], paged.layout, heads, n, write=paged.write,
                             native=PageWriter([scratch], paged.native.layout) if paged.native is not None else None)
        scratch_kv.write_layers(block, slots)

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

    def start_load_kv(self, plan: StepPlan | None) -> None:
        if plan is None:
            return
        began = time.perf_counter()
        pieces = [chunk for chunks in plan.loads.values() for chunk in chunks]
        if self.settings.layerwise and pieces and self._start_layerwise(pieces):
            self.load_s += time.perf_counter() - began
            return
        copy_before, loaded_before = self.load_copy_s, self.loaded_chunks
        for chunks in plan.loads.values():
            self._load(chunks)
        load_s = time.perf_counter() - began
        if self.first_load is None and self.loaded_chunks > loaded_before:
            self.first_load = FirstLoad(self.loaded_chunks - loaded_before, load_s, self.load_copy_s - copy_before)
            log.info("KVStoreConnector worker: %s", self.first_load)
        for blend in plan.blends:
            self._blend(blend)
        self.load_s += time.perf_counter() - began

    def _blend(self, request: BlendRequest) -> None:
        """Blend one request into its pages; on any failure its pages are reported failed (vLLM
        recomputes them) and the request is served as a plain prompt."""
        try:
            if self.blender is None or self.paged is None:
                raise RuntimeError("blend is off in this worker")
            blended = self.blender.run(request, self.paged)
        except Exception as exc:  # noqa: BLE001 - a blend that fails is a prefill, never a failed request
            log.warning("KVStoreConnector: blend of request %s failed (%s: %s); vLLM prefills it",
                        brief(request.request_id), type(exc).__name__, exc)
            self.failed_pages.update(request.span.page_ids)
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
            self.failed_pages.update(chunk.span.page_ids)

    def get_kv_connector_kv_cache_events(self) -> KVStoreEvents | None:
        if not self._stored_events:
            return None
        events, self._stored_events = self._stored_events, []  # a swap: the save thread appends to the new list
        return KVStoreEvents(events)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed_pages = self.failed_pages, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layerwise is not None:  # otherwise loads finished in start_load_kv
            self._layerwise.wait(self._layer_index.get(layer_name, self.namespace.layout.num_layers - 1))

    def _finish_layerwise(self) -> None:
        if self._layerwise is not None:
            self._layerwise.finish()
            self._layerwise = None

    def wait_for_save(self, plan: StepPlan | None) -> None:
        self._finish_layerwise()  # before vLLM asks for load errors
        if self._blend_stores:  # passages blends computed alone, stored now that the forward is done
            stores, self._blend_stores = self._blend_stores, []
            self.cache.store_blocks_async(len(stores), stores.__getitem__)
        if plan is None or self.paged is None:
            return
        saves = plan.saves
        if not saves:
            return
        if self.save_mode != "async":  # stored before this step ends (and its request returns)
            if self.cache.client() is None:
                self.dropped_chunks += len(saves)
                return
            copies = [(save.key, *self.paged.copy_out(save.span), save.event, save.parent, save.token_ids)
                      for save in saves]
            self._saved(copies, len(copies) if self.cache.put(self._blocks(copies), self.save_mode == "durable") else 0)
            return
        # async: nothing here waits for the daemon; a save the store thread has no room for (queue
        # full, or behind by PrefixCache.max_lag_s) is skipped before its pages are copied
        if not self.cache.available():  # down, within retry_s: no copy, no connect in the step
            self.dropped_chunks += len(saves)
            return
        room = self.cache.store_room()
        skipped = max(0, len(saves) - room)
        self.dropped_chunks += skipped
        self.skipped_chunks += skipped
        self.cache.skip(skipped)
        # the block read out of the pages (vLLM may reuse them after this step), or a plain copy of
        # them that the store thread permutes (PagedKV.copy_out)
        copies = [(save.key, *self.paged.copy_out(save.span), save.event, save.parent, save.token_ids)
                  for save in saves[:room]]
        self.cache.store_blocks_async(len(copies), lambda i: self._blocks(copies[i : i + 1])[0],
                                      stored=lambda n: self._saved(copies, n))

    def _blocks(self, copies: list) -> list[BlockToPut]:
        """Saves' copies ``(key, pages, span, event, parent, token_ids)`` (`PagedKV.copy_out`) as the blocks to Put."""
        blocks = [(key, self.paged.block_of_pages(pages, span), parent, token_ids)
                  for key, pages, span, _, parent, token_ids in copies]
        return [BlockToPut(key, block.shape[3], block, parent, token_ids) for key, block, parent, token_ids in blocks]

    def _saved(self, copies: list, stored: int) -> None:
        """The daemon took the first ``stored`` of ``copies``: counted, their events reported."""
        self.saved_chunks += stored
        self.dropped_chunks += len(copies) - stored
        self._stored_events.extend(copy[3] for copy in copies[:stored] if copy[3] is not None)

    def shutdown(self) -> None:
        self.cache.close(timeout=30.0)  # after the chunks already queued
        log.info("KVStoreConnector worker: loaded %d pieces (%.1f MB, page writes %.1f ms, loads %.1f ms in all), "
                 "saved %d, dropped %d (%d skipped: the save queue full or behind), daemon errors %d in %d outages; "
                 "blended %d requests (%.1f ms)",
                 self.loaded_chunks, self.load_bytes / 1e6, self.load_copy_s * 1e3, self.load_s * 1e3,
                 self.saved_chunks, self.dropped_chunks, self.skipped_chunks, self.cache.errors, self.cache.outages,
                 self.blender.blended if self.blender else 0, (self.blender.seconds if self.blender else 0) * 1e3)


class LayerwiseLoad:
    """One step's loads, layer by layer: the daemon streams each layer of every block into the arena
    (GetLayers) and a thread writes that layer's pages; vLLM's attention for layer i waits only for
    layer i (``wait``). Any failure fails every piece from the first one not fully written."""

    def __init__(self, worker: ConnectorWorker, client: KVStoreClient, pieces: list[ChunkLoad], slot: int) -> None:
        self.worker = worker
        self.pieces = pieces
        layers = worker.namespace.layout.num_layers
        self.ready = [threading.Event() for _ in range(layers)]
        self.failed = False
        self._stack = contextlib.ExitStack()
        self._thread: threading.Thread | None = None
        try:
            stream = self._stack.enter_context(client.fetch_layers([p.key for p in pieces], slot))
            layout = worker.namespace.layout
            for piece, block in zip(pieces, stream.blocks):
                if block is None or block.tokens != piece.tokens or block.layout != layout or block.codec != "raw":
                    raise LookupError(f"block {piece.key.hex()} vanished or is not a raw block of this layout")
        except Exception as exc:  # noqa: BLE001
            self._fail("get", exc)
            return
        self._thread = threading.Thread(target=self._run, args=(stream,), name="kvstore-layer-load", daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        paged = self.worker.paged
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
        self.worker.load_copy_s += time.perf_counter() - began

    def _fail(self, what: str, exc: BaseException) -> None:
        self.failed = True
        self.worker.cache.failed(what, exc)
        for event in self.ready:
            event.set()  # never leave the forward waiting; the pages are reported failed

    def wait(self, layer: int) -> None:
        if not self.ready[layer].wait(self.worker.settings.timeout_s):
            self._fail("get", TimeoutError(f"layer {layer} not loaded within {self.worker.settings.timeout_s} s"))

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join(self.worker.settings.timeout_s)
            if self._thread.is_alive():
                self._fail("get", TimeoutError("the layer-wise load did not finish"))
        self._stack.close()
        worker = self.worker
        if self.failed:
            for piece in self.pieces:
                worker.failed_pages.update(piece.span.page_ids)
        else:
            worker.loaded_chunks += len(self.pieces)
            worker.load_bytes += sum(worker.namespace.layout.block_bytes(p.hi - p.lo) for p in self.pieces)
            worker.cache.ok()
