"""State enums keep the strings the store and JSON documents carry, and map outcomes in one place."""

from __future__ import annotations

import json

import pytest

from gpuyard import exitcodes
from gpuyard.errors import ConfigError
from gpuyard.scheduler.spec import JobState
from gpuyard.states import DeploymentState, ModelStage, RunStatus, TrainOutcome

pytestmark = pytest.mark.unit


def test_values_are_the_stored_strings() -> None:
    # Rows written before the enums existed hold exactly these strings.
    runs = ["running", "finished", "failed", "pruned", "preempted", "diverged"]
    assert [s.value for s in RunStatus] == runs
    assert [s.value for s in ModelStage] == ["none", "staging", "production", "archived"]
    assert [s.value for s in DeploymentState] == ["starting", "running", "stopped", "failed", "dead"]
    assert [s.value for s in TrainOutcome] == [
        "completed", "early_stopped", "preempted", "diverged", "failed"
    ]  # fmt: skip
    assert [s.value for s in JobState] == [
        "queued", "scheduled", "running", "succeeded", "failed", "cancelled", "preempted"
    ]  # fmt: skip


def test_members_print_and_serialise_as_their_value() -> None:
    assert f"{JobState.RUNNING}" == str(JobState.RUNNING) == "running"
    assert json.dumps({"s": ModelStage.PRODUCTION, "o": TrainOutcome.EARLY_STOPPED}) == (
        '{"s": "production", "o": "early_stopped"}'
    )
    assert RunStatus("finished") is RunStatus.FINISHED and RunStatus.FINISHED == "finished"


def test_outcomes_map_to_run_statuses_and_exit_codes() -> None:
    assert {o: (o.run_status, o.exit_code) for o in TrainOutcome} == {
        TrainOutcome.COMPLETED: (RunStatus.FINISHED, exitcodes.SUCCESS),
        TrainOutcome.EARLY_STOPPED: (RunStatus.FINISHED, exitcodes.SUCCESS),
        TrainOutcome.PREEMPTED: (RunStatus.PREEMPTED, exitcodes.PREEMPTED),
        TrainOutcome.DIVERGED: (RunStatus.DIVERGED, exitcodes.DIVERGED),
        TrainOutcome.FAILED: (RunStatus.FAILED, exitcodes.UNRECOVERABLE),
    }


@pytest.mark.parametrize("word", ["finished", "FAILED", "", None, 3, "completed "])
def test_an_unknown_outcome_is_an_error_in_one_line(word: object) -> None:
    with pytest.raises(ValueError, match="is not a training outcome") as info:
        TrainOutcome.parse(word)
    assert "\n" not in str(info.value)
    assert TrainOutcome.parse("failed") is TrainOutcome.FAILED


@pytest.mark.parametrize(
    ("word", "status"),
    [("completed", RunStatus.FINISHED), ("early_stopped", RunStatus.FINISHED), ("failed", RunStatus.FAILED)]
    + [(s.value, s) for s in RunStatus if s is not RunStatus.RUNNING],
)
def test_a_run_ends_with_a_run_status_or_an_outcome(word: str, status: RunStatus) -> None:
    assert RunStatus.ended_as(word) is status


@pytest.mark.parametrize("word", ["running", "succeeded", "error", "exploded", ""])
def test_other_words_cannot_end_a_run(word: str) -> None:
    with pytest.raises(ConfigError, match=r"must be one of finished, failed, pruned, preempted, diverged"):
        RunStatus.ended_as(word)


def test_active_deployments_and_terminal_jobs() -> None:
    assert {s for s in DeploymentState if s.active} == {DeploymentState.STARTING, DeploymentState.RUNNING}
    assert {s for s in JobState if s.terminal} == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
