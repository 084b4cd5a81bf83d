"""The daemon's own transform-codec calibrations: ``disk_codec = "kvtc@auto"`` (or ``s3_codec``).

The transform codec (``kvtc@<id>``) needs a calibration per namespace, and `kvstore calibrate`
makes one with the model. A daemon has no model. With ``kvtc@auto`` it makes one per namespace
(model, layout, tenant: the stored namespace id) from the first blocks of that namespace it moves
into the tier, without the model (`compression/blind.py`)::

    block of namespace N moves down --> N calibrated? --no--> sample it (statistics), store it as it is
                                                     --yes-> kvtc@<N's id>, decoded again and checked:
                                                             relative error within MAX_RELATIVE_ERROR?
                                                             --yes-> store coded --no--> store as it is

Until the namespace has `auto_calibration_tokens` tokens sampled, its blocks go down as they
are: nothing lossy happens to a namespace the daemon knows nothing about. A calibration, once made:

- is saved in the calibration directory (`calibration_store.calibration_dir()`, ``<id>.kvcal``)
  and registered in this process, so this daemon and the engines on its host decode its blocks;
- is named as the namespace's in ``auto/<namespace>-<layout>`` there, so a restarted daemon
  keeps it instead of making another (blocks coded before keep naming theirs: ids never change);
- is stored in the cache as a block (`calibration_store.calibration_block`) under the namespace's
  tenant, in every tier: engines elsewhere and hosts sharing the S3 bucket fetch it by id
  (`calibration_store.client_source`, which `PrefixCache` adds).

Every coded block is decoded again and compared: the relative error of each (layer, K/V) is
``|x' - x| / |x - mean over tokens|``; above `MAX_RELATIVE_ERROR` (a block unlike the sample: a
calibration made from unrepresentative or hostile first blocks, a drifting workload) the block
is stored as it is and counted. Each tenant's namespaces are its own, so one tenant's blocks never
shape another's calibration. Bounds, so that a client making up namespaces cannot make the daemon
hold unbounded memory or keep other tenants from being calibrated: at most `MAX_SAMPLING`
namespaces are sampled at once, `MAX_SAMPLING_PER_TENANT` of one tenant, and a sample idle for
`SAMPLE_IDLE_S` gives its slot to a namespace that waits (the others go down as they are
meanwhile); at most `MAX_NAMESPACES` namespaces are followed, `MAX_NAMESPACES_PER_TENANT` of one
tenant; later ones go down as they are, said once in the log.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from compression.blind import BlindCalibration
from compression.calibration import Allocation, Calibration
from kvstore.block import BlockHeader, payload_checksum
from kvstore.keys import KVLayout

log = logging.getLogger("kvstore.autocal")

AUTO_SPEC = "kvtc@auto"
#: Relative steps of the daemon's calibrations (docs/compression.md, "Calibrated by the daemon").
AUTO_ALLOCATION = Allocation(key_step=0.4, value_step=0.3, drop=0.2)
DEFAULT_SAMPLE_TOKENS = 8192
MAX_RELATIVE_ERROR = 0.35
MAX_SAMPLING = 4  # namespaces sampled at once (each holds its warm-up blocks and rows * C^2 float64 sums)
MAX_SAMPLING_PER_TENANT = 2
SAMPLE_IDLE_S = 300.0  # a sample that got no block for this long gives its slot to a namespace that waits
MAX_NAMESPACES = 64  # namespaces one daemon follows (a calibration in memory: 2 * rows * C^2 * 4 bytes and more)
MAX_NAMESPACES_PER_TENANT = 16

Publish = Callable[[Calibration, object], None]  # (calibration, the tenant whose namespace it was made for)


def layout_tag(layout: KVLayout) -> str:
    return f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}-{layout.dtype}"


def relative_errors(block: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """[L, 2] float64: |decoded - block| / |block - its mean over tokens| per layer and K/V."""
    x = block.double()
    err = (decoded.double() - x).pow(2).sum((2, 3, 4))
    spread = (x - x.mean(3, keepdim=True)).pow(2).sum((2, 3, 4))
    return (err / spread.clamp_min(1e-300)).sqrt()


@dataclasses.dataclass
class _Namespace:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    blind: BlindCalibration | None = None
    calibration: Calibration | None = None
    failed: str = ""  # why it will not be calibrated (then its blocks always go down as they are)
    sampled: set[bytes] = dataclasses.field(default_factory=set)  # keys in the sample (a block moving on to S3
    # from disk passes here again)
    tenant: str = ""  # the name of the tenant that Put it ("" unknown or anonymous)
    last_sample: float = 0.0


class AutoCalibrator:
    """Per stored namespace and layout: sample, calibrate, then code (see the module doc).

    `transcode` is called from the store's reader threads, several at once; it never raises for
    a block it cannot code (that block goes down as it is).
    """

    def __init__(self, sample_tokens: int = DEFAULT_SAMPLE_TOKENS, allocation: Allocation = AUTO_ALLOCATION,
                 folder: Path | None = None, publish: Publish | None = None, metrics=None) -> None:
        from compression import calibration_store

        self.sample_tokens = sample_tokens
        self.allocation = allocation
        self.folder = folder or calibration_store.calibration_dir()
        self.publish = publish
        self.metrics = metrics
        self._lock = threading.Lock()
        self._namespaces: dict[tuple[bytes, KVLayout], _Namespace] = {}
        self._tenants: dict[bytes, object] = {}  # stored namespace -> the tenant that Put it (`note`)
        self._full_said = False

    def note(self, namespace: bytes, tenant: object) -> None:
        """``tenant`` Put a block of stored namespace ``namespace`` (the server's Put calls this):
        the calibration made for it is stored under that tenant, where its clients find it."""
        if namespace in self._tenants or len(self._tenants) >= 4 * MAX_NAMESPACES:
            return
        with self._lock:
            self._tenants[namespace] = tenant

    # -- the namespace's calibration, made or found ----------------------------------------------

    def _pointer(self, namespace: bytes, layout: KVLayout) -> Path:
        return self.folder / "auto" / f"{namespace.hex()}-{layout_tag(layout)}"

    def _tenant_name(self, namespace: bytes) -> str:
        return getattr(self._tenants.get(namespace), "name", "")

    def _state(self, namespace: bytes, layout: KVLayout) -> _Namespace | None:
        """The namespace's state, made on first sight (None past `MAX_NAMESPACES`, overall or its tenant's)."""
        with self._lock:
            state = self._namespaces.get((namespace, layout))
            if state is not None:
                return state
            tenant = self._tenant_name(namespace)
            if len(self._namespaces) >= MAX_NAMESPACES or \
                    sum(s.tenant == tenant for s in self._namespaces.values()) >= MAX_NAMESPACES_PER_TENANT:
                if not self._full_said:
                    self._full_said = True
                    log.warning("kvtc@auto follows %d namespaces (at most %d, %d per tenant): blocks of other "
                                "namespaces are stored as they are (or calibrate them with `kvstore calibrate`)",
                                len(self._namespaces), MAX_NAMESPACES, MAX_NAMESPACES_PER_TENANT)
                return None
            state = self._namespaces[namespace, layout] = _Namespace(tenant=tenant)
            state.calibration = self._recorded(namespace, layout)
            return state

    def _recorded(self, namespace: bytes, layout: KVLayout) -> Calibration | None:
        """The calibration a daemon made for this namespace before (its pointer file), if it still loads."""
        from compression import calibration_store

        path = self._pointer(namespace, layout)
        try:
            calibration_id = path.read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("auto-calibration %s not read (%s); the namespace is calibrated again", path, exc)
            return None
        try:
            if len(calibration_id) != 64 or not all(c in "0123456789abcdef" for c in calibration_id):
                raise ValueError(f"{calibration_id[:80]!r} is not a calibration id")
            return calibration_store.load(calibration_id, self.folder)
        except (OSError, ValueError) as exc:  # its calibration gone or damaged: make a new one
            log.warning("auto-calibration %s not used (%s); the namespace is calibrated again", path, exc)
            return None

    def calibration_of(self, namespace: bytes, layout: KVLayout) -> Calibration | None:
        state = self._state(namespace, layout)
        return state.calibration if state is not None else None

    def _take_slot(self, state: _Namespace) -> bool:
        """Whether ``state`` may start a sample now; frees the slot of a sample idle for `SAMPLE_IDLE_S`."""
        now = time.monotonic()
        with self._lock:
            sampling = [s for s in self._namespaces.values() if s.blind is not None]
            if len(sampling) < MAX_SAMPLING and \
                    sum(s.tenant == state.tenant for s in sampling) < MAX_SAMPLING_PER_TENANT:
                return True
            idle = [s for s in sampling if now - s.last_sample > SAMPLE_IDLE_S
                    and (len(sampling) >= MAX_SAMPLING or s.tenant == state.tenant)]
            for stale in sorted(idle, key=lambda s: s.last_sample):
                if stale.lock.acquire(blocking=False):  # (never waits: its holder may be waiting for self._lock)
                    try:
                        stale.blind, stale.sampled = None, set()
                    finally:
                        stale.lock.release()
                    return True
            return False

    def _sample(self, state: _Namespace, header: BlockHeader, block: torch.Tensor) -> None:
        """Add ``block`` to the namespace's sample; make the calibration once it has enough. Holds state.lock."""
        layout = header.layout
        if state.blind is None:
            if not self._take_slot(state):
                self._count("busy")
                return
            state.blind = BlindCalibration(layout.num_layers, layout.num_kv_heads, layout.head_dim)
        if header.key in state.sampled:
            return
        if not bool(torch.isfinite(block).all()):
            self._count("not_finite")
            return
        state.last_sample = time.monotonic()
        blind = state.blind
        try:
            blind.add(block)
        except Exception as exc:  # noqa: BLE001 - never let a sample keep a block from its tier
            state.blind, state.failed = None, f"{type(exc).__name__}: {exc}"
            log.warning("namespace %s (%s) not calibrated: %s; its blocks are stored as they are",
                        header.namespace.hex()[:12], layout_tag(layout), state.failed)
            return
        state.sampled.add(header.key)
        self._count("sampled")
        if blind.tokens < self.sample_tokens:
            return
        state.blind, state.sampled = None, set()
        started = time.perf_counter()
        try:
            calibration = blind.calibration(self.allocation, source=f"kvstore daemon, namespace "
                                                                    f"{header.namespace.hex()[:12]}")
        except Exception as exc:  # noqa: BLE001 - (degenerate statistics) the namespace stays uncoded
            state.failed = f"{type(exc).__name__}: {exc}"
            log.warning("namespace %s (%s) not calibrated: %s; its blocks are stored as they are",
                        header.namespace.hex()[:12], layout_tag(layout), state.failed)
            return
        self._keep(calibration, header.namespace, layout)
        state.calibration = calibration
        log.info("calibrated namespace %s (%s) from %d blocks, %d tokens in %.1f s: kvtc@%s, %d of %d components "
                 "kept; %s", header.namespace.hex()[:12], layout_tag(layout), blind.blocks, blind.tokens,
                 time.perf_counter() - started, calibration.id[:12], int(calibration.kept.sum()),
                 calibration.kept.numel(), calibration.source)
        self._count("calibrations")

    def _keep(self, calibration: Calibration, namespace: bytes, layout: KVLayout) -> None:
        """Register, save, point the namespace at it, and hand it to `publish` (the cache's copy)."""
        from compression import calibration_store

        calibration_store.register(calibration)
        try:
            calibration_store.save(calibration, self.folder)
            pointer = self._pointer(namespace, layout)
            pointer.parent.mkdir(parents=True, exist_ok=True)
            tmp = pointer.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(calibration.id + "\n")
            os.replace(tmp, pointer)
        except OSError as exc:  # this process still has it; a restart calibrates again
            log.warning("auto-calibration %s not saved in %s (%s)", calibration.id[:12], self.folder, exc)
        tenant = self._tenants.get(namespace)
        if tenant is None:  # not Put through this daemon's server: no tenant to store it under
            log.warning("auto-calibration %s not stored in the cache: the tenant of namespace %s is not known; "
                        "engines on other hosts will not decode its blocks", calibration.id[:12], namespace.hex()[:12])
        elif self.publish is not None:
            try:
                self.publish(calibration, tenant)
            except Exception as exc:  # noqa: BLE001 - the file above still serves this host
                log.warning("auto-calibration %s not stored in the cache (%s)", calibration.id[:12], exc)

    # -- the transcoder -----------------------------------------------------------------------------

    def transcode(self, header: BlockHeader, payload: bytes | memoryview) -> tuple[BlockHeader, memoryview]:
        """``(header, payload)`` for the tier: coded with the namespace's calibration, or as they are."""
        from kvstore.transcode import decode_payload

        as_is = header, memoryview(payload)
        if header.codec_params.get("exact") or header.codec.startswith("kvtc"):
            return as_is
        state = self._state(header.namespace, header.layout)
        if state is None or state.failed:
            return as_is
        calibration = state.calibration
        try:
            block = decode_payload(header, payload)
        except Exception:  # noqa: BLE001 - a block this daemon cannot read goes down as it is
            self._count("unreadable")
            return as_is
        if calibration is None:
            if not state.lock.acquire(blocking=False):  # another thread is sampling or calibrating it
                self._count("busy")
                return as_is
            try:
                if state.calibration is None and not state.failed:
                    self._sample(state, header, block)
            finally:
                state.lock.release()
            return as_is
        return self._coded(calibration, header, block) or as_is

    def _coded(self, calibration: Calibration, header: BlockHeader, block: torch.Tensor
               ) -> tuple[BlockHeader, memoryview] | None:
        from compression.transform import TransformCodec

        codec = TransformCodec(calibration)
        try:
            encoded = codec.encode(block)
            decoded = codec.decode(encoded.payload, encoded.params, tuple(block.shape), block.dtype)
        except Exception as exc:  # noqa: BLE001 - e.g. a non-finite block
            self._count("over_error")
            log.debug("block %s not coded: %s", header.key.hex(), exc)
            return None
        worst = float(relative_errors(block, decoded).max())
        if not worst <= MAX_RELATIVE_ERROR:  # (NaN too)
            self._count("over_error")
            return None
        self._count("coded")
        payload = memoryview(encoded.payload)
        return dataclasses.replace(header, codec=encoded.codec, codec_params=encoded.params, payload_len=len(payload),
                                   checksum=payload_checksum(payload)), payload

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.auto_calibration.labels(outcome).inc()
