"""Entropy stages for integer codes laid out as rows (one row = one component over a block's tokens).

Three coders behind one pair of functions, measured against each other in docs/notes/compression-log.md:

- ``ans``: kvstore's own interleaved rANS (`kernels/rans.c`, its numpy reference
  `kernels/rans_ref.py`), the default. The layout of ``rans`` (a Laplace scale byte per row, rows
  of one byte sharing a model) with its own frequency tables (13-bit, `laplace_model`), built from
  the scale byte by arithmetic that is exact on every host, so a block coded on one host decodes on
  any other; codes beyond a model's range (10 scales) escape to a list of int16.
- ``rans``: range-ANS (the `constriction` package). Each row r gets a Laplace scale
  b_r = mean |code| (quantized to a byte, `scale_code`); rows with the same byte share a
  categorical model, the discretized Laplace pmf over [-M, M] with M the largest |code| among them
  (every symbol in the range keeps a nonzero probability). Rows of all zeros cost nothing.
- ``zstd``: the codes as int8 (int16 when any |code| > 127), row after row, zstd level 3.

All are exact for codes in the int16 range (what the transform codec makes; beyond it ``ans`` and
``zstd`` refuse): `decode_rows(encode_rows(codes)) == codes`.

``ans`` layout: scale bytes [R] | range table [256] uint16 (as ``rans``) | lanes uint16 | escape
count uint32 | lane states [lanes] uint32 | escapes int16 | words uint16 (`kernels/rans_ref.py`).
``rans`` rebuilds its pmfs with numpy's float64 exp, whose last bit may differ between hosts (SIMD
paths): blocks it codes are safe to decode where they were coded; ``ans`` is safe anywhere.
"""

from __future__ import annotations

import decimal
import functools
import math

import numpy as np
import zstandard

from kernels import rans, rans_ref

ENTROPY_CODERS = ("ans", "rans", "zstd")
DEFAULT_CODER = "ans"
_SCALE_LEVELS = 16  # scale bytes per octave
_SCALE_ZERO = 128  # scale byte of b = 1
_MAX_RANGE = 2**15 - 1


def scale_code(mean_abs: np.ndarray) -> np.ndarray:
    """uint8 scale bytes for row Laplace scales (0 = an all-zero row)."""
    q = np.round(_SCALE_LEVELS * np.log2(np.maximum(mean_abs, 1e-12)) + _SCALE_ZERO)
    q = np.clip(q, 1, 255).astype(np.uint8)
    q[mean_abs == 0] = 0
    return q


def scale_value(code: int) -> float:
    return 2.0 ** ((code - _SCALE_ZERO) / _SCALE_LEVELS)


def laplace_pmf(scale: float, max_abs: int) -> np.ndarray:
    """P(round(X) = k) for k in [-max_abs, max_abs], X ~ Laplace(0, scale), tails folded into the ends."""
    edges = np.arange(-max_abs, max_abs + 2, dtype=np.float64) - 0.5  # [2M + 2]
    cdf = np.where(edges < 0, 0.5 * np.exp(edges / scale), 1.0 - 0.5 * np.exp(-edges / scale))
    cdf[0], cdf[-1] = 0.0, 1.0
    return np.maximum(np.diff(cdf), 1e-12)  # [2M + 1]


_ESCAPE_SCALES = 10  # an ans model codes |v| <= 10 b + 2 directly (P(|X| > 10 b) = e^-10 under its Laplace)
_MAX_HALF = 2047  # and at most |v| <= 2047 (4,096 symbols of 2^13 slots; wider codes escape)
_MAX_LANES = rans_ref.MAX_LANES
_SYMBOLS_PER_LANE = 4096  # lanes = the power of two nearest below N / 4096, in [1, 256]: 4 bytes of state each


@functools.lru_cache(maxsize=None)
def _exact_scale(code: int) -> tuple[float, int]:
    """(s = e^(-1 / (2 b)), escape range) of scale byte ``code``, correctly rounded (decimal), so the same on every host."""
    # a context of its own: the caller's rounding mode or traps must not change the models
    with decimal.localcontext(decimal.Context(prec=40, rounding=decimal.ROUND_HALF_EVEN)):
        b = (decimal.Decimal(2).ln() * (code - _SCALE_ZERO) / _SCALE_LEVELS).exp()
        s = (-1 / (2 * b)).exp()
        cap = int((_ESCAPE_SCALES * b).to_integral_value(rounding=decimal.ROUND_CEILING)) + 2
    return float(s), min(cap, _MAX_HALF)


def laplace_model(code: int, max_abs: int) -> rans_ref.Model:
    """The ``ans`` model of scale byte ``code`` for codes up to ``max_abs`` (see `_laplace_model`)."""
    cap = _exact_scale(code)[1]
    return _laplace_model(code, min(max_abs, cap), max_abs > cap)


