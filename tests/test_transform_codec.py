"""The calibrated transform codec (kvtc): calibration bytes and ids, the entropy stages, the
error bound on irregular blocks, spec parsing, and calibrations stored in and resolved from the
cache through a real daemon."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compression import calibration_store, decode_block, get_codec
from compression.calibration import Allocation, Calibration
from compression.calibration_fit import calibrate
from compression.entropy import decode_rows, encode_rows
from compression.transform import TransformCodec

LAYERS, HEADS, HEAD_DIM = 3, 2, 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kv_block(tokens: int, seed: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[L, 2, H, T, D] correlated non-zero data: a low-rank part, outlier channels, an offset, noise."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(LAYERS, 2, 8, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(99))  # shared "model"
    latent = torch.randn(LAYERS, 2, tokens, 8, generator=g)
    x = latent @ mix + 0.1 * torch.randn(LAYERS, 2, tokens, HEADS * HEAD_DIM, generator=g) + 0.3
    x[..., 5] *= 6.0  # an outlier channel
    x = x.view(LAYERS, 2, tokens, HEADS, HEAD_DIM).permute(0, 1, 3, 2, 4)
    return x.contiguous().to(dtype)


@pytest.fixture(scope="module")
def calibration() -> Calibration:
    return calibrate([kv_block(300, seed=1), kv_block(200, seed=2)], Allocation(0.2, 0.3), source="test")


@pytest.fixture(autouse=True)
def isolated_store(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration_store.CALIBRATION_DIR_ENV, str(tmp_path / "calibrations"))


def test_calibration_bytes_round_trip_and_id(calibration):
    raw = calibration.to_bytes
    again = Calibration.from_bytes(raw + bytes(100))  # padding of a stored block is ignored
    assert again.id == calibration.id and len(calibration.id) == 64
    assert torch.equal(again.analysis, calibration.analysis) and torch.equal(again.step, calibration.step)
    # analysis and synthesis invert each other; the basis puts the most variance first
    eye = torch.bmm(calibration.analysis, calibration.synthesis)
    assert torch.allclose(eye, torch.eye(eye.shape[-1]).expand_as(eye), atol=1e-4)
    assert (calibration.std[:, :-1] >= calibration.std[:, 1:] - 1e-6).all()
    other = calibration.with_allocation(Allocation(0.5, 0.5))
    assert other.id != calibration.id and other.kept.sum() <= calibration.kept.sum()
    assert (other.step >= calibration.step).all()


SPEC_HEAD = {"ans": "kvtc", "rans": "kvtc-rans", "zstd": "kvtc-zstd"}


@pytest.mark.parametrize("coder", ["ans", "rans", "zstd"])
def test_entropy_stages_are_exact(coder):
    g = np.random.default_rng(0)
    codes = np.concatenate([
        np.round(g.laplace(0, 3.0, (40, 77))), np.zeros((3, 77)),  # ordinary rows, all-zero rows
        np.round(g.laplace(0, 0.2, (5, 77))), np.full((1, 77), -300.0),  # nearly zero, wide (int16)
    ]).astype(np.int32)
    codes[7, 3] = 32767
    raw = encode_rows(codes, coder)
    assert np.array_equal(decode_rows(raw, *codes.shape, coder), codes)


def test_rans_beats_zstd_on_mixed_scales():
    g = np.random.default_rng(1)
    scales = np.geomspace(0.05, 20, 64)[:, None]
    codes = np.round(g.laplace(0, 1.0, (64, 256)) * scales).astype(np.int32)
    assert len(encode_rows(codes, "rans")) < 0.95 * len(encode_rows(codes, "zstd"))
    # kvstore's own coder: Laplace models at 13-bit precision, lane states and escapes: within 1%
    assert len(encode_rows(codes, "ans")) < 1.01 * len(encode_rows(codes, "rans"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 256])
@pytest.mark.parametrize("coder", ["ans", "rans", "zstd"])
def test_codec_holds_its_error_bound(calibration, dtype, tokens, coder):
    calibration_store.register(calibration)
    codec = get_codec(SPEC_HEAD[coder] + "@" + calibration.id[:12])
    block = kv_block(tokens, seed=tokens + 7, dtype=dtype)
    encoded = codec.encode(block)
    assert encoded.params["calibration"] == calibration.id and encoded.codec == codec.name
    decoded = decode_block(encoded, tuple(block.shape), dtype)
    assert decoded.dtype == dtype and decoded.shape == block.shape
    err = (decoded.double() - block.double()).abs().max().item()
    bound = codec.error_bound(block)
    assert err <= bound, f"max error {err} above the bound {bound}"
    if tokens >= 37:  # (a 1-token block is mostly the stream header: row scales and the range table)
        assert encoded.nbytes < block.numel() * 2 / 2  # at least 2x smaller than fp16 on correlated data


def test_codec_error_shrinks_with_the_step(calibration):
    block = kv_block(128, seed=5, dtype=torch.float32)
    errors = []
    for step in (0.4, 0.1, 0.02):
        codec = TransformCodec(calibration.with_allocation(Allocation(step, step)))
        encoded = codec.encode(block)
        errors.append(float((codec.decode(encoded.payload, encoded.params, block.shape, block.dtype) - block).abs().mean()))
    assert errors[0] > errors[1] > errors[2]


def test_spec_errors_name_the_fix(calibration):
    with pytest.raises(ValueError, match="kvtc@<calibration id>"):
        get_codec("kvtc-lz9@0123456789ab")
    with pytest.raises(ValueError, match="hex digits"):
        get_codec("kvtc@xyz")
    with pytest.raises(ValueError, match="kvstore calibrate"):
        get_codec("kvtc@0123456789ab").encode(kv_block(4, seed=0))
    with pytest.raises(ValueError, match="does not match"):
        TransformCodec(calibration).encode(torch.randn(1, 2, 1, 8, 8).half() + 1)


def test_resolve_from_directory_and_rejects_tampered_bytes(calibration, tmp_path):
    path = calibration_store.save(calibration)
    calibration_store._loaded.pop(calibration.id, None)
    assert calibration_store.resolve(calibration.id[:10]).id == calibration.id
    calibration_store._loaded.pop(calibration.id, None)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="hash to"):
        calibration_store.resolve(calibration.id)


def test_calibration_travels_through_the_daemon(calibration, daemon):
    """Put through KVStoreClient, drop every local copy, decode a block by Getting it back."""
    from engine_adapter.client.kvstore_client import KVStoreClient

    block = kv_block(64, seed=11)
    encoded = TransformCodec(calibration).encode(block)
    with KVStoreClient(daemon.address) as client:
        assert calibration_store.put_calibration(client, calibration) == len(calibration_store.calibration_blocks(calibration))
        calibration_store._loaded.pop(calibration.id, None)
        source = calibration_store.client_source(client)
        calibration_store.add_source(source)
        try:
            decoded = decode_block(encoded, tuple(block.shape), block.dtype)
        finally:
            calibration_store.remove_source(source)
    assert (decoded.double() - block.double()).abs().max() <= TransformCodec(calibration).error_bound(block)


def test_a_calibration_travels_in_parts_each_within_an_inline_get(calibration, daemon, monkeypatch):
    """A calibration larger than a part (Llama-3-8B's is 128 MiB, which one inline Get with its
    reply's copies could not carry) is stored and fetched in parts; with a part gone it is not
    resolved at all (never a truncated calibration)."""
    from engine_adapter.client.kvstore_client import KVStoreClient

    raw = calibration.to_bytes
    monkeypatch.setattr(calibration_store, "PART_BYTES", 64 * 256)  # parts of 16 KiB: several for this calibration
    blocks = calibration_store.calibration_blocks(calibration)
    assert len(blocks) >= 3 and len({key for key, _, _ in blocks}) == len(blocks)
    assert blocks[0][0] == calibration_store.calibration_key(calibration.id)
    assert all(len(payload) == calibration_store.PART_BYTES for _, _, payload in blocks[:-1])
    with KVStoreClient(daemon.address) as client:
        assert calibration_store.put_calibration(client, calibration) == len(blocks)
        fetched = calibration_store.fetch_calibration(client, calibration.id)
        assert fetched[: len(raw)] == raw and not any(fetched[len(raw):])  # the last part's padding
        calibration_store._loaded.pop(calibration.id, None)
        source = calibration_store.client_source(client)
        calibration_store.add_source(source)
        try:
            assert calibration_store.resolve(calibration.id).id == calibration.id
            calibration_store._loaded.pop(calibration.id, None)
            assert client.delete([blocks[1][0]]) == 1  # a middle part evicted
            with pytest.raises(ValueError):
                calibration_store.resolve(calibration.id)
        finally:
            calibration_store.remove_source(source)


def test_exact_blocks_such_as_calibrations_are_never_transcoded():
    """A lossy disk_codec/s3_codec would destroy a calibration's bytes (their hash is checked on load)."""
    import dataclasses

    import numpy as np

    from kvstore.block import BlockHeader, payload_checksum
    from kvstore.keys import KVLayout
    from compression.transcode import transcode

    layout = KVLayout(2, 1, 8, "float16")
    payload = np.random.default_rng(5).standard_normal(layout.block_bytes(4) // 2).astype(np.float16).tobytes()
    header = BlockHeader(key=b"c" * 16, namespace=b"n" * 16, layout=layout, tokens=4, payload_len=len(payload),
                         checksum=payload_checksum(payload), codec="raw", codec_params={"exact": True})
    same_header, same_payload = transcode(header, payload, "int8")
    assert same_header == header and bytes(same_payload) == payload
    lossy_header, _ = transcode(dataclasses.replace(header, codec_params={}), payload, "int8")
    assert lossy_header.codec == "int8"


# -- keys before RoPE (calibration format v3) ------------------------------------------------------------

INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))  # [D/2]


