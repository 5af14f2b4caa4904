"""Every module imports on its own, and the library never imports its front ends."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

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


# Imports every gpuyard module in a child forked from a parent that holds only third-party libraries,
# so each gpuyard module is the first one imported in its process: circular imports show up, and the
# heavy libraries are paid for once.
_CHILD_SCRIPT = r"""
import importlib, os, sys, traceback
# The third-party libraries gpuyard's modules use, paid for once here instead of in every child (measured:
# 22 s of the children's CPU with the first seven, 12 s with all of them).
for lib in (
    "torch", "torch.distributed.checkpoint", "numpy", "sqlalchemy", "sqlalchemy.orm", "pydantic", "typer",
    "fastapi", "starlette", "uvicorn", "httpx", "yaml", "jinja2", "psutil", "alembic", "pyarrow",
    "pyarrow.parquet", "pyarrow.dataset", "pandas", "safetensors", "safetensors.torch", "tokenizers",
):
    try:
        importlib.import_module(lib)
    except ImportError:
        pass
def child(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        code = 0 if exc.name and exc.name.split(".")[0] in {optional} else 1
        if code:
            traceback.print_exc()
        os._exit(code)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


failed, running, todo = 0, {}, list(sys.argv[1:])
while todo or running:
    while todo and len(running) < (os.cpu_count() or 1):
        name = todo.pop(0)
        pid = os.fork()
        if pid == 0:
            child(name)
        running[pid] = name
    pid, status = os.wait()
    name = running.pop(pid)
    if status != 0:
        print("FAILED", name, file=sys.stderr)
        failed += 1
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first() -> None:
    script = _CHILD_SCRIPT.replace("{optional}", repr(OPTIONAL))
    out = subprocess.run([sys.executable, "-c", script, *_modules()], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]


def test_library_does_not_import_front_ends() -> None:
    offenders = []
    for name in _modules():
        if name.startswith(FRONT_ENDS):
            continue
        module = importlib.import_module(name)
        source = open(module.__file__ or "", encoding="utf-8").read()  # noqa: SIM115
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
        f"print(' '.join(m for m in {_HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], f"loaded at start-up: {out.stdout.strip()}"
