"""kvstore's interleaved rANS (`kernels/rans.c` against its numpy reference `kernels/rans_ref.py`),
the ``ans`` entropy stage's models (`compression.entropy.laplace_model`), and the transform codec's
products over kept components only (projection and back-projection, against the full ones)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from compression.entropy import decode_rows, encode_rows, laplace_model
from kernels import rans, rans_ref, transform_ref

NATIVE = rans.native_library() is not None


def random_models(rng: np.random.Generator, count: int) -> list[rans_ref.Model]:
    """Irregular models: skewed random frequencies, 1 to ~400 symbols, some with an escape."""
    models = []
    for _ in range(count):
        half, escape = int(rng.integers(0, 200)) if rng.random() < 0.8 else 0, bool(rng.random() < 0.4)
        n = 2 * half + 1 + escape
        w = rng.exponential(1.0, n) ** 3 + 1e-4
        freq = np.maximum(1, np.floor(w / w.sum() * (rans_ref.PROB_SCALE - n))).astype(np.int64)
        freq[int(np.argmax(freq))] += rans_ref.PROB_SCALE - int(freq.sum())
        models.append(rans_ref.Model.of(freq, escape))
    return models


def random_case(seed: int, n_rows: int = 40, n_tokens: int = 37):
    """(codes [R, T], coding order, model per row, models): codes drawn from each row's model, escapes included."""
    rng = np.random.default_rng(seed)
    models = random_models(rng, 6)
    rows = rng.permutation(n_rows)[: max(1, n_rows - 7)]  # some rows left out (all-zero rows of the caller)
    model_of = rng.integers(0, len(models), len(rows))
    codes = np.zeros((n_rows, n_tokens), dtype=np.int32)
    for r, m in zip(rows, model_of):
        model = models[m]
        p = model.freq[: model.n - model.escape] / model.freq[: model.n - model.escape].sum()
        codes[r] = rng.choice(np.arange(-model.half, model.half + 1), size=n_tokens, p=p)
        if model.escape:
            hit = rng.random(n_tokens) < 0.08
            codes[r, hit] = rng.integers(-32767, 32768, int(hit.sum()))
    return codes, rows.astype(np.int64), model_of.astype(np.int64), rans_ref.ModelSet(tuple(models))


@pytest.mark.parametrize("lanes", [1, 3, 64, 256])
@pytest.mark.parametrize("seed,n_rows,n_tokens", [(0, 40, 37), (1, 3, 1), (2, 17, 255), (3, 1, 5)])
def test_native_matches_reference_bit_for_bit(lanes, seed, n_rows, n_tokens):
    if not NATIVE:
        pytest.skip("no C compiler: the reference is the coder")
    codes, rows, model_of, models = random_case(seed, n_rows, n_tokens)
    want = rans_ref.encode(codes, rows, model_of, models, lanes)
    got = rans.encode(codes, rows, model_of, models, lanes)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    states, words, escapes = want
    expected = np.zeros_like(codes)
    expected[rows] = codes[rows]
    for coder in (rans_ref, rans):
        assert np.array_equal(coder.decode(words, states, escapes, n_tokens, rows, model_of, models, n_rows), expected)


def test_coded_size_is_near_the_entropy():
    """The coder wastes little beyond the models' own cross-entropy: lane states, 13-bit frequencies."""
    rng = np.random.default_rng(5)
    codes, rows, model_of, models = random_case(5, 60, 400)
    states, words, escapes = rans.encode(codes, rows, model_of, models, 16)
    bits = 0.0
    for r, m in zip(rows, model_of):
        model = models.models[m]
        v = codes[r]
        symbol = np.where(np.abs(v) > model.half, model.n - 1, v + model.half)
        bits += float(-np.log2(model.freq[symbol] / rans_ref.PROB_SCALE).sum())
    assert 16 * len(words) <= bits * 1.002 + 64 + 32 * len(states)
    del rng


