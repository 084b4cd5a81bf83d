"""Triton kernels for the transform codec, each beside its torch reference in `kernels/transform_ref.py`.

    project_quantize        codes = clamp(floor(((x - mean) @ analysis) * inv_step + 1/2))   [B, T, K] int32
    dequantize_backproject  x' = (codes * step) @ synthesis + mean                            [B, T, C] dtype

One program computes a [BLOCK_T, BLOCK_N] tile of one row b's output, looping over the inner
dimension in BLOCK_I slices (tl.dot in IEEE fp32, no TF32, so codes stay those of the reference
except where a value lies within float32 rounding of a half-integer)::

    grid = (B, cdiv(T, BLOCK_T), cdiv(N, BLOCK_N))        N = K (project) or C (back-project)

Launchers check shapes, strides and dtypes before launch; they run on CUDA tensors, or on CPU
tensors when TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.transform_ref import CODE_MAX, check_backproject_args, check_project_args

BLOCK_T = 32
BLOCK_N = 32
BLOCK_I = 32
_OUT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _project_quantize_kernel(
    p_x, p_mean, p_a, p_inv, p_codes,
    n_tokens, n_chan, n_comp,
    s_xb, s_xt, s_xc,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, CODE_MAX: tl.constexpr,
):
    i_b, i_t, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] tokens
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] components
    m_t, m_n = o_t < n_tokens, o_n < n_comp
    b_acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for i_i in range(0, tl.cdiv(n_chan, BLOCK_I)):
        o_c = i_i * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI] channels
        m_c = o_c < n_chan
        p_xt = p_x + i_b * s_xb + o_t[:, None] * s_xt + o_c[None, :] * s_xc
        b_x = tl.load(p_xt, mask=m_t[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [BT, BI]
        b_mean = tl.load(p_mean + i_b * n_chan + o_c, mask=m_c, other=0.0)  # [BI]
        b_x = tl.where(m_c[None, :], b_x - b_mean[None, :], 0.0)
        p_at = p_a + i_b * n_chan * n_comp + o_c[:, None] * n_comp + o_n[None, :]
        b_a = tl.load(p_at, mask=m_c[:, None] & m_n[None, :], other=0.0)  # [BI, BN]
        b_acc += tl.dot(b_x, b_a, input_precision="ieee")  # [BT, BI] @ [BI, BN] -> [BT, BN]
    b_inv = tl.load(p_inv + i_b * n_comp + o_n, mask=m_n, other=0.0)  # [BN]
    b_q = tl.floor(b_acc * b_inv[None, :] + 0.5)
    b_q = tl.minimum(tl.maximum(b_q, -CODE_MAX * 1.0), CODE_MAX * 1.0)
    p_out = p_codes + i_b * n_tokens * n_comp + o_t[:, None] * n_comp + o_n[None, :]
    tl.store(p_out, b_q.to(tl.int32), mask=m_t[:, None] & m_n[None, :])


@triton.jit
def _dequantize_backproject_kernel(
    p_codes, p_step, p_s, p_mean, p_out,
    n_tokens, n_comp, n_chan,
    s_qb, s_qt, s_qk,
    OUT_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
):
    i_b, i_t, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] tokens
    o_c = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] channels
    m_t, m_c = o_t < n_tokens, o_c < n_chan
    b_acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for i_i in range(0, tl.cdiv(n_comp, BLOCK_I)):
        o_k = i_i * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI] components
        m_k = o_k < n_comp
        p_qt = p_codes + i_b * s_qb + o_t[:, None] * s_qt + o_k[None, :] * s_qk
        b_q = tl.load(p_qt, mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)  # [BT, BI]
        b_step = tl.load(p_step + i_b * n_comp + o_k, mask=m_k, other=0.0)  # [BI]
        b_y = b_q * b_step[None, :]
        p_st = p_s + i_b * n_comp * n_chan + o_k[:, None] * n_chan + o_c[None, :]
        b_s = tl.load(p_st, mask=m_k[:, None] & m_c[None, :], other=0.0)  # [BI, BN]
        b_acc += tl.dot(b_y, b_s, input_precision="ieee")  # [BT, BI] @ [BI, BN] -> [BT, BN]
    b_mean = tl.load(p_mean + i_b * n_chan + o_c, mask=m_c, other=0.0)  # [BN]
    b_out = (b_acc + b_mean[None, :]).to(OUT_DTYPE)
    p_o = p_out + i_b * n_tokens * n_chan + o_t[:, None] * n_chan + o_c[None, :]
    tl.store(p_o, b_out, mask=m_t[:, None] & m_c[None, :])


def _check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def project_quantize(x: torch.Tensor, mean: torch.Tensor, analysis: torch.Tensor, inv_step: torch.Tensor) -> torch.Tensor:
    """Triton twin of `transform_ref.project_quantize`: codes [B, T, K] int32 (x may be strided)."""
    check_project_args(x, mean, analysis, inv_step)
    _check_same_device(x, mean, analysis, inv_step)
    mean, analysis, inv_step = mean.contiguous(), analysis.contiguous(), inv_step.contiguous()
    n_rows, n_tokens, n_chan = x.shape
    n_comp = analysis.shape[2]
    codes = torch.empty(n_rows, n_tokens, n_comp, dtype=torch.int32, device=x.device)
    if codes.numel() == 0:
        return codes
    grid = (n_rows, triton.cdiv(n_tokens, BLOCK_T), triton.cdiv(n_comp, BLOCK_N))
    _project_quantize_kernel[grid](
        x, mean, analysis, inv_step, codes, n_tokens, n_chan, n_comp, *x.stride(),
        BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_I=BLOCK_I, CODE_MAX=CODE_MAX,
    )
    return codes


def dequantize_backproject(codes: torch.Tensor, step: torch.Tensor, synthesis: torch.Tensor, mean: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """Triton twin of `transform_ref.dequantize_backproject`: x' [B, T, C] in dtype (codes may be strided)."""
    check_backproject_args(codes, step, synthesis, mean, dtype)
    _check_same_device(codes, step, synthesis, mean)
    step, synthesis, mean = step.contiguous(), synthesis.contiguous(), mean.contiguous()
    n_rows, n_tokens, n_comp = codes.shape
    n_chan = synthesis.shape[2]
    out = torch.empty(n_rows, n_tokens, n_chan, dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    grid = (n_rows, triton.cdiv(n_tokens, BLOCK_T), triton.cdiv(n_chan, BLOCK_N))
    _dequantize_backproject_kernel[grid](
        codes, step, synthesis, mean, out, n_tokens, n_comp, n_chan, *codes.stride(),
        OUT_DTYPE=_OUT_DTYPES[dtype], BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_I=BLOCK_I,
    )
    return out
