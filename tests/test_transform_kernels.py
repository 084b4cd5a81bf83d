"""Transform-codec Triton kernels vs their torch references, under TRITON_INTERPRET=1 on CPU.

Bounds: codes equal the reference's except where a kernel's fp32 sum order moves a value across
a rounding boundary (then by exactly 1, in under 0.5% of codes); back-projected values within
one ulp of the output dtype plus 1e-5 relative (fp32 sum order), on irregular shapes with
non-zero random inputs and strided (transposed) inputs.
"""

from __future__ import annotations

import pytest
import torch

from kernels import transform_ref

transform = pytest.importorskip("kernels.transform")  # needs triton; conftest set TRITON_INTERPRET

ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}


def problem(n_rows: int, n_tokens: int, n_chan: int, n_comp: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, n_tokens, n_chan, generator=g) * torch.exp(torch.randn(n_chan, generator=g)) + 0.7
    mean = torch.randn(n_rows, n_chan, generator=g) * 0.5 + 0.1
    q, _ = torch.linalg.qr(torch.randn(n_rows, n_chan, n_chan, generator=g))
    analysis = q[:, :, :n_comp].contiguous()  # [B, C, K]
    inv_step = torch.rand(n_rows, n_comp, generator=g) * 8 + 0.25  # steps 0.12 .. 4
    inv_step[:, -1] = 0.0  # a dropped component
    return x, mean, analysis, inv_step


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_rows,n_tokens,n_chan,n_comp", [(3, 63, 30, 30), (2, 257, 64, 50), (5, 1, 48, 17)])
def test_project_quantize_matches_reference(dtype, n_rows, n_tokens, n_chan, n_comp):
    x, mean, analysis, inv_step = problem(n_rows, n_tokens, n_chan, n_comp, seed=n_tokens)
    x = x.to(dtype)
    got, ref = transform.project_quantize(x, mean, analysis, inv_step), transform_ref.project_quantize(x, mean, analysis, inv_step)
    assert got.dtype == torch.int32 and got.shape == (n_rows, n_tokens, n_comp)
    diff = (got - ref).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.005
    assert (got[..., -1] == 0).all()  # dropped component
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, token stride 1
    assert (transform.project_quantize(strided, mean, analysis, inv_step) - ref).abs().max() <= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_rows,n_tokens,n_chan,n_comp", [(3, 63, 30, 30), (2, 257, 64, 50), (4, 5, 20, 33)])
def test_dequantize_backproject_matches_reference(dtype, n_rows, n_tokens, n_chan, n_comp):
    g = torch.Generator().manual_seed(n_chan)
    codes = torch.randint(-200, 200, (n_rows, n_comp, n_tokens), generator=g, dtype=torch.int32).transpose(1, 2)
    step = torch.rand(n_rows, n_comp, generator=g) * 0.1 + 0.01
    synthesis = torch.randn(n_rows, n_comp, n_chan, generator=g)
    mean = torch.randn(n_rows, n_chan, generator=g) + 0.5
    got = transform.dequantize_backproject(codes, step, synthesis, mean, dtype)
    ref = transform_ref.dequantize_backproject(codes, step, synthesis, mean, dtype)
    assert got.dtype == dtype and got.shape == (n_rows, n_tokens, n_chan)
    exact = transform_ref.dequantize_backproject(codes, step, synthesis, mean, torch.float32).double()
    tol = exact.abs() * (ULP[dtype] + 1e-5) + 1e-5
    assert ((got.double() - ref.double()).abs() <= 2 * tol).all()


def test_launchers_check_arguments():
    x, mean, analysis, inv_step = problem(2, 8, 16, 16, seed=0)
    with pytest.raises(ValueError, match="shapes disagree"):
        transform.project_quantize(x, mean[:1], analysis, inv_step)
    with pytest.raises(ValueError, match="float32"):
        transform.project_quantize(x, mean, analysis.double(), inv_step)
    with pytest.raises(ValueError, match="integer"):
        transform.dequantize_backproject(x, inv_step, analysis, mean, torch.float16)


@pytest.mark.parametrize("layer_group", [1, 3])
def test_rope_aware_codec_on_kernels_matches_reference(layer_group):
    """The whole RoPE-aware kvtc path (turn keys, project, quantize; back-project, turn back) on the
    Triton kernels decodes within the codec's bound and within 1e-3 relative of the torch path, with
    per-layer rows and with rows over all 3 layers (96 channels)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_transform_codec import INV_FREQ, rope_block

    from compression.calibration import Allocation
    from compression.calibration_fit import calibrate
    from compression.transform import TransformCodec

    calibration = calibrate([rope_block(300, 0, seed=1, dtype=torch.float32)], Allocation(0.2, 0.3, sink_tokens=4),
                            rope_inv_freq=INV_FREQ, max_position=8192, layer_group=layer_group)
    block = rope_block(45, 2, seed=8, dtype=torch.float16)  # sinks at 2, 3 raw, the rest coded
    on_triton, on_torch = TransformCodec(calibration, kernels_choice="triton"), TransformCodec(calibration, kernels_choice="torch")
    encoded = on_triton.encode(block)
    reference = on_torch.encode(block)
    for field in ("calibration", "start", "sink_tokens"):
        assert encoded.params[field] == reference.params[field]
    got = on_triton.decode(encoded.payload, encoded.params, block.shape, block.dtype)
    ref = on_torch.decode(reference.payload, reference.params, block.shape, block.dtype)
    assert (got.double() - block.double()).abs().max() <= on_torch.error_bound(block)
    assert (got.double() - ref.double()).abs().max() <= 1e-3 * block.double().abs().max() + on_torch.calibration.step.max()
