"""The daemon's own transform-codec calibrations: ``disk_codec = "kvtc@auto"`` (or ``s3_codec``).

The transform codec (``kvtc@<id>``) needs a calibration per namespace, and `kvstore calibrate`
makes one with the model. A daemon has no model. With ``kvtc@auto`` it makes one per namespace
(model, layout, tenant: the stored namespace id) from the first blocks of that namespace it moves
into the tier, without the model (`compression/blind.py`)::

    block of namespace N moves down --> N's calibration stored in the cache? --no--> copy it to the
                                        sampler thread (until N has enough), store it as it is
                                     --yes-> kvtc@<N's id>, decoded again and checked:
                                             error within the limits? --yes-> store coded
                                                                      --no--> store as it is

With ``auto_layer_group`` N > 1 a calibration's rows span up to N consecutive layers
(`Calibration.layer_group`; `layer_group_for` fits N to each layout's bounds): fewer bytes at
better quality, slower decode and larger calibrations (docs/notes/compression-log.md measures both).

Until a namespace has `auto_calibration_tokens` tokens sampled, its blocks go down as they are:
nothing lossy happens to a namespace the daemon knows nothing about. Sampling and calibrating run
on one thread of their own (`_worker`), never in the store's copy path (which may hold the store's
lock). A calibration, once made:

- is saved in the calibration directory (``<id>.kvcal``, folder mode 0700) and registered in this
  process, so this daemon and the engines on its host decode its blocks;
- is named as the namespace's in ``auto/<namespace>-<layout>`` there, so a restarted daemon keeps
  it instead of making another (blocks coded before keep naming theirs: ids never change);
- is stored in the cache as a block under the namespace's tenant (durably where a durable tier
  exists), so engines elsewhere and hosts sharing the S3 bucket fetch it by id
  (`calibration_store.client_source`, which `PrefixCache` adds). Blocks are coded only once that
  Put succeeded (retried every `PUBLISH_RETRY_S`; again after a restart).

Every coded block is decoded again and checked against its own spread; one that errs too far is
stored as it is, counted. That check, and which layouts are calibrated at all (with how many
layers a row), are ``kvstore/daemon/autocal_bounds.py``'s.

Each tenant's namespaces are its own, so one tenant's blocks never shape another's calibration;
a namespace is followed only once a Put of it told the daemon its tenant (`note`). Bounds, so
that a client declaring huge layouts or making up namespaces cannot make the daemon hold
unbounded memory or keep other tenants from being calibrated: a layout whose calibration would
pass `MAX_CALIBRATION_BYTES` (or whose decoded block passes `MAX_BLOCK_BYTES`) is never
calibrated; at most `MAX_NAMESPACES` namespaces are followed, `MAX_NAMESPACES_PER_TENANT` of a named
tenant (one without a calibration idle for `SAMPLE_IDLE_S` gives its place up), and `MAX_MEMORY` of
calibrations held and samples running, a quarter per named tenant; at most `MAX_SAMPLING` namespaces
are sampled at once, `MAX_SAMPLING_PER_TENANT` of a named tenant, and a sample idle for
`SAMPLE_IDLE_S` gives its slot to a namespace that waits within that tenant's share. (An open
daemon's one anonymous tenant is bound by the totals only.) Past them, blocks go down as they
are, said once in the log.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from compression.blind import BlindCalibration
from compression.calibration import Allocation, Calibration
from kvstore.block import BlockHeader, payload_checksum
from kvstore.daemon.autocal_bounds import (DEFAULT_SAMPLE_TOKENS, MAX_CALIBRATION_BYTES, calibration_bytes,
                                           code_checked, layer_group_for, unfit_layout)
from kvstore.keys import KVLayout

log = logging.getLogger("kvstore.daemon.autocal")

AUTO_SPEC = "kvtc@auto"
#: Relative steps of the daemon's calibrations (docs/notes/compression-log.md, "Calibrated by the daemon").
AUTO_ALLOCATION = Allocation(key_step=0.4, value_step=0.3, drop=0.2)
MAX_BLOCK_BYTES = 32 << 20  # decoded size of a block the calibrator reads (a 256-token Llama-3-8B block: 32 MiB)
MAX_SAMPLING = 4  # namespaces sampled at once (each holds its warm-up blocks and rows * C^2 float64 sums)
MAX_SAMPLING_PER_TENANT = 2
SAMPLE_IDLE_S = 300.0  # a sample that got no block for this long gives its slot to a namespace that waits
MAX_NAMESPACES = 64  # namespaces one daemon follows
MAX_NAMESPACES_PER_TENANT = 16  # (of a named tenant; an open daemon's one anonymous tenant may have them all)
MAX_MEMORY = 2 << 30  # calibrations held and samples running, counted as 3x their size; a quarter per named tenant
PUBLISH_RETRY_S = 30.0  # doubled after each failure, up to an hour
QUEUE_BLOCKS = 8  # blocks waiting for the sampler thread (more: the block is not sampled)


class CalibrationTooLarge(ValueError):
    """`Publish` can never store this calibration (e.g. it is over a quarter of the top tier)."""


Publish = Callable[[Calibration, object], None]  # stores it in the cache for the tenant; raises on failure


def layout_tag(layout: KVLayout) -> str:
    return f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}-{layout.dtype}"


@dataclasses.dataclass
class _Namespace:
    layout: KVLayout
    owner: object  # the tenant that Put it (kvstore.daemon.auth.Tenant): its calibration is stored under it
    memory: int = 0  # what its calibration is counted as against MAX_MEMORY
    layer_group: int = 1  # layers per row of the calibration it is to get
    checked: bool = False  # the calibration folder was looked at for one made before (by the sampler thread)
    load_queued: bool = False
    last_seen: float = 0.0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # the sampler's
    blind: BlindCalibration | None = None
    reserved: bool = False  # holds a sampling slot
    sampled: set[bytes] = dataclasses.field(default_factory=set)  # keys in the sample (a block moving on to S3
    # from disk passes here again)
    last_sample: float = 0.0
    calibration: Calibration | None = None
    published: bool = False  # the calibration is stored in the cache: blocks may be coded with it
    publish_after: float = 0.0
    publish_backoff: float = PUBLISH_RETRY_S
    failed: str = ""  # why it will not be calibrated (its blocks always go down as they are)

    @property
    def tenant(self) -> str:
        """The owner's name ("": the anonymous tenant of an open daemon)."""
        return getattr(self.owner, "name", "")


