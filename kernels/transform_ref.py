"""Torch references for the transform codec's hot loops (the CPU path); Triton twins in transform.py.

A KV block is cut into B rows of vectors: row b = (layer, k/v, head group), each a [T, C] matrix
of T tokens and C = heads_per_group * head_dim channels. Each row has a calibrated mean [C], an
analysis matrix [C, K] (principal components as columns, K <= C), the synthesis matrix [K, C]
that inverts it (its transpose when the basis is orthonormal) and a quantization step per
component [K] (0 = the component is dropped: 0 bits, code 0)::

    encode   y = (x - mean) @ analysis          [T, C] @ [C, K] -> [T, K]
             code = clamp(floor(y * inv_step + 1/2), -CODE_MAX, CODE_MAX)     int32
    decode   x' = (code * step) @ synthesis + mean                          [T, K] @ [K, C] -> [T, C]

Rounding is floor(v + 1/2) in float32, the same in both implementations; a kernel's matmul sums
in another order, so a code may differ from the reference's by one where y * inv_step lies within
float32 rounding of a half-integer (tests/test_transform_kernels.py bounds how often).
"""

from __future__ import annotations

import torch

CODE_MAX = 2**15 - 1  # codes are stored as int16 at most; the entropy stage sees them as int32


def check_project_args(x: torch.Tensor, mean: torch.Tensor, analysis: torch.Tensor, inv_step: torch.Tensor) -> None:
    """ValueError unless x [B, T, C], mean [B, C], analysis [B, C, K], inv_step [B, K] agree (float32 params)."""
    if x.dim() != 3 or mean.dim() != 2 or analysis.dim() != 3 or inv_step.dim() != 2:
        raise ValueError(f"want x [B, T, C], mean [B, C], analysis [B, C, K], inv_step [B, K]; got "
                         f"{tuple(x.shape)}, {tuple(mean.shape)}, {tuple(analysis.shape)}, {tuple(inv_step.shape)}")
    n_rows, _, n_chan = x.shape
    if mean.shape != (n_rows, n_chan) or analysis.shape[:2] != (n_rows, n_chan) or inv_step.shape != (n_rows, analysis.shape[2]):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, mean {tuple(mean.shape)}, analysis {tuple(analysis.shape)}, "
                         f"inv_step {tuple(inv_step.shape)}")
    for name, t in (("mean", mean), ("analysis", analysis), ("inv_step", inv_step)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")


def project_quantize(x: torch.Tensor, mean: torch.Tensor, analysis: torch.Tensor, inv_step: torch.Tensor) -> torch.Tensor:
    """Codes [B, T, K] int32 of x [B, T, C] through each row's analysis [B, C, K], step 1/inv_step [B, K]."""
    check_project_args(x, mean, analysis, inv_step)
    y = torch.bmm(x.float() - mean[:, None, :], analysis)  # [B, T, C] @ [B, C, K] -> [B, T, K]
    codes = torch.floor(y * inv_step[:, None, :] + 0.5)  # [B, T, K]
    return codes.clamp_(-CODE_MAX, CODE_MAX).to(torch.int32)


def project_quantize_kept(x: torch.Tensor, mean: torch.Tensor, analysis: torch.Tensor, counts: torch.Tensor,
                          inv_step: torch.Tensor) -> torch.Tensor:
    """The kept components' codes only, [R, T] int32 (row b's K_b = counts[b] of them, rows in order):
    x [B, T, C], mean [B, C], analysis [R, C] (each kept component's analysis column, `Calibration.kept_analysis`),
    inv_step [R]. The same codes as `project_quantize` at the kept components except where a value lies
    within float32 rounding of a half-integer (the products sum in another order), in one matrix
    product per row over the kept components only::

        codes_b = clamp(floor(analysis_b [K_b, C] @ (x_b - mean_b)^T [C, T] * inv_step_b + 1/2))
    """
    if x.dim() != 3 or mean.shape != (x.shape[0], x.shape[2]) or analysis.dim() != 2 \
            or analysis.shape[1] != x.shape[2] or inv_step.shape != (analysis.shape[0],) \
            or counts.shape != (x.shape[0],) or int(counts.sum()) != analysis.shape[0]:
        raise ValueError(f"want x [B, T, C], mean [B, C], analysis [R, C], counts [B] summing to R, inv_step [R]; got "
                         f"{tuple(x.shape)}, {tuple(mean.shape)}, {tuple(analysis.shape)}, {tuple(counts.shape)}, "
                         f"{tuple(inv_step.shape)}")
    centred = x.float() - mean[:, None, :]  # [B, T, C]
    y = torch.empty(analysis.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [R, T]
    start = 0
    for b, k in enumerate(counts.tolist()):
        if k:
            torch.mm(analysis[start:start + k], centred[b].T, out=y[start:start + k])
        start += k
    y.mul_(inv_step[:, None]).add_(0.5).floor_()
    return y.clamp_(-CODE_MAX, CODE_MAX).to(torch.int32)


def check_backproject_kept_args(codes: torch.Tensor, counts: torch.Tensor, synthesis: torch.Tensor,
                                mean: torch.Tensor, dtype: torch.dtype) -> None:
    """ValueError unless codes [R, T] int, counts [B] (summing to R), synthesis [R, C], mean [B, C] float32 agree."""
    if codes.dim() != 2 or counts.dim() != 1 or synthesis.dim() != 2 or mean.dim() != 2:
        raise ValueError(f"want codes [R, T], counts [B], synthesis [R, C], mean [B, C]; got {tuple(codes.shape)}, "
                         f"{tuple(counts.shape)}, {tuple(synthesis.shape)}, {tuple(mean.shape)}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    if synthesis.shape[0] != codes.shape[0] or int(counts.sum()) != codes.shape[0] or counts.shape[0] != mean.shape[0] \
            or synthesis.shape[1] != mean.shape[1] or bool((counts < 0).any()):
        raise ValueError(f"codes {tuple(codes.shape)}, counts (sum {int(counts.sum())}), synthesis "
                         f"{tuple(synthesis.shape)} and mean {tuple(mean.shape)} disagree")
    for name, t in (("synthesis", synthesis), ("mean", mean)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"output dtype must be float16, bfloat16 or float32, got {dtype}")


def dequantize_backproject_kept(codes: torch.Tensor, counts: torch.Tensor, synthesis: torch.Tensor,
                                mean: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x' [B, T, C] from the kept components only: codes [R, T] (row b's K_b = counts[b] kept codes,
    rows in order), their synthesis rows already scaled by the step, [R, C] (`Calibration.kept_synthesis`).

    The same x' as `dequantize_backproject` up to float32 rounding (step * synthesis is rounded once
    here, code * step there), in one matrix product per row over its kept components only::

        x'_b = codes_b^T [T, K_b] @ (step * synthesis)_b [K_b, C] + mean_b
    """
    check_backproject_kept_args(codes, counts, synthesis, mean, dtype)
    n_rows, n_chan = mean.shape
    y = codes.float()  # [R, T]
    out = torch.empty(n_rows, codes.shape[1], n_chan, dtype=torch.float32, device=codes.device)
    start = 0
    for b, k in enumerate(counts.tolist()):
        if k:
            torch.addmm(mean[b], y[start:start + k].T, synthesis[start:start + k], out=out[b])
        else:
            out[b] = mean[b]
        start += k
    return out if dtype == torch.float32 else out.to(dtype)


def check_backproject_args(codes: torch.Tensor, step: torch.Tensor, synthesis: torch.Tensor, mean: torch.Tensor,
                           dtype: torch.dtype) -> None:
    """ValueError unless codes [B, T, K] int, step [B, K], synthesis [B, K, C], mean [B, C] (float32) agree."""
    if codes.dim() != 3 or synthesis.dim() != 3 or codes.shape[0] != synthesis.shape[0] or codes.shape[2] != synthesis.shape[1]:
        raise ValueError(f"codes {tuple(codes.shape)} do not match synthesis {tuple(synthesis.shape)} ([B, T, K], [B, K, C])")
    if step.shape != codes.shape[::2] or mean.shape != (synthesis.shape[0], synthesis.shape[2]):
        raise ValueError(f"step {tuple(step.shape)} / mean {tuple(mean.shape)} do not match synthesis {tuple(synthesis.shape)}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    for name, t in (("step", step), ("synthesis", synthesis), ("mean", mean)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"output dtype must be float16, bfloat16 or float32, got {dtype}")


def dequantize_backproject(codes: torch.Tensor, step: torch.Tensor, synthesis: torch.Tensor, mean: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """x' [B, T, C] in dtype from codes [B, T, K] (any int dtype), step [B, K], synthesis [B, K, C], mean [B, C]."""
    check_backproject_args(codes, step, synthesis, mean, dtype)
    y = codes.float() * step[:, None, :]  # [B, T, K]
    x = torch.bmm(y, synthesis)  # [B, T, K] @ [B, K, C] -> [B, T, C]
    return (x + mean[:, None, :]).to(dtype)
