"""RoPE re-rotation of CPU keys in one pass of native C (`rope_native.c`), for bfloat16 and float32.

Same signature and the same bits as `kernels/rope_ref.py` ``rerotate_keys``: the angles come from
the reference's `rotation_angles`, and the C code does the reference's float32 arithmetic in its
order. The reference makes about ten passes over the keys through float32 temporaries: for the
3.6 M key elements of a 620-token passage of SmolLM2-135M, 9-12 ms against 4.6 ms for this on a
quiet 2-core dev VM (the reference on 2 torch threads, this on one), 51 ms against 6-11 ms with the VM loaded.
Other dtypes, and hosts without a C compiler (`kernels.native`), take the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels import rope_ref
from kernels.native import build
from kernels.rope_ref import as_4d, check_rerotate_args, rotation_angles

SOURCE = Path(__file__).with_name("rope_native.c")
_DTYPES = {torch.bfloat16: 0, torch.float32: 1}  # the C enum
_I64 = ctypes.c_int64


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    library = build(SOURCE, "RoPE re-rotation")
    if library is not None:
        library.kvstore_rerotate.restype = ctypes.c_int
        library.kvstore_rerotate.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, *[_I64] * 10,
                                             ctypes.c_void_p, ctypes.c_void_p]
    return library


def _view_4d(x: torch.Tensor) -> torch.Tensor | None:
    """`rope_ref.as_4d` of x with head_dim contiguous (what the C code reads), or None."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return None
    try:
        return as_4d(x)
    except ValueError:
        return None


def rerotate_keys(keys: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                  inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Keys [..., T, D] rotated from ``old_positions`` [T] to ``new_positions`` [T]; returns ``out``
    (``out`` may be ``keys`` itself). As `kernels.rope_ref.rerotate_keys`, bit for bit."""
    check_rerotate_args(keys, old_positions, new_positions, inv_freq, out)
    library = native_library() if keys.device.type == "cpu" and keys.dtype in _DTYPES else None
    in_place = out is not None and out.data_ptr() == keys.data_ptr() and out.stride() == keys.stride()
    if library is None or (out is not None and not in_place and _overlap(keys, out)):
        return rope_ref.rerotate_keys(keys, old_positions, new_positions, inv_freq, out)
    target = torch.empty_like(keys) if out is None else out
    x, o = _view_4d(keys), _view_4d(target)
    if x is None or o is None:
        return rope_ref.rerotate_keys(keys, old_positions, new_positions, inv_freq, out)
    if keys.numel() == 0:
        return target
    cos, sin = (t.contiguous() for t in rotation_angles(old_positions, new_positions, inv_freq))  # [T, D/2]
    if library.kvstore_rerotate(_DTYPES[keys.dtype], x.data_ptr(), o.data_ptr(), *x.shape, *x.stride()[:3],
                                *o.stride()[:3], cos.data_ptr(), sin.data_ptr()) != 0:
        raise ValueError(f"native re-rotation refused {keys.dtype} keys of shape {tuple(keys.shape)}")
    return target


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges a and b span intersect (conservative)."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
