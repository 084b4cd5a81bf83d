"""The KV dtypes as torch dtypes and back: the one map from a layout's dtype name to torch.

Layouts, block headers and namespaces carry the name (``KVLayout.dtype``, one of
``kvstore.keys.SUPPORTED_DTYPES``); engines, codecs and the daemon's transcoder need the torch
dtype. This module imports torch, so only code that already handles tensors imports it (the client,
``kvstore.keys`` and the CLI's non-engine commands stay free of torch).
"""

from __future__ import annotations

import torch

from kvstore.keys import SUPPORTED_DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in SUPPORTED_DTYPES}
TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
