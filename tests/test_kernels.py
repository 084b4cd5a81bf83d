"""Triton quantization kernels vs their torch references, under TRITON_INTERPRET=1 on CPU.

Integer and packed outputs must match bit for bit, scales and zeros within 1e-6 relative (they
match exactly in practice), dequantized values within one ulp of the output dtype (the
interpreter truncates fp32 -> bfloat16 where torch rounds to nearest).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import quant_ref

quant = pytest.importorskip("kernels.quant")  # needs triton; conftest set TRITON_INTERPRET

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}


def kv_like(n_rows: int, n_cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[n_rows, n_cols] normal data with uneven per-column scales and offsets (outlier channels)."""
    g = torch.Generator().manual_seed(seed)
    col_scale = torch.exp(torch.randn(n_cols, generator=g))  # lognormal: a few channels dominate
    col_scale[torch.randint(0, n_cols, (2,), generator=g)] *= 12.0
    offset = torch.randn(n_cols, generator=g) * 0.5
    return (torch.randn(n_rows, n_cols, generator=g) * col_scale + offset).to(dtype)


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    a, b = a.double(), b.double()
    assert ((a - b).abs() <= rel * b.abs() + 1e-30).all(), f"max diff {(a - b).abs().max()}"


# ---------------------------------------------------------------------------------------------
# int8
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_rows,n_cols,transposed", [(300, 80, False), (257, 64, True), (63, 128, False)])
def test_int8_matches_reference(dtype, n_rows, n_cols, transposed):
    x = kv_like(n_rows, n_cols, dtype, seed=n_rows)
    if transposed:  # strided rows: a [D, R] tensor seen as [R, D]
        x = x.t().contiguous().t()
    got, ref = quant.quantize_int8(x), quant_ref.quantize_int8(x)
    assert got.q.dtype == torch.int8 and got.q.shape == (n_rows, n_cols)
    assert got.scale.dtype == torch.float32 and got.scale.shape == (n_rows,)
    assert torch.equal(got.q, ref.q)
    assert_rel_close(got.scale, ref.scale, 1e-6)
    out_k = quant.dequantize_int8(got.q, got.scale, dtype)
    out_r = quant_ref.dequantize_int8(ref.q, ref.scale, dtype)
    assert out_k.dtype == dtype
    assert_rel_close(out_k, out_r, ULP[dtype])
    # the dequantized block is within scale/2 (+ the cast) of the input
    err = (out_r.float() - x.float()).abs()
    assert (err <= ref.scale[:, None] * 0.5001 + x.float().abs() * ULP[dtype]).all()


def test_int8_rounds_half_away_from_zero():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5, 2.49, -0.49, 0.0]])  # scale = 1
    want = torch.tensor([[127, 1, -1, 2, -3, 2, 0, 0]], dtype=torch.int8)
    for impl in (quant, quant_ref):
        q, scale = impl.quantize_int8(x)
        assert torch.equal(q, want) and float(scale[0]) == 1.0


def test_int8_zero_row_is_exact():
    x = torch.zeros(3, 16)
    x[1] = torch.arange(16.0)
    q, scale = quant.quantize_int8(x)
    assert torch.equal(scale[[0, 2]], torch.ones(2))
    assert torch.equal(quant.dequantize_int8(q, scale, torch.float32)[[0, 2]], torch.zeros(2, 16))


