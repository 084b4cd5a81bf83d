"""kvstore's `kernels/` and Hugging Face's ``kernels`` under one module name, in one process.

kvstore's top-level `kernels/` (the design's layout) shares its name with Hugging Face's
``kernels`` package, which transformers 5 requires and imports (``from kernels import
CUDAProperties, ...`` in ``transformers.integrations.hub_kernels``). Python binds one module to a
name, so without this module:

- outside the project root (the ``kvstore`` console script, ``python bench/x.py``, an engine
  started elsewhere) sys.path lists site-packages first, ``import kernels`` gave Hugging Face's
  package, and kvstore's first codec call failed (``module 'kernels' has no attribute 'ops'``);
- in the project root (the tests) it gave kvstore's, and importing transformers 5 failed.

So the name is kvstore's package, which also serves Hugging Face's: `claim` (run on import of
`compression`, `blend` and `engine_adapter`, which use the kernels, and by `kvstore.block` before it
loads `kernels.copy_hash`) registers kvstore's package
under ``kernels`` whatever sys.path finds first; kvstore's package appends the other one's folder
to its ``__path__`` (`extend_path`, so ``kernels._internals`` and the like import from there: the
two share no submodule name) and hands out the other one's top-level names through its module
``__getattr__`` (`foreign_attr`). If the other package was imported before kvstore's, that module
is kept and its names come from it, so its importers and later ones see the same objects.

A plain wheel install of kvstore next to Hugging Face's ``kernels`` cannot work (both write
site-packages/kernels/); install kvstore editable, as the README does.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

OWN_DIR = Path(__file__).resolve().parents[1] / "kernels"
OWN = OWN_DIR / "__init__.py"

_lock = threading.RLock()
_foreign: ModuleType | None = None  # the other package's top level, once loaded (or as found in sys.modules)


def _is_own(module: ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve() == OWN


def foreign_spec() -> importlib.machinery.ModuleSpec | None:
    """The spec of a ``kernels`` package on sys.path other than kvstore's, or None."""
    paths = [p for p in sys.path if Path(p or ".").resolve() != OWN_DIR.parent]
    spec = importlib.machinery.PathFinder.find_spec("kernels", paths)
    if spec is None or spec.origin is None or Path(spec.origin).resolve() == OWN:
        return None
    return spec


def extend_path(path: list[str]) -> None:
    """Append the other package's folders to kvstore's ``kernels.__path__`` (its submodules then import)."""
    spec = foreign_spec()
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if folder not in path:
            path.append(folder)


#: dunder names the other package may define that its importers read (e.g. ``from kernels import __version__``)
FOREIGN_DUNDERS = ("__version__", "__all__")


def foreign_attr(name: str):
    """A top-level name of the other ``kernels`` package; AttributeError if there is none, it lacks
    the name, it fails to import, or ``name`` is one of kvstore's own submodules (so that ``from kernels
    import rans`` imports ours without loading the other package)."""
    global _foreign
    if (name.startswith("__") and name not in FOREIGN_DUNDERS) or (OWN_DIR / f"{name}.py").is_file() \
            or (OWN_DIR / name / "__init__.py").is_file():
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    with _lock:
        if _foreign is None:
            spec = foreign_spec()
            if spec is None:
                raise AttributeError(f"module 'kernels' (kvstore's) has no attribute {name!r}")
            other = importlib.util.spec_from_file_location("kernels", spec.origin,
                                                           submodule_search_locations=spec.submodule_search_locations)
            module = importlib.util.module_from_spec(other)
            try:
                other.loader.exec_module(module)  # its `from kernels.x import y` resolve through our extended __path__
            except Exception as exc:  # noqa: BLE001 - a broken other package must not break kvstore's
                raise AttributeError(f"module 'kernels' has no attribute {name!r} (the other 'kernels' package, "
                                     f"{spec.origin}, failed to import: {exc})") from exc
            _foreign = module
    try:
        return getattr(_foreign, name)
    except AttributeError:
        raise AttributeError(f"module 'kernels' has no attribute {name!r} (neither kvstore's nor "
                             f"{getattr(_foreign, '__file__', 'the other')} has it)") from None


def claim() -> None:
    """Make ``import kernels`` give kvstore's package in this process (idempotent)."""
    global _foreign
    with _lock:
        current = sys.modules.get("kernels")
        if current is not None and _is_own(current):
            return
        if current is None:
            spec = importlib.util.find_spec("kernels")
            if spec is not None and spec.origin and Path(spec.origin).resolve() == OWN:
                return  # sys.path finds ours first: the normal import does it
        if not OWN.is_file():
            raise ImportError(f"kvstore's kernels package is missing: no {OWN} (a broken install?)")
        if current is not None:
            _foreign = current  # imported before ours: keep serving its names from that module
        own = importlib.util.spec_from_file_location("kernels", OWN, submodule_search_locations=[str(OWN_DIR)])
        module = importlib.util.module_from_spec(own)
        sys.modules["kernels"] = module
        try:
            own.loader.exec_module(module)
        except BaseException:
            if current is not None:
                sys.modules["kernels"] = current
            else:
                del sys.modules["kernels"]
            raise


claim()
