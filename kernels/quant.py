"""Triton kernels for KV quantization, each beside its torch reference in `kernels/quant_ref.py`.

The formulations, rounding and bit layout are documented in `quant_ref.py`; the kernels follow
them operation by operation (fp32 math, `div_rn` for a correctly rounded divide, floor-based
rounding because `libdevice.rint` does not run in the interpreter), so integer and packed outputs
match the reference bit for bit. Dequantized values may differ by an ulp on a GPU where
`q * scale + zero` is contracted into an FMA.

Launchers check shapes, strides and dtypes and raise ValueError before launch. They run on CUDA
tensors, or on CPU tensors when TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.quant_ref import (
    FLOAT_DTYPES,
    INT8_QMAX,
    Int8Quantized,
    LowbitQuantized,
    check_lowbit_args,
    n_groups,
    packed_cols,
)

INT8_BLOCK_ROWS = 32
INT8_MAX_COLS = 4096
LOWBIT_BLOCK_ROWS = 64


# ---------------------------------------------------------------------------------------------
# int8, symmetric, one scale per row
# ---------------------------------------------------------------------------------------------


@triton.jit
def _quantize_int8_kernel(
    p_x, p_q, p_scale,
    n_rows, n_cols, stride_xr, stride_xc,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr,
):
    i_r = tl.program_id(0)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    o_d = tl.arange(0, BLOCK_D)  # [BD]
    m_r = o_r < n_rows
    m_x = m_r[:, None] & (o_d[None, :] < n_cols)  # [BR, BD]
    b_x = tl.load(p_x + o_r[:, None] * stride_xr + o_d[None, :] * stride_xc, mask=m_x, other=0.0)
    b_x = b_x.to(tl.float32)  # [BR, BD]
    b_scale = tl.math.div_rn(tl.max(tl.abs(b_x), axis=1), QMAX * 1.0)  # [BR]
    b_scale = tl.where(b_scale > 0, b_scale, 1.0)
    b_v = tl.math.div_rn(b_x, b_scale[:, None])  # [BR, BD]
    b_a = tl.floor(tl.abs(b_v) + 0.5)
    b_q = tl.where(b_v < 0, -b_a, b_a)
    b_q = tl.minimum(tl.maximum(b_q, -QMAX * 1.0), QMAX * 1.0)
    tl.store(p_q + o_r[:, None] * n_cols + o_d[None, :], b_q.to(tl.int8), mask=m_x)
    tl.store(p_scale + o_r, b_scale, mask=m_r)


@triton.jit
def _dequantize_int8_kernel(
    p_q, p_scale, p_out,
    n_rows, n_cols,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_r = tl.program_id(0)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    o_d = tl.arange(0, BLOCK_D)  # [BD]
    m_r = o_r < n_rows
    m_x = m_r[:, None] & (o_d[None, :] < n_cols)  # [BR, BD]
    o_x = o_r[:, None] * n_cols + o_d[None, :]  # [BR, BD]
    b_q = tl.load(p_q + o_x, mask=m_x, other=0).to(tl.float32)  # [BR, BD]
    b_scale = tl.load(p_scale + o_r, mask=m_r, other=1.0)  # [BR]
    b_x = b_q * b_scale[:, None]  # [BR, BD]
    tl.store(p_out + o_x, b_x.to(p_out.dtype.element_ty), mask=m_x)


# ---------------------------------------------------------------------------------------------
# low-bit (4 / 2), asymmetric, groups along the last dim, packed low bits first
# ---------------------------------------------------------------------------------------------


@triton.jit
def _quantize_lowbit_kernel(
    p_x, p_packed, p_scale, p_zero,
    n_rows, n_cols, n_grp, stride_xr, stride_xc,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
):
    PER_BYTE: tl.constexpr = 8 // BITS
    N_BYTES: tl.constexpr = GROUP // PER_BYTE
    LEVELS: tl.constexpr = (1 << BITS) - 1
    i_r, i_g = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    o_j = tl.arange(0, N_BYTES)  # [NB] byte within the group
    o_k = tl.arange(0, PER_BYTE)  # [PB] code within the byte
    o_c = i_g * GROUP + o_j[:, None] * PER_BYTE + o_k[None, :]  # [NB, PB] column
    m_r = o_r < n_rows
    m_x = m_r[:, None, None] & (o_c < n_cols)[None, :, :]  # [BR, NB, PB]
    p_xg = p_x + o_r[:, None, None] * stride_xr + o_c[None, :, :] * stride_xc
    b_x = tl.load(p_xg, mask=m_x, other=0.0).to(tl.float32)  # [BR, NB, PB]
    b_mn = tl.min(tl.min(tl.where(m_x, b_x, float("inf")), axis=2), axis=1)  # [BR]
    b_mx = tl.max(tl.max(tl.where(m_x, b_x, float("-inf")), axis=2), axis=1)  # [BR]
    b_mn = tl.where(m_r, b_mn, 0.0)
    b_mx = tl.where(m_r, b_mx, 0.0)
    # round the stored metadata first, then choose codes for exactly those values
    b_zero = b_mn.to(p_zero.dtype.element_ty).to(tl.float32)  # [BR]
    b_scale = tl.maximum(tl.math.div_rn(b_mx - b_zero, LEVELS * 1.0), 0.0)
    b_scale = b_scale.to(p_scale.dtype.element_ty).to(tl.float32)  # [BR]
    b_div = tl.where(b_scale > 0, b_scale, 1.0)
    b_v = tl.math.div_rn(b_x - b_zero[:, None, None], b_div[:, None, None])  # [BR, NB, PB]
    b_q = tl.minimum(tl.maximum(tl.floor(b_v + 0.5), 0.0), LEVELS * 1.0)
    b_q = tl.where(m_x, b_q, 0.0).to(tl.int32)  # [BR, NB, PB]
    b_byte = tl.sum(b_q << (o_k * BITS)[None, None, :], axis=2)  # [BR, NB]
    o_meta = o_r * n_grp + i_g  # [BR]
    p_out = p_packed + o_r[:, None] * (n_grp * N_BYTES) + i_g * N_BYTES + o_j[None, :]
    tl.store(p_out, b_byte.to(tl.uint8), mask=m_r[:, None])
    tl.store(p_scale + o_meta, b_scale.to(p_scale.dtype.element_ty), mask=m_r)
    tl.store(p_zero + o_meta, b_zero.to(p_zero.dtype.element_ty), mask=m_r)


@triton.jit
def _dequantize_lowbit_kernel(
    p_packed, p_scale, p_zero, p_out,
    n_rows, n_cols, n_grp,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
):
    PER_BYTE: tl.constexpr = 8 // BITS
    N_BYTES: tl.constexpr = GROUP // PER_BYTE
    LEVELS: tl.constexpr = (1 << BITS) - 1
    i_r, i_g = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    o_j = tl.arange(0, N_BYTES)  # [NB]
    o_k = tl.arange(0, PER_BYTE)  # [PB]
    o_c = i_g * GROUP + o_j[:, None] * PER_BYTE + o_k[None, :]  # [NB, PB]
    m_r = o_r < n_rows
    m_x = m_r[:, None, None] & (o_c < n_cols)[None, :, :]  # [BR, NB, PB]
    o_meta = o_r * n_grp + i_g  # [BR]
    b_scale = tl.load(p_scale + o_meta, mask=m_r, other=0.0).to(tl.float32)  # [BR]
    b_zero = tl.load(p_zero + o_meta, mask=m_r, other=0.0).to(tl.float32)  # [BR]
    p_in = p_packed + o_r[:, None] * (n_grp * N_BYTES) + i_g * N_BYTES + o_j[None, :]
    b_byte = tl.load(p_in, mask=m_r[:, None], other=0).to(tl.int32)  # [BR, NB]
    b_q = (b_byte[:, :, None] >> (o_k * BITS)[None, None, :]) & LEVELS  # [BR, NB, PB]
    b_x = b_q.to(tl.float32) * b_scale[:, None, None] + b_zero[:, None, None]  # [BR, NB, PB]
    p_xg = p_out + o_r[:, None, None] * n_cols + o_c[None, :, :]
    tl.store(p_xg, b_x.to(p_out.dtype.element_ty), mask=m_x)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _check_device(*tensors: torch.Tensor) -> None:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for t in tensors:
        if not (t.is_cuda or interpret):
            raise ValueError(
                f"Triton kernels need CUDA tensors (got {t.device}); use kernels.quant_ref on CPU "
                "or set TRITON_INTERPRET=1 before importing kernels.quant"
            )
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"tensors are on different devices: {[str(t.device) for t in tensors]}")


def _check_float_2d(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be 2-D float16/bfloat16/float32, got {tuple(x.shape)} {x.dtype}")
    if x.numel() == 0:
        raise ValueError("x is empty")


def quantize_int8(x: torch.Tensor) -> Int8Quantized:
    """x: [R, D] float (any strides) -> (q int8 [R, D], scale float32 [R]); see quant_ref."""
    _check_float_2d(x)
    _check_device(x)
    n_rows, n_cols = x.shape
    if n_cols > INT8_MAX_COLS:
        raise ValueError(f"int8 rows hold at most {INT8_MAX_COLS} values, got {n_cols}")
    q = torch.empty((n_rows, n_cols), dtype=torch.int8, device=x.device)
    scale = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_rows, INT8_BLOCK_ROWS),)
    _quantize_int8_kernel[grid](
        x, q, scale, n_rows, n_cols, x.stride(0), x.stride(1),
        BLOCK_R=INT8_BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(n_cols), QMAX=INT8_QMAX,
    )
    return Int8Quantized(q, scale)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q: int8 [R, D] contiguous, scale: float32 [R] -> [R, D] in dtype."""
    if q.dim() != 2 or q.dtype != torch.int8 or not q.is_contiguous():
        raise ValueError(f"q must be contiguous 2-D int8, got {tuple(q.shape)} {q.dtype}")
    n_rows, n_cols = q.shape
    if scale.shape != (n_rows,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale must be contiguous float32 [{n_rows}], got {tuple(scale.shape)} {scale.dtype}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if n_cols > INT8_MAX_COLS:
        raise ValueError(f"int8 rows hold at most {INT8_MAX_COLS} values, got {n_cols}")
    _check_device(q, scale)
    out = torch.empty((n_rows, n_cols), dtype=dtype, device=q.device)
    grid = (triton.cdiv(n_rows, INT8_BLOCK_ROWS),)
    _dequantize_int8_kernel[grid](
        q, scale, out, n_rows, n_cols,
        BLOCK_R=INT8_BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(n_cols),
    )
    return out


def quantize_lowbit(
    x: torch.Tensor, bits: int, group_size: int, meta_dtype: torch.dtype = torch.float16
) -> LowbitQuantized:
    """x: [R, C] float (any strides), groups along C -> (packed, scale, zero); see quant_ref."""
    check_lowbit_args(bits, group_size, meta_dtype)
    _check_float_2d(x)
    _check_device(x)
    n_rows, n_cols = x.shape
    n_grp = n_groups(n_cols, group_size)
    packed = torch.empty((n_rows, packed_cols(n_cols, bits, group_size)), dtype=torch.uint8, device=x.device)
    scale = torch.empty((n_rows, n_grp), dtype=meta_dtype, device=x.device)
    zero = torch.empty((n_rows, n_grp), dtype=meta_dtype, device=x.device)
    grid = (triton.cdiv(n_rows, LOWBIT_BLOCK_ROWS), n_grp)
    _quantize_lowbit_kernel[grid](
        x, packed, scale, zero, n_rows, n_cols, n_grp, x.stride(0), x.stride(1),
        BITS=bits, GROUP=group_size, BLOCK_R=LOWBIT_BLOCK_ROWS,
    )
    return LowbitQuantized(packed, scale, zero)


def dequantize_lowbit(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    n_cols: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """packed: uint8 [R, Cp*bits/8], scale/zero: [R, NG] contiguous -> [R, n_cols] in dtype."""
    check_lowbit_args(bits, group_size, scale.dtype)
    n_grp = n_groups(n_cols, group_size)
    n_bytes = packed_cols(n_cols, bits, group_size)
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] != n_bytes or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous uint8 [R, {n_bytes}], got {tuple(packed.shape)} {packed.dtype}")
    n_rows = packed.shape[0]
    for name, t in (("scale", scale), ("zero", zero)):
        if t.shape != (n_rows, n_grp) or t.dtype != scale.dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{n_rows}, {n_grp}] {scale.dtype}, got {tuple(t.shape)} {t.dtype}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    _check_device(packed, scale, zero)
    out = torch.empty((n_rows, n_cols), dtype=dtype, device=packed.device)
    grid = (triton.cdiv(n_rows, LOWBIT_BLOCK_ROWS), n_grp)
    _dequantize_lowbit_kernel[grid](
        packed, scale, zero, out, n_rows, n_cols, n_grp,
        BITS=bits, GROUP=group_size, BLOCK_R=LOWBIT_BLOCK_ROWS,
    )
    return out
