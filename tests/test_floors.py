"""The floors docs/architecture.md draws hold in the code (issue #58).

Each package stands on a floor and imports only from floors below it, never from one beside or
above, with the exceptions docs/architecture.md names (at most two); no two modules import each
other, directly or round a circle; and the "Floors" table there says what each package imports
from, truly (no more, no less). Imports are read from the source (ast): lazy ones inside functions
and ``TYPE_CHECKING`` ones included, since a reader follows them all the same.

A warm hit's path is counted here too (`scripts/warm_hit_path.py`): the files it crosses and the
returns to a file already visited, against the figures docs/architecture.md states.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "tiers", "compression", "blend", "engine_adapter", "kernels")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    """Every project module (generated protobuf stubs aside) by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "proto" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (the longest known prefix of each imported name)."""
    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
            if any(t not in known for t in targets):  # a name the package itself defines, not a submodule
                targets.append(base)
        else:
            continue
        found.update(t for t in map(resolve, targets) if t is not None and t != name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def floors_table() -> dict[str, tuple[int, set[str]]]:
    """docs/architecture.md's Floors table: package -> (floor, the packages it says it imports from)."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Floors"):]
    table = {}
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            names = set(re.findall(r"`([\w.]+)`", cells[2]))
            table[cells[1].strip("`")] = (int(cells[0]), names)
    return table


def upward_exceptions() -> set[tuple[str, str]]:
    """The imports that run up a floor which docs/architecture.md names: ``module -> module`` lines."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("Imports that run up"):]
    return set(re.findall(r"`([\w.]+)` -> `([\w.]+)`", section.split("\n\n")[0] + section.split("\n\n")[1]))


def package_of(module: str, table: dict[str, tuple[int, set[str]]]) -> str:
    """The table's package holding ``module``: the longest package name it starts with."""
    candidates = [p for p in table if module == p or module.startswith(p + ".")]
    if not candidates:
        raise AssertionError(f"{module} is in no package of docs/architecture.md's Floors table")
    return max(candidates, key=len)


def test_there_are_no_circles():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, "modules that import each other (round a circle):\n" + "\n".join(map(str, circles))


def test_imports_run_down_the_floors_except_where_named():
    table = floors_table()
    named = upward_exceptions()
    assert len(named) <= 2, f"docs/architecture.md names {len(named)} upward imports; the floors allow at most 2"
    offenders, used = [], set()
    for module, targets in graph().items():
        source = package_of(module, table)
        for target in targets:
            into = package_of(target, table)
            if into == source or table[into][0] < table[source][0]:
                continue
            if (module, target) in named:
                used.add((module, target))
                continue
            offenders.append(f"{module} (floor {table[source][0]}) -> {target} (floor {table[into][0]})")
    assert not offenders, "imports beside or up a floor that docs/architecture.md does not name:\n" + "\n".join(
        sorted(offenders))
    assert used == named, f"named upward imports that no longer exist: {sorted(named - used)}"


def test_the_floors_table_says_what_each_package_imports():
    table = floors_table()
    actual: dict[str, set[str]] = {package: set() for package in table}
    for module, targets in graph().items():
        source = package_of(module, table)
        actual[source].update(package_of(t, table) for t in targets)
    wrong = []
    for package, (_, said) in sorted(table.items()):
        real = actual[package] - {package}
        if real != said:
            wrong.append(f"{package}: the table says {sorted(said)}, the code imports {sorted(real)}")
    assert not wrong, "docs/architecture.md's Floors table is wrong:\n" + "\n".join(wrong)


def test_the_daemon_has_every_module_it_names_and_the_ground_floor_none_of_its():
    """The daemon's modules live in its package and not also on the ground floor (a module left
    behind by a move would be imported by mistake)."""
    daemon = {p.name for p in (ROOT / "kvstore" / "daemon").glob("*.py")} - {"__init__.py"}
    ground = {p.name for p in (ROOT / "kvstore").glob("*.py")}
    assert {"process.py", "server.py", "placement.py", "config.py"} <= daemon
    assert not daemon & ground, sorted(daemon & ground)


def test_a_warm_hit_crosses_the_files_docs_architecture_states():
    """The count docs/architecture.md states for a warm hit holds: no change adds a file or a
    return to the path unnoticed (lowering them is welcome: then lower the figures there)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import warm_hit_path
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    stated = re.search(r"crosses \*\*(\d+) files\*\* with \*\*(\d+) returns\*\*", ARCHITECTURE.read_text())
    assert stated, "docs/architecture.md states no warm-hit count"
    path = warm_hit_path.trace_warm_hit()
    files, returns = int(stated.group(1)), int(stated.group(2))
    assert len(path.files) <= files and len(path.returns) <= returns, (
        f"a warm hit now crosses {len(path.files)} files with {len(path.returns)} returns (stated: {files}, "
        f"{returns}):\n" + "\n".join(path.files))