class AutoCalibrator:
    """Per stored namespace and layout: sample, calibrate, publish, then code (see the module doc).

    `transcode` is called from the store's reader threads, several at once, possibly under the
    store's lock: it never waits for the sampler and never raises (a block it cannot code goes
    down as it is).
    """

    def __init__(self, sample_tokens: int = DEFAULT_SAMPLE_TOKENS, allocation: Allocation = AUTO_ALLOCATION,
                 folder: Path | None = None, publish: Publish | None = None, metrics=None,
                 max_calibration_bytes: int = MAX_CALIBRATION_BYTES, layer_group: int = 1) -> None:
        from compression import calibration_store

        self.sample_tokens = sample_tokens
        self.layer_group = layer_group  # layers per row wanted (`layer_group_for` fits it to each layout)
        self.allocation = allocation
        self.folder = folder or calibration_store.calibration_dir()
        self.publish = publish
        self.metrics = metrics
        self.max_calibration_bytes = max_calibration_bytes
        self._lock = threading.Lock()
        self._namespaces: dict[tuple[bytes, KVLayout], _Namespace] = {}
        self._tenants: collections.OrderedDict[bytes, object] = collections.OrderedDict()  # `note`, LRU
        self._full_said = False
        self._jobs: queue.Queue = queue.Queue(QUEUE_BLOCKS)
        self._thread: threading.Thread | None = None

    def note(self, namespace: bytes, tenant: object) -> None:
        """``tenant`` Put a block of stored namespace ``namespace`` (the server's Put calls this):
        the calibration made for it is stored under that tenant, where its clients find it."""
        with self._lock:
            self._tenants[namespace] = tenant
            self._tenants.move_to_end(namespace)
            while len(self._tenants) > 4 * MAX_NAMESPACES:
                self._tenants.popitem(last=False)

    # -- the transcoder (reader threads) --------------------------------------------------------------

    def transcode(self, header: BlockHeader, payload: bytes | memoryview) -> tuple[BlockHeader, memoryview]:
        """``(header, payload)`` for the tier: coded with the namespace's calibration, or as they are."""
        as_is = header, memoryview(payload)
        try:
            return self._transcode(header, payload) or as_is
        except Exception:  # noqa: BLE001 - never keep a block from its tier
            log.exception("kvtc@auto: block %s stored as it is", header.key.hex())
            self._count("error")
            return as_is

    def _transcode(self, header: BlockHeader, payload) -> tuple[BlockHeader, memoryview] | None:
        from compression.transcode import decode_payload

        if header.codec_params.get("exact") or header.codec.startswith("kvtc"):
            return None
        if header.layout.block_bytes(header.tokens) > MAX_BLOCK_BYTES:  # (a small payload may decode huge)
            self._count("too_large")
            return None
        state = self._state(header.namespace, header.layout)
        if state is None or state.failed:
            return None
        if not state.checked:  # the sampler thread looks for a calibration made before a restart first
            if not state.load_queued:
                state.load_queued = self._submit(("load", state, header.namespace))
            return None
        if state.calibration is not None:
            if state.published:
                return self._coded(state.calibration, header, decode_payload(header, payload))
            if time.monotonic() >= state.publish_after and self._submit(("publish", state, header.namespace)):
                state.publish_after = time.monotonic() + state.publish_backoff
            return None
        if header.key in state.sampled or not self._reserve(state):
            return None
        block = decode_payload(header, payload).clone()  # the payload's memory is the tier's
        if not self._submit(("sample", state, header, block)):
            self._count("busy")
        return None

    def _coded(self, calibration: Calibration, header: BlockHeader, block: torch.Tensor
               ) -> tuple[BlockHeader, memoryview] | None:
        try:
            encoded = code_checked(calibration, block)
        except Exception as exc:  # noqa: BLE001 - e.g. a non-finite block
            self._count("over_error")
            log.debug("block %s not coded: %s", header.key.hex(), exc)
            return None
        if encoded is None:
            self._count("over_error")
            return None
        self._count("coded")
        payload = memoryview(encoded.payload)
        return dataclasses.replace(header, codec=encoded.codec, codec_params=encoded.params, payload_len=len(payload),
                                   checksum=payload_checksum(payload)), payload

    # -- namespaces and slots --------------------------------------------------------------------------

    def _pointer(self, namespace: bytes, layout: KVLayout) -> Path:
        return self.folder / "auto" / f"{namespace.hex()}-{layout_tag(layout)}"

    def _state(self, namespace: bytes, layout: KVLayout) -> _Namespace | None:
        """The namespace's state, made on first sight; None while its tenant is not known (no Put of it
        noted lately) or past `MAX_NAMESPACES` (overall, or its named tenant's). A state without a
        calibration that saw no block for `SAMPLE_IDLE_S` gives its place to a new one."""
        key = namespace, layout
        state = self._namespaces.get(key)
        if state is None:
            owner = self._tenants.get(namespace)
            if owner is None or not self._room(getattr(owner, "name", ""), decide=False):
                return None
            made_before = self._pointer(namespace, layout).exists()  # (a stat; loading it is the sampler thread's)
            failed = unfit_layout(layout, self.max_calibration_bytes)
            with self._lock:
                state = self._namespaces.get(key)
                if state is None:
                    if not self._room(getattr(owner, "name", ""), decide=True):
                        return None
                    layer_group = layer_group_for(layout, self.layer_group, self.max_calibration_bytes,
                                                  self.sample_tokens)  # (a sample short of it waits: `_sample`)
                    memory = 0 if failed else 3 * calibration_bytes(layout, layer_group)
                    state = self._namespaces[key] = _Namespace(layout, owner, memory, layer_group, failed=failed,
                                                               checked=not made_before)
                    if failed:
                        log.warning("namespace %s (%s) is not calibrated automatically: %s; its blocks are stored "
                                    "as they are", namespace.hex()[:12], layout_tag(layout), failed)
        state.last_seen = time.monotonic()
        return state

    def _room(self, tenant: str, decide: bool) -> bool:
        """Whether one more namespace of ``tenant`` may be followed, after retiring idle ones without a
        calibration. ``decide`` (holding `_lock`): retire and decide; else a first look that may say yes."""
        def full() -> bool:
            return len(self._namespaces) >= MAX_NAMESPACES or \
                (bool(tenant) and sum(s.tenant == tenant for s in list(self._namespaces.values()))
                 >= MAX_NAMESPACES_PER_TENANT)

        if not full():
            return True
        now = time.monotonic()
        idle = [key for key, s in list(self._namespaces.items())
                if s.calibration is None and not s.reserved and now - s.last_seen > SAMPLE_IDLE_S
                and (len(self._namespaces) >= MAX_NAMESPACES or s.tenant == tenant)]
        if not decide:
            return bool(idle)
        for key in idle:
            del self._namespaces[key]
            if not full():
                return True
        if not self._full_said:
            self._full_said = True
            log.warning("kvtc@auto follows %d namespaces (at most %d, %d per named tenant): blocks of other "
                        "namespaces are stored as they are (or calibrate them with `kvstore calibrate`)",
                        len(self._namespaces), MAX_NAMESPACES, MAX_NAMESPACES_PER_TENANT)
        return False

    def _recorded(self, namespace: bytes, layout: KVLayout, layer_group: int = 1) -> Calibration | None:
        """The calibration a daemon made for this namespace before (its pointer file), if it still loads
        and has ``layer_group`` layers a row (another setting since: calibrated again, as now set)."""
        from compression import calibration_store

        path = self._pointer(namespace, layout)
        try:
            calibration_id = path.read_bytes().decode("ascii", "replace").strip()
            if len(calibration_id) != 64 or not all(c in "0123456789abcdef" for c in calibration_id):
                raise ValueError(f"{calibration_id[:80]!r} is not a calibration id")
            calibration = calibration_store.load(calibration_id, self.folder)
            if calibration.layer_group != layer_group:
                raise ValueError(f"it has {calibration.layer_group} layers a row, auto_layer_group gives {layer_group}")
            return calibration
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - its calibration gone or damaged: make a new one
            log.warning("auto-calibration %s not used (%s); the namespace is calibrated again", path, exc)
            return None

    def _reserve(self, state: _Namespace) -> bool:
        """Whether ``state`` may be sampled: it holds a slot, or takes one (a free one, or that of a
        sample idle for `SAMPLE_IDLE_S`, within its tenant's share)."""
        now = time.monotonic()
        with self._lock:
            if state.reserved:
                return True
            if state.calibration is not None or state.failed:
                return False
            # memory: calibrations held and samples running, counted as 3x their calibration's size
            held = [s for s in self._namespaces.values() if s.calibration is not None or s.reserved]
            if sum(s.memory for s in held) + state.memory > MAX_MEMORY or (state.tenant and sum(
                    s.memory for s in held if s.tenant == state.tenant) + state.memory > MAX_MEMORY // 4):
                self._count("busy")
                return False
            sampling = [s for s in self._namespaces.values() if s.reserved]
            if state.tenant and sum(s.tenant == state.tenant for s in sampling) >= MAX_SAMPLING_PER_TENANT:
                idle = [s for s in sampling if s.tenant == state.tenant and now - s.last_sample > SAMPLE_IDLE_S]
            elif len(sampling) >= MAX_SAMPLING:
                idle = [s for s in sampling if now - s.last_sample > SAMPLE_IDLE_S]
            else:
                idle = None
            if idle is not None:
                stale = next((s for s in sorted(idle, key=lambda s: s.last_sample)
                              if s.lock.acquire(blocking=False)), None)  # (never waits: see `_sample`)
                if stale is None:
                    self._count("busy")
                    return False
                try:
                    stale.reserved, stale.blind, stale.sampled = False, None, set()
                finally:
                    stale.lock.release()
            state.reserved, state.last_sample = True, now
            return True

    # -- the sampler thread -----------------------------------------------------------------------------

    def _submit(self, job: tuple) -> bool:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="kvstore-autocal", daemon=True)
                self._thread.start()
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

    def _worker(self) -> None:
        while True:
            kind, state, *args = self._jobs.get()
            try:
                if kind == "sample":
                    self._sample(state, *args)
                elif kind == "load":
                    self._load(state, *args)
                else:
                    self._publish(state, *args)
            except Exception:  # noqa: BLE001 - the thread serves every namespace: never let it die
                log.exception("kvtc@auto: %s failed", kind)

    def _sample(self, state: _Namespace, header: BlockHeader, block: torch.Tensor) -> None:
        """Add ``block`` to the namespace's sample; make the calibration once it has enough."""
        layout = header.layout
        with state.lock:
            if state.calibration is not None or state.failed:
                self._release(state)
                return
            if not state.reserved or header.key in state.sampled:
                return
            if not bool(torch.isfinite(block).all()):
                self._count("not_finite")
                return
            state.last_sample = time.monotonic()
            if state.blind is None:
                state.blind = BlindCalibration(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                               layer_group=state.layer_group)
            blind = state.blind
            try:
                blind.add(block)
                state.sampled.add(header.key)
                self._count("sampled")
                if blind.tokens < self.sample_tokens or (blind.short and blind.tokens < 4 * self.sample_tokens):
                    return  # (rows over layers need twice their channels: a few blocks more, at most 4x)
                started = time.perf_counter()
                calibration = blind.calibration(self.allocation, source=f"kvstore daemon, namespace "
                                                                        f"{header.namespace.hex()[:12]}")
            except Exception as exc:  # noqa: BLE001 - (degenerate statistics) the namespace stays uncoded
                state.failed = f"{type(exc).__name__}: {exc}"
                log.warning("namespace %s (%s) not calibrated: %s; its blocks are stored as they are",
                            header.namespace.hex()[:12], layout_tag(layout), state.failed)
                self._release(state)
                return
            state.calibration = calibration  # before the slot goes: no new sample starts
            self._release(state)
            self._keep(calibration, header.namespace, layout)
            log.info("calibrated namespace %s (%s) from %d blocks, %d tokens in %.1f s: kvtc@%s, %d of %d components "
                     "kept; %s", header.namespace.hex()[:12], layout_tag(layout), blind.blocks, blind.tokens,
                     time.perf_counter() - started, calibration.id[:12], int(calibration.kept.sum()),
                     calibration.kept.numel(), calibration.source)
            self._count("calibrations")
        self._publish(state, header.namespace)

    def _release(self, state: _Namespace) -> None:
        with self._lock:
            state.reserved, state.blind, state.sampled = False, None, set()

    def _load(self, state: _Namespace, namespace: bytes) -> None:
        """Take up the calibration made for this namespace before a restart, if any (then samples may start)."""
        if not state.checked:
            state.calibration = self._recorded(namespace, state.layout, state.layer_group)
            state.checked = True
            self._publish(state, namespace)  # stored in the cache again before any block is coded with it

    def _keep(self, calibration: Calibration, namespace: bytes, layout: KVLayout) -> None:
        """Register, save, and point the namespace at it (a restart finds it)."""
        from compression import calibration_store

        calibration_store.register(calibration)
        try:
            calibration_store.save(calibration, self.folder)
            calibration_store.write_file(self._pointer(namespace, layout), calibration.id.encode() + b"\n")
        except OSError as exc:  # this process still has it; a restart calibrates again
            log.warning("auto-calibration %s not saved in %s (%s)", calibration.id[:12], self.folder, exc)

    def _publish(self, state: _Namespace, namespace: bytes) -> None:
        """Store the namespace's calibration in the cache under its tenant; its blocks are coded from then on."""
        calibration = state.calibration
        if calibration is None or state.published or self.publish is None:
            return
        try:
            self.publish(calibration, state.owner)
        except CalibrationTooLarge as exc:  # it never will be stored: its blocks go down as they are
            state.failed = str(exc)
            log.warning("auto-calibration %s of namespace %s is never stored in the cache (%s); the namespace's "
                        "blocks are stored as they are", calibration.id[:12], namespace.hex()[:12], exc)
            return
        except Exception as exc:  # noqa: BLE001 - retried later and later; meanwhile blocks go down as they are
            log.warning("auto-calibration %s of namespace %s not stored in the cache (%s); retried in %.0f s",
                        calibration.id[:12], namespace.hex()[:12], exc, state.publish_backoff)
            state.publish_after = time.monotonic() + state.publish_backoff
            state.publish_backoff = min(3600.0, 2 * state.publish_backoff)
            return
        state.published = True
        self._count("published")

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.auto_calibration.labels(outcome).inc()
