"""Pure-torch references for the quantization kernels in `kernels/quant.py`.

Same signatures and bit-exact integer outputs as the Triton kernels: both sides run the same
fp32 operations in the same order (subtract, correctly rounded divide, add 0.5, floor), so
`q`, `packed`, `scale` and `zero` match bit for bit. These functions are also the CPU path of
the codecs.

Formulations (x is a 2-D view; rows are independent):

int8, symmetric, one scale per row of D (a (token, head) row over head_dim):
    scale = amax(|x_r|) / 127                      (fp32; a zero row stores scale 1)
    q     = clamp(round_half_away(x / scale), -127, 127)
    x'    = q * scale                              |x - x'| <= scale / 2 (+ fp32 rounding)

low-bit (bits = 4 or 2), asymmetric, groups of `group_size` along the LAST dim (KIVI):
    L     = 2**bits - 1
    zero  = meta(min_g x)                          meta = float16 or float32, round to nearest
    scale = meta(max((max_g x - zero) / L, 0))     a 0 scale quantizes with divisor 1
    q     = clamp(floor((x - zero) / scale + 0.5), 0, L)
    x'    = q * scale + zero
    scale and zero are rounded to `meta_dtype` BEFORE q is computed, so q is chosen for the
    values the decoder will see. Error <= scale/2 inside [zero, zero + L*scale]; at the ends the
    meta rounding adds at most 2**-11 * (|min| + |max|) for float16 meta.

Columns: C need not divide by group_size. The last group is a tail group: its min/max use only
the valid columns, and its padding columns are stored as q = 0 so the packed row always holds
n_groups * group_size codes:

    col:    0 ........ G-1 | G ....... 2G-1 | 2G ... C-1  [pad ... 3G-1]
    group:  0              | 1              | 2 (tail; pad codes are 0)

Bit layout of `packed` (uint8, row-major [R, n_groups * group_size * bits / 8]): code of column c
sits in byte c * bits // 8 at bit offset (c % (8 // bits)) * bits, low bits first. For bits=4:
byte j = code[2j] | code[2j+1] << 4.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT8_QMAX = 127
LOWBIT_BITS = (2, 4)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
META_DTYPES = (torch.float16, torch.float32)


class Int8Quantized(NamedTuple):
    q: torch.Tensor  # int8 [R, D]
    scale: torch.Tensor  # float32 [R]


class LowbitQuantized(NamedTuple):
    packed: torch.Tensor  # uint8 [R, n_groups * group_size * bits // 8]
    scale: torch.Tensor  # meta_dtype [R, n_groups]
    zero: torch.Tensor  # meta_dtype [R, n_groups]


def n_groups(n_cols: int, group_size: int) -> int:
    return -(-n_cols // group_size)


def packed_cols(n_cols: int, bits: int, group_size: int) -> int:
    return n_groups(n_cols, group_size) * group_size * bits // 8


MAX_GROUP_SIZE = 1024


def check_lowbit_args(bits: int, group_size: int, meta_dtype: torch.dtype) -> None:
    """Raise ValueError unless (bits, group_size, meta_dtype) is a supported combination."""
    if bits not in LOWBIT_BITS:
        raise ValueError(f"bits must be one of {LOWBIT_BITS}, got {bits}")
    if group_size < 8 or group_size > MAX_GROUP_SIZE or group_size & (group_size - 1):
        # (at most MAX_GROUP_SIZE: a block's params name it, and a 1-token key row pads to a group)
        raise ValueError(f"group_size must be a power of two in 8..{MAX_GROUP_SIZE}, got {group_size}")
    if meta_dtype not in META_DTYPES:
        raise ValueError(f"meta_dtype must be one of {META_DTYPES}, got {meta_dtype}")


def round_half_away_(v: torch.Tensor) -> torch.Tensor:
    """Round in place to nearest, ties away from zero: trunc(v + copysign(0.5, v)).

    Bit-identical to the kernel's where(v < 0, -floor(-v + 0.5), floor(v + 0.5)): fp32 rounding
    is symmetric in sign, so v - 0.5 == -(|v| + 0.5) exactly for v < 0.
    """
    return v.add_(torch.copysign(torch.tensor(0.5, dtype=v.dtype), v)).trunc_()


def quantize_int8(x: torch.Tensor) -> Int8Quantized:
    """x: [R, D] float -> (q int8 [R, D], scale float32 [R])."""
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be 2-D float16/bfloat16/float32, got {tuple(x.shape)} {x.dtype}")
    b_x = x.to(torch.float32, copy=True)  # [R, D], worked on in place
    b_lo, b_hi = torch.aminmax(b_x, dim=1)  # [R]
    b_scale = torch.maximum(b_hi, -b_lo) / INT8_QMAX  # [R]
    b_scale = torch.where(b_scale > 0, b_scale, torch.ones_like(b_scale))
    b_q = round_half_away_(b_x.div_(b_scale[:, None])).clamp_(-INT8_QMAX, INT8_QMAX)  # [R, D]
    return Int8Quantized(b_q.to(torch.int8), b_scale)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q: int8 [R, D], scale: float32 [R] -> [R, D] in dtype."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"q must be 2-D int8, got {tuple(q.shape)} {q.dtype}")
    if scale.shape != (q.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 [{q.shape[0]}], got {tuple(scale.shape)} {scale.dtype}")
    return (q.float() * scale[:, None]).to(dtype)


def quantize_lowbit(
    x: torch.Tensor, bits: int, group_size: int, meta_dtype: torch.dtype = torch.float16
) -> LowbitQuantized:
    """x: [R, C] float, groups of group_size along C -> (packed, scale, zero); see module doc."""
    check_lowbit_args(bits, group_size, meta_dtype)
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be 2-D float16/bfloat16/float32, got {tuple(x.shape)} {x.dtype}")
    n_rows, n_cols = x.shape
    n_grp = n_groups(n_cols, group_size)
    levels = 2**bits - 1
    per_byte = 8 // bits
    b_x = x.to(torch.float32, copy=True)  # [R, C], worked on in place
    pad = n_grp * group_size - n_cols
    if pad:  # replicate the last column: min/max of the tail group see only valid values
        b_x = torch.cat([b_x, b_x[:, -1:].expand(n_rows, pad)], dim=1)  # [R, Cp]
    b_x = b_x.view(n_rows, n_grp, group_size)  # [R, NG, G]
    b_mn, b_mx = torch.aminmax(b_x, dim=2)  # [R, NG]
    b_zero = b_mn.to(meta_dtype).float()  # [R, NG]
    b_scale = ((b_mx - b_zero) / levels).clamp_(min=0).to(meta_dtype).float()  # [R, NG]
    b_div = torch.where(b_scale > 0, b_scale, torch.ones_like(b_scale))
    b_q = b_x.sub_(b_zero[:, :, None]).div_(b_div[:, :, None]).add_(0.5).floor_().clamp_(0, levels)
    b_q = b_q.to(torch.uint8).view(n_rows, n_grp * group_size)  # [R, Cp]
    if pad:
        b_q[:, n_cols:] = 0
    b_q = b_q.view(n_rows, -1, per_byte)  # [R, Cp / per_byte, per_byte]
    packed = b_q[:, :, 0].clone()  # [R, Cp / per_byte]
    for k in range(1, per_byte):
        packed |= b_q[:, :, k] << (k * bits)
    return LowbitQuantized(packed, b_scale.to(meta_dtype), b_zero.to(meta_dtype))


def dequantize_lowbit(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    n_cols: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """packed: uint8 [R, Cp*bits/8], scale/zero: [R, NG] -> x': [R, n_cols] in dtype."""
    check_lowbit_args(bits, group_size, scale.dtype)
    n_rows = packed.shape[0]
    n_grp = n_groups(n_cols, group_size)
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] != packed_cols(n_cols, bits, group_size):
        raise ValueError(
            f"packed must be uint8 [R, {packed_cols(n_cols, bits, group_size)}], got {tuple(packed.shape)} {packed.dtype}"
        )
    if scale.shape != (n_rows, n_grp) or zero.shape != scale.shape or zero.dtype != scale.dtype:
        raise ValueError(f"scale and zero must both be [{n_rows}, {n_grp}] of one dtype")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)  # [per_byte]
    b_q = (packed[:, :, None] >> shifts) & (2**bits - 1)  # [R, Cp / per_byte, per_byte]
    b_x = b_q.view(n_rows, n_grp, group_size).float()  # [R, NG, G]
    b_x = b_x.mul_(scale.float()[:, :, None]).add_(zero.float()[:, :, None])  # [R, NG, G]
    return b_x.view(n_rows, n_grp * group_size)[:, :n_cols].to(dtype)
