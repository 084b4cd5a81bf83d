"""Shared pytest fixtures.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set here,
at collection time, whenever no CUDA device is present.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
