"""`kvstore.kernels_path`: ``import kernels`` is kvstore's package even where another one of that name
comes first on sys.path, and that other package (Hugging Face's) still imports through it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


SCRIPT = """
import torch
{first}
from compression import get_codec
import kernels
from kernels._other_part import PART
block = torch.randn(2, 2, 3, 16, 64).half()
encoded = get_codec("int4-g64+shuffle+zstd").encode(block)
from kernels import __version__
print(kernels.__file__, kernels.SHADOW, PART, __version__, encoded.nbytes < block.numel() * 2)
"""


@pytest.mark.parametrize("first", ["", "import kernels as theirs; assert theirs.SHADOW"])
def test_kernels_is_kvstores_and_serves_the_other_package_too(tmp_path, first):
    """Hugging Face's ``kernels`` (transformers 5 requires and imports it) comes first on sys.path
    outside the project root; a package of that name put first on PYTHONPATH stands in for it. kvstore's
    package gets the name, its codecs work, and the other package's names and submodules still import,
    whether it was imported before kvstore or not."""
    shadow = tmp_path / "shadow" / "kernels"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("from kernels._other_part import PART\nSHADOW = 'shadow'\n__version__ = '9.9'\n")
    (shadow / "_other_part.py").write_text("PART = 'part'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(first=first)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    path, shadowed, part, version, smaller = out.stdout.split()
    assert Path(path).resolve() == ROOT / "kernels" / "__init__.py"
    assert (shadowed, part, version, smaller) == ("shadow", "part", "9.9", "True")


def test_a_broken_other_package_does_not_break_kvstore(tmp_path):
    """kvstore's own submodules never load the other package; when something does ask it for a name and
    it fails to import, that is an AttributeError naming it, not kvstore's failure."""
    shadow = tmp_path / "shadow" / "kernels"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    script = ("import torch\nfrom compression import get_codec\nimport kernels\n"
              "from kernels import rans, quant_ref\n"
              "get_codec('kvtc-zstd@0123456789ab')\n"
              "print(get_codec('int4-g64+shuffle+zstd').encode(torch.randn(2, 2, 3, 16, 64).half()).nbytes > 0)\n"
              "try:\n    kernels.LayerRepository\nexcept AttributeError as exc:\n    print('broken on purpose' in str(exc))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]


def test_transformers_imports_beside_kvstore():
    """The real case in this environment: transformers' hub-kernels integration imports its names from
    ``kernels`` after kvstore took the name (the suite runs in the project root, where ours comes first)."""
    import kernels

    pytest.importorskip("transformers")
    import transformers.integrations.hub_kernels  # noqa: F401  (imports Hugging Face's names, if installed)

    assert hasattr(kernels, "ops")
