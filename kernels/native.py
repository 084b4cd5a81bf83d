"""Builds kvstore's native C kernels (``kernels/*.c``) with the host's C compiler, once per machine.

Each C file is compiled with ``cc`` (or ``$CC``) into ``$XDG_CACHE_HOME/kvstore/native``; the file
name carries a hash of source, compiler and platform, and the write is atomic, so concurrent
builds of one source agree. :func:`build` returns None where there is no compiler or the build
fails, and says why once; every caller then keeps its torch (or engine) path.

An image without a compiler builds them once, at install time, into the package itself:
``python -m kernels.native`` writes each into ``kernels/prebuilt/`` under a name that hashes its
source, flags and platform, and :func:`build` loads that file when one matches before it compiles.

``-ffp-contract=off``: no multiply-add is fused, so float math in C rounds as torch's does and a
kernel can be tested bit for bit against its torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off")


PREBUILT = Path(__file__).parent / "prebuilt"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "kvstore" / "native"


def _prebuilt_path(source: Path) -> Path:
    """Where ``python -m kernels.native`` keeps ``source`` compiled: named by source, flags and platform."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + platform.machine().encode()
                            + sys.platform.encode())
    return PREBUILT / f"{source.stem}-{digest.hexdigest()[:16]}.so"


@functools.lru_cache(maxsize=None)
def build(source: Path, purpose: str) -> ctypes.CDLL | None:
    """``source`` compiled and loaded; None (logged once, naming ``purpose``) when it cannot be."""
    try:
        prebuilt = _prebuilt_path(source)
        if prebuilt.exists():
            return ctypes.CDLL(str(prebuilt))
    except OSError as exc:
        log.warning("kvstore %s: could not load the prebuilt %s (%s); compiling it", purpose, source.name, exc)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("kvstore %s: no C compiler (cc, gcc or $CC); the torch or engine path is used", purpose)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        text = source.read_bytes()
        digest = hashlib.sha256(text + " ".join(FLAGS).encode() + version.encode() + platform.machine().encode()
                                + sys.platform.encode())
        target = _cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                command = [compiler, *FLAGS, "-o", str(built), str(source)]
                result = subprocess.run(command, capture_output=True, text=True, timeout=120)
                if result.returncode != 0:
                    raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}")
                os.replace(built, target)  # atomic: a concurrent build of the same source is the same file
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("kvstore %s: could not build %s (%s); the torch or engine path is used", purpose, source, exc)
        return None


def prebuild() -> list[Path]:
    """Every ``kernels/*.c`` compiled into ``kernels/prebuilt/`` (an image's build step); raises on a failure."""
    PREBUILT.mkdir(exist_ok=True)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC): install gcc and libc6-dev to prebuild kvstore's kernels")
    built = []
    for source in sorted(Path(__file__).parent.glob("*.c")):
        target = _prebuilt_path(source)
        command = [compiler, *FLAGS, "-o", str(target), str(source)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}")
        built.append(target)
    return built


if __name__ == "__main__":
    for path in prebuild():
        print(path)
