"""The floors docs/architecture.md draws hold in the code: the daemon (``kvstore/daemon/``) stands
on the ground floor (``kvstore/``) and on ``tiers/``, and nothing below it, nor any client, imports
it; only the CLI, the one entry point, does. Imports are read from the source (ast), lazy ones
inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folders that must not import the daemon, and the one file that may.
BELOW_OR_BESIDE = ("kvstore", "tiers", "compression", "kernels", "engine_adapter", "blend")
ENTRY_POINT = ROOT / "kvstore" / "cli.py"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_nothing_below_the_daemon_and_no_client_imports_it():
    daemon = ROOT / "kvstore" / "daemon"
    offenders = []
    for folder in BELOW_OR_BESIDE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if daemon in path.parents or path == ENTRY_POINT or "proto" in path.parts:
                continue
            upward = sorted(m for m in imported_modules(path) if m == "kvstore.daemon" or m.startswith("kvstore.daemon."))
            if upward:
                offenders.append(f"{path.relative_to(ROOT)}: {', '.join(upward)}")
    assert not offenders, "imports of the daemon from below it:\n" + "\n".join(offenders)


def test_the_daemon_has_every_module_it_names_and_the_ground_floor_none_of_its():
    """The daemon's modules live in its package and not also on the ground floor (a module left
    behind by a move would be imported by mistake)."""
    daemon = {p.name for p in (ROOT / "kvstore" / "daemon").glob("*.py")} - {"__init__.py"}
    ground = {p.name for p in (ROOT / "kvstore").glob("*.py")}
    assert {"process.py", "server.py", "placement.py", "config.py"} <= daemon
    assert not daemon & ground, sorted(daemon & ground)
