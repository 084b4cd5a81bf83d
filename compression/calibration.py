"""A transform-codec calibration: what it holds, its rows, its steps, and its bytes (the file format).

Per (layer, k/v, head group) a PCA basis and a bit allocation. Learned once per namespace (model,
layout, dtype) from KV blocks: their statistics (`compression/calibration_stats.py`), fitted
(`compression/calibration_fit.py`: the metric, the PCA), with the model
(`engine_adapter/calibrate.py`, `kvstore calibrate`) or without it (`compression/blind.py`,
the daemon's `kvtc@auto`). Stored content-addressed (`Calibration.id` is the SHA-256 of its
bytes) and named by that id in every block's codec params, so any reader that can fetch the id
decodes the block; see `compression/calibration_store.py` for where calibrations live and
`docs/notes/compression-log.md` for the measurements behind the defaults.

Rows: a block [L, 2, H, T, D] is cut into B = L * 2 * G rows (layer, k/v, group), each [T, C]
with C = (H / G) * D: the heads of one group side by side per token::

    block[l, kv, g*H/G : (g+1)*H/G, t, :]  ->  x[b, t, :]     b = (l * 2 + kv) * G + g

Bit allocation: one quantization step per component. With an entropy coder behind it, a uniform
step is what minimises squared error at a given rate (every kept component pays the same
distortion step^2/12); components whose calibrated standard deviation is below `drop * step` are
dropped (0 bits, decoded as 0). The step of a row is ``rel_step[kv] * rms(row)``: one relative
step for keys, one for values, scaled by each layer's own RMS, since errors relative to a
layer's activations are what the next layer sees.

Keys before RoPE (``rope_inv_freq`` set, format v3): RoPE turns each channel pair (i, i + D/2)
of a key by ``position * inv_freq[i]``, which smears the keys' low-rank structure over positions.
Such a calibration holds its key bases in the un-rotated frame: the statistics turn the keys of
their blocks (computed at positions 0..n-1) back to position 0 (`turn_keys`), and the codec does
the same to a block at encode, with the block's start position, and rotates back at decode
(`compression/transform.py`). The first ``sink_tokens`` positions of a context (attention sinks:
rare, huge-norm keys that every query reads) are left out of the statistics and stored raw.

Per-row steps: ``allocation.row_scale`` multiplies each row's relative step, e.g. from a measured
sensitivity of the model's output to each layer's keys and values
(`engine_adapter.calibrate.row_sensitivity`).

Layer groups (``layer_group`` N > 1, format v4): a row is N consecutive layers' keys (or values)
side by side, C = N * H/G * D channels, so one basis also takes out what neighbouring layers share
(the residual stream feeds them all: on SmolLM2 a basis over 10 layers' keys needs 45% fewer bits
than 10 per-layer ones at the same weighted error; docs/notes/compression-log.md). Each layer keeps its own
metric and its own step (``rel_step * rms(layer) * row_scale``), folded into the basis: a layer's
channels are whitened by its metric and divided by its step before the joint PCA, so every
component of a grouped row has step 1 in its units, and the allocation cannot change without the
statistics (`with_allocation` refuses; fit again). Decode costs about N times the products
of per-layer rows.

Format: v2 files (no RoPE, no sinks, no row scales) still load and re-serialize to the same bytes, so their ids
hold; a calibration with either feature is written as v3, one with layer groups as v4.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

FORMAT = "kvstore-calibration-v2"  # plain PCA over the stored (post-RoPE) keys, no sinks
FORMAT_V3 = "kvstore-calibration-v3"  # v2 + rope_inv_freq (keys before RoPE), sink_tokens, row_scale
FORMAT_V4 = "kvstore-calibration-v4"  # v3 + layer_group (rows over several layers)
FORMATS = (FORMAT, FORMAT_V3, FORMAT_V4)
MAX_GROUP_CHANNELS = 2048  # channels of a layer-grouped row at most: its two [C, C] matrices are 32 MiB
MAGIC = b"KVCAL1\n"


@dataclass(frozen=True)
class Allocation:
    """How a calibration spends bits: relative steps for keys and values, and the drop threshold."""

    key_step: float  # step = key_step * rms(row) for key rows
    value_step: float  # likewise for value rows
    drop: float = 0.5  # components with calibrated std < drop * step get 0 bits
    sink_tokens: int = 0  # positions 0..sink_tokens-1 of a context are stored raw (needs RoPE-aware keys)
    row_scale: tuple[float, ...] = ()  # per row b, a factor on its relative step (empty: all 1)

    def __post_init__(self) -> None:
        if not (self.key_step > 0 and self.value_step > 0):
            raise ValueError(f"steps must be > 0, got key_step={self.key_step} value_step={self.value_step}")
        if not 0 <= self.drop < 100:
            raise ValueError(f"drop must be in [0, 100), got {self.drop}")
        if not (isinstance(self.sink_tokens, int) and 0 <= self.sink_tokens <= 1024):
            raise ValueError(f"sink_tokens must be an int in [0, 1024], got {self.sink_tokens!r}")
        if not all(0 < f < 1e6 for f in self.row_scale):
            raise ValueError(f"row_scale factors must be > 0, got {self.row_scale!r}")
        object.__setattr__(self, "row_scale", tuple(float(f) for f in self.row_scale))

    def to_json(self) -> dict:
        """The header form; fields at their v2 defaults are left out so v2 bytes (and ids) are unchanged."""
        out = {"key_step": self.key_step, "value_step": self.value_step, "drop": self.drop}
        if self.sink_tokens:
            out["sink_tokens"] = self.sink_tokens
        if self.row_scale:
            out["row_scale"] = list(self.row_scale)
        return out


@dataclass(frozen=True, eq=False)
class Calibration:
    """Per-row mean [B, C], analysis [B, C, C] (components as columns, by falling variance in the
    metric), synthesis [B, C, C] (its inverse), component std [B, C] and step [B, C] (0 = dropped),
    all float32 on CPU; immutable once built."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    groups: int  # head groups per layer and k/v (1 = all heads share one basis)
    mean: torch.Tensor = field(repr=False)
    analysis: torch.Tensor = field(repr=False)
    synthesis: torch.Tensor = field(repr=False)
    std: torch.Tensor = field(repr=False)
    step: torch.Tensor = field(repr=False)
    allocation: Allocation
    source: str = ""  # what it was calibrated on, for people (e.g. "3 MuSiQue dev contexts, 17000 tokens")
    # [D/2] float32: key bases are in the frame before RoPE with these frequencies (None: after RoPE)
    rope_inv_freq: torch.Tensor | None = field(default=None, repr=False)
    max_position: int = 0  # RoPE-aware: blocks start below this (the model's context length); 0 = 2^17
    layer_group: int = 1  # consecutive layers per row (> 1: steps folded into the bases, format v4)

    def __post_init__(self) -> None:
        if self.num_kv_heads % self.groups:
            raise ValueError(f"groups ({self.groups}) must divide num_kv_heads ({self.num_kv_heads})")
        check_layer_group(self.layer_group, self.num_layers, self.num_kv_heads // self.groups * self.head_dim)
        freq = self.rope_inv_freq
        if freq is not None and (tuple(freq.shape) != (self.head_dim // 2,) or freq.dtype != torch.float32
                                 or self.head_dim % 2):
            raise ValueError(f"rope_inv_freq must be float32 [{self.head_dim // 2}] (even head_dim), got "
                             f"{freq.dtype} {tuple(freq.shape)}")
        if not (isinstance(self.max_position, int) and 0 <= self.max_position <= 1 << 24):
            raise ValueError(f"max_position must be an int in [0, 2^24], got {self.max_position!r}")
        if self.allocation.row_scale and len(self.allocation.row_scale) != self.layer_rows:
            raise ValueError(f"allocation.row_scale has {len(self.allocation.row_scale)} factors for "
                             f"{self.layer_rows} (layer, k/v, group) rows")
        if self.allocation.sink_tokens and freq is None:
            raise ValueError("sink_tokens needs a RoPE-aware calibration (rope_inv_freq): the codec finds a block's "
                             "position through the keys' rotation")
        n_rows, n_chan = self.rows, self.channels
        for name, shape in (("mean", (n_rows, n_chan)), ("analysis", (n_rows, n_chan, n_chan)),
                            ("synthesis", (n_rows, n_chan, n_chan)),
                            ("std", (n_rows, n_chan)), ("step", (n_rows, n_chan))):
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise ValueError(f"Calibration.{name} must be float32 {shape}, got {t.dtype} {tuple(t.shape)}")

    @property
    def rows(self) -> int:
        return self.num_layers // self.layer_group * 2 * self.groups

    @property
    def channels(self) -> int:
        return self.layer_group * self.num_kv_heads // self.groups * self.head_dim

    @property
    def layer_rows(self) -> int:
        """(layer, k/v, head group) rows: what `Allocation.row_scale` and a model metric are given per."""
        return self.num_layers * 2 * self.groups

    @cached_property
    def inv_step(self) -> torch.Tensor:
        """[B, C]: 1/step, 0 for dropped components (so their code is always 0)."""
        return torch.where(self.step > 0, 1.0 / self.step.clamp_min(1e-30), torch.zeros_like(self.step))

    @cached_property
    def kept(self) -> torch.Tensor:
        """[B, C] bool: the components that are coded."""
        return self.step > 0

    @cached_property
    def kept_counts(self) -> torch.Tensor:
        """[B] int64: kept components per row."""
        return self.kept.sum(dim=1)

    @cached_property
    def kept_analysis(self) -> torch.Tensor:
        """[R, C]: the analysis columns of the kept components, row after row (the encode's matrix,
        `kernels.transform_ref.project_quantize_kept`), and their 1/step, [R], in `kept_inv_step`."""
        return self.analysis.transpose(1, 2)[self.kept].contiguous()

    @cached_property
    def kept_inv_step(self) -> torch.Tensor:
        return self.inv_step[self.kept].contiguous()

    @cached_property
    def kept_synthesis(self) -> torch.Tensor:
        """[R, C]: the synthesis rows of the kept components, row after row, each scaled by its step
        (the decode's matrix, `kernels.transform_ref.dequantize_backproject_kept`)."""
        return (self.step[:, :, None] * self.synthesis)[self.kept].contiguous()

    @cached_property
    def to_bytes(self) -> bytes:
        v3 = self.rope_inv_freq is not None or self.allocation.sink_tokens or self.allocation.row_scale
        header = {"format": FORMAT_V4 if self.layer_group > 1 else FORMAT_V3 if v3 else FORMAT,
                  "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                  "groups": self.groups, "source": self.source, "allocation": self.allocation.to_json()}
        if self.layer_group > 1:  # (absent at 1: v2 and v3 bytes, hence ids, are unchanged)
            header["layer_group"] = self.layer_group
        if self.rope_inv_freq is not None:
            header["rope_inv_freq"] = [float(f) for f in self.rope_inv_freq]  # float32 -> float: exact in JSON
            header["max_position"] = self.max_position
        head = json.dumps(header, sort_keys=True).encode()
        out = io.BytesIO()
        out.write(MAGIC)
        out.write(len(head).to_bytes(4, "little"))
        out.write(head)
        for t in (self.mean, self.analysis, self.synthesis, self.std, self.step):
            out.write(t.contiguous().numpy().astype("<f4").tobytes())
        return out.getvalue()

    @cached_property
    def id(self) -> str:
        """Content address: SHA-256 of `to_bytes`, 64 hex digits."""
        return hashlib.sha256(self.to_bytes).hexdigest()

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> "Calibration":
        """Inverse of `to_bytes`; trailing bytes (padding of a stored block) are ignored. ValueError
        for anything else (a forged header's field of the wrong type included)."""
        try:
            return cls._from_bytes(bytes(raw))
        except (TypeError, KeyError, OverflowError, AttributeError) as exc:
            raise ValueError(f"calibration header is malformed: {type(exc).__name__}: {str(exc)[:200]}") from None

    @classmethod
    def _from_bytes(cls, raw: bytes) -> "Calibration":
        if not raw.startswith(MAGIC):
            raise ValueError("not a kvstore calibration (bad magic)")
        n_head = int.from_bytes(raw[len(MAGIC):len(MAGIC) + 4], "little")
        offset = len(MAGIC) + 4
        header = json.loads(raw[offset:offset + n_head])
        if header.get("format") not in FORMATS:
            raise ValueError(f"calibration format {header.get('format')!r} is not one of {FORMATS}; "
                             f"recalibrate with this kvstore (`kvstore calibrate`)")
        offset += n_head
        sizes = [header[k] for k in ("num_layers", "num_kv_heads", "head_dim", "groups")] + [header.get("layer_group", 1)]
        if not all(type(v) is int for v in sizes):  # (not bool, float or str: ids name canonical bytes)
            raise ValueError(f"calibration header sizes must be integers, got {sizes!r:.200}")
        n_layers, n_heads, head_dim, groups, layer_group = sizes
        if not (n_layers > 0 and n_heads > 0 and head_dim > 0 and groups > 0 and n_heads % groups == 0):
            raise ValueError(f"calibration header has a bad layout: {n_layers} layers, {n_heads} kv heads, "
                             f"head_dim {head_dim}, {groups} groups")
        check_layer_group(layer_group, n_layers, n_heads // groups * head_dim)
        n_rows, n_chan = n_layers // layer_group * 2 * groups, layer_group * n_heads // groups * head_dim
        tensors = []
        for shape in ((n_rows, n_chan), (n_rows, n_chan, n_chan), (n_rows, n_chan, n_chan), (n_rows, n_chan),
                      (n_rows, n_chan)):
            n = int(np.prod(shape))
            if offset + 4 * n > len(raw):
                raise ValueError("calibration bytes are truncated")
            tensors.append(torch.from_numpy(np.frombuffer(raw, dtype="<f4", count=n, offset=offset).copy()).view(shape))
            offset += 4 * n
        freq = header.get("rope_inv_freq")
        calibration = cls(n_layers, n_heads, head_dim, groups, *tensors,
                          allocation=Allocation(**header["allocation"]), source=header.get("source", ""),
                          rope_inv_freq=None if freq is None else torch.tensor(freq, dtype=torch.float32),
                          max_position=int(header.get("max_position", 0)), layer_group=layer_group)
        return calibration

    def block_rows(self, block: torch.Tensor) -> torch.Tensor:
        """A block [L, 2, H, T, D] as rows [B, T, C] (a copy)."""
        n_layers, _, n_heads, n_tokens, head_dim = block.shape
        if (n_layers, n_heads, head_dim) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(f"block {tuple(block.shape)} does not match the calibration's layout "
                             f"[{self.num_layers}, 2, {self.num_kv_heads}, T, {self.head_dim}]")
        per_group, lg = n_heads // self.groups, self.layer_group
        # row (layer group, k/v, head group); its channels (layer in group, head in group, d)
        x = block.reshape(n_layers // lg, lg, 2, self.groups, per_group, n_tokens, head_dim)
        return x.permute(0, 2, 3, 5, 1, 4, 6).reshape(self.rows, n_tokens, self.channels)

    def rows_block(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of `block_rows`: rows [B, T, C] -> block [L, 2, H, T, D]."""
        n_tokens = rows.shape[1]
        per_group, lg = self.num_kv_heads // self.groups, self.layer_group
        x = rows.reshape(self.num_layers // lg, 2, self.groups, n_tokens, lg, per_group, self.head_dim)
        return x.permute(0, 4, 1, 2, 5, 3, 6).reshape(self.num_layers, 2, self.num_kv_heads, n_tokens, self.head_dim)

    def with_allocation(self, allocation: Allocation) -> "Calibration":
        """The same bases with another bit allocation (a new id); per-layer rows only (a layer-grouped
        calibration's steps are inside its bases: make it again from the statistics)."""
        if self.layer_group > 1:
            raise ValueError(f"calibration {self.id[:12]} groups {self.layer_group} layers a row: its steps are folded "
                             "into its bases, so another allocation needs the statistics (calibrate again)")
        step = allocation_steps(self.std, row_rms(self.std), allocation, self.groups)
        return Calibration(self.num_layers, self.num_kv_heads, self.head_dim, self.groups, self.mean, self.analysis,
                           self.synthesis, self.std, step, allocation, self.source, self.rope_inv_freq, self.max_position)

    @cached_property
    def is_key_row(self) -> torch.Tensor:
        """[B] bool: rows that hold keys (row b = (l * 2 + kv) * G + g)."""
        return (torch.arange(self.rows) // self.groups) % 2 == 0


def check_layer_group(layer_group: int, num_layers: int, layer_channels: int) -> None:
    """ValueError unless ``layer_group`` layers of ``layer_channels`` each make a row: a positive
    divisor of ``num_layers``, at most `MAX_GROUP_CHANNELS` channels when above 1."""
    if not (isinstance(layer_group, int) and layer_group >= 1 and num_layers % layer_group == 0):
        raise ValueError(f"layer_group must be a positive divisor of the {num_layers} layers, got {layer_group!r}")
    if layer_group > 1 and layer_group * layer_channels > MAX_GROUP_CHANNELS:
        raise ValueError(f"layer_group {layer_group} makes rows of {layer_group * layer_channels} channels; at most "
                         f"{MAX_GROUP_CHANNELS} (a row's two [C, C] matrices grow as C^2)")


def row_rms(std: torch.Tensor) -> torch.Tensor:
    """[B]: RMS over components of each row's std (the row's RMS about its mean)."""
    return std.pow(2).mean(dim=1).sqrt()


def allocation_steps(std: torch.Tensor, rms: torch.Tensor, allocation: Allocation, groups: int) -> torch.Tensor:
    """[B, C] steps: rel_step * rms per row, 0 where std < drop * step."""
    n_rows = std.shape[0]
    is_key = (torch.arange(n_rows) // groups) % 2 == 0  # row b = (l * 2 + kv) * G + g
    rel = torch.where(is_key, torch.tensor(allocation.key_step), torch.tensor(allocation.value_step))
    if allocation.row_scale:
        if len(allocation.row_scale) != n_rows:
            raise ValueError(f"allocation.row_scale has {len(allocation.row_scale)} factors for {n_rows} rows")
        rel = rel * torch.tensor(allocation.row_scale)
    step = (rel * rms)[:, None].expand_as(std).clone()  # [B, C]
    step[std < allocation.drop * step] = 0.0
    return step.float()


def turn_keys(block: torch.Tensor, start: int, inv_freq: torch.Tensor, to_rope: bool,
              kernels_choice: str | None = None) -> torch.Tensor:
    """block [L, 2, H, T, D] float32 with its keys turned in place and returned::

        to_rope=False   stored keys at positions start..start+T-1  ->  keys at position 0 (before RoPE)
        to_rope=True    the inverse

    RoPE rotations of one frequency compose by adding angles, so this is `rerotate_keys` between
    the block's positions and 0 (Triton on CUDA tensors, the torch reference otherwise).
    """
    import kernels

    if block.dtype != torch.float32:
        raise ValueError(f"turn_keys works in float32, got {block.dtype}")
    n_tokens = block.shape[3]
    positions = torch.arange(start, start + n_tokens, device=block.device)
    zeros = torch.zeros_like(positions)
    old, new = (zeros, positions) if to_rope else (positions, zeros)
    keys = block[:, 0]  # [L, H, T, D], a strided view
    kernels.rope_ops(keys, kernels_choice).rerotate_keys(keys, old, new, inv_freq.to(block.device), out=keys)
    return block