@functools.lru_cache(maxsize=2048)
def _laplace_model(code: int, half: int, escape: bool) -> rans_ref.Model:
    """The ``ans`` model of scale byte ``code`` over [-half, half] (`laplace_model`: half = min(max_abs,
    escape range)): integer frequencies of the discretized Laplace pmf there, its tails folded into
    the ends or, with ``escape`` (max_abs beyond the range), into an escape symbol.

    Only IEEE +, -, *, / on floats from `_exact_scale`, in a fixed order, so the frequencies are the
    same bits on every host: P(0) = 1 - s, P(+-j) = t_(j-1) - t_j with t_j = s^(2 j + 1) / 2 the tail
    beyond j + 1/2. Each symbol gets 1 + floor(P (2^13 - n)) and the remainder goes to the largest
    fractional parts (ties to the lower symbol)."""
    s = _exact_scale(code)[0]
    s2 = s * s
    side = []  # P(j) for j = 1..E
    tail = 0.5 * s
    for _ in range(half):
        nxt = tail * s2
        side.append(tail - nxt)
        tail = nxt
    if half and not escape:
        side[-1] += tail
    centre = 1.0 - s if half or escape else 1.0
    weights = side[::-1] + [centre] + side + ([2.0 * tail] if escape else [])
    n = len(weights)
    budget = rans_ref.PROB_SCALE - n
    total = 0.0
    for w in weights:
        total += w
    raw = [w * budget / total for w in weights]
    base = [math.floor(r) for r in raw]
    freq = np.array(base, dtype=np.int64) + 1
    left = rans_ref.PROB_SCALE - int(freq.sum())
    if left:
        order = sorted(range(n), key=lambda i: (-(raw[i] - base[i]), i))
        freq[order[:left]] += 1
    return rans_ref.Model.of(freq, escape)


def _ans_models(scales: np.ndarray, ranges: np.ndarray, n_cols: int) -> tuple[np.ndarray, np.ndarray, rans_ref.ModelSet]:
    """(rows in coding order, their model indices, the models) for rows with scale bytes ``scales``:
    rows by rising scale byte, all-zero rows (byte 0) left out, as the ``rans`` layout."""
    order = np.argsort(scales, kind="stable") if n_cols else np.zeros(0, np.int64)  # by rising byte, stable
    rows = order[scales[order] != 0].astype(np.int64)
    used, model_of = np.unique(scales[rows], return_inverse=True)
    models = rans_ref.ModelSet(tuple(laplace_model(int(q), int(ranges[q])) for q in used))
    return rows, model_of.astype(np.int64).reshape(-1), models


