"""`kvstore.kernels_path`: ``import kernels`` is kvstore's package even where another one of that name
comes first on sys.path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_is_kvstores_even_when_another_package_shadows_it(tmp_path):
    """Hugging Face's ``kernels`` (transformers 5 installs it) comes first on sys.path outside the
    project root; a package of that name put first on PYTHONPATH stands in for it here."""
    shadow = tmp_path / "shadow" / "kernels"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("SHADOW = True\n")
    script = textwrap.dedent("""
        import torch
        from compression import get_codec
        import kernels
        block = torch.randn(2, 2, 3, 16, 64).half()
        encoded = get_codec("int4-g64+shuffle+zstd").encode(block)
        print(kernels.__file__, hasattr(kernels, "SHADOW"), encoded.nbytes < block.numel() * 2)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    path, shadowed, smaller = out.stdout.split()
    assert Path(path).resolve() == ROOT / "kernels" / "__init__.py" and shadowed == "False" and smaller == "True"
