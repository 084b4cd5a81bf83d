"""Torch reference for RoPE re-rotation (`kernels/rope.py` has the Triton kernel, same signature).

Cached keys are stored after RoPE at the positions they were computed at. Moving a key from
position `old` to position `new` is one more rotation by `delta = new - old`, because RoPE
rotations of one frequency compose by adding angles::

    k_new = k_old * cos(delta * f) + rotate_half(k_old) * sin(delta * f)

with the half-split layout of `engine_adapter.reference.model.rotate_half` (pairs (i, i + D/2) share the
frequency f_i = inv_freq[i]). Linear and llama3 RoPE scaling only change `inv_freq`, never the
linearity in position, so the same formula holds for them.

Exactness for any offset: `delta * f` in fp32 loses ~|delta| * 6e-8 rad, which is 3e-3 rad at
delta = 50k. So the angle is formed in float64 and reduced modulo 2*pi before the fp32 cos, sin
and rotation: the result is the key rotated by the exact angle to fp32 rounding (~1e-6 relative)
for any |delta| < 2**31, negative deltas included.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TWO_PI = 2.0 * math.pi


def check_rerotate_args(keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                        inv_freq: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise ValueError unless the arguments fit: keys [..., T, D], positions [T], inv_freq [D/2]."""
    if keys.dtype not in FLOAT_DTYPES:
        raise ValueError(f"keys must be one of {FLOAT_DTYPES}, got {keys.dtype}")
    if keys.dim() < 2:
        raise ValueError(f"keys must be [..., tokens, head_dim], got shape {tuple(keys.shape)}")
    tokens, head_dim = keys.shape[-2], keys.shape[-1]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    for name, pos in (("old_positions", old_positions), ("new_positions", new_positions)):
        if pos.shape != (tokens,) or pos.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32/int64 tensor [{tokens}], got {pos.dtype} {tuple(pos.shape)}")
        if pos.device != keys.device:
            raise ValueError(f"{name} is on {pos.device}, keys on {keys.device}; move them to one device")
    if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32 [{head_dim // 2}], got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if out is not None and (out.shape != keys.shape or out.dtype != keys.dtype or out.device != keys.device):
        raise ValueError(f"out must match keys ({keys.dtype} {tuple(keys.shape)}), got {out.dtype} {tuple(out.shape)}")


def as_4d(x: torch.Tensor) -> torch.Tensor:
    """A [A, B, T, D] view of x [..., T, D]: missing leading dims added, extra ones folded where
    strides allow (else ValueError). Always a view, so a kernel writing into it writes into x."""
    lead = x.shape[:-2]
    if len(lead) < 2:
        return x[(None,) * (2 - len(lead))]
    try:
        return x.view(-1, lead[-1], *x.shape[-2:])
    except RuntimeError as exc:
        raise ValueError(f"keys of shape {tuple(x.shape)} and strides {x.stride()} cannot be viewed as "
                         "[A, B, T, D]; pass .contiguous() keys") from exc


def rotation_angles(old_positions: torch.Tensor, new_positions: torch.Tensor,
                    inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] in float32 of (new - old) * inv_freq, formed in float64 mod 2*pi."""
    delta = (new_positions.to(torch.int64) - old_positions.to(torch.int64)).to(torch.float64)  # [T]
    angles = torch.remainder(delta[:, None] * inv_freq.to(delta.device, torch.float64)[None, :], TWO_PI)
    angles = angles.float()  # [T, D/2]
    return angles.cos(), angles.sin()


def rerotate_keys(keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                  inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Keys [..., T, D] rotated from `old_positions` [T] to `new_positions` [T]; returns `out`.

    `out` may be `keys` itself (in place). Math in float32, result cast to the keys' dtype.
    """
    check_rerotate_args(keys, old_positions, new_positions, inv_freq, out)
    cos, sin = rotation_angles(old_positions, new_positions, inv_freq)  # [T, D/2]
    half = keys.shape[-1] // 2
    x = keys.float()
    x1, x2 = x[..., :half], x[..., half:]  # [..., T, D/2] each
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [..., T, D]
    if out is None:
        return rotated.to(keys.dtype)
    out.copy_(rotated)
    return out
