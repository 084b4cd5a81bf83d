"""Codecs round-trip within their stated error bound; lossless stages are bit-exact; decoding
needs only payload + params (after a JSON round trip) + shape + dtype."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compression import EncodedBlock, STAGES, decode_block, get_codec, known_codecs
from compression.codecs import LowbitCodec, Int8Codec

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SHAPES = ((2, 2, 3, 63, 80), (1, 2, 3, 100, 64), (2, 2, 1, 257, 128))
SPECS = (
    "raw",
    "int8",
    "int4",
    "int2",
    "int4-g64",
    "int2-g16",
    "raw+lz4",
    "raw+shuffle+zstd",
    "raw+zstd3",
    "int8+shuffle+zstd",
    "int4-g32+shuffle+zstd",
    "int2-g64+lz4",
)


def kv_block(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim] with KV-like statistics: keys carry a few outlier
    channels and a per-channel offset that drifts slowly over tokens; values are plainer."""
    n_layers, _, n_heads, n_tokens, head_dim = shape
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(torch.randn(n_layers, n_heads, 1, head_dim, generator=g))  # per-channel scale
    chan[..., torch.randint(0, head_dim, (3,), generator=g)] *= 10.0
    drift = torch.cumsum(torch.randn(n_layers, n_heads, n_tokens, 1, generator=g) * 0.05, dim=2)
    keys = torch.randn(n_layers, n_heads, n_tokens, head_dim, generator=g) * chan + chan * drift
    values = torch.randn(n_layers, n_heads, n_tokens, head_dim, generator=g) * torch.exp(
        0.3 * torch.randn(n_layers, n_heads, n_tokens, 1, generator=g)
    )
    return torch.stack([keys, values], dim=1).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS)
def test_roundtrip_within_bound(spec, dtype):
    shape = SHAPES[SPECS.index(spec) % len(SHAPES)]
    block = kv_block(shape, dtype, seed=SPECS.index(spec))
    codec = get_codec(spec)
    encoded = codec.encode(block)
    assert encoded.codec == codec.name
    decoded = codec.decode(encoded.payload, encoded.params, block.shape, dtype)
    assert decoded.shape == block.shape and decoded.dtype == dtype
    if codec.lossless:
        assert codec.error_bound(block) == 0.0
        assert same_bits(decoded, block)
        return
    err = (decoded.float() - block.float()).abs()
    bound = codec.error_bound(block)
    assert float(err.max()) <= bound, f"{spec}: max error {float(err.max())} > bound {bound}"
    assert float(err.max()) > 0  # a lossy codec that is exact here is not being exercised


@pytest.mark.parametrize("spec", ["raw+shuffle+zstd", "int4-g32+shuffle+zstd", "int8+lz4"])
def test_decoding_needs_only_payload_params_shape_dtype(spec):
    block = kv_block(SHAPES[0], torch.bfloat16, seed=11)
    encoded = get_codec(spec).encode(block)
    header = json.dumps({"codec": encoded.codec, "params": encoded.params})  # what a header holds
    fields = json.loads(header)
    rebuilt = EncodedBlock(bytes(encoded.payload), fields["params"], fields["codec"])
    again = decode_block(rebuilt, tuple(block.shape), torch.bfloat16)
    first = get_codec(spec).decode(encoded.payload, encoded.params, block.shape, torch.bfloat16)
    assert same_bits(again, first)


def test_keys_are_grouped_per_channel_values_per_token():
    """KIVI orientation: a large constant key channel must not spoil the other channels (keys are
    grouped along tokens), and one loud value token must not spoil the other tokens."""
    block = torch.randn(1, 2, 2, 64, 64, generator=torch.Generator().manual_seed(3)) * 0.1
    block[:, 0, :, :, 5] = 100.0  # key channel 5: constant over tokens
    block[:, 1, :, 7, :] *= 1000.0  # value token 7: loud
    decoded = get_codec("int4-g32").decode(*_enc(block, "int4-g32"), block.shape, torch.float32)
    err = (decoded - block).abs()
    quiet_keys = torch.cat([err[:, 0, ..., :5], err[:, 0, ..., 6:]], dim=-1)
    quiet_values = torch.cat([err[:, 1, :, :7], err[:, 1, :, 8:]], dim=2)
    assert float(err[:, 0, ..., 5].max()) < 1e-2
    # groups of quiet data span about 0.8, so scale ~0.05 and error <= 0.03; a group that held
    # the loud channel or token would have scale >= 100 / 15 and errors up to 3
    assert float(quiet_keys.max()) < 0.05 and float(quiet_values.max()) < 0.05


