"""The house as docs/architecture.md draws it: which package may import which, and no import circles.

The import graph is read from the source with ``ast`` (module-level, function-level and
``TYPE_CHECKING`` imports alike: an import deferred into a function is still a dependency), so the
test sees what ``import`` statements say without importing anything.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuyard

pytestmark = pytest.mark.unit

SRC = Path(gpuyard.__file__).parent
# Modules every package may use: the package root (its version), errors, exit codes, settings,
# references, state enums, request limits and the connection guard. They import nothing but each other.
CORE = frozenset(
    {
        "gpuyard",
        "errors",
        "exitcodes",
        "settings",
        "refs",
        "states",
        "textfiles",
        "privileged",
        "limits",
        "connections",
    }
)
_FRONT = frozenset({"api", "web", "cli"})
# Which packages each package may import besides CORE and itself: docs/architecture.md's picture.
ALLOWED: dict[str, frozenset[str]] = {
    "store": frozenset(),
    "auth": frozenset({"store"}),
    "hardware": frozenset({"store"}),
    "fabric": frozenset({"hardware"}),
    "scheduler": frozenset({"store", "auth", "hardware", "fabric"}),
    "data": frozenset({"store"}),
    "tracking": frozenset({"store"}),
    "train": frozenset({"store", "hardware", "data", "tracking"}),
    "models": frozenset({"store", "data", "scheduler", "tracking", "train"}),
    "serve": frozenset({"store", "auth", "scheduler", "models"}),
    "pipelines": frozenset(
        {"store", "hardware", "fabric", "scheduler", "data", "tracking", "train", "models", "serve"}
    ),
}
LIBRARY = frozenset(ALLOWED) | CORE
ALLOWED |= {
    "web": frozenset(),
    "api": LIBRARY | {"web"},  # the API serves the dashboard's templates
    "cli": LIBRARY | {"api", "web"},  # `gpuyard server` starts the API
}
# Known debts, each one edge between modules that the picture does not draw (none today).
EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()
# Import circles still allowed (none: fabric/cluster <-> local was opened by fabric/presets.py).
KNOWN_CIRCLES: frozenset[frozenset[str]] = frozenset()


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        if "migrations" in path.relative_to(SRC).parts:
            continue  # Alembic's scripts, loaded by Alembic
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of every gpuyard import in the module, resolved against its package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import name`: the submodule when there is one, else the package itself.
            yield from ((f"{base}.{a.name}", node.lineno) for a in node.names)


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {gpuyard module it imports: first line}; ``from`` imports resolve to modules."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        for target, line in _imported(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]  # an attribute of a module, or outside gpuyard
            if target and target != name:
                graph[name].setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package(module: str) -> str:
    """The top-level package of a gpuyard module (``gpuyard.serve.deploy`` -> ``serve``)."""
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import that ALLOWED does not draw, as ``module:line -> module``."""
    bad = []
    for source, targets in graph.items():
        mine = package(source)
        allowed = CORE if mine in CORE else ALLOWED[mine] | CORE | {mine}
        for target, line in targets.items():
            if package(target) not in allowed and (source, target) not in EXCEPTIONS:
                bad.append(f"{source}:{line} -> {target}")
    return sorted(bad)


def test_every_package_is_drawn() -> None:
    packages = {package(m) for m in _modules()}
    assert packages - set(ALLOWED) - CORE == set()


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph()


def test_no_package_imports_one_the_picture_puts_above_it(graph: dict[str, dict[str, int]]) -> None:
    assert upward_imports(graph) == []


def test_no_import_circles(graph: dict[str, dict[str, int]]) -> None:
    assert [sorted(c) for c in circles(graph) if c not in KNOWN_CIRCLES] == []


def test_the_checks_see_an_upward_import_and_a_circle(graph: dict[str, dict[str, int]]) -> None:
    graph = {name: dict(targets) for name, targets in graph.items()}  # a copy to draw on
    assert "gpuyard.serve.deploy" in graph["gpuyard.pipelines.stages.serve"]  # a function-level import
    assert "gpuyard.data.arrays" in graph["gpuyard.models.datasets"]
    graph["gpuyard.data.catalog"]["gpuyard.models.registry"] = 1
    assert upward_imports(graph) == ["gpuyard.data.catalog:1 -> gpuyard.models.registry"]
    graph["gpuyard.models.registry"]["gpuyard.data.catalog"] = 2
    # The drawn pair closes a circle (other modules on a path between them may join it).
    assert any({"gpuyard.data.catalog", "gpuyard.models.registry"} <= c for c in circles(graph))
    assert not any({"gpuyard.data.catalog", "gpuyard.models.registry"} <= c for c in circles(_undrawn(graph)))


def _undrawn(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out = {name: dict(targets) for name, targets in graph.items()}
    del (
        out["gpuyard.data.catalog"]["gpuyard.models.registry"],
        out["gpuyard.models.registry"]["gpuyard.data.catalog"],
    )
    return out
