"""status.json: one typed document that the ranks write and the launcher reads; nothing unknown is
read as some outcome."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuyard import exitcodes
from gpuyard.states import RunStatus, TrainOutcome
from gpuyard.train.names import STATUS_FALLBACK_ENV, STATUS_FILE
from gpuyard.train.spec import TrainSpec
from gpuyard.train.status import (
    MAX_STATUS_BYTES,
    UNKNOWN,
    StatusFileError,
    TrainStatus,
    read_status,
    status_places,
    write_status,
)

from .conftest import run

pytestmark = pytest.mark.unit


def test_a_status_reads_back_as_written(tmp_path: Path) -> None:
    report = TrainStatus(
        TrainOutcome.PREEMPTED,
        step=7,
        epoch=1,
        checkpoint="/r/checkpoints/step-000000007",
        run_id="ab" * 16,
        tracking_failed=True,
        stragglers=[{"rank": 1, "cause": "data"}],
        metrics={"loss": 0.25, "accuracy": 1.0},
    )
    assert write_status(report, [tmp_path]) == tmp_path / STATUS_FILE
    assert read_status(tmp_path) == report
    assert json.loads((tmp_path / STATUS_FILE).read_text())["status"] == "preempted"
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed over it
    assert read_status(tmp_path / "nowhere") is None  # the ranks never got that far


def test_failed_is_an_outcome_the_launcher_acts_on(tmp_path: Path) -> None:
    report = TrainStatus(TrainOutcome.FAILED, unrecoverable=True, error="disk full at /d", step=5)
    write_status(report, [tmp_path])
    back = read_status(tmp_path)
    assert back is not None and back.status is TrainOutcome.FAILED and back.stopped_for_good
    assert back.status.exit_code == exitcodes.UNRECOVERABLE and back.status.run_status is RunStatus.FAILED
    # A failure that does not say a restart would repeat it is not one the launcher stops for.
    assert not TrainStatus(TrainOutcome.FAILED).stopped_for_good


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"status": "finished", "step": 3}, "status 'finished' is not a training outcome"),
        ({"status": "FAILED"}, "status 'FAILED' is not a training outcome"),
        ({"step": 3}, "status 'None' is not a training outcome"),
        ({"status": "completed", "step": "3"}, "field 'step' is a str, not int"),
        ({"status": "completed", "step": True}, "field 'step' is a bool, not int"),
        ({"status": "failed", "unrecoverable": "yes"}, "field 'unrecoverable' is a str, not bool"),
        ({"status": "completed", "metrics": {"loss": "low"}}, "field 'metrics' must map names to numbers"),
        ({"status": "completed", "stragglers": [1]}, "field 'stragglers' must be a list of objects"),
        (["completed"], "not a JSON object"),
    ],
)
def test_a_status_no_rank_writes_is_an_error_in_one_line(tmp_path: Path, doc: Any, says: str) -> None:
    (tmp_path / STATUS_FILE).write_text(json.dumps(doc))
    with pytest.raises(StatusFileError) as info:
        read_status(tmp_path)
    message = str(info.value)
    assert says in message and str(tmp_path / STATUS_FILE) in message and "\n" not in message


def test_torn_and_oversized_files_are_errors_not_outcomes(tmp_path: Path) -> None:
    (tmp_path / STATUS_FILE).write_text('{"status": "compl')
    with pytest.raises(StatusFileError, match="not JSON"):
        read_status(tmp_path)
    (tmp_path / STATUS_FILE).write_bytes(b" " * (MAX_STATUS_BYTES + 1))
    with pytest.raises(StatusFileError, match="larger than 4 MiB"):
        read_status(tmp_path)


def test_a_full_run_folder_writes_in_the_launchers_folder(tmp_path: Path, monkeypatch: Any) -> None:
    private = tmp_path / "private"
    private.mkdir()
    monkeypatch.setenv(STATUS_FALLBACK_ENV, str(private))
    gone = tmp_path / "not-a-folder"
    gone.write_text("")  # writing under a file fails as a full disk would
    places = status_places(gone)
    assert places == [gone, private]
    assert write_status(TrainStatus(TrainOutcome.DIVERGED, step=2), places) == private / STATUS_FILE
    assert read_status(private) == TrainStatus(TrainOutcome.DIVERGED, step=2)
    monkeypatch.delenv(STATUS_FALLBACK_ENV)
    with pytest.raises(OSError):
        write_status(TrainStatus(TrainOutcome.DIVERGED), status_places(gone))


def test_the_trainer_writes_a_status_the_launcher_reads(spec_factory: Callable[..., TrainSpec]) -> None:
    spec = spec_factory(tracking="jsonl")
    _, result = run(spec)
    report = read_status(spec.resolved_run_dir())
    assert report is not None and report.status is TrainOutcome.COMPLETED is result.status
    assert (report.step, report.epoch) == (result.step, result.epoch) == (16, 2)
    assert report.checkpoint == str(result.checkpoint) and report.metrics["loss"] == result.metrics["loss"]


def test_a_configuration_error_is_reported_as_failed(tmp_path: Path, monkeypatch: Any) -> None:
    from gpuyard.train.worker import _report_config_error

    monkeypatch.delenv(STATUS_FALLBACK_ENV, raising=False)
    assert not _report_config_error("model: required", "0")  # no launcher folder to tell
    monkeypatch.setenv(STATUS_FALLBACK_ENV, str(tmp_path))
    assert _report_config_error("model: required", "1")
    report = read_status(tmp_path)
    assert report is not None and report.stopped_for_good and report.config_error
    assert (report.status, report.error, report.rank) == (TrainOutcome.FAILED, "model: required", 1)


def test_an_unknown_last_status_is_trained_past_with_a_warning(
    spec_factory: Callable[..., TrainSpec], capsys: Any
) -> None:
    from gpuyard.train.launch import _unrecoverable, already_complete

    spec = spec_factory(tracking="jsonl")
    run(spec)
    run_dir = spec.resolved_run_dir()
    assert already_complete(spec, run_dir) is not None
    (run_dir / STATUS_FILE).write_text(json.dumps({"status": "finished", "step": 16}))
    assert already_complete(spec, run_dir) is None  # not known to be complete: nothing skipped
    assert "outcome is unknown" in capsys.readouterr().err
    # While a run goes on the launcher passes over it; its final read reports it.
    assert _unrecoverable(run_dir, run_dir / "private", strict=False) is None
    with pytest.raises(StatusFileError, match="'finished' is not a training outcome"):
        _unrecoverable(run_dir, run_dir / "private")


def test_the_final_line_says_an_unknown_outcome() -> None:
    from gpuyard.cli.train import final_line

    error = "/r/status.json: status 'x' is not a training outcome"
    assert final_line({"status": UNKNOWN, "error": error}, 74) == f"outcome unknown: {error}; exit 74"
    assert final_line({"step": 3}, 1).startswith("unknown at step 3")
