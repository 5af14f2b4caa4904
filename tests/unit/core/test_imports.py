"""Every module imports on its own, and the library never imports its front ends."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpuyard

pytestmark = pytest.mark.unit

FRONT_ENDS = ("gpuyard.api", "gpuyard.web", "gpuyard.cli")
# Modules that need an optional extra or hardware-specific package to import.
OPTIONAL = {"ray", "jax", "webdataset"}


def _modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(gpuyard.__path__, "gpuyard."):
        if ".migrations.versions." in info.name or info.name.endswith(".migrations.env"):
            continue
        names.append(info.name)
    return sorted(names)


def _source(name: str) -> str:
    """A module's source, found as importing it would find it but without running it (its packages run)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name}: no source file"
    return Path(spec.origin).read_text(encoding="utf-8")


def _run_on_import(tree: ast.AST) -> list[ast.AST]:
    """The nodes of a module but those under `if TYPE_CHECKING:` (function bodies too: one may run early)."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return nodes


# Third-party libraries that make a process large: a fork of one that holds them costs tens of ms.
_BIG_LIBS = {"torch", "numpy", "pyarrow", "pandas", "safetensors", "tokenizers", "transformers"}


def _static_reach(names: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """For each module, the gpuyard modules its source imports when it runs, directly or through others;
    and the modules that import a library of ``_BIG_LIBS`` so, themselves or through those.

    Only a guess for the import tree below, checked there against what each import really loaded: what the
    test proves does not depend on it."""
    known = set(names)
    direct: dict[str, set[str]] = {}
    heavy = set()
    for name in names:
        spec = importlib.util.find_spec(name)
        is_package = spec is not None and spec.submodule_search_locations is not None
        package = name if is_package else name.rpartition(".")[0]
        found = set()
        for node in _run_on_import(ast.parse(_source(name))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        # Importing a module first imports the packages above it.
        found.update(name.rsplit(".", i)[0] for i in range(1, name.count(".")))
        direct[name] = {m for m in found if m in known and m != name}
        if {m.split(".")[0] for m in found} & _BIG_LIBS:
            heavy.add(name)
    reach = {}
    for name in names:
        seen, stack = set(), [name]
        while stack:
            for dep in direct[stack.pop()] - seen:
                seen.add(dep)
                stack.append(dep)
        reach[name] = sorted(seen - {name})
    return reach, sorted(n for n in names if heavy.intersection([n, *reach[n]]))


# Imports every gpuyard module in a child forked from a parent that holds only third-party libraries and
# gpuyard modules that never try to import it, so that each import runs the same code in the same order as
# it would as the first gpuyard import of a fresh process: circular imports show up, and the heavy libraries
# are paid for once.
#
# The children form a tree. A parent forks a child for its first module M and hands it the modules M's
# source cannot reach that import something M loads; it keeps the others and goes on with them. The child
# imports M and serves the modules handed to it only when its import loaded none of them and tried to
# import no gpuyard module it did not finish (a caught ImportError); otherwise, or when M failed, the
# parent serves them itself. So no module held where another is imported ever tries to import it: that
# import runs as it would first in a fresh process whenever the modules held pass their own test, and each
# of those is tested where fewer are held, so a failing module is always reported by a child whose held
# modules import cleanly (an injected cycle that fails only when one side is imported first is reported).
# Modules that do not import the heavy libraries are forked from a parent that does not hold them (a
# smaller process forks faster). Each module's own code runs a few times in all instead of once per module
# that imports it (measured on 287 modules, 2 cores at load ~2: the children's CPU 48-55 s -> 37-40 s, their
# time 32-35 s -> 20-22 s).
_CHILD_SCRIPT = r"""
import gc, importlib, json, os, sys, traceback
# The third-party libraries gpuyard's modules use, paid for once here instead of in every child (measured:
# 22 s of the children's CPU with the first seven, 12 s with all of them).
LIGHT_LIBS = (
    "sqlalchemy", "sqlalchemy.orm", "pydantic", "typer", "fastapi", "starlette", "uvicorn", "httpx", "yaml",
    "jinja2", "psutil", "alembic", "fsspec", "concurrent.futures.process", "statistics", "getpass",
)
HEAVY_LIBS = (
    "torch", "torch.distributed.checkpoint", "numpy", "pyarrow", "pyarrow.parquet", "pyarrow.dataset",
    "pandas", "safetensors", "safetensors.torch", "tokenizers",
)


