"""Entropy stages for integer codes laid out as rows (one row = one component over a block's tokens).

Two coders behind one pair of functions, measured against each other in docs/compression.md:

- ``rans``: range-ANS (the `constriction` package). Each row r gets a Laplace scale
  b_r = mean |code| (quantized to a byte, `scale_code`); rows with the same byte share a
  categorical model, the discretized Laplace pmf over [-M, M] with M the largest |code| among them
  (every symbol in the range keeps a nonzero probability). Rows of all zeros cost nothing.
- ``zstd``: the codes as int8 (int16 when any |code| > 127), row after row, zstd level 3.

Both are exact: `decode_rows(encode_rows(codes)) == codes`.
"""

from __future__ import annotations

import math

import numpy as np
import zstandard

ENTROPY_CODERS = ("rans", "zstd")
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


def encode_rows(codes: np.ndarray, coder: str) -> bytes:
    """codes [R, T] int32 -> bytes. Layout (rans): scale bytes [R] | range table [256] uint16 | stream."""
    if coder not in ENTROPY_CODERS:
        raise ValueError(f"entropy coder must be one of {ENTROPY_CODERS}, got {coder!r}")
    codes = np.ascontiguousarray(codes, dtype=np.int32)
    if coder == "zstd":
        wide = codes.size and int(np.abs(codes).max()) > 127
        body = codes.astype(np.int16 if wide else np.int8).tobytes()
        return bytes([2 if wide else 1]) + zstandard.ZstdCompressor(level=3).compress(body)
    import constriction

    scales = scale_code(np.abs(codes).mean(axis=1) if codes.size else np.zeros(0))  # [R]
    max_abs = np.abs(codes).max(axis=1) if codes.shape[1] else np.zeros(len(codes), dtype=np.int32)
    ranges = np.zeros(256, dtype=np.uint16)
    np.maximum.at(ranges, scales, np.minimum(max_abs, _MAX_RANGE).astype(np.uint16))
    ranges[0] = 0
    coder_ = constriction.stream.stack.AnsCoder()
    for q in sorted(set(scales.tolist()) - {0}, reverse=True):  # decoded in rising order
        m = int(ranges[q])
        symbols = (codes[scales == q] + m).reshape(-1)  # [rows_q * T], in 0..2m
        model = constriction.stream.model.Categorical(laplace_pmf(scale_value(q), m), perfect=False)
        coder_.encode_reverse(symbols.astype(np.int32), model)
    stream = coder_.get_compressed().astype("<u4").tobytes()
    return scales.tobytes() + ranges.astype("<u2").tobytes() + stream


def decode_rows(raw: bytes, n_rows: int, n_cols: int, coder: str) -> np.ndarray:
    """Inverse of `encode_rows` -> codes [n_rows, n_cols] int32."""
    if coder not in ENTROPY_CODERS:
        raise ValueError(f"entropy coder must be one of {ENTROPY_CODERS}, got {coder!r}")
    if coder == "zstd":
        width = raw[0]
        body = zstandard.ZstdDecompressor().decompress(raw[1:], max_output_size=n_rows * n_cols * width)
        return np.frombuffer(body, dtype=np.int16 if width == 2 else np.int8).astype(np.int32).reshape(n_rows, n_cols)
    import constriction

    scales = np.frombuffer(raw, dtype=np.uint8, count=n_rows)
    ranges = np.frombuffer(raw, dtype="<u2", count=256, offset=n_rows).astype(np.int64)
    stream_offset = n_rows + 512
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


def bits_per_code(raw_len: int, n_codes: int) -> float:
    return 8 * raw_len / n_codes if n_codes else math.nan
