"""Binds the module name ``kernels`` to kvstore's own `kernels/` package, whatever sys.path finds first.

kvstore's top-level `kernels/` (the design's layout) shares its name with Hugging Face's
``kernels`` package, which transformers 5 installs. With kvstore installed editable (the README's
``pip install -e .``), sys.path lists site-packages before the project, so any process that does
not start in the project root (the ``kvstore`` console script, ``python bench/x.py``, an engine
started elsewhere) imported Hugging Face's package under kvstore's name, and the first codec call
failed with ``module 'kernels' has no attribute 'ops'``.

The packages that use the kernels (`compression`, `blend`, `engine_adapter`) import this module
first; it loads kvstore's package from beside this one and registers it as ``kernels``. If another
``kernels`` was imported before, it is replaced (its importers keep what they already took from it)
and that is logged once. A plain wheel install of kvstore next to Hugging Face's ``kernels`` cannot
work (both write site-packages/kernels/); install kvstore editable, as the README does.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

OWN = Path(__file__).resolve().parents[1] / "kernels" / "__init__.py"


def claim() -> None:
    """Make ``import kernels`` give kvstore's package in this process (idempotent)."""
    current = sys.modules.get("kernels")
    if current is not None and _is_own(current):
        return
    spec = importlib.util.find_spec("kernels") if current is None else None
    if spec is not None and spec.origin and Path(spec.origin).resolve() == OWN:
        return  # sys.path finds ours: let the normal import do it
    if not OWN.is_file():
        raise ImportError(f"kvstore's kernels package is missing: no {OWN} (a broken install?)")
    if current is not None:
        log.warning("kvstore: a package named 'kernels' (%s) was imported before kvstore's own; kvstore's "
                    "replaces it under that name", getattr(current, "__file__", current))
        for name in [n for n in sys.modules if n.startswith("kernels.")]:
            del sys.modules[name]
    own = importlib.util.spec_from_file_location("kernels", OWN, submodule_search_locations=[str(OWN.parent)])
    module = importlib.util.module_from_spec(own)
    sys.modules["kernels"] = module
    try:
        own.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise


def _is_own(module) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve() == OWN


claim()
