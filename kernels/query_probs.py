"""The stale_attention query pass's attention probabilities in C (`query_probs.c`), on CPUs with
AVX512-BF16.

`query_probs` gives what `blend.select.attention_probs` gives for bfloat16 queries and keys (the
float32 probabilities of rows at given positions over a causal cache), and the attention mass the
weighted rows pay each key, in one pass per KV head: the products of bfloat16 values are exact in
float32, so the kernel multiplies the bfloat16 inputs two at a time (vdpbf16ps) instead of copying
them to float32 first and multiplying one at a time; the results are torch's within float32
rounding (1e-5 relative: the order of the sums, the exp). On the 2-core AVX-512 dev VM, for 43
query rows over 1,900 keys of SmolLM2-135M's 3 KV heads (one layer), one thread: 0.8 ms against
2.3 ms for torch's products, mask, softmax and mass (docs/benchmarks.md).
It returns None where it does not apply (other dtypes or devices, no C compiler, a CPU without
AVX512-BF16), and the caller keeps its torch path, which is also the reference the tests hold it to.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from kernels.native import build

SOURCE = Path(__file__).with_name("query_probs.c")
_U64, _PTR = ctypes.c_uint64, ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use (`kernels.native.build`); None when it cannot be
    or this CPU lacks AVX512-BF16."""
    library = build(SOURCE, "query-pass attention")
    if library is None or not library.kvstore_query_probs_supported():
        return None
    library.kvstore_query_probs.restype = ctypes.c_int
    library.kvstore_query_probs.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _U64, _U64, _U64, _U64, _U64, _U64,
                                            _U64, ctypes.c_float]
    return library


def query_probs(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """([H, R, S] float32 probabilities, [S] float32 mass) of queries ``q`` [H, R, D] at
    ``positions`` [R] over ``keys`` [KVH, S, D] (key j visible to row i iff j <= positions[i];
    head h reads KV head h // (H / KVH)), both bfloat16 on the CPU; mass[j] is the sum over heads
    and rows i of weights[i] * probs[h, i, j] (``weights`` [R] float32, default all 1). None where
    the kernel does not apply."""
    if q.dim() != 3 or keys.dim() != 3:
        return None
    heads, rows, dim = q.shape
    kv_heads, num_keys = keys.shape[0], keys.shape[1]
    if (q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16 or q.device.type != "cpu"
            or keys.device.type != "cpu" or keys.shape[2] != dim or not kv_heads or heads % kv_heads
            or keys.stride(2) != 1 or rows == 0 or num_keys == 0 or positions.shape != (rows,)
            or (weights is not None and weights.shape != (rows,))):
        return None
    library = native_library()
    if library is None:
        return None
    group = heads // kv_heads
    grouped = q.contiguous().view(kv_heads, group * rows, dim)  # head h's rows follow head h-1's
    at = positions.to(device="cpu", dtype=torch.int64).repeat(group)
    weight = (torch.ones(rows, dtype=torch.float32) if weights is None
              else weights.to(device="cpu", dtype=torch.float32)).repeat(group)
    probs = torch.empty(kv_heads, group * rows, num_keys, dtype=torch.float32)
    mass = torch.zeros(num_keys, dtype=torch.float32)
    status = library.kvstore_query_probs(probs.data_ptr(), mass.data_ptr(), grouped.data_ptr(), keys.data_ptr(),
                                         at.data_ptr(), weight.data_ptr(), kv_heads, group * rows, num_keys, dim,
                                         group * rows * dim, keys.stride(0), keys.stride(1), 1 / math.sqrt(dim))
    if status != 0:
        return None
    return probs.view(heads, rows, num_keys), mass
