"""Every benchmark script runs: each one once in its ``--smoke`` mode, its last line checked.

A benchmark that no test runs rots unseen (``benchmarks/shard_verify.py`` crashed for days after a name
it imported moved). ``--smoke`` is each script's smallest run through all of its code paths (seconds,
not a figure: BENCHMARKS.md's rows come from the full and ``--quick`` runs); the last line must read
``<script name>: key=value ...`` as BENCHMARKS.md quotes it. A script whose outside requirement is
missing here (Slurm, the shared traces, Polars/DuckDB) is skipped with that reason; ``gpu_check.sh``
is the GPU acceptance path, not a benchmark script, and is not run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuyard.scheduler.openb import NODE_LIST, traces_dir

pytestmark = [pytest.mark.integration, pytest.mark.bench]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _traces() -> Path | None:
    folder = traces_dir()
    return folder if (folder / NODE_LIST).is_file() and (folder / "philly.csv").is_file() else None


def _missing_modules(*names: str) -> str | None:
    gone = [n for n in names if importlib.util.find_spec(n) is None]
    return f"needs {', '.join(gone)} (pip install -e '.[dev]')" if gone else None


def _slurm() -> str | None:
    if os.geteuid() != 0:
        return "needs root (starts a private Slurm cluster)"
    gone = [b for b in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(b) is None]
    return f"needs Slurm ({', '.join(gone)} not found)" if gone else None


def _no_traces() -> str | None:
    return None if _traces() else f"needs the shared traces ({traces_dir()}; set GPUYARD_TRACES)"


def _trace_args(flag: str, philly: bool) -> Callable[[], list[str]]:
    def args() -> list[str]:
        folder = _traces()
        assert folder is not None
        return [flag, str(folder / "philly.csv" if philly else folder)]

    return args


# Per script: extra arguments after the mode flag, and what it needs (None: nothing outside the repo).
SMOKE: dict[str, tuple[Callable[[], list[str]], Callable[[], str | None]]] = {
    "api_abuse": (list, lambda: None),
    "checkpoint": (list, lambda: None),
    "collective_accuracy": (list, lambda: None),
    "ddp_scaling": (list, lambda: None),
    "eta_accuracy": (list, lambda: None),
    "fabric_accuracy": (list, lambda: None),
    "fabric_placement": (_trace_args("--trace", philly=True), _no_traces),
    "llm_gateway_soak": (list, lambda: None),
    "llm_long_prompt": (list, lambda: _missing_modules("transformers")),
    "llm_serve": (list, lambda: _missing_modules("transformers")),
    "llm_train": (list, lambda: _missing_modules("transformers", "accelerate")),
    "loader": (list, lambda: _missing_modules("webdataset")),
    "mfu": (list, lambda: None),
    "placement": (list, lambda: None),
    "planner": (list, lambda: None),
    "predict_measure": (list, lambda: None),
    "serve": (list, lambda: None),
    "shard_verify": (list, lambda: None),
    "sharing": (_trace_args("--traces", philly=False), _no_traces),
    "simulator": (_trace_args("--trace", philly=True), _no_traces),
    "slurm_latency": (list, _slurm),
    "submit_latency": (list, lambda: None),
    "tracking": (list, lambda: _missing_modules("sklearn")),
    "train_overhead": (list, lambda: None),
    "transform": (list, lambda: _missing_modules("pandas", "polars", "duckdb")),
}
# fabric_accuracy.py has no --smoke: its --quick run is the whole deterministic run (seconds).
MODE = {"fabric_accuracy": "--quick"}
LAST_LINE = re.compile(r"^(?P<name>[a-z_]+): [A-Za-z0-9_]+=\S+( [A-Za-z0-9_]+=\S+)*$")


def test_every_script_has_a_smoke_entry() -> None:
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert scripts == set(SMOKE), f"benchmarks without a smoke entry: {sorted(scripts - set(SMOKE))}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_benchmark_runs(name: str, tmp_path: Path) -> None:
    extra, needs = SMOKE[name]
    missing = needs()
    if missing:
        pytest.skip(f"{name}.py {missing}")
    env = {**os.environ, "GPUYARD_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    env.pop("GPUYARD_DATABASE_URL", None)
    env.pop("GPUYARD_ARTIFACTS", None)
    cmd = [sys.executable, str(BENCHMARKS / f"{name}.py"), MODE.get(name, "--smoke"), *extra()]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540, check=False
    )
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{name}.py printed nothing:\n{tail}"
    match = LAST_LINE.match(lines[-1])
    assert match is not None, f"{name}.py's last line is not '<name>: key=value ...': {lines[-1]!r}"
    assert match["name"] == name, f"{name}.py's last line is named {match['name']!r}"