def rope_block(tokens: int, start: int, seed: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """`kv_block` data with its keys rotated by RoPE to positions start..start+T-1, position 0 an outlier (a sink)."""
    from kernels.rope_ref import rerotate_keys

    block = kv_block(tokens, seed, torch.float32)
    block[:, 0] += 2.0  # keys with a clear mean (real keys have one: the start estimate reads it)
    if start == 0:
        block[:, :, :, 0] *= 8.0
    positions = torch.arange(start, start + tokens)
    block[:, 0] = rerotate_keys(block[:, 0].contiguous(), torch.zeros_like(positions), positions, INV_FREQ)
    return block.to(dtype)


@pytest.fixture(scope="module")
def rope_calibration() -> Calibration:
    return calibrate([rope_block(300, 0, seed=1, dtype=torch.float32), rope_block(200, 0, seed=2, dtype=torch.float32)],
                     Allocation(0.2, 0.3, sink_tokens=4), rope_inv_freq=INV_FREQ, max_position=8192,
                     source="test, pre-RoPE")


def test_a_block_of_another_layout_is_refused_in_words_not_by_a_tensor_op(rope_calibration):
    """A RoPE-aware calibration asked to code a block of another layout (a write-down to a kvtc
    disk tier of a namespace it was not made for) says so; on ee82bf6 it failed inside einsum()."""
    codec = TransformCodec(rope_calibration)
    cal = rope_calibration
    for shape in [(cal.num_layers + 1, 2, cal.num_kv_heads, 8, cal.head_dim),
                  (cal.num_layers, 2, cal.num_kv_heads + 1, 8, cal.head_dim),
                  (cal.num_layers, 2, cal.num_kv_heads, 8, cal.head_dim * 2)]:
        with pytest.raises(ValueError, match="does not match calibration"):
            codec.encode(torch.randn(*shape).half())


def test_v3_calibration_round_trips_and_v2_bytes_are_unchanged(calibration, rope_calibration):
    again = Calibration.from_bytes(rope_calibration.to_bytes)
    assert again.id == rope_calibration.id and torch.equal(again.rope_inv_freq, INV_FREQ)
    assert again.allocation.sink_tokens == 4 and b"kvstore-calibration-v3" in rope_calibration.to_bytes
    assert b"kvstore-calibration-v2" in calibration.to_bytes  # no new feature: the old format, the old id
    scaled = rope_calibration.with_allocation(Allocation(0.2, 0.3, sink_tokens=4, row_scale=(2.0,) + (1.0,) * 5))
    assert torch.allclose(scaled.step[0][scaled.kept[0]], 2 * rope_calibration.step[0][scaled.kept[0]])
    assert Calibration.from_bytes(scaled.to_bytes).allocation.row_scale == scaled.allocation.row_scale
    with pytest.raises(ValueError, match="row_scale has 3 factors"):
        rope_calibration.with_allocation(Allocation(0.2, 0.3, sink_tokens=4, row_scale=(1.0, 1.0, 1.0)))
    future = rope_calibration.to_bytes.replace(b"kvstore-calibration-v3", b"kvstore-calibration-v9")
    with pytest.raises(ValueError, match="recalibrate"):
        Calibration.from_bytes(future)


@pytest.mark.parametrize("tokens,start,max_position", [
    (1, 0, 8192), (3, 0, 8192), (37, 0, 8192), (37, 300, 8192), (256, 1024, 8192), (5, 2, 8192), (63, 8128, 8192),
    (63, 77_777, 1 << 17), (64, 131_008, 1 << 17), (100, 5, 0)])
def test_start_estimate_finds_the_position(rope_calibration, tokens, start, max_position):
    import dataclasses

    from compression.transform import estimate_start

    calibration = dataclasses.replace(rope_calibration, max_position=max_position)  # 0: the 2^17 default
    block = rope_block(tokens, start, seed=start + tokens)
    assert estimate_start(block[:, 0].float(), calibration) == start


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,start", [(1, 0), (4, 0), (37, 0), (37, 300), (130, 5000)])
@pytest.mark.parametrize("layer_group", [1, 3])
def test_rope_codec_holds_its_error_bound(rope_calibration, dtype, tokens, start, layer_group):
    """Per-layer rows, and rows over all 3 layers (format v4) on data whose layers share factors."""
    calibration = rope_calibration if layer_group == 1 else grouped_calibration(layer_group)
    calibration_store.register(calibration)
    codec = get_codec("kvtc@" + calibration.id[:12])
    block = (rope_block if layer_group == 1 else shared_block)(tokens, start, seed=tokens + 3, dtype=dtype)
    encoded = codec.encode(block)
    assert encoded.params["start"] == start
    decoded = decode_block(encoded, tuple(block.shape), dtype)
    assert decoded.dtype == dtype and decoded.shape == block.shape
    err = (decoded.double() - block.double()).abs().max().item()
    bound = codec.error_bound(block)
    assert err <= bound, f"max error {err} above the bound {bound}"
    sinks = max(0, min(tokens, 4 - start))
    assert encoded.params["sink_tokens"] == sinks
    assert torch.equal(decoded[:, :, :, :sinks], block[:, :, :, :sinks])  # attention sinks travel raw


def test_wrong_start_still_decodes_within_the_bound(rope_calibration):
    """The written start, not the estimate, drives decode: a wrong one costs bytes or error, within the bound."""
    codec = TransformCodec(rope_calibration)
    block = rope_block(64, 640, seed=9, dtype=torch.float32)
    errors = []
    for start in (640, 641, 700, 0):
        encoded = codec.encode(block, start=start)
        assert encoded.params["start"] == start
        decoded = codec.decode(encoded.payload, encoded.params, block.shape, block.dtype)
        errors.append(float((decoded - block).abs().max()))
        assert errors[-1] <= codec.error_bound(block, start=start)
    assert errors[0] < errors[2]


def test_keys_before_rope_code_rotated_keys_better(rope_calibration):
    """The point of the v3 frame: keys that RoPE rotated are coded with less error for no more bytes."""
    post = calibrate([rope_block(300, 0, seed=1, dtype=torch.float32), rope_block(200, 0, seed=2, dtype=torch.float32)],
                     Allocation(0.2, 0.3))
    block = rope_block(256, 2048, seed=4, dtype=torch.float32)
    results = []
    for codec in (TransformCodec(rope_calibration), TransformCodec(post)):
        encoded = codec.encode(block)
        decoded = codec.decode(encoded.payload, encoded.params, block.shape, block.dtype)
        results.append((float((decoded - block)[:, 0].pow(2).mean()), encoded.nbytes))
    (pre_err, pre_bytes), (post_err, post_bytes) = results
    assert pre_err < post_err and pre_bytes <= 1.1 * post_bytes


def test_sensitivity_scale_gives_sensitive_rows_finer_steps():
    from engine_adapter.calibrate import sensitivity_scale

    scale = sensitivity_scale(torch.tensor([1e-4, 4e-4, 1e-4, 1e-4]), groups=2)
    assert len(scale) == 8 and scale[0] == scale[1]  # one factor per head group
    assert scale[2] == pytest.approx(scale[0] / 2)  # 4x the KL per step^2: half the step
    assert math.prod(scale) == pytest.approx(1.0)  # geometric mean 1: about the same bytes
    assert sensitivity_scale(torch.tensor([1e-9, 1.0]), limit=4.0) == (4.0, 0.25)
    assert sensitivity_scale(torch.tensor([1e-4, 4e-4]), strength=0.0) == (1.0, 1.0)
    assert sensitivity_scale(torch.tensor([1e-9, 1.0]), limit=16.0) == pytest.approx((16.0, 1 / 16))  # a wider clip
    with pytest.raises(ValueError, match="limit must be >= 1"):
        sensitivity_scale(torch.tensor([1e-4, 4e-4]), limit=0.5)


# -- rows over several layers (calibration format v4) ------------------------------------------------------


def shared_block(tokens: int, start: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[L, 2, H, T, D] whose layers share their latent factors per token, as a residual stream feeds
    every layer (`kv_block` has one latent per layer); keys rotated by RoPE to start..start+T-1."""
    from kernels.rope_ref import rerotate_keys

    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(LAYERS, 2, 6, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(98))
    latent = torch.randn(tokens, 6, generator=g)  # one per token, read by every layer
    x = (latent @ mix) * torch.tensor([1.0, 3.0, 0.5])[:, None, None, None]  # layers of different scales
    x = x + 0.05 * torch.randn(LAYERS, 2, tokens, HEADS * HEAD_DIM, generator=g) + 0.2
    x[:, 0] += 6.0  # keys with a clear mean, as real keys have (the start estimate reads it)
    block = x.view(LAYERS, 2, tokens, HEADS, HEAD_DIM).permute(0, 1, 3, 2, 4).contiguous()
    if start == 0:
        block[:, :, :, 0] *= 8.0  # position 0 an outlier (a sink), as in `rope_block`
    positions = torch.arange(start, start + tokens)
    block[:, 0] = rerotate_keys(block[:, 0].contiguous(), torch.zeros_like(positions), positions, INV_FREQ)
    return block.to(dtype)


def grouped_calibration(layer_group: int, allocation: Allocation | None = None, groups: int = 1) -> Calibration:
    return calibrate([shared_block(400, 0, seed=1), shared_block(300, 0, seed=2)],
                     allocation or Allocation(0.3, 0.3, drop=0.2, sink_tokens=4), groups=groups,
                     rope_inv_freq=INV_FREQ, max_position=8192, layer_group=layer_group)


@pytest.mark.parametrize("layer_group,groups", [(1, 1), (3, 1), (3, 2)])
def test_layer_grouped_rows_invert(layer_group, groups):
    calibration = grouped_calibration(layer_group, groups=groups)
    assert calibration.rows == LAYERS // layer_group * 2 * groups
    assert calibration.channels == layer_group * HEADS // groups * HEAD_DIM
    block = kv_block(37, seed=5, dtype=torch.float32)
    rows = calibration.block_rows(block)
    assert torch.equal(calibration.rows_block(rows), block)
    if layer_group == 3 and groups == 1:  # row 1 = values of layers 0..2, side by side per token
        assert torch.equal(rows[1, 7, :HEADS * HEAD_DIM], block[0, 1, :, 7].reshape(-1))
        assert torch.equal(rows[1, 7, 2 * HEADS * HEAD_DIM:], block[2, 1, :, 7].reshape(-1))
    assert calibration.is_key_row.tolist() == [(b // groups) % 2 == 0 for b in range(calibration.rows)]


def forge(raw: bytes, **fields) -> bytes:
    """Calibration bytes with header fields replaced (the header's length prefix re-made)."""
    import json

    from compression.calibration import MAGIC

    start = len(MAGIC) + 4
    n_head = int.from_bytes(raw[len(MAGIC):start], "little")
    header = {**json.loads(raw[start:start + n_head]), **fields}
    head = json.dumps(header).encode()
    return MAGIC + len(head).to_bytes(4, "little") + head + raw[start + n_head:]


def test_v4_calibration_round_trips_and_refuses_what_it_cannot():
    calibration = grouped_calibration(3)
    raw = calibration.to_bytes
    again = Calibration.from_bytes(raw)
    assert again.id == calibration.id and again.layer_group == 3 and b"kvstore-calibration-v4" in raw
    assert b"layer_group" not in grouped_calibration(1).to_bytes  # per-layer rows: v3 as before, the same ids
    with pytest.raises(ValueError, match="folded into its bases"):
        calibration.with_allocation(Allocation(0.5, 0.5, sink_tokens=4))
    with pytest.raises(ValueError, match="positive divisor of the 3 layers"):
        grouped_calibration(2)
    for hostile in (0, -3, 9, 3.0, [3], "3", 1e99, True, None):  # a forged header, re-framed with its length
        with pytest.raises(ValueError, match="layer_group|truncated|integers"):
            Calibration.from_bytes(forge(raw, layer_group=hostile))
    with pytest.raises(ValueError, match="integers"):
        Calibration.from_bytes(forge(raw, num_layers=None))
    with pytest.raises(ValueError, match="malformed"):
        Calibration.from_bytes(forge(raw, allocation={"key_step": 0.3}))
    from compression.calibration import MAX_GROUP_CHANNELS
    from compression.calibration_stats import CalibrationStats

    assert CalibrationStats(8, 8, 64, layer_group=4)._probe.channels == MAX_GROUP_CHANNELS  # 512 a layer
    with pytest.raises(ValueError, match=f"at most {MAX_GROUP_CHANNELS}"):  # two [C, C] matrices grow as C^2
        CalibrationStats(8, 8, 64, layer_group=8)
    with pytest.raises(ValueError, match="row_scale has 2 factors for 6"):
        grouped_calibration(3, Allocation(0.3, 0.3, sink_tokens=4, row_scale=(1.0, 2.0)))


def test_layer_groups_code_shared_structure_in_fewer_bytes():
    """What rows over layers are for: layers that share their factors cost fewer bytes at the same
    allocation, and no layer comes out worse than its per-layer twin by more than a little."""
    block = shared_block(256, 1000, seed=21)
    results = {}
    for layer_group in (1, 3):
        codec = TransformCodec(grouped_calibration(layer_group))
        encoded = codec.encode(block)
        decoded = codec.decode(encoded.payload, encoded.params, block.shape, block.dtype)
        per_layer = (decoded - block).pow(2).mean((1, 2, 3, 4)) / block.var((1, 2, 3, 4))  # [L] relative MSE
        results[layer_group] = encoded.nbytes, per_layer
    (bytes_1, err_1), (bytes_3, err_3) = results[1], results[3]
    assert bytes_3 < 0.8 * bytes_1, (bytes_3, bytes_1)
    assert bool((err_3 <= 1.5 * err_1).all()), (err_3, err_1)


def test_layer_grouped_steps_follow_each_layers_scale():
    """Per-layer steps survive the grouping: a row_scale of 1/4 on layer 0's values codes them finer."""
    block = shared_block(256, 700, seed=31)
    plain = Allocation(0.3, 0.3, drop=0.2, sink_tokens=4)
    finer = Allocation(0.3, 0.3, drop=0.2, sink_tokens=4, row_scale=(1.0, 0.25) + (1.0,) * 4)
    errors = []
    for allocation in (plain, finer):
        codec = TransformCodec(grouped_calibration(3, allocation))
        encoded = codec.encode(block)
        decoded = codec.decode(encoded.payload, encoded.params, block.shape, block.dtype)
        errors.append(float((decoded - block)[0, 1].pow(2).mean()))
    assert errors[1] < 0.5 * errors[0], errors


def test_calibrate_model_groups_layers_with_per_layer_sensitivities():
    """`kvstore calibrate --layer-group` on a model: the sensitivities are measured per layer, as for
    per-layer rows, and end up in the grouped rows' steps; the result codes the model's KV within its bound."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tests.blend_models import tiny_model

    from engine_adapter.calibrate import calibrate_model

    model = tiny_model(seed=3)
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(1, 97, (420,), generator=g).tolist() for _ in range(2)]
    allocation = Allocation(0.4, 0.4, drop=0.2, sink_tokens=4)
    per_layer = calibrate_model(model, texts, allocation, sensitivity=True)
    grouped = calibrate_model(model, texts, allocation, sensitivity=True, layer_group=2)
    assert (per_layer.layer_group, grouped.layer_group) == (1, 2) and grouped.rows == 4 and grouped.channels == 64
    assert grouped.allocation.row_scale == per_layer.allocation.row_scale and len(grouped.allocation.row_scale) == 8
    from engine_adapter.reference.generate import prefill

    kv = model.new_cache(300)
    prefill(model, torch.randint(1, 97, (300,), generator=g).tolist(), kv, start_pos=0)
    block = kv.export(256, 300)  # the model's own KV at positions 256..299
    for calibration in (per_layer, grouped):
        codec = TransformCodec(calibration)
        encoded = codec.encode(block)
        assert encoded.params["start"] == 256
        decoded = codec.decode(encoded.payload, encoded.params, block.shape, block.dtype)
        assert 0 < float((decoded - block).abs().max()) <= codec.error_bound(block)


def test_calibrate_refuses_a_layer_group_before_any_work():
    """`kvstore calibrate --layer-group` says what is wrong before the forwards, in one line."""
    from types import SimpleNamespace

    from engine_adapter.calibrate import check_layer_group_early

    smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    check_layer_group_early(10, smollm2, 1, tokens=11_000)
    check_layer_group_early(1, smollm2, 1, tokens=10)  # per-layer rows: no extra need
    with pytest.raises(ValueError, match="--layer-group 7: layer_group must be a positive divisor of the 30 layers"):
        check_layer_group_early(7, smollm2, 1, tokens=11_000)
    with pytest.raises(ValueError, match="--layer-group 15: .*at most 2048"):
        check_layer_group_early(15, smollm2, 1, tokens=11_000)
    with pytest.raises(ValueError, match="need at least 3840 tokens of text, got 900"):
        check_layer_group_early(10, smollm2, 1, tokens=900)
    with pytest.raises(ValueError, match="--layer-group 0"):
        check_layer_group_early(0, smollm2, 1, tokens=11_000)
    for groups in (0, 2):
        with pytest.raises(ValueError, match=f"--groups {groups}: must divide the model's 3 kv heads"):
            check_layer_group_early(1, smollm2, groups, tokens=11_000)


def test_a_layer_without_spread_in_a_group_decodes_to_its_mean():
    """A layer whose values never vary (its step is 0) gets no components, as a per-layer row would,
    instead of weights of 1e30 that would swamp its group (and its error bound)."""
    blocks = [shared_block(400, 0, seed=1), shared_block(300, 0, seed=2)]
    for block in blocks:
        block[1, 1] = 0.25  # layer 1's values: constant
    calibration = calibrate(blocks, Allocation(0.3, 0.3, drop=0.2, sink_tokens=4), rope_inv_freq=INV_FREQ,
                            max_position=8192, layer_group=3)
    assert float(calibration.analysis.abs().max()) < 1e4 and bool(torch.isfinite(calibration.synthesis).all())
    codec = TransformCodec(calibration)
    block = shared_block(64, 512, seed=3)
    block[1, 1] = 0.25
    encoded = codec.encode(block)
    decoded = codec.decode(encoded.payload, encoded.params, block.shape, block.dtype)
    assert torch.allclose(decoded[1, 1], block[1, 1], atol=1e-5)
    bound = codec.error_bound(block)
    assert math.isfinite(bound) and float((decoded - block).abs().max()) <= bound
