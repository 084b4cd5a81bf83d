"""Triton RoPE re-rotation: move cached keys from the positions they were stored at to new ones.

The math, the angle precision (float64, reduced mod 2*pi, then fp32) and the half-split layout are
in `kernels/rope_ref.py`, whose `rerotate_keys` has the same signature. One program rotates
BLOCK_T tokens of one (a, b) row of a [A, B, T, D] view; leading dims are folded into (A, B) so a
block's K half `block[:, 0]` ([layers, kv_heads, T, D], strided) is rotated without a copy.

Launchers check shapes, strides and dtypes and raise ValueError before launch. They run on CUDA
tensors, or on CPU tensors when TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rope_ref import TWO_PI, as_4d, check_rerotate_args

BLOCK_T = 64


@triton.jit
def _rerotate_kernel(
    p_x, p_out, p_old, p_new, p_freq,
    n_tokens, half,
    stride_xa, stride_xb, stride_xt, stride_xd,
    stride_oa, stride_ob, stride_ot, stride_od,
    TWO_PI_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i_t, i_b, i_a = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    o_h = tl.arange(0, BLOCK_H)  # [BH] frequency index, first half of head_dim
    m_t = o_t < n_tokens
    m_h = o_h < half
    m_x = m_t[:, None] & m_h[None, :]  # [BT, BH]
    b_old = tl.load(p_old + o_t, mask=m_t, other=0).to(tl.int64)  # [BT]
    b_new = tl.load(p_new + o_t, mask=m_t, other=0).to(tl.int64)  # [BT]
    b_freq = tl.load(p_freq + o_h, mask=m_h, other=0.0).to(tl.float64)  # [BH]
    b_ang = (b_new - b_old).to(tl.float64)[:, None] * b_freq[None, :]  # [BT, BH] float64
    b_ang = b_ang - tl.floor(b_ang / TWO_PI_C) * TWO_PI_C  # in [0, 2pi)
    b_ang = b_ang.to(tl.float32)
    b_cos, b_sin = tl.cos(b_ang), tl.sin(b_ang)  # [BT, BH]
    p_x1 = p_x + i_a * stride_xa + i_b * stride_xb + o_t[:, None] * stride_xt + o_h[None, :] * stride_xd
    b_x1 = tl.load(p_x1, mask=m_x, other=0.0).to(tl.float32)  # [BT, BH]
    b_x2 = tl.load(p_x1 + half * stride_xd, mask=m_x, other=0.0).to(tl.float32)  # [BT, BH]
    b_y1 = b_x1 * b_cos - b_x2 * b_sin
    b_y2 = b_x2 * b_cos + b_x1 * b_sin
    p_o1 = p_out + i_a * stride_oa + i_b * stride_ob + o_t[:, None] * stride_ot + o_h[None, :] * stride_od
    tl.store(p_o1, b_y1.to(p_out.dtype.element_ty), mask=m_x)
    tl.store(p_o1 + half * stride_od, b_y2.to(p_out.dtype.element_ty), mask=m_x)


def rerotate_keys(keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                  inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Keys [..., T, D] rotated from `old_positions` [T] to `new_positions` [T]; returns `out`.

    `out` may be `keys` itself (in place: each element is read before it is written, by the same
    program). Any strides; math in float32 with float64 angles (see `rope_ref.py`).
    """
    check_rerotate_args(keys, old_positions, new_positions, inv_freq, out)
    if out is None:
        out = torch.empty_like(keys)
    tokens, head_dim = keys.shape[-2], keys.shape[-1]
    if keys.numel() == 0:
        return out
    x, o = as_4d(keys), as_4d(out)
    half = head_dim // 2
    grid = (triton.cdiv(tokens, BLOCK_T), x.shape[1], x.shape[0])
    _rerotate_kernel[grid](
        x, o, old_positions.contiguous(), new_positions.contiguous(), inv_freq.contiguous(),
        tokens, half,
        *x.stride(), *o.stride(),
        TWO_PI_C=TWO_PI, BLOCK_T=BLOCK_T, BLOCK_H=triton.next_power_of_2(half),
    )
    return out

