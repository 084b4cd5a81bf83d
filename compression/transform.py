"""The calibrated transform codec (KVTC-style): project, quantize, entropy-code.

    codec = get_codec("kvtc@3fa9c2d1e0b4")    # a calibration id (prefix of >= 8 hex digits)
    encoded = codec.encode(block)             # params carry the full calibration id
    block2 = decode_block(encoded, shape, dtype)   # resolves the calibration by id

Per block [L, 2, H, T, D]: rows (layer, k/v, head group) of T token vectors [C] are centred and
projected on the calibration's PCA basis, each component quantized with its step (the bit
allocation; dropped components cost 0 bits), and the kept components' codes, one row per
component over the block's tokens, entropy-coded (`compression/entropy.py`)::

    x [B, T, C] --(x - mean) @ basis, / step, round--> codes [B, T, C] --kept--> [R, T] --rans--> bytes

Spec: ``kvtc[-zstd]@<calibration id>``: ``kvtc`` codes with range-ANS, ``kvtc-zstd`` with zstd.

Error bound per token vector (basis orthonormal): the error is basis @ (y' - y), so every element
is at most its L2 norm, sqrt(sum over kept of (step/2)^2 + sum over dropped of y^2), plus float32
rounding of the two matmuls and the cast to the block dtype (`error_bound`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import kernels
from compression.base import DTYPE_EPS, Codec, EncodedBlock, check_block, register_calibrated, split_sections
from compression.calibration import Calibration
from compression.calibration_store import resolve
from compression.entropy import ENTROPY_CODERS, decode_rows, encode_rows
from kernels import transform_ref

SPEC_PREFIX = "kvtc"
ID_DIGITS = 12  # calibration id digits in the canonical spec (the full id is in params)


class TransformCodec(Codec):
    """Calibrated PCA transform + uniform quantization + entropy coding; lossy (see `error_bound`)."""

    def __init__(self, calibration: str | Calibration, entropy: str = "rans", kernels_choice: str | None = None):
        if entropy not in ENTROPY_CODERS:
            raise ValueError(f"entropy coder must be one of {ENTROPY_CODERS}, got {entropy!r}")
        self._calibration = calibration if isinstance(calibration, Calibration) else None
        self._calibration_ref = calibration.id if isinstance(calibration, Calibration) else calibration
        self.entropy = entropy
        self.kernels_choice = kernels_choice
        head = SPEC_PREFIX if entropy == "rans" else f"{SPEC_PREFIX}-{entropy}"
        self.name = f"{head}@{self._calibration_ref[:ID_DIGITS]}"

    @property
    def calibration(self) -> Calibration:
        if self._calibration is None:
            self._calibration = resolve(self._calibration_ref)
        return self._calibration

    def encode(self, block: torch.Tensor) -> EncodedBlock:
        check_block(block)
        cal = self.calibration
        rows = cal.block_rows(block)  # [B, T, C]
        device = rows.device
        op = kernels.transform_ops(rows, self.kernels_choice)
        codes = op.project_quantize(rows, cal.mean.to(device), cal.analysis.to(device), cal.inv_step.to(device))  # [B, T, C]
        kept = codes.transpose(1, 2)[cal.kept.to(device)]  # [R, T]: one row per kept component
        stream = encode_rows(kept.cpu().numpy(), self.entropy)
        params = {"calibration": cal.id, "entropy": self.entropy, "sections": [["stream", len(stream), 1]]}
        return EncodedBlock(stream, params, self.name)

    def decode(self, payload, params, shape, dtype, device="cpu") -> torch.Tensor:
        wanted = str(params["calibration"])
        own = self._calibration
        cal = own if own is not None and own.id == wanted else resolve(wanted)
        if len(shape) != 5 or shape[1] != 2:
            raise ValueError(f"shape must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(shape)}")
        if (shape[0], shape[2], shape[4]) != (cal.num_layers, cal.num_kv_heads, cal.head_dim):
            raise ValueError(f"shape {tuple(shape)} does not match calibration {cal.id[:12]} "
                             f"[{cal.num_layers}, 2, {cal.num_kv_heads}, T, {cal.head_dim}]")
        n_tokens = shape[3]
        stream = bytes(split_sections(payload, [("stream", len(payload), 1)])["stream"].numpy())
        kept_mask = cal.kept  # [B, C]
        kept = decode_rows(stream, int(kept_mask.sum()), n_tokens, str(params["entropy"]))  # [R, T]
        codes = torch.zeros(cal.rows, cal.channels, n_tokens, dtype=torch.int32)  # [B, C, T]
        codes[kept_mask] = torch.from_numpy(kept)
        codes = codes.to(device).transpose(1, 2)  # [B, T, C] (a view)
        op = kernels.transform_ops(codes, self.kernels_choice)
        rows = op.dequantize_backproject(codes, cal.step.to(device), cal.synthesis.to(device), cal.mean.to(device), dtype)
        return cal.rows_block(rows)

    def error_bound(self, block: torch.Tensor) -> float:
        cal = self.calibration
        rows = cal.block_rows(block).float()  # [B, T, C]
        y = torch.bmm(rows - cal.mean[:, None, :], cal.analysis)  # [B, T, C]
        half = (cal.step / 2)[:, None, :].expand_as(y)  # [B, T, C]
        clipped = y.abs() * cal.inv_step[:, None, :] > transform_ref.CODE_MAX
        per = torch.where(cal.kept[:, None, :] & ~clipped, half, y.abs())  # |y' - y| per component, at most
        # |x' - x|_c = |sum_k (y' - y)_k synthesis[k, c]| <= |y' - y|_2 * |synthesis[:, c]|_2 (Cauchy-Schwarz)
        gain = cal.synthesis.pow(2).sum(1).sqrt().amax(-1)  # [B]
        err = per.pow(2).sum(-1).sqrt() * gain[:, None]  # [B, T]
        # float32 matmuls: ~C ulps of the largest partial sums, on the way in and out
        y_amax = y.abs().amax(-1)  # [B, T]
        fp32 = 4 * cal.channels * 2.0**-24 * (rows.abs().amax(-1) + cal.mean.abs().amax(-1)[:, None] + y_amax * gain[:, None]
                                                + y_amax * cal.analysis.abs().amax((1, 2))[:, None])
        bound = err * (1 + 1e-5) + fp32 + (rows.abs().amax(-1) + err) * DTYPE_EPS[block.dtype]
        return float(bound.max())


def parse_spec(head: str) -> TransformCodec:
    """``kvtc@<id>`` or ``kvtc-<coder>@<id>`` -> the codec; ValueError with the expected form."""
    name, at, ref = head.partition("@")
    coder = name[len(SPEC_PREFIX) + 1:] if name.startswith(SPEC_PREFIX + "-") else "rans"
    if not at or not ref or name not in (SPEC_PREFIX, f"{SPEC_PREFIX}-{coder}") or coder not in ENTROPY_CODERS:
        raise ValueError(f"transform codec spec is kvtc@<calibration id> or kvtc-zstd@<calibration id>, got {head!r}")
    if not all(c in "0123456789abcdef" for c in ref) or len(ref) < 8:
        raise ValueError(f"calibration id in {head!r} must be >= 8 lower-case hex digits (see `kvstore calibrate`)")
    return TransformCodec(ref, coder)


def stats(codec: TransformCodec, block: torch.Tensor) -> dict[str, Any]:
    """Kept components and bits per kept code of one block, for benchmarks."""
    cal = codec.calibration
    encoded = codec.encode(block)
    n_codes = int(cal.kept.sum()) * block.shape[3]
    return {"kept_components": int(cal.kept.sum()), "of": cal.rows * cal.channels,
            "bits_per_code": 8 * encoded.nbytes / n_codes if n_codes else math.nan,
            "bits_per_value": 8 * encoded.nbytes / block.numel()}


register_calibrated(SPEC_PREFIX, parse_spec)
