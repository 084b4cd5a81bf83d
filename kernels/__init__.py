"""Triton kernels, each beside a pure-torch reference with the same signature.

`ops(x)` picks the implementation for a tensor:

    KVSTORE_KERNELS=auto    (default) Triton for CUDA tensors when triton imports, torch otherwise
    KVSTORE_KERNELS=triton  always Triton (CPU tensors then need TRITON_INTERPRET=1)
    KVSTORE_KERNELS=torch   always the torch reference

A `choice` argument overrides the environment. Triton is imported only when it is chosen, so this
package imports (and the codecs work) without triton installed.

Some kernels are native C rather than Triton, for CPU memory, where Triton does not run (built by
`kernels.native`): `page_copy.c` (through `page_copy.py`, beside `page_copy_ref.py`) writes blocks
into vLLM's CPU pages and reads them back, `rope_native.c` (`rope_native.py`) re-rotates keys with the bits of
`rope_ref.py`, `rans.c` (`rans.py`, beside `rans_ref.py`) is kvtc's entropy coder, and
`copy_hash.c` (`copy_hash.py`) copies a Put's payload and computes its XXH3-64 in one pass, and
`query_probs.c` (`query_probs.py`, beside `blend.select.attention_probs`) forms the blend's query
pass's attention probabilities from bfloat16 with AVX512-BF16.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

KERNELS_ENV = "KVSTORE_KERNELS"
BACKENDS = ("auto", "triton", "torch")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend(x: torch.Tensor, choice: str | None = None) -> str:
    """'triton' or 'torch' for tensor x; choice (or $KVSTORE_KERNELS, default 'auto') decides."""
    choice = choice or os.environ.get(KERNELS_ENV, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS} (from argument or ${KERNELS_ENV}), got {choice!r}")
    if choice == "auto":
        return "triton" if x.is_cuda and _triton_available() else "torch"
    return choice


def ops(x: torch.Tensor, choice: str | None = None) -> ModuleType:
    """The module (kernels.quant or kernels.quant_ref) that quantizes x; both share signatures."""
    if backend(x, choice) == "triton":
        from kernels import quant

        return quant
    from kernels import quant_ref

    return quant_ref


def transform_ops(x: torch.Tensor, choice: str | None = None) -> ModuleType:
    """kernels.transform or kernels.transform_ref for x (the transform codec's kernels); same rule as `ops`."""
    if backend(x, choice) == "triton":
        from kernels import transform

        return transform
    from kernels import transform_ref

    return transform_ref


def rope_ops(x: torch.Tensor, choice: str | None = None) -> ModuleType:
    """kernels.rope or kernels.rope_ref for x (RoPE re-rotation of keys); same rule as `ops`,
    except that "auto" takes the native C kernel (`kernels.rope_native`, the reference's bits in
    one pass) for a CPU tensor."""
    if backend(x, choice) == "triton":
        from kernels import rope

        return rope
    if x.device.type == "cpu" and (choice or os.environ.get(KERNELS_ENV, "auto")) == "auto":
        from kernels import rope_native

        return rope_native
    from kernels import rope_ref

    return rope_ref


# ``kernels`` is also the name of Hugging Face's package (transformers 5 imports it): its submodules
# and top-level names are served from here too (kvstore/kernels_path.py says why and how).
from kvstore import kernels_path as _kernels_path  # noqa: E402

_kernels_path.extend_path(__path__)


def __getattr__(name: str):
    return _kernels_path.foreign_attr(name)
