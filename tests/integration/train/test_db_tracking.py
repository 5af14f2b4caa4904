"""The trainer's database tracker in one process on real SQLite: resume, refill, datasets, outages."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from gpuyard.models.runs import get_run, list_runs, metric_series
from gpuyard.store import get_store
from gpuyard.store.tables.models import RunMetricRow
from gpuyard.tracking.files import JsonlTracker, read_metrics
from gpuyard.tracking.training import DbRunTracker, read_run_file
from gpuyard.train.spec import TrainSpec
from gpuyard.train.trainer import db_tracker

pytestmark = pytest.mark.integration


def _spec(run_dir: Path, **fields: object) -> TrainSpec:
    return TrainSpec.model_validate({"name": "unit-run", "run_dir": str(run_dir), **fields})


def _attempt(spec: TrainSpec, steps: range, start: int, resumed: bool, scale: float = 1.0) -> DbRunTracker:
    """One job attempt on rank 0: params, then a loss per step and a validation loss at the last one."""
    tracker = db_tracker(spec, JsonlTracker(spec.resolved_run_dir()), start_step=start, resumed=resumed)
    tracker.log_params(spec.model_dump(mode="json"))
    for step in steps:
        tracker.log_metrics(step, {"loss": scale * step, "lr": 0.1})
    tracker.log_metrics(steps[-1], {"val_loss": scale})
    return tracker


def test_resumed_job_keeps_its_run_drops_replayed_steps_and_refills_lost_ones(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    spec = _spec(tmp_path / "run", tracking={"experiment": "exp"})
    first = _attempt(spec, range(1, 11), start=0, resumed=False)
    first.finish("preempted")
    run_id = first.run_id
    assert run_id and get_run(run_id).status == "preempted"
    # A job killed outright loses the points its tracker had not flushed: take steps 5-8 away.
    with get_store().session() as s:
        s.query(RunMetricRow).filter(RunMetricRow.run_id == run_id, RunMetricRow.step.between(5, 8)).delete()

    # The restarted job resumes from its checkpoint at step 8 and logs 9-12 again, with other values.
    second = _attempt(spec, range(9, 13), start=8, resumed=True, scale=2.0)
    assert second.run_id == run_id and second.reused
    second.finish("completed")

    runs = list_runs(experiment="exp")
    assert [r.id for r in runs] == [run_id] and runs[0].status == "finished"
    loss = metric_series(run_id, ["loss"])["loss"]
    assert [step for step, _ in loss] == list(range(1, 13))  # each step once, none missing
    # 1-8 from the first attempt (5-8 refilled from metrics.jsonl), 9-12 from the second.
    assert [v for _, v in loss] == [float(s) for s in range(1, 9)] + [2.0 * s for s in range(9, 13)]
    assert [step for step, _ in metric_series(run_id, ["validation/loss"])["validation/loss"]] == [12]
    run = get_run(run_id)
    assert run.params["optimizer.lr"] == spec.optimizer.lr and run.tags["train_status"] == "completed"
    assert [e["step"] for e in run.tags["events"] if e["event"] == "resume"] == [8]
    assert read_run_file(spec.resolved_run_dir())["status"] == "completed"

    # The finished run started over from scratch (no checkpoint) is a new run.
    third = _attempt(spec, range(1, 3), start=0, resumed=False)
    third.finish("completed")
    assert third.run_id != run_id and len(list_runs(experiment="exp")) == 2


def test_dataset_version_of_a_gpuyard_dataset_is_recorded(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.data.ingest import ingest

    src = tmp_path / "toy.csv"
    src.write_text("x,label\n" + "".join(f"{i},{i % 2}\n" for i in range(20)))
    version = ingest(src, "toy")
    train = {"entrypoint": "gpuyard.pipelines.torchglue:shard_batches", "kwargs": {"dataset": "toy"}}
    spec = _spec(tmp_path / "run", data={"train": train})
    tracker = _attempt(spec, range(1, 3), start=0, resumed=False)
    tracker.finish("completed")
    assert tracker.run_id and get_run(tracker.run_id).dataset_version == version.ref

    # A split selection is kept and `latest` recorded as the version it named then, not as `latest`.
    from gpuyard.data import load_recipe, transform

    split = {"method": "random", "seed": 0, "fractions": {"train": 0.75, "val": 0.25}}
    split_version = transform(version.ref, load_recipe({"split": split}), engine="serial")
    selected = {**train, "kwargs": {"dataset": "toy@latest#split=train"}}
    t = _attempt(_spec(tmp_path / "split", data={"train": selected}), range(1, 2), start=0, resumed=False)
    t.finish("completed")
    assert t.run_id and get_run(t.run_id).dataset_version == f"{split_version.ref}#split=train"

    # A kwarg that is no catalog name is not a dataset version; an explicit one is kept as written.
    other = {"entrypoint": "m:f", "kwargs": {"dataset": "no-such-data"}}
    for fields, expected in (
        ({"data": {"train": other}}, None),
        ({"tracking": {"dataset": "ext@v1"}}, "ext@v1"),
    ):
        t = _attempt(_spec(tmp_path / f"r{expected}", **fields), range(1, 2), start=0, resumed=False)
        t.finish("completed")
        assert t.run_id and get_run(t.run_id).dataset_version == expected


def test_unreachable_database_warns_once_and_keeps_the_jsonl(
    gpuyard_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:  # a port nobody listens on: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("GPUYARD_DATABASE_URL", f"postgresql+psycopg://nobody@127.0.0.1:{port}/none")
    spec = _spec(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="gpuyard.train"):
        tracker = _attempt(spec, range(1, 21), start=0, resumed=False)
        tracker.log_event("checkpoint", step=20, path="x")
        tracker.finish("completed")
    warnings = [r for r in caplog.records if "tracking database is unavailable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    events = read_metrics(spec.resolved_run_dir())
    assert [e["step"] for e in events if e["event"] == "metrics" and "loss" in e] == list(range(1, 21))
    assert [e["event"] for e in events].count("tracking_error") == 1
    assert events[-1] == {**events[-1], "event": "finish", "status": "completed"}
    # The run folder still names the run, so a later attempt with the database back records it.
    assert json.loads((spec.resolved_run_dir() / "tracking.json").read_text())["run_id"] == tracker.run_id


def test_launcher_closes_a_run_whose_workers_died_without_reporting(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    import time

    from gpuyard.train.launch import _close_tracked_run

    spec = _spec(tmp_path / "run")
    tracker = _attempt(spec, range(1, 4), start=0, resumed=False)  # killed outright: never finished
    run_id = str(tracker.run_id)
    deadline = time.monotonic() + 30
    while not list_runs() and time.monotonic() < deadline:  # the tracker's thread creates the run
        time.sleep(0.05)
    assert get_run(run_id).status == "running"
    _close_tracked_run(spec, spec.resolved_run_dir(), "failed", "torchrun exited with code 1")
    run = get_run(run_id)
    assert run.status == "failed" and run.error == "torchrun exited with code 1"
    # A run that did report is left as it is.
    _close_tracked_run(spec, spec.resolved_run_dir(), "preempted", "signal 15")
    assert get_run(run_id).status == "failed"
    tracker.fail("cleaned up")  # stop the tracker's threads


def test_tracking_setting_shorthand_overrides_and_errors(tmp_path: Path) -> None:
    import yaml

    from gpuyard.errors import ConfigError
    from gpuyard.train.launch import LaunchConfig, prepare, torchrun_command
    from gpuyard.train.spec import load_spec

    doc = {
        "name": "s",
        "model": {"entrypoint": "gpuyard.train.examples:mlp"},
        "data": {"train": {"entrypoint": "gpuyard.train.examples:classification_data"}},
        "tracking": "jsonl",
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert load_spec(path).tracking.backend == "jsonl"
    # --experiment alone keeps the spec's `tracking: jsonl`; --tracking db switches the backend.
    spec = load_spec(path, {"tracking": {"experiment": "e1"}})
    assert (spec.tracking.backend, spec.tracking.experiment) == ("jsonl", "e1")
    cfg = LaunchConfig(spec_path=path, tracking="db", experiment="e2")
    spec, overrides = prepare(cfg)
    assert (spec.tracking.backend, spec.tracking.experiment) == ("db", "e2")
    cmd = torchrun_command(cfg, spec, overrides)
    assert json.loads(cmd[cmd.index("--tracking") + 1]) == {"backend": "db", "experiment": "e2"}
    with pytest.raises(ConfigError, match=r"tracking\.backend"):
        prepare(LaunchConfig(spec_path=path, tracking="mlflow"))


def test_the_run_has_one_writer_thread_which_writes_points_and_system_samples(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    import threading

    from tests.waiting import wait_for

    before = set(threading.enumerate())
    spec = _spec(tmp_path / "run")
    tracker = _attempt(spec, range(1, 4), start=0, resumed=False)
    run_id = str(tracker.run_id)
    # Points reach the database while the run goes on (the writer's tick), not only at its end.
    wait_for(lambda: len(metric_series(run_id, ["loss"]).get("loss", [])) == 3, 30)
    assert [t.name for t in set(threading.enumerate()) - before] == ["gpuyard-tracking"]
    tracker.finish("completed")
    samples = metric_series(run_id, ["sys/cpu_percent"])["sys/cpu_percent"]
    assert [step for step, _ in samples] == [1, 2]  # one when the run opened, one when it closed


def test_straggler_and_snapshot_failure_events_reach_the_run(gpuyard_home: Path, tmp_path: Path) -> None:
    from tests.waiting import wait_for

    spec = _spec(tmp_path / "run")
    tracker = _attempt(spec, range(1, 3), start=0, resumed=False)
    tracker.log_event("straggler", rank=1, cause="data", step=2)
    tracker.log_event("memory_snapshot_failed", step=2, error="No space left on device")
    tracker.log_event("metrics_only", step=2)  # not a run event
    run_id = str(tracker.run_id)

    def events() -> list[str]:
        from gpuyard.errors import NotFoundError

        try:  # the writer thread creates the run
            return [e["event"] for e in get_run(run_id).tags.get("events", [])]
        except NotFoundError:
            return []

    wait_for(lambda: "memory_snapshot_failed" in events(), 30)
    tracker.finish("completed")
    assert "straggler" in events() and "metrics_only" not in events()
    straggler = next(e for e in get_run(run_id).tags["events"] if e["event"] == "straggler")
    assert straggler["rank"] == 1 and straggler["cause"] == "data"
