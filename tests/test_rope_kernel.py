"""RoPE re-rotation: the Triton kernel against its torch reference, and the reference against RoPE.

Tolerance: kernel vs reference within 2e-6 relative to the row norm in float32 (both form the angle
in float64 and rotate in fp32; they differ only in cos/sin rounding), one ulp of the dtype for
half types. Re-rotation against the model's own RoPE at the new position within 2e-4 (the model
forms its angles in fp32, which is itself ~pos * 6e-8 rad off).
"""

from __future__ import annotations

import pytest
import torch

from engine_adapter.reference.model import ModelConfig, apply_rope, rope_inverse_frequencies
from kernels import rope_ref

rope = pytest.importorskip("kernels.rope")  # needs triton; conftest set TRITON_INTERPRET

ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2e-6}


def config(head_dim: int, scaling=None) -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=head_dim * 2, intermediate_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=head_dim, rope_theta=10000.0, rope_scaling=scaling,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False,
                       max_position_embeddings=4096, bos_token_id=None, eos_token_ids=(0,), model_id="t")


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,offset", [
    ((3, 5, 63, 64), 1000),          # [layers, heads, T, D], irregular T
    ((2, 130, 30), -517),            # negative delta, D = 30 (half = 15, not a power of two)
    ((1, 1, 200, 128), 1 << 20),     # a large offset
])
def test_kernel_matches_reference(dtype, shape, offset):
    g = torch.Generator().manual_seed(sum(shape))
    keys = (torch.randn(shape, generator=g) * 3).to(dtype)
    tokens = shape[-2]
    old = torch.randint(0, 4096, (tokens,), generator=g)
    new = old + offset + torch.randint(-7, 8, (tokens,), generator=g)
    inv_freq = rope_inverse_frequencies(config(shape[-1]))
    got = rope.rerotate_keys(keys, old, new, inv_freq)
    ref = rope_ref.rerotate_keys(keys, old, new, inv_freq)
    assert got.dtype == dtype and got.shape == keys.shape
    assert max_rel(got, ref) <= ULP[dtype] * 4


def test_kernel_on_a_strided_block_half_in_place():
    # A block [layers, 2, kv_heads, T, D]: rotate its K half (strided view) in place.
    g = torch.Generator().manual_seed(7)
    block = torch.randn(4, 2, 3, 77, 64, generator=g)
    expected_k = rope_ref.rerotate_keys(block[:, 0], torch.arange(77), torch.arange(77) + 300,
                                        rope_inverse_frequencies(config(64)))
    values = block[:, 1].clone()
    k = block[:, 0]
    rope.rerotate_keys(k, torch.arange(77), torch.arange(77) + 300, rope_inverse_frequencies(config(64)), out=k)
    assert max_rel(block[:, 0], expected_k) <= 1e-5
    assert torch.equal(block[:, 1], values)  # V untouched


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rerotation_equals_rope_at_the_new_position(scaling):
    cfg = config(64, scaling)
    inv_freq = rope_inverse_frequencies(cfg)
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(2, 50, 64, generator=g, dtype=torch.float64)  # keys before RoPE

    def rope_at(positions):  # float64 angles: the exact rotation
        angles = positions.double()[:, None] * inv_freq.double()[None, :]
        angles = torch.cat((angles, angles), -1)
        return apply_rope(raw, angles.cos(), angles.sin()).float()

    old = torch.arange(50)
    for new in (old + 3000, old.flip(0) * 2, old - 40):
        got = rope_ref.rerotate_keys(rope_at(old), old, new, inv_freq)
        assert max_rel(got, rope_at(new)) <= 2e-6
    # and a round trip by +delta then -delta is the identity
    k = rope_at(old)
    there = rope_ref.rerotate_keys(k, old, old + 12345, inv_freq)
    assert max_rel(rope_ref.rerotate_keys(there, old + 12345, old, inv_freq), k) <= 2e-6


def test_launcher_rejects_bad_arguments():
    keys = torch.randn(2, 10, 8)
    inv = torch.ones(4)
    with pytest.raises(ValueError, match="old_positions"):
        rope.rerotate_keys(keys, torch.arange(9), torch.arange(10), inv)
    with pytest.raises(ValueError, match="inv_freq"):
        rope.rerotate_keys(keys, torch.arange(10), torch.arange(10), torch.ones(5))
    with pytest.raises(ValueError, match="even"):
        rope_ref.rerotate_keys(torch.randn(2, 10, 7), torch.arange(10), torch.arange(10), torch.ones(3))
