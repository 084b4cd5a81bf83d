"""Interleaved static rANS over rows of integer codes: the numpy reference of `kernels/rans.c`.

The entropy stage of the transform codec (`compression/entropy.py`, coder ``ans``). The caller
gives the models (integer frequencies per symbol); this module only codes. Format::

    N = rows * T symbols, symbol i = (row i // T, token i % T) in coding order, in lane i % W
    each lane: a 32-bit state x in [2^16, 2^32), starting (encode) and ending (decode) at 2^16
    frequencies f out of 2^13 (every symbol >= 1), cumulative c, slot = x mod 2^13
    decode:  s = slots[slot]; x = f[s] * (x >> 13) + slot - c[s]; if x < 2^16: x = x << 16 | next word
    encode:  (symbols in reverse) if x >= f << 19: push x & 0xffff, x >>= 16; x = (x // f << 13) + x % f + c
    stream:  the W final states, then the pushed 16-bit words in reverse push order (= decode order)

A model of n symbols codes v in [-E, E] as symbol v + E. With an escape symbol (n - 1) it codes
any v: |v| > E is the escape, and v itself goes, in coding order, to an escape list the caller
stores beside the stream.

Lanes make the lockstep loop here vectorize over W symbols at a time (one numpy step per W
symbols, the renormalization reads ordered by a cumulative sum); in C they are independent
dependency chains. Decode refuses a damaged stream (ValueError): a read past the words, an
escape past the list, or a lane that does not end at 2^16.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

PROB_BITS = 13
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 16
MAX_LANES = 256


@dataclasses.dataclass(frozen=True)
class Model:
    """One symbol model: frequencies [n] (sum 2^13, each >= 1), whether symbol n - 1 escapes, and
    the derived tables (`Model.of` makes them): cumulative frequencies [n], slot -> symbol [2^13]."""

    freq: np.ndarray  # uint32 [n]
    escape: bool
    cum: np.ndarray  # uint32 [n]
    slots: np.ndarray  # uint16 [2^13]

    def __post_init__(self) -> None:
        """The C coder trusts a model's tables: check them (whoever built the model)."""
        n = len(self.freq)
        if (n - int(self.escape)) % 2 != 1 or n > PROB_SCALE:
            raise ValueError(f"a model has an odd number of code symbols (plus an escape), at most {PROB_SCALE}; got {n}")
        if self.freq.dtype != np.uint32 or int(self.freq.min()) < 1 or int(self.freq.sum(dtype=np.int64)) != PROB_SCALE:
            raise ValueError(f"model frequencies must be uint32, >= 1, and sum to {PROB_SCALE}")
        for name, t, dtype, length in (("freq", self.freq, np.uint32, n), ("cum", self.cum, np.uint32, n),
                                       ("slots", self.slots, np.uint16, PROB_SCALE)):
            if t.dtype != dtype or t.shape != (length,) or not t.flags.c_contiguous:
                raise ValueError(f"model {name} must be contiguous {np.dtype(dtype).name} [{length}]")
        if int(self.slots.max()) >= n or int(self.cum[0]) != 0 \
                or not np.array_equal(self.cum[1:], np.cumsum(self.freq, dtype=np.int64)[:-1]):
            raise ValueError("model cum and slots must be those of its frequencies (use Model.of)")

    @classmethod
    def of(cls, freq: np.ndarray, escape: bool) -> "Model":
        freq = np.array(freq, dtype=np.uint32)  # a copy: it is made read-only below
        cum = np.concatenate(([0], np.cumsum(freq, dtype=np.int64)[:-1])).astype(np.uint32)
        slots = np.repeat(np.arange(len(freq), dtype=np.uint16), freq)
        for t in (freq, cum, slots):
            t.flags.writeable = False
        return cls(freq, escape, cum, slots)

    @property
    def n(self) -> int:
        return len(self.freq)

    @functools.cached_property
    def addresses(self) -> tuple[int, int, int]:
        """Where freq, cum and slots live (the C coder's model pointers; the arrays are read-only)."""
        return self.freq.ctypes.data, self.cum.ctypes.data, self.slots.ctypes.data

    @property
    def half(self) -> int:
        """E: the model codes v in [-E, E] directly."""
        return (self.n - 1 - int(self.escape)) // 2


@dataclasses.dataclass(frozen=True)
class ModelSet:
    """The models of one stream, indexed by model number."""

    models: tuple[Model, ...]

    @functools.cached_property
    def n(self) -> np.ndarray:  # int64 [M]
        return np.array([m.n for m in self.models], dtype=np.int64)

    @functools.cached_property
    def has_esc(self) -> np.ndarray:  # int32 [M]
        return np.array([m.escape for m in self.models], dtype=np.int32)

    @functools.cached_property
    def half(self) -> np.ndarray:  # int64 [M]
        return np.array([m.half for m in self.models], dtype=np.int64)

    @functools.cached_property
    def off(self) -> np.ndarray:  # int64 [M]: model m's symbols start at off[m] in `flat`'s freq and cum
        return np.concatenate(([0], np.cumsum(self.n)[:-1])).astype(np.int64)

    @functools.cached_property
    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(freq, cum, slots) of every model concatenated: the lockstep loop's lookup tables."""
        if not self.models:
            return np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint16)
        return tuple(np.concatenate([getattr(m, name) for m in self.models]) for name in ("freq", "cum", "slots"))


