"""The house's import rules, checked on the code as it is: no import cycle in sdzero/ or advisor/ (imports
inside functions and under TYPE_CHECKING count too), no sdzero module importing the advisor, and sdzero's
subpackages stacked one way (no two of them importing each other, through any path)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sdzero", "advisor")


def module_files() -> dict[str, Path]:
    """Every module of both packages by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imported_modules(name: str, path: Path, modules: Iterable[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file, each resolved to the module that holds it
    (`from sdzero.x import y` is sdzero.x.y when that is a module, else sdzero.x)."""
    known = set(modules)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def holder(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PACKAGES and (resolved := holder(target)) is not None:
                found.add(resolved)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, files) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def subpackage_of(module: str) -> str:
    """sdzero.data.cache -> sdzero.data; a top-level module (sdzero.errors) is its own node."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_graph_is_read_from_the_code():
    graph = import_graph()
    # Edges the layout rests on, one of each kind: module level, inside a function, `from pkg import mod`.
    assert "sdzero.training.callbacks" in graph["sdzero.training.trainer"]
    assert "sdzero.checkpoint.manifest" in graph["sdzero.checkpoint.identity"]
    assert "sdzero.training.trainer" in graph["sdzero.train"]
    assert len(graph) > 80


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_sdzero_never_imports_the_advisor():
    upward = [
        (name, target)
        for name, targets in import_graph().items()
        if name.startswith("sdzero")
        for target in targets
        if target.startswith("advisor")
    ]
    assert upward == []


def test_sdzero_subpackages_stack_one_way():
    graph = import_graph()
    packages: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if name.startswith("sdzero"):
            packages.setdefault(subpackage_of(name), set()).update(
                subpackage_of(t) for t in targets if t.startswith("sdzero")
            )
    for name, targets in packages.items():
        targets.discard(name)
    packages.pop("sdzero", None)  # the package root imports nothing of its own
    assert cycles(packages) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_top_level_stays_small(package):
    """sdzero/ holds only contracts and leaves at its top (train.py, cli.py, errors, constants, ...)."""
    top = sorted(p.name for p in (ROOT / package).glob("*.py"))
    assert len(top) <= 8, top


def test_importing_the_trainer_loads_no_advisor_module():
    """`import sdzero` and the trainer's own command never load the advisor (the `sdzero` command that
    users run is composed one floor up, in advisor.cli)."""
    import subprocess
    import sys

    probe = (
        "import sys, sdzero, sdzero.cli, sdzero.train; "
        "print(sorted(m for m in sys.modules if m == 'advisor' or m.startswith('advisor.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


ADVISOR_FLOORS = {
    "advisor": 0,  # the package root and stats.py: the statistics every floor shares
    "advisor.stats": 0,
    "advisor.measure": 1,
    "advisor.model": 2,
    "advisor.decide": 3,
    "advisor.report": 4,
    "advisor.stages": 5,
    "advisor.commands": 6,
    "advisor.cli": 7,
}
"""The advisor's floors, lowest first (README's layout): a module imports its own floor or lower ones."""


def advisor_floor(module: str) -> int | None:
    """The floor of an advisor module: its folder's, or its own for a top-level module; None: none given."""
    parts = module.split(".")
    for size in (2, 1):
        if ".".join(parts[:size]) in ADVISOR_FLOORS:
            return ADVISOR_FLOORS[".".join(parts[:size])]
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, what it imports) for every advisor import of a higher floor."""
    return sorted(
        (name, target)
        for name, targets in graph.items()
        if name.startswith("advisor")
        for target in targets
        if target.startswith("advisor") and (advisor_floor(target) or 0) > (advisor_floor(name) or 0)
    )


def test_every_advisor_module_has_a_floor():
    """A new folder or top-level module is given its floor here before it can hold code."""
    unplaced = [name for name in import_graph() if name.startswith("advisor") and advisor_floor(name) is None]
    assert unplaced == []


def test_no_advisor_module_imports_a_higher_floor():
    assert upward_imports(import_graph()) == []


def test_the_floor_rule_catches_an_upward_import():
    graph = {
        "advisor.decide.x": {"advisor.report.y", "advisor.model.z"},
        "advisor.report.y": {"advisor.decide.x"},
    }
    assert upward_imports(graph) == [("advisor.decide.x", "advisor.report.y")]


def test_no_two_advisor_folders_import_each_other():
    folders: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        if name.startswith("advisor"):
            folders.setdefault(subpackage_of(name), set()).update(
                subpackage_of(t) for t in targets if t.startswith("advisor")
            )
    for name, targets in folders.items():
        targets.discard(name)
    assert cycles(folders) == []
