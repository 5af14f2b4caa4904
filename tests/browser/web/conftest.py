"""Fixtures of the dashboard tests: a seeded GPUYARD_HOME, a real `gpuyard server`, and Chromium."""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tests.waiting import free_port

IN_CI = os.environ.get("CI", "").lower() == "true"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
REPO = Path(__file__).resolve().parents[3]
ARTIFACTS = REPO / "test-artifacts"
H100_NODE = REPO / "tests" / "unit" / "hardware" / "fixtures" / "h100_hgx.json"


@dataclass
class Server:
    """A running `gpuyard server`: its URL, home, admin token and log file."""

    url: str
    home: Path
    token: str
    log: Path
    proc: subprocess.Popen[bytes]


def _free_port() -> int:
    return free_port()  # below the ephemeral range (tests.waiting)


def seed(home: Path) -> None:
    """Record what the pages show: an 8-GPU H100 node (recorded NVML), runs with curves, a model."""
    from gpuyard.hardware.fake import FakeNvml, load_description, write_host_tree
    from gpuyard.hardware.probe import probe_node
    from gpuyard.hardware.record import record_inventory
    from gpuyard.hardware.sysfs import HostRoots
    from gpuyard.tracking.store import start_run

    desc = load_description(H100_NODE)
    with tempfile.TemporaryDirectory() as tmp:
        roots = HostRoots.under(write_host_tree(desc, Path(tmp)))
        record_inventory(probe_node(FakeNvml(desc), roots=roots, frameworks=False, hostname="h100-node"))
    run_ids = []
    for lr in (0.1, 0.03):
        with start_run(
            "mlp", experiment="digits", params={"lr": lr, "epochs": 20}, system_interval_s=None
        ) as run:
            for step in range(20):
                loss = 2.3 * (1 - lr) ** step + 0.05
                run.log_metrics(step, {"train/loss": loss, "validation/accuracy": 1 - loss / 2.5})
            run.log_artifact("notes/summary.txt", f"lr={lr}\n".encode())
            run_ids.append(run.run_id)
    _register_model(run_ids)


def _register_model(run_ids: list[str]) -> None:
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    from gpuyard.models.registry import register_model, set_stage
    from gpuyard.models.signature import infer_signature

    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    for i, run_id in enumerate(run_ids):
        model = LogisticRegression(C=1.0 + i).fit(X, y)
        register_model(
            "digits-clf",
            model,
            "classification",
            infer_signature(X, y, "classification"),
            run_id=run_id,
            metrics={"validation/accuracy": 0.9 + 0.02 * i},
        )
    set_stage("digits-clf:2", "staging")


def start_server(options: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start `gpuyard server OPTIONS` on a free port with ``env``; wait for /health (fail with its log)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "gpuyard.cli.main", "server", "--port", str(port), *options]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{log.read_text()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A seeded home and `gpuyard server --gpus 2` on it (teams research and vision); killed at the end."""
    from gpuyard.store.db import reset_store_cache

    home = tmp_path_factory.mktemp("dash") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUYARD_HOME", str(home))
        for var in ("GPUYARD_DATABASE_URL", "GPUYARD_ARTIFACTS", "GPUYARD_TOKEN"):
            mp.delenv(var, raising=False)
        reset_store_cache()
        seed(home)
        reset_store_cache()
        log = home.parent / "server.log"
        env = {k: v for k, v in os.environ.items() if k != "GPUYARD_TOKEN"} | {"GPUYARD_HOME": str(home)}
        options = ["--gpus", "2", "--cpus", "2", "--team", "research", "--team", "vision", "--grace", "1"]
        options += ["--job-user", getpass.getuser()]  # the seeded jobs run as the server's user
        proc, url = start_server(options, env, log)
        try:
            yield Server(url, home, (home / "token").read_text().strip(), log, proc)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reset_store_cache()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Debian's Chromium under Playwright (skipped without it, except under CI=true where it fails)."""
    if not (shutil.which(CHROMIUM) or os.path.exists(CHROMIUM)):
        msg = f"{CHROMIUM} is not installed; .ci/run installs Debian's chromium"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if IN_CI:
            pytest.fail("playwright is not installed (pip install -e '.[dev]')")
        pytest.skip("playwright is not installed")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def artifacts_dir() -> Path:
    """Where screenshots go (git-ignored)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