def check_rows(n_rows_total: int, rows: np.ndarray, models: np.ndarray, model_set: ModelSet) -> None:
    if rows.shape != models.shape or rows.ndim != 1:
        raise ValueError("rows and models must be 1-d arrays of one length")
    if len(rows) and (rows.min() < 0 or rows.max() >= n_rows_total):
        raise ValueError(f"row indices must lie in [0, {n_rows_total})")
    if len(models) and (models.min() < 0 or models.max() >= len(model_set.n)):
        raise ValueError(f"model indices must lie in [0, {len(model_set.models)})")


def encode(codes: np.ndarray, rows: np.ndarray, models: np.ndarray, model_set: ModelSet,
           lanes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [R, T] int32; coding order rows[r] with model models[r] -> (states [W] uint32, words uint16, escapes int16).

    ValueError if a code falls outside its model and the model has no escape."""
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be in [1, {MAX_LANES}], got {lanes}")
    check_rows(codes.shape[0], rows, models, model_set)
    n_tokens = codes.shape[1]
    values = codes[rows].astype(np.int64).reshape(-1)  # [N] in coding order
    model = np.repeat(models, n_tokens)  # [N]
    half = model_set.half[model]
    outside = np.abs(values) > half
    if np.any(outside & (model_set.has_esc[model] == 0)):
        raise ValueError("a code lies outside its model's range and the model has no escape symbol")
    symbols = np.where(outside, model_set.n[model] - 1, values + half)
    escapes = values[outside]
    if escapes.size and (escapes.min() < -32768 or escapes.max() > 32767):
        raise ValueError("an escaped code lies outside the int16 range")
    escapes = escapes.astype(np.int16)
    freq, cum, _ = model_set.flat
    index = model_set.off[model] + symbols
    f = freq[index].astype(np.uint64)
    c = cum[index].astype(np.uint64)
    x = np.full(lanes, STATE_LOW, dtype=np.uint64)
    pushed = []
    n = len(values)
    for start in range((n - 1) // lanes * lanes if n else -1, -1, -lanes):
        stop = min(start + lanes, n)
        k = stop - start
        xs, fs, cs = x[:k], f[start:stop], c[start:stop]
        emit = xs >= (fs << np.uint64(32 - PROB_BITS))
        pushed.append((xs[emit] & np.uint64(0xFFFF))[::-1])  # lanes in falling order, as the C loop
        xs = np.where(emit, xs >> np.uint64(16), xs)
        x[:k] = ((xs // fs) << np.uint64(PROB_BITS)) + xs % fs + cs
    words = np.concatenate(pushed)[::-1].astype(np.uint16) if pushed else np.zeros(0, np.uint16)
    return x.astype(np.uint32), words, escapes


def decode(words: np.ndarray, states: np.ndarray, escapes: np.ndarray, n_tokens: int, rows: np.ndarray,
           models: np.ndarray, model_set: ModelSet, n_rows_total: int) -> np.ndarray:
    """Inverse of `encode` -> codes [n_rows_total, T] int32 (rows not in ``rows`` are 0)."""
    check_rows(n_rows_total, rows, models, model_set)
    lanes = len(states)
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be in [1, {MAX_LANES}], got {lanes}")
    out = np.zeros((n_rows_total, n_tokens), dtype=np.int32)
    model = np.repeat(models, n_tokens)  # [N]
    n = len(model)
    x = states.astype(np.uint64)
    word = words.astype(np.uint64)
    symbols = np.empty(n, dtype=np.int64)
    slot_base = model.astype(np.int64) * PROB_SCALE
    off = model_set.off[model]
    freq, cum, slots = model_set.flat
    read = 0
    mask = np.uint64(PROB_SCALE - 1)
    for start in range(0, n, lanes):
        stop = min(start + lanes, n)
        k = stop - start
        xs = x[:k]
        slot = xs & mask
        s = slots[slot_base[start:stop] + slot.astype(np.int64)].astype(np.int64)
        index = off[start:stop] + s
        xs = freq[index].astype(np.uint64) * (xs >> np.uint64(PROB_BITS)) + slot - cum[index].astype(np.uint64)
        xs &= np.uint64(0xFFFFFFFF)  # as the C code's uint32 (only a damaged stream wraps)
        need = xs < STATE_LOW
        count = int(need.sum())
        if read + count > len(word):
            raise ValueError("rans stream damaged: it runs out of words")
        xs[need] = (xs[need] << np.uint64(16)) | word[read:read + count]
        read += count
        x[:k] = xs
        symbols[start:stop] = s
    escaped = (model_set.has_esc[model] == 1) & (symbols == model_set.n[model] - 1)
    if int(escaped.sum()) > len(escapes):
        raise ValueError("rans stream damaged: it runs out of escapes")
    if np.any(x != STATE_LOW) or read != len(word) or int(escaped.sum()) != len(escapes):
        raise ValueError("rans stream damaged: a lane does not end at its initial state, or data is left over")
    values = symbols - model_set.half[model]
    values[escaped] = escapes.astype(np.int64)
    out[rows] = values.reshape(len(rows), n_tokens)
    return out
