"""A job's goodput from its state changes, alone and with its training run's."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gpuyard.scheduler.goodput import Change, job_goodput

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_queueing_startup_and_a_failed_attempt_restarted() -> None:
    changes = [
        Change(at(0), "queued"),
        Change(at(10), "scheduled"),
        Change(at(12), "running"),
        Change(at(40), "queued", "failed (exit code 1); restart 1 of 1"),
        Change(at(50), "scheduled"),
        Change(at(51), "running"),
        Change(at(100), "succeeded"),
    ]
    gp = job_goodput(at(0), changes, at(100))
    assert gp["wall_s"] == 100.0 and gp["source"] == "job"
    assert gp["lost_s"]["queueing"] == 20.0  # 0-10 and 40-50
    assert gp["lost_s"]["startup"] == 2.0 and gp["lost_s"]["restart"] == 1.0 + 28.0
    assert gp["productive_s"] == 49.0 and gp["ettr"] == 0.49


def test_a_preempted_attempt_is_requeued_and_the_running_job_ends_now() -> None:
    changes = [
        Change(at(0), "queued"),
        Change(at(1), "scheduled"),
        Change(at(2), "running"),
        Change(at(20), "preempted", "preempted (exit code 75); resumes from its checkpoint"),
        Change(at(20), "queued", "requeued after preemption"),
        Change(at(30), "scheduled"),
        Change(at(31), "running"),
    ]
    gp = job_goodput(at(0), changes, at(60))
    assert gp["lost_s"]["queueing"] == 11.0 and gp["lost_s"]["restart"] == 1.0
    assert gp["productive_s"] == 18.0 + 29.0
    assert gp["productive_s"] + sum(gp["lost_s"].values()) == gp["wall_s"] == 60.0


def test_with_its_run_the_running_time_is_split_by_the_runs_causes() -> None:
    changes = [Change(at(0), "queued"), Change(at(5), "scheduled"), Change(at(6), "running")]
    changes.append(Change(at(106), "succeeded"))
    run = {
        "ettr": 0.8,
        "wall_s": 97.0,  # the launcher started 3 s after the job's process
        "productive_s": 80.0,
        "lost_s": {"startup": 7.0, "restart": 5.0, "recomputed": 2.0, "checkpoint": 1.0, "straggler": 2.0},
    }
    gp = job_goodput(at(0), changes, at(106), run)
    assert gp["source"] == "job+run"
    assert gp["productive_s"] == 80.0
    assert gp["lost_s"]["startup"] == 1.0 + 7.0 + 3.0
    assert gp["lost_s"]["recomputed"] == 2.0 and gp["lost_s"]["queueing"] == 5.0
    assert gp["wall_s"] == 106.0 and gp["ettr"] == pytest.approx(80 / 106, abs=1e-4)


def test_a_running_job_counts_the_time_since_its_runs_last_record_as_not_yet_split() -> None:
    changes = [Change(at(0), "queued"), Change(at(2), "scheduled"), Change(at(3), "running")]
    run = {"wall_s": 50.0, "productive_s": 40.0, "lost_s": {"startup": 10.0}, "as_of": at(55).timestamp()}
    gp = job_goodput(at(0), changes, at(60), run)  # the launcher started at 5 s; recorded at 55 s
    assert gp["productive_s"] == 40.0 + 5.0
    assert gp["lost_s"]["startup"] == 1.0 + 10.0 + 2.0  # scheduled, the run's, before the launcher
    assert gp["wall_s"] == 60.0