# ---------------------------------------------------------------------------------------------
# low-bit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group_size", [(4, 32), (2, 32), (4, 64), (2, 16)])
def test_lowbit_matches_reference(dtype, bits, group_size):
    # keys-like view: rows = channels, cols = tokens (257: a 1-token tail group), strided
    x = kv_like(257, 96, dtype, seed=bits * group_size).t()  # [96, 257], stride (1, 96)
    got = quant.quantize_lowbit(x, bits, group_size)
    ref = quant_ref.quantize_lowbit(x, bits, group_size)
    n_grp = -(-257 // group_size)
    assert got.packed.shape == (96, n_grp * group_size * bits // 8) and got.packed.dtype == torch.uint8
    assert got.scale.shape == got.zero.shape == (96, n_grp) and got.scale.dtype == torch.float16
    assert torch.equal(got.packed, ref.packed)
    assert_rel_close(got.scale, ref.scale, 1e-6)
    assert_rel_close(got.zero, ref.zero, 1e-6)
    out_k = quant.dequantize_lowbit(*got, bits, group_size, 257, dtype)
    out_r = quant_ref.dequantize_lowbit(*ref, bits, group_size, 257, dtype)
    assert out_k.shape == (96, 257) and out_k.dtype == dtype
    assert_rel_close(out_k, out_r, ULP[dtype])


@pytest.mark.parametrize("bits", [4, 2])
def test_lowbit_float32_meta_and_value_rows(bits):
    # values-like view: rows = tokens, cols = head_dim 80 (tail group of 16 with group 64)
    x = kv_like(100, 80, torch.float32, seed=7) * 1e5
    got = quant.quantize_lowbit(x, bits, 64, torch.float32)
    ref = quant_ref.quantize_lowbit(x, bits, 64, torch.float32)
    assert got.scale.dtype == torch.float32
    assert torch.equal(got.packed, ref.packed)
    assert_rel_close(got.scale, ref.scale, 1e-6)
    assert_rel_close(got.zero, ref.zero, 1e-6)
    out = quant.dequantize_lowbit(*got, bits, 64, 80, torch.float32)
    scale = ref.scale.float().repeat_interleave(64, dim=1)[:, :80]
    assert ((out - x).abs() <= scale * 0.5001 + x.abs() * 1e-6).all()


def test_lowbit_bit_layout():
    # one group of 16 codes 0..15 with min 0 and max 15: scale 1, zero 0, codes = values
    x = torch.arange(16.0).repeat(2, 1)
    x[1] = x[1].flip(0)
    for impl in (quant, quant_ref):
        packed, scale, zero = impl.quantize_lowbit(x, 4, 16)
        assert float(scale[0, 0]) == 1.0 and float(zero[0, 0]) == 0.0
        assert packed[0].tolist() == [c0 | c1 << 4 for c0, c1 in zip(range(0, 16, 2), range(1, 16, 2))]
        assert packed[1].tolist() == [(15 - c0) | (15 - c1) << 4 for c0, c1 in zip(range(0, 16, 2), range(1, 16, 2))]
    # 2 bits: four codes per byte, low bits first. Tail group [0.0, 1.5, 3.0] + 5 pad columns:
    # zero 0, scale 1, codes 0, 2 (1.5 rounds half up), 3, then code 0 for the padding
    x2 = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0, 1.5, 3.0]])
    for impl in (quant, quant_ref):
        packed, scale, zero = impl.quantize_lowbit(x2, 2, 8)
        assert scale.tolist() == [[1.0, 1.0]] and zero.tolist() == [[0.0, 0.0]]
        assert packed[0].tolist() == [0 | 1 << 2 | 2 << 4 | 3 << 6, 3, 0 | 2 << 2 | 3 << 4, 0]


# ---------------------------------------------------------------------------------------------
# launcher checks and dispatch
# ---------------------------------------------------------------------------------------------


def test_launchers_reject_bad_inputs():
    x = torch.randn(8, 32)
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize_int8(x[None])
    with pytest.raises(ValueError, match="float16"):
        quant.quantize_int8(x.to(torch.int32))
    with pytest.raises(ValueError, match="bits"):
        quant.quantize_lowbit(x, 3, 32)
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize_lowbit(x, 4, 24)
    with pytest.raises(ValueError, match="meta_dtype"):
        quant.quantize_lowbit(x, 4, 32, torch.bfloat16)
    q, scale = quant.quantize_int8(x)
    with pytest.raises(ValueError, match="scale"):
        quant.dequantize_int8(q, scale[:-1], torch.float16)
    with pytest.raises(ValueError, match="q must be"):
        quant.dequantize_int8(q.to(torch.uint8), scale, torch.float16)
    packed, s, z = quant.quantize_lowbit(x, 4, 16)
    with pytest.raises(ValueError, match="packed"):
        quant.dequantize_lowbit(packed, s, z, 4, 16, 40, torch.float16)
    with pytest.raises(ValueError, match="zero"):
        quant.dequantize_lowbit(packed, s, z[:, :1].contiguous(), 4, 16, 32, torch.float16)


def test_backend_choice(monkeypatch):
    x = torch.randn(4, 8)
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    assert kernels.backend(x) == "torch"  # auto: CPU tensors take the reference
    assert kernels.ops(x) is quant_ref
    assert kernels.ops(x, "triton") is quant
    monkeypatch.setenv(kernels.KERNELS_ENV, "triton")
    assert kernels.backend(x) == "triton"
    assert kernels.backend(x, "torch") == "torch"  # the argument wins
    monkeypatch.setenv(kernels.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="KVSTORE_KERNELS"):
        kernels.backend(x)
