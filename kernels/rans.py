"""Interleaved rANS in native C (`rans.c`), with the signatures and bits of `kernels/rans_ref.py`.

The numpy reference steps W symbols at a time; this codes one symbol at a time with W lanes
as independent dependency chains. Hosts without a C compiler (`kernels.native`) take the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from kernels import rans_ref
from kernels.native import build
from kernels.rans_ref import MAX_LANES, ModelSet, check_rows

SOURCE = Path(__file__).with_name("rans.c")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_DAMAGE = {1: "it runs out of words", 2: "it runs out of escapes",
           3: "a lane does not end at its initial state, or data is left over"}


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    library = build(SOURCE, "rANS entropy coder")
    if library is not None:
        library.kvstore_rans_encode.restype = _I64
        library.kvstore_rans_encode.argtypes = [_P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _I64,
                                                _P, _I64]
        library.kvstore_rans_decode.restype = ctypes.c_int
        library.kvstore_rans_decode.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P,
                                                _P, _P, _P]
    return library


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _tables(model_set: ModelSet) -> tuple[np.ndarray, ...]:
    """(n, has_esc, and arrays of pointers to each model's freq, cum and slots): the C functions' model
    arguments; the pointed-to arrays live as long as the models (read-only, in the model cache)."""
    addresses = np.array([m.addresses for m in model_set.models], dtype=np.uint64).reshape(-1, 3)
    pointers = tuple(np.ascontiguousarray(addresses[:, i]) for i in range(3))
    return (np.ascontiguousarray(model_set.n), np.ascontiguousarray(model_set.has_esc), *pointers)


def encode(codes: np.ndarray, rows: np.ndarray, models: np.ndarray, model_set: ModelSet,
           lanes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """As `rans_ref.encode`: (states [W] uint32, words uint16, escapes int16)."""
    library = native_library()
    if library is None:
        return rans_ref.encode(codes, rows, models, model_set, lanes)
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be in [1, {MAX_LANES}], got {lanes}")
    check_rows(codes.shape[0], rows, models, model_set)
    codes = np.ascontiguousarray(codes, dtype=np.int32)
    rows, models = np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(models, dtype=np.int64)
    n_tokens = codes.shape[1]
    tables = _tables(model_set)  # held: the call reads through their pointers
    states = np.empty(lanes, dtype=np.uint32)
    cap = len(rows) * n_tokens + 1
    words = np.empty(cap, dtype=np.uint16)
    escapes = np.empty(cap, dtype=np.int16)  # filled backward from its end, in coding order
    written = library.kvstore_rans_encode(_ptr(codes), n_tokens, len(rows), _ptr(rows), _ptr(models),
                                          *map(_ptr, tables), lanes, _ptr(states), _ptr(words), cap,
                                          _ptr(escapes), cap)
    if written == -2:
        raise ValueError("an escaped code lies outside the int16 range")
    if written < 0:
        raise ValueError("a code lies outside its model's range and the model has no escape symbol")
    n_esc = int(written >> 32)
    written &= 0xFFFFFFFF
    return states, words[cap - written:].copy(), escapes[cap - n_esc:].copy()


def decode(words: np.ndarray, states: np.ndarray, escapes: np.ndarray, n_tokens: int, rows: np.ndarray,
           models: np.ndarray, model_set: ModelSet, n_rows_total: int) -> np.ndarray:
    """As `rans_ref.decode`: codes [n_rows_total, T] int32; ValueError for a damaged stream."""
    library = native_library()
    if library is None:
        return rans_ref.decode(words, states, escapes, n_tokens, rows, models, model_set, n_rows_total)
    check_rows(n_rows_total, rows, models, model_set)
    lanes = len(states)
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be in [1, {MAX_LANES}], got {lanes}")
    # aligned copies where a payload offset left them unaligned (the C code reads them as typed arrays)
    words = np.require(words, dtype=np.uint16, requirements=("C", "A"))
    states = np.require(states, dtype=np.uint32, requirements=("C", "A"))
    escapes = np.require(escapes, dtype=np.int16, requirements=("C", "A"))
    rows, models = np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(models, dtype=np.int64)
    out = np.zeros((n_rows_total, n_tokens), dtype=np.int32)
    scratch = np.empty(lanes, dtype=np.uint32)
    tables = _tables(model_set)  # held: the call reads through their pointers
    status = library.kvstore_rans_decode(_ptr(words), len(words), _ptr(states), lanes, _ptr(escapes), len(escapes),
                                         n_tokens, len(rows), _ptr(rows), _ptr(models), *map(_ptr, tables),
                                         _ptr(scratch), _ptr(out))
    if status:
        raise ValueError(f"rans stream damaged: {_DAMAGE.get(status, status)}")
    return out
