"""Runs recorded in the state store, read back by `gpuyard runs`, drawn as PNG; the trainer logs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuyard.cli.main import app
from gpuyard.errors import ConfigError, ConflictError, NotFoundError
from gpuyard.models.runs import compare_runs, get_run, list_runs, metric_series, plot_curves, resolve_run_id
from gpuyard.tracking.store import DbTracker, start_run

pytestmark = pytest.mark.integration


def _run(lr: float, steps: int = 30, dataset: str = "toy@abc123") -> str:
    with start_run(
        "toy", experiment="exp", params={"lr": lr}, dataset_version=dataset, system_interval_s=None
    ) as t:
        for step in range(steps):
            t.log_metrics(step, {"loss": lr / (step + 1), "acc": step / steps})
        t.log_artifact("notes/readme.txt", b"hello")
        return t.run_id


def test_run_records_params_series_lineage_and_system(any_db: str) -> None:
    run_id = _run(0.1)
    run = get_run(run_id[:6])
    assert run.status == "finished" and run.params == {"lr": 0.1} and run.dataset_version == "toy@abc123"
    assert run.latest["loss"] == pytest.approx(0.1 / 30)
    series = metric_series(run_id, ["loss"])["loss"]
    assert [s for s, _ in series] == list(range(30))
    sys_series = metric_series(run_id)
    assert "sys/process_rss_mb" in sys_series and sys_series["sys/process_rss_mb"][0][1] > 10
    # Run from the repository: the code version is the git commit
    assert run.code_version is not None and len(run.code_version.split("-")[0]) == 40


def test_failed_run_and_non_finite_values(home: Path) -> None:
    with pytest.raises(RuntimeError), start_run("boom", system_interval_s=None) as t:
        t.log_metrics(0, {"loss": float("nan")})
        raise RuntimeError("exploded")
    run = get_run(t.run_id)
    assert run.status == "failed" and "exploded" in (run.error or "")
    assert metric_series(t.run_id, ["loss"])["loss"] == [(0, None)]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda t: t.log_metrics(-1, {"a": 1.0}), ConfigError),
        (lambda t: t.log_metrics(0, {"bad key!": 1.0}), ConfigError),
        (lambda t: t.log_metrics(0, {"a": "high"}), ConfigError),
        (lambda t: t.finish("exploded"), ConfigError),
        (lambda t: t.log_artifact("../escape", b"x"), ConfigError),
    ],
)
def test_bad_tracking_input(home: Path, call, error) -> None:
    t = start_run("x", system_interval_s=None)
    with pytest.raises(error):
        call(t)
    t.finish()


def test_resolve_and_compare(home: Path) -> None:
    a, b = _run(0.1), _run(0.01)
    with pytest.raises(ConfigError, match="too short"):
        resolve_run_id("ab")
    with pytest.raises(NotFoundError):
        resolve_run_id("ffffffff")
    doc = compare_runs([a, b])
    assert doc["differs"] == ["lr"] and doc["params"]["lr"] == [0.1, 0.01]
    assert [r.id for r in list_runs(experiment="exp")] == [b, a]
    out = plot_curves([a, b], Path(str(home)) / "c.png", keys=["loss"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    with pytest.raises(NotFoundError):
        plot_curves([a], Path(str(home)) / "none.png", keys=["nope"])


def test_runs_cli(home: Path, tmp_path: Path) -> None:
    a, b = _run(0.1), _run(0.01)
    runner = CliRunner()
    out = runner.invoke(app, ["runs", "ls", "--json"])
    assert out.exit_code == 0 and {r["id"] for r in json.loads(out.stdout)} == {a, b}
    out = runner.invoke(app, ["runs", "show", a[:8], "--json", "--plot", str(tmp_path / "a.png")])
    doc = json.loads(out.stdout)
    assert doc["series"]["loss"] == 30 and doc["artifacts"][0]["name"] == "notes/readme.txt"
    assert (tmp_path / "a.png").exists()
    out = runner.invoke(app, ["runs", "compare", a[:8], b[:8]])
    assert out.exit_code == 0 and "param lr" in out.stdout
    assert runner.invoke(app, ["runs", "show", "zzzz"]).exit_code != 0


def test_tracker_is_the_training_runtimes_tracker(home: Path, tmp_path: Path) -> None:
    from gpuyard.tracking.files import Tracker
    from gpuyard.train import examples as ex
    from gpuyard.train.spec import TrainSpec
    from gpuyard.train.trainer import Trainer

    tracker = start_run("trainer", experiment="train", system_interval_s=None)
    assert isinstance(tracker, Tracker) and isinstance(tracker, DbTracker)
    spec = TrainSpec.model_validate({"run_dir": str(tmp_path / "r"), "epochs": 1, "data": {"batch_size": 32}})
    result = Trainer(
        spec, model=lambda: ex.mlp(), train_data=ex.classification_data(128), tracker=tracker
    ).fit()
    run = get_run(tracker.run_id)
    assert run.status == "finished", result.status
    assert "loss" in run.latest and metric_series(tracker.run_id, ["loss"])["loss"][-1][0] == result.step
    assert run.params  # the resolved spec


def test_deleted_run_conflicts(home: Path) -> None:
    from gpuyard.store import get_store
    from gpuyard.store.tables.models import RunRow

    t = start_run("gone", system_interval_s=None)
    with get_store().session() as s:
        s.delete(s.get(RunRow, t.run_id))
    with pytest.raises(ConflictError):
        t.set_tags({"a": 1})