def _enc(block: torch.Tensor, spec: str) -> tuple[bytes, dict]:
    encoded = get_codec(spec).encode(block)
    return encoded.payload, encoded.params


def test_large_float32_blocks_keep_float32_scales():
    block = kv_block(SHAPES[1], torch.float32, seed=5) * 1e5
    codec = get_codec("int4-g32")
    encoded = codec.encode(block)
    assert encoded.params["meta_dtype"] == "float32"
    decoded = codec.decode(encoded.payload, encoded.params, block.shape, torch.float32)
    assert torch.isfinite(decoded).all()
    assert float((decoded - block).abs().max()) <= codec.error_bound(block)


@pytest.mark.parametrize("codec", [Int8Codec("triton"), LowbitCodec(4, 32, "triton"), LowbitCodec(2, 16, "triton")])
def test_triton_path_encodes_the_same_bytes(codec):
    pytest.importorskip("triton")
    block = kv_block((1, 2, 3, 63, 64), torch.float16, seed=9)
    reference = get_codec(codec.name)  # torch path on CPU
    encoded = codec.encode(block)
    assert encoded.payload == reference.encode(block).payload
    decoded = codec.decode(encoded.payload, encoded.params, block.shape, torch.float16)
    assert same_bits(decoded, reference.decode(encoded.payload, encoded.params, block.shape, torch.float16))


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_lossless_stages_are_bit_exact(stage):
    rng = np.random.default_rng(0)
    sections = [("a", 4 * 999, 4), ("b", 1001, 1), ("c", 2 * 257, 2), ("empty", 0, 2)]
    payload = rng.integers(0, 256, sum(n for _, n, _ in sections), dtype=np.uint8)
    payload[:2000] //= 16  # some redundancy so coders take their compressing path
    payload = payload.tobytes()
    s = STAGES[stage]()
    encoded, params = s.encode(payload, sections)
    params = json.loads(json.dumps(params))
    assert s.decode(encoded, params, sections) == payload
    empty, params = s.encode(b"", [("x", 0, 2)])
    assert s.decode(empty, params, [("x", 0, 2)]) == b""


def test_shuffle_then_zstd_beats_plain_zstd_on_fp16():
    block = kv_block((4, 2, 3, 128, 64), torch.float16, seed=2)
    plain = len(get_codec("raw+zstd").encode(block).payload)
    shuffled = len(get_codec("raw+shuffle+zstd").encode(block).payload)
    assert shuffled < plain < block.numel() * 2


@pytest.mark.parametrize("spec", ["int5", "raw+gzip", "int4-gx", "int4-g", "raw-g32", "int8-g32", "int4-g24", ""])
def test_unknown_specs_raise_value_error(spec):
    with pytest.raises(ValueError) as err:
        get_codec(spec)
    if spec in ("int5", "raw+gzip", ""):
        assert "known" in str(err.value) and "int4" in str(err.value) and "zstd" in str(err.value)


def test_known_codecs_lists_every_name():
    text = known_codecs()
    for name in ("raw", "int8", "int4", "int2", "lz4", "zstd", "shuffle"):
        assert name in text


def test_decode_rejects_a_truncated_payload():
    block = kv_block(SHAPES[0], torch.float16, seed=1)
    for spec in ("raw", "int8", "int4"):
        codec = get_codec(spec)
        encoded = codec.encode(block)
        with pytest.raises(ValueError, match="payload"):
            codec.decode(encoded.payload[:-1], encoded.params, block.shape, torch.float16)


def test_encode_rejects_non_blocks():
    with pytest.raises(ValueError, match="layers, 2"):
        get_codec("int8").encode(torch.randn(2, 3, 4, 5, 6))
    with pytest.raises(ValueError, match="dtype"):
        get_codec("raw").encode(torch.zeros(1, 2, 1, 4, 8, dtype=torch.int32))