def _lanes(n_symbols: int) -> int:
    lanes = 1
    while lanes * 2 <= min(_MAX_LANES, n_symbols // _SYMBOLS_PER_LANE):
        lanes *= 2
    return lanes


def _row_scales(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale byte per row, range table [256]: the largest |code| among the rows of each byte)."""
    scales = scale_code(np.abs(codes).mean(axis=1) if codes.size else np.zeros(len(codes)))  # [R]
    max_abs = np.abs(codes).max(axis=1) if codes.shape[1] else np.zeros(len(codes), dtype=np.int32)
    ranges = np.zeros(256, dtype=np.uint16)
    np.maximum.at(ranges, scales, np.minimum(max_abs, _MAX_RANGE).astype(np.uint16))
    ranges[0] = 0
    return scales, ranges


def encode_rows(codes: np.ndarray, coder: str) -> bytes:
    """codes [R, T] int32 -> bytes. Layout (rans): scale bytes [R] | range table [256] uint16 | stream."""
    if coder not in ENTROPY_CODERS:
        raise ValueError(f"entropy coder must be one of {ENTROPY_CODERS}, got {coder!r}")
    codes = np.ascontiguousarray(codes, dtype=np.int32)
    if coder == "zstd":
        if codes.size and (int(codes.min()) < -32768 or int(codes.max()) > 32767):
            raise ValueError("zstd codes must lie in the int16 range")
        wide = codes.size and int(np.abs(codes).max()) > 127
        body = codes.astype(np.int16 if wide else np.int8).tobytes()
        return bytes([2 if wide else 1]) + zstandard.ZstdCompressor(level=3).compress(body)
    scales, ranges = _row_scales(codes)
    if coder == "ans":  # (a code beyond int16 always escapes, and the coder refuses such an escape)
        rows, model_of, models = _ans_models(scales, ranges, codes.shape[1])
        states, words, escapes = rans.encode(codes, rows, model_of, models, _lanes(len(rows) * codes.shape[1]))
        head = np.array([len(states)], "<u2").tobytes() + np.array([len(escapes)], "<u4").tobytes()
        return (scales.tobytes() + ranges.astype("<u2").tobytes() + head + states.astype("<u4").tobytes()
                + escapes.astype("<i2").tobytes() + words.astype("<u2").tobytes())
    import constriction

    coder_ = constriction.stream.stack.AnsCoder()
    for q in sorted(set(scales.tolist()) - {0}, reverse=True):  # decoded in rising order
        m = int(ranges[q])
        symbols = (codes[scales == q] + m).reshape(-1)  # [rows_q * T], in 0..2m
        model = constriction.stream.model.Categorical(laplace_pmf(scale_value(q), m), perfect=False)
        coder_.encode_reverse(symbols.astype(np.int32), model)
    stream = coder_.get_compressed().astype("<u4").tobytes()
    return scales.tobytes() + ranges.astype("<u2").tobytes() + stream


def stream_bound(n_rows: int, n_cols: int) -> int:
    """The most bytes `encode_rows` writes for codes [n_rows, n_cols], any coder: 8 per code (``ans``
    writes at most a word and an escape, 4; ``rans`` at most 24 bits; ``zstd`` 2 and its worst case),
    the scale and range tables, and 64 KiB for lane states, counts and frame headers."""
    return n_rows + 512 + 8 * n_rows * n_cols + (1 << 16)


def decode_rows(raw: bytes, n_rows: int, n_cols: int, coder: str) -> np.ndarray:
    """Inverse of `encode_rows` -> codes [n_rows, n_cols] int32; ValueError for a damaged stream or one
    that would decode to more or fewer codes (nothing larger than the codes is allocated)."""
    if coder not in ENTROPY_CODERS:
        raise ValueError(f"entropy coder must be one of {ENTROPY_CODERS}, got {coder!r}")
    if not (type(n_rows) is int and type(n_cols) is int and n_rows >= 0 and n_cols >= 0):
        raise ValueError(f"a stream codes [rows, tokens] of ints >= 0, got [{n_rows!r}, {n_cols!r}]")
    if coder == "zstd":
        return _decode_zstd(raw, n_rows, n_cols)
    if len(raw) < n_rows + 512:
        raise ValueError(f"{coder} stream of {len(raw)} bytes is shorter than its {n_rows + 512}-byte header")
    scales = np.frombuffer(raw, dtype=np.uint8, count=n_rows)
    ranges = np.frombuffer(raw, dtype="<u2", count=256, offset=n_rows).astype(np.int64)
    stream_offset = n_rows + 512
    if coder == "ans":
        return _decode_ans(raw, scales, ranges, stream_offset, n_rows, n_cols)
    import constriction

    if (len(raw) - stream_offset) % 4:
        raise ValueError("rans stream is not a whole number of 32-bit words")
    stream = np.frombuffer(raw, dtype="<u4", offset=stream_offset).astype(np.uint32)
    coder_ = constriction.stream.stack.AnsCoder(stream)
    codes = np.zeros((n_rows, n_cols), dtype=np.int32)
    for q in sorted(set(scales.tolist()) - {0}):
        m = int(ranges[q])
        rows = np.flatnonzero(scales == q)
        model = constriction.stream.model.Categorical(laplace_pmf(scale_value(q), m), perfect=False)
        symbols = coder_.decode(model, len(rows) * n_cols)
        codes[rows] = symbols.reshape(len(rows), n_cols) - m
    return codes


def _decode_zstd(raw: bytes, n_rows: int, n_cols: int) -> np.ndarray:
    width = raw[0] if raw else 0
    if width not in (1, 2):
        raise ValueError(f"zstd stream's code width is {width}; must be 1 or 2 bytes")
    size = n_rows * n_cols * width
    try:
        declared = zstandard.frame_content_size(raw[1:])  # what zstd would allocate
        if declared != size:
            raise ValueError(f"zstd stream holds {declared} bytes (-1: unknown); [{n_rows}, {n_cols}] codes are "
                             f"{size}")
        body = zstandard.ZstdDecompressor().decompress(raw[1:], max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd stream does not decompress: {exc}") from None
    if len(body) != size:
        raise ValueError(f"zstd stream decompresses to {len(body)} bytes; [{n_rows}, {n_cols}] codes are {size}")
    return np.frombuffer(body, dtype=np.int16 if width == 2 else np.int8).astype(np.int32).reshape(n_rows, n_cols)


def _decode_ans(raw: bytes, scales: np.ndarray, ranges: np.ndarray, at: int, n_rows: int, n_cols: int) -> np.ndarray:
    if len(raw) < at + 6:
        raise ValueError("ans stream is shorter than its lane and escape counts")
    lanes = int(np.frombuffer(raw, "<u2", count=1, offset=at)[0])
    n_esc = int(np.frombuffer(raw, "<u4", count=1, offset=at + 2)[0])
    rows, model_of, models = _ans_models(scales, ranges, n_cols)
    if not 1 <= lanes <= _MAX_LANES or n_esc > len(rows) * n_cols:  # (any lane count decodes: not tied to `_lanes`)
        raise ValueError(f"ans stream header is damaged: {lanes} lanes, {n_esc} escapes for {len(rows) * n_cols} codes")
    at += 6
    words_at = at + 4 * lanes + 2 * n_esc
    if len(raw) < words_at or (len(raw) - words_at) % 2:
        raise ValueError("ans stream is not its header, states, escapes and whole 16-bit words")
    states = np.frombuffer(raw, "<u4", count=lanes, offset=at)
    escapes = np.frombuffer(raw, "<i2", count=n_esc, offset=at + 4 * lanes)
    words = np.frombuffer(raw, "<u2", offset=words_at)
    return rans.decode(words, states, escapes, n_cols, rows, model_of, models, n_rows)


def bits_per_code(raw_len: int, n_codes: int) -> float:
    return 8 * raw_len / n_codes if n_codes else math.nan
