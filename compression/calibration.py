"""A transform-codec calibration: per (layer, k/v, head group) a PCA basis and a bit allocation.

Learned once per namespace (model, layout, dtype) from the model's own KV (`calibrate`), stored
content-addressed (`Calibration.id` is the SHA-256 of its bytes) and named by that id in every
block's codec params, so any reader that can fetch the id decodes the block; see
`compression/calibration_store.py` for where calibrations live and `docs/compression.md` for the
measurements behind the defaults.

Rows: a block [L, 2, H, T, D] is cut into B = L * 2 * G rows (layer, k/v, group), each [T, C]
with C = (H / G) * D: the heads of one group side by side per token::

    block[l, kv, g*H/G : (g+1)*H/G, t, :]  ->  x[b, t, :]     b = (l * 2 + kv) * G + g

Metric: errors are measured where they act, not in raw KV units. A key error d moves attention
logits by q . d, so keys are coded in a space whitened by the queries' second moment
(E[q q^T] over the query heads that share the KV head); a value error reaches the residual
stream through o_proj, so values are weighted by W_o^T W_o of those heads. With a metric M
(symmetric PSD) and W = M^(1/2), rows are whitened (x W), PCA'd there (basis V), and::

    analysis = W V   [C, C]      synthesis = V^T W^-1   [C, C]      (M = I: analysis = V, synthesis = V^T)

Bit allocation: one quantization step per component. With an entropy coder behind it, a uniform
step is what minimises squared error at a given rate (every kept component pays the same
distortion step^2/12); components whose calibrated standard deviation is below `drop * step` are
dropped (0 bits, decoded as 0). The step of a row is ``rel_step[kv] * rms(row)``: one relative
step for keys, one for values, scaled by each layer's own RMS, since errors relative to a
layer's activations are what the next layer sees.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

FORMAT = "kvstore-calibration-v2"
MAGIC = b"KVCAL1\n"


@dataclass(frozen=True)
class Allocation:
    """How a calibration spends bits: relative steps for keys and values, and the drop threshold."""

    key_step: float  # step = key_step * rms(row) for key rows
    value_step: float  # likewise for value rows
    drop: float = 0.5  # components with calibrated std < drop * step get 0 bits

    def __post_init__(self) -> None:
        if not (self.key_step > 0 and self.value_step > 0):
            raise ValueError(f"steps must be > 0, got key_step={self.key_step} value_step={self.value_step}")
        if not 0 <= self.drop < 100:
            raise ValueError(f"drop must be in [0, 100), got {self.drop}")


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

    def __post_init__(self) -> None:
        if self.num_kv_heads % self.groups:
            raise ValueError(f"groups ({self.groups}) must divide num_kv_heads ({self.num_kv_heads})")
        n_rows, n_chan = self.rows, self.channels
        for name, shape in (("mean", (n_rows, n_chan)), ("analysis", (n_rows, n_chan, n_chan)),
                            ("synthesis", (n_rows, n_chan, n_chan)),
                            ("std", (n_rows, n_chan)), ("step", (n_rows, n_chan))):
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise ValueError(f"Calibration.{name} must be float32 {shape}, got {t.dtype} {tuple(t.shape)}")

    @property
    def rows(self) -> int:
        return self.num_layers * 2 * self.groups

    @property
    def channels(self) -> int:
        return self.num_kv_heads // self.groups * self.head_dim

    @cached_property
    def inv_step(self) -> torch.Tensor:
        """[B, C]: 1/step, 0 for dropped components (so their code is always 0)."""
        return torch.where(self.step > 0, 1.0 / self.step.clamp_min(1e-30), torch.zeros_like(self.step))

    @cached_property
    def kept(self) -> torch.Tensor:
        """[B, C] bool: the components that are coded."""
        return self.step > 0

    @cached_property
    def to_bytes(self) -> bytes:
        header = {"format": FORMAT, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                  "head_dim": self.head_dim, "groups": self.groups, "source": self.source,
                  "allocation": {"key_step": self.allocation.key_step, "value_step": self.allocation.value_step,
                                 "drop": self.allocation.drop}}
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
        """Inverse of `to_bytes`; trailing bytes (padding of a stored block) are ignored."""
        raw = bytes(raw)
        if not raw.startswith(MAGIC):
            raise ValueError("not a kvstore calibration (bad magic)")
        n_head = int.from_bytes(raw[len(MAGIC):len(MAGIC) + 4], "little")
        offset = len(MAGIC) + 4
        header = json.loads(raw[offset:offset + n_head])
        if header.get("format") != FORMAT:
            raise ValueError(f"calibration format {header.get('format')!r} is not {FORMAT!r}")
        offset += n_head
        n_layers, n_heads, head_dim, groups = (int(header[k]) for k in ("num_layers", "num_kv_heads", "head_dim", "groups"))
        n_rows, n_chan = n_layers * 2 * groups, n_heads // groups * head_dim
        tensors = []
        for shape in ((n_rows, n_chan), (n_rows, n_chan, n_chan), (n_rows, n_chan, n_chan), (n_rows, n_chan),
                      (n_rows, n_chan)):
            n = int(np.prod(shape))
            if offset + 4 * n > len(raw):
                raise ValueError("calibration bytes are truncated")
            tensors.append(torch.from_numpy(np.frombuffer(raw, dtype="<f4", count=n, offset=offset).copy()).view(shape))
            offset += 4 * n
        calibration = cls(n_layers, n_heads, head_dim, groups, *tensors,
                          allocation=Allocation(**header["allocation"]), source=header.get("source", ""))
        return calibration

    def block_rows(self, block: torch.Tensor) -> torch.Tensor:
        """A block [L, 2, H, T, D] as rows [B, T, C] (a copy)."""
        n_layers, _, n_heads, n_tokens, head_dim = block.shape
        if (n_layers, n_heads, head_dim) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(f"block {tuple(block.shape)} does not match the calibration's layout "
                             f"[{self.num_layers}, 2, {self.num_kv_heads}, T, {self.head_dim}]")
        per_group = n_heads // self.groups
        x = block.reshape(n_layers, 2, self.groups, per_group, n_tokens, head_dim)
        return x.permute(0, 1, 2, 4, 3, 5).reshape(self.rows, n_tokens, self.channels)

    def rows_block(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of `block_rows`: rows [B, T, C] -> block [L, 2, H, T, D]."""
        n_tokens = rows.shape[1]
        per_group = self.num_kv_heads // self.groups
        x = rows.reshape(self.num_layers, 2, self.groups, n_tokens, per_group, self.head_dim)
        return x.permute(0, 1, 2, 4, 3, 5).reshape(self.num_layers, 2, self.num_kv_heads, n_tokens, self.head_dim)

    def with_allocation(self, allocation: Allocation) -> "Calibration":
        """The same bases with another bit allocation (a new id)."""
        rms = _row_rms(self.std)
        return Calibration(self.num_layers, self.num_kv_heads, self.head_dim, self.groups, self.mean, self.analysis,
                           self.synthesis, self.std, _steps(self.std, rms, allocation, self.groups), allocation, self.source)


