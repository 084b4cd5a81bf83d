"""RoPE re-rotation in native C (`kernels/rope_native.c`) against the torch reference, bit for bit.

The C code takes the reference's float32 cos/sin and does its float32 arithmetic in its order
(no fused multiply-add), so every output element must have the reference's bits: equality of
the raw bits is the bound, infinities included. NaN is NaN on both sides, not one bit pattern:
torch's own bfloat16 rounding writes 0xFFFF from its vector loop and 0x7FC0 from its scalar one.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import rope_native, rope_ref

pytestmark = pytest.mark.skipif(rope_native.native_library() is None, reason="no C compiler")


def inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def sample(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype), g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,offset", [
    ((3, 5, 63, 64), 1000),         # [layers, heads, T, D], irregular T
    ((2, 130, 30), -517),           # negative delta, half = 15
    ((200, 128), 1 << 20),          # no leading dims, a large offset
    ((2, 3, 4, 9, 16), 77),         # three leading dims
])
def test_native_rotation_has_the_references_bits(dtype, shape, offset):
    keys, g = sample(shape, dtype, sum(shape))
    tokens = shape[-2]
    old = torch.randint(0, 4096, (tokens,), generator=g)
    new = old + offset + torch.randint(-7, 8, (tokens,), generator=g)  # per-token deltas
    freq = inv_freq(shape[-1])
    got = rope_native.rerotate_keys(keys, old, new, freq)
    assert got.dtype == dtype and got.shape == keys.shape
    assert torch.equal(bits(got), bits(rope_ref.rerotate_keys(keys, old, new, freq)))


def test_native_rotation_of_a_strided_block_half_in_place_and_into_a_strided_cache():
    block, _ = sample((4, 2, 3, 77, 64), torch.bfloat16, 7)
    old, new, freq = torch.arange(77), torch.arange(77) + 300, inv_freq(64)
    expected = rope_ref.rerotate_keys(block[:, 0], old, new, freq)
    values = block[:, 1].clone()
    cache = torch.randn(4, 3, 500, 64).bfloat16()  # rows 300..376 of a bigger cache: strided out
    before = cache.clone()
    rope_native.rerotate_keys(block[:, 0], old, new, freq, out=cache[:, :, 300:377])
    assert torch.equal(bits(cache[:, :, 300:377]), bits(expected))
    assert torch.equal(cache[:, :, :300], before[:, :, :300]) and torch.equal(cache[:, :, 377:], before[:, :, 377:])
    k = block[:, 0]
    rope_native.rerotate_keys(k, old, new, freq, out=k)  # in place
    assert torch.equal(bits(block[:, 0]), bits(expected))
    assert torch.equal(block[:, 1], values)  # V untouched


def test_special_values_round_as_torch_rounds():
    keys, _ = sample((2, 40, 32), torch.float32, 3)
    keys[0, 0, 0], keys[0, 1, 5], keys[1, 2, 20] = float("nan"), float("inf"), -float("inf")
    keys[1, 3, :] = 3.3895313892515355e38  # bf16's largest: rounding may overflow to inf
    keys[1, 4, :] = 1e-40  # subnormal
    keys = keys.bfloat16()
    old = torch.arange(40)
    for new in (old + 5, old * 3 - 11):
        got = rope_native.rerotate_keys(keys, old, new, inv_freq(32))
        ref = rope_ref.rerotate_keys(keys, old, new, inv_freq(32))
        nan = ref.isnan()
        assert nan.any() and ref.isinf().any() and torch.equal(got.isnan(), nan)
        assert torch.equal(bits(got)[~nan], bits(ref)[~nan])


def test_other_dtypes_and_overlapping_outputs_take_the_reference():
    freq, old = inv_freq(16), torch.arange(10)
    half, _ = sample((3, 10, 16), torch.float16, 1)
    assert torch.equal(rope_native.rerotate_keys(half, old, old + 9, freq), rope_ref.rerotate_keys(half, old, old + 9, freq))
    keys, _ = sample((3, 11, 16), torch.float32, 2)
    expected = rope_ref.rerotate_keys(keys[:, :10], old, old + 9, freq)
    rope_native.rerotate_keys(keys[:, :10], old, old + 9, freq, out=keys[:, 1:])  # shifted by one row
    assert torch.equal(keys[:, 1:], expected)
    with pytest.raises(ValueError, match="old_positions"):
        rope_native.rerotate_keys(keys, torch.arange(9), torch.arange(11), freq)


def test_auto_takes_the_native_kernel_on_the_cpu(monkeypatch):
    x = torch.randn(2, 8)
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    assert kernels.rope_ops(x) is rope_native
    assert kernels.rope_ops(x, "torch") is rope_ref
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    assert kernels.rope_ops(x) is rope_ref


def test_without_a_compiler_the_reference_answers(monkeypatch, tmp_path, caplog):
    from kernels import native

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.build.cache_clear()
    rope_native.native_library.cache_clear()
    try:
        keys, _ = sample((2, 12, 16), torch.bfloat16, 5)
        old = torch.arange(12)
        with caplog.at_level("WARNING"):
            got = rope_native.rerotate_keys(keys, old, old + 40, inv_freq(16))
        assert rope_native.native_library() is None
        assert "could not build" in caplog.text and "rope_native.c" in caplog.text
        assert torch.equal(got, rope_ref.rerotate_keys(keys, old, old + 40, inv_freq(16)))
    finally:
        native.build.cache_clear()
        rope_native.native_library.cache_clear()