def preload(libs):
    for lib in libs:
        try:
            importlib.import_module(lib)
        except ImportError:
            pass
    gc.freeze()


preload(LIGHT_LIBS)
REACH, HEAVY = json.load(sys.stdin)
HEAVY = set(HEAVY)


def ours(name):
    return name == "gpuyard" or name.startswith("gpuyard.")


class Attempts:
    # Every gpuyard module an import tried to load (a finder is asked only for a module not yet loaded).
    names = set()

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if ours(name):
            cls.names.add(name)
        return None


sys.meta_path.insert(0, Attempts)
# At most one import per CPU at a time: a byte in this pipe is a turn.
turns_r, turns_w = os.pipe()
os.write(turns_w, b"x" * (os.cpu_count() or 1))


def child(name, rest, report):
    held = {m for m in sys.modules if ours(m)}
    Attempts.names.clear()
    os.read(turns_r, 1)
    try:
        importlib.import_module(name)
    except BaseException as exc:
        optional = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in {optional}
        if not optional:
            traceback.print_exc()
            print("FAILED", name, file=sys.stderr)
        os.write(turns_w, b"x")
        os._exit(0 if optional else 1)
    os.write(turns_w, b"x")
    loaded = {m for m in sys.modules if ours(m)} - held
    if not Attempts.names <= loaded or loaded & set(rest):
        os._exit(0)
    os.write(report, b"served")
    os.close(report)
    os._exit(serve(rest))


def serve(todo):
    children = []
    while todo:
        name, todo = todo[0], todo[1:]
        reach = set(REACH[name])
        # Handed to the child: the modules that import some of what it will hold, and that it does not reach.
        rest = [m for m in todo if m not in reach and (name in REACH[m] or reach.intersection(REACH[m]))]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(name, rest, w)
        os.close(w)
        children.append((pid, r, rest))
        todo = [m for m in todo if m not in rest]
    failed = 0
    for pid, r, rest in children:
        with os.fdopen(r, "rb") as f:
            if f.read() != b"served":
                failed |= serve(rest)
        failed |= os.waitpid(pid, 0)[1] != 0
    return 1 if failed else 0


# Widest first: a child that holds much is handed little, so the tree stays shallow.
order = sorted(REACH, key=lambda m: (-len(REACH[m]), m))
heavy_root = os.fork()
if heavy_root == 0:
    preload(HEAVY_LIBS)
    os._exit(serve([m for m in order if m in HEAVY]))
failed = serve([m for m in order if m not in HEAVY])
sys.exit(1 if os.waitpid(heavy_root, 0)[1] or failed else 0)
"""


def test_every_module_imports_first() -> None:
    script = _CHILD_SCRIPT.replace("{optional}", repr(OPTIONAL))
    reach = json.dumps(_static_reach(_modules()))
    out = subprocess.run([sys.executable, "-c", script], input=reach, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]


def test_library_does_not_import_front_ends() -> None:
    offenders = []
    for name in _modules():
        if name.startswith(FRONT_ENDS):
            continue
        source = _source(name)
        for fe in FRONT_ENDS:
            if f"from {fe}" in source or f"import {fe}" in source:
                offenders.append(f"{name} -> {fe}")
    assert offenders == []


# What `gpuyard server` and every CLI command load before they do anything: none of these may pull in
# torch, pyarrow or the data catalog (seconds of start-up each, paid by every command and server start).
_LIGHT = ("gpuyard.cli.main", "gpuyard.scheduler.setup", "gpuyard.api.app", "gpuyard.train.resize")
_HEAVY = ("torch", "pyarrow", "gpuyard.data.catalog", "transformers")


def test_the_command_line_and_the_server_start_without_heavy_libraries() -> None:
    script = (
        "import importlib, sys\n"
        f"for name in {_LIGHT!r}: importlib.import_module(name)\n"
        "importlib.import_module('gpuyard.cli.main').app\n"  # every command registered (main() registers one)
        f"print(' '.join(m for m in {_HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], f"loaded at start-up: {out.stdout.strip()}"