def _row_rms(std: torch.Tensor) -> torch.Tensor:
    """[B]: RMS over components of each row's std (the row's RMS about its mean)."""
    return std.pow(2).mean(dim=1).sqrt()


def _steps(std: torch.Tensor, rms: torch.Tensor, allocation: Allocation, groups: int) -> torch.Tensor:
    """[B, C] steps: rel_step * rms per row, 0 where std < drop * step."""
    n_rows = std.shape[0]
    is_key = (torch.arange(n_rows) // groups) % 2 == 0  # row b = (l * 2 + kv) * G + g
    rel = torch.where(is_key, torch.tensor(allocation.key_step), torch.tensor(allocation.value_step))
    step = (rel * rms)[:, None].expand_as(std).clone()  # [B, C]
    step[std < allocation.drop * step] = 0.0
    return step.float()


def calibrate(blocks: list[torch.Tensor], allocation: Allocation, groups: int = 1,
              metric: torch.Tensor | None = None, source: str = "") -> Calibration:
    """A calibration from KV blocks [L, 2, H, T_i, D] of one namespace (any token counts).

    Per row: mean and covariance over all tokens of all blocks (float64); with ``metric``
    [B, C, C] (symmetric PSD per row, e.g. from `compression.calibrate.model_metrics`) the
    covariance is taken in the whitened space; eigenvectors by falling eigenvalue are the basis,
    sqrt(eigenvalue) the component std; steps from `allocation`.
    """
    if not blocks:
        raise ValueError("calibrate needs at least one KV block")
    n_layers, _, n_heads, _, head_dim = blocks[0].shape
    if n_heads % groups:
        raise ValueError(f"groups ({groups}) must divide num_kv_heads ({n_heads})")
    n_chan = n_heads // groups * head_dim
    n_rows = n_layers * 2 * groups
    eye = torch.eye(n_chan).expand(n_rows, n_chan, n_chan)
    probe = Calibration(n_layers, n_heads, head_dim, groups, torch.zeros(n_rows, n_chan), eye.clone(), eye.clone(),
                        torch.zeros(n_rows, n_chan), torch.zeros(n_rows, n_chan), allocation)
    total = torch.zeros(n_rows, n_chan, dtype=torch.float64)
    outer = torch.zeros(n_rows, n_chan, n_chan, dtype=torch.float64)
    n_tokens = 0
    for block in blocks:
        x = probe.block_rows(block).double()  # [B, T, C]
        total += x.sum(dim=1)
        outer += torch.bmm(x.transpose(1, 2), x)  # [B, C, T] @ [B, T, C] -> [B, C, C]
        n_tokens += x.shape[1]
    if n_tokens < 2 * n_chan:
        raise ValueError(f"calibrate needs at least {2 * n_chan} tokens for {n_chan}-channel rows, got {n_tokens}; "
                         f"give it more text")
    mean = total / n_tokens  # [B, C]
    cov = outer / n_tokens - mean[:, :, None] * mean[:, None, :]  # [B, C, C]
    if metric is None:
        whiten = unwhiten = torch.eye(n_chan, dtype=torch.float64).expand(n_rows, n_chan, n_chan)
    else:
        if tuple(metric.shape) != (n_rows, n_chan, n_chan):
            raise ValueError(f"metric must be [{n_rows}, {n_chan}, {n_chan}], got {tuple(metric.shape)}")
        m_val, m_vec = torch.linalg.eigh(metric.double())  # M = U diag(m) U^T
        m_val = m_val.clamp_min(m_val.amax(-1, keepdim=True) * 1e-6)  # keep W invertible
        whiten = m_vec @ torch.diag_embed(m_val.sqrt()) @ m_vec.transpose(1, 2)  # W = M^(1/2)
        unwhiten = m_vec @ torch.diag_embed(m_val.rsqrt()) @ m_vec.transpose(1, 2)  # W^-1
    cov = whiten.transpose(1, 2) @ cov @ whiten  # covariance of x W
    eigval, eigvec = torch.linalg.eigh(cov)  # ascending
    eigval, eigvec = eigval.flip(-1).clamp_min(0), eigvec.flip(-1)  # by falling variance
    std = eigval.sqrt().float()
    analysis = (whiten @ eigvec).float().contiguous()  # [B, C, C]
    synthesis = (eigvec.transpose(1, 2) @ unwhiten).float().contiguous()  # [B, C, C]
    step = _steps(std, _row_rms(std), allocation, groups)
    return Calibration(n_layers, n_heads, head_dim, groups, mean.float(), analysis, synthesis, std, step,
                       allocation, source)