def damaged(stream: tuple[np.ndarray, np.ndarray, np.ndarray], what: str):
    states, words, escapes = (a.copy() for a in stream)
    if what == "state":
        states[0] ^= 0x5A5A
    elif what == "short":
        words = words[:-1]
    elif what == "long":
        words = np.concatenate([words, words[:1]])
    elif what == "word":
        words[len(words) // 2] ^= 0x0101
    elif what == "escapes":
        escapes = escapes[:-1]
    return words, states, escapes


@pytest.mark.parametrize("what", ["state", "short", "long", "word", "escapes"])
def test_damaged_streams_are_refused(what):
    codes, rows, model_of, models = random_case(7, 30, 64)
    stream = rans_ref.encode(codes, rows, model_of, models, 8)
    assert len(stream[2]), "the case must have escapes"
    words, states, escapes = damaged(stream, what)
    for coder in (rans_ref, rans):
        with pytest.raises(ValueError, match="damaged"):
            coder.decode(words, states, escapes, 64, rows, model_of, models, 30)


def test_hostile_payloads_never_crash_the_decoder():
    """Random bytes and single-byte edits of a real ``ans`` payload: a ValueError or some codes, nothing worse."""
    rng = np.random.default_rng(11)
    codes = np.round(rng.laplace(0, np.geomspace(0.1, 40, 24)[:, None], (24, 50))).astype(np.int32)
    raw = encode_rows(codes, "ans")
    for trial in range(300):
        if trial % 3 == 0:
            bad = bytes(rng.integers(0, 256, int(rng.integers(0, 2 * len(raw))), dtype=np.uint8))
        else:
            edit = bytearray(raw)
            edit[int(rng.integers(0, len(raw)))] ^= int(rng.integers(1, 256))
            bad = bytes(edit[: len(edit) - int(rng.integers(0, 3)) * (trial % 2)])
        try:
            out = decode_rows(bad, 24, 50, "ans")
        except ValueError:
            continue
        assert out.shape == (24, 50)


def test_laplace_models_are_the_same_bits_everywhere():
    """The decoder rebuilds each model from its scale byte: the frequencies must not depend on the host.

    They come from correctly rounded decimal arithmetic and IEEE +, -, *, / only; the digest pins
    them, so a change in how they are made (which would make old blocks undecodable) fails here."""
    digest = hashlib.sha256()
    for code in (1, 60, 100, 128, 140, 170, 200, 255):
        for max_abs in (0, 1, 7, 300, 32767):
            model = laplace_model(code, max_abs)
            assert int(model.freq.sum()) == rans_ref.PROB_SCALE and model.freq.min() >= 1
            digest.update(model.freq.astype("<u4").tobytes() + bytes([model.escape]))
    assert digest.hexdigest()[:16] == LAPLACE_DIGEST


LAPLACE_DIGEST = "6ccb6ca9d923c15f"


def test_reference_fallback_without_a_compiler(monkeypatch):
    """Without a C compiler the numpy reference codes the same bytes."""
    codes = np.round(np.random.default_rng(3).laplace(0, 2.0, (20, 300))).astype(np.int32)
    native = encode_rows(codes, "ans")
    monkeypatch.setattr(rans, "native_library", lambda: None)
    assert encode_rows(codes, "ans") == native
    assert np.array_equal(decode_rows(native, 20, 300, "ans"), codes)


@pytest.mark.parametrize("n_tokens", [1, 33, 130])
def test_kept_backprojection_matches_the_full_one(n_tokens):
    """Over the kept components only (not a prefix here) = the full product with zero codes elsewhere."""
    g = torch.Generator().manual_seed(n_tokens)
    n_rows, n_chan = 5, 24
    step = torch.rand(n_rows, n_chan, generator=g) + 0.05
    step[torch.rand(n_rows, n_chan, generator=g) < 0.4] = 0.0
    step[2] = 0.0  # a row with nothing kept
    kept = step > 0
    synthesis = torch.randn(n_rows, n_chan, n_chan, generator=g)
    mean = torch.randn(n_rows, n_chan, generator=g)
    codes = torch.randint(-40, 41, (n_rows, n_tokens, n_chan), generator=g, dtype=torch.int32) * kept[:, None, :]
    full = transform_ref.dequantize_backproject(codes, step, synthesis, mean, torch.float32)
    packed = codes.transpose(1, 2)[kept]  # [R, T]
    scaled = (step[:, :, None] * synthesis)[kept]  # [R, C]
    for dtype in (torch.float32, torch.bfloat16):
        fast = transform_ref.dequantize_backproject_kept(packed, kept.sum(1), scaled, mean, dtype)
        assert fast.dtype == dtype and fast.shape == full.shape
        tol = 1e-4 * float(full.abs().max()) if dtype == torch.float32 else 0.01 * float(full.abs().max())
        assert (fast.float() - full).abs().max() <= tol
    with pytest.raises(ValueError, match="disagree"):
        transform_ref.dequantize_backproject_kept(packed[1:], kept.sum(1), scaled, mean, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n_tokens", [1, 45, 257])
def test_kept_projection_matches_the_full_one(dtype, n_tokens):
    """Codes of the kept components equal the full projection's there, except where the other sum order
    moves a value across a rounding boundary: then by 1, rarely (the Triton kernels' bound)."""
    g = torch.Generator().manual_seed(n_tokens + 1)
    n_rows, n_chan = 4, 40
    x = (torch.randn(n_rows, n_tokens, n_chan, generator=g) * torch.exp(torch.randn(n_chan, generator=g)) + 0.7).to(dtype)
    mean = torch.randn(n_rows, n_chan, generator=g) * 0.5 + 0.1
    analysis, _ = torch.linalg.qr(torch.randn(n_rows, n_chan, n_chan, generator=g))
    inv_step = torch.rand(n_rows, n_chan, generator=g) * 8 + 0.25
    inv_step[torch.rand(n_rows, n_chan, generator=g) < 0.3] = 0.0  # dropped, not a prefix
    inv_step[1] = 0.0  # a row with nothing kept
    kept = inv_step > 0
    full = transform_ref.project_quantize(x, mean, analysis, inv_step).transpose(1, 2)[kept]  # [R, T]
    got = transform_ref.project_quantize_kept(x, mean, analysis.transpose(1, 2)[kept].contiguous(), kept.sum(1),
                                              inv_step[kept])
    assert got.dtype == torch.int32 and got.shape == full.shape
    diff = (got - full).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.005
    with pytest.raises(ValueError, match="summing to R"):
        transform_ref.project_quantize_kept(x, mean, analysis.transpose(1, 2)[kept], kept.sum(1) + 1, inv_step[kept])


def test_models_do_not_depend_on_the_callers_decimal_context():
    import decimal

    from compression import entropy

    want = [laplace_model(q, 40).freq.copy() for q in (112, 160, 176, 192, 208, 240)]
    entropy._exact_scale.cache_clear()
    entropy._laplace_model.cache_clear()
    with decimal.localcontext(decimal.Context(prec=5, rounding=decimal.ROUND_CEILING, traps=[decimal.Inexact])):
        got = [laplace_model(q, 40).freq for q in (112, 160, 176, 192, 208, 240)]
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_codes_beyond_int16_are_refused_not_wrapped():
    codes = np.zeros((2, 10), dtype=np.int32)
    codes[1, 3] = 40000
    for coder in ("ans", "zstd"):
        with pytest.raises(ValueError, match="int16"):
            encode_rows(codes, coder)


def test_a_model_checks_its_tables_however_it_is_built():
    good = rans_ref.Model.of(np.full(8, rans_ref.PROB_SCALE // 8), escape=True)
    with pytest.raises(ValueError, match="cum and slots"):
        rans_ref.Model(good.freq, True, good.cum, np.zeros(rans_ref.PROB_SCALE, dtype=np.uint16) + 9)
    with pytest.raises(ValueError, match="slots must be contiguous"):
        rans_ref.Model(good.freq, True, good.cum, good.slots[:100])
    with pytest.raises(ValueError, match=">= 1"):
        rans_ref.Model.of(np.array([rans_ref.PROB_SCALE, 0, 0]), escape=False)
