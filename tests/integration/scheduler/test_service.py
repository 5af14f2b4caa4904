"""The job service with the local executor: real process groups, exit codes, cancel, restarts, preemption."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuyard.errors import CapacityError, ConfigError, ConflictError, NotFoundError
from gpuyard.scheduler.spec import parse_spec

from .conftest import wait_for

pytestmark = pytest.mark.integration


def _run_until(service: Any, job_id: int, states: set[str], timeout: float = 30.0) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        service.tick()
        doc = service.get(job_id)
        return doc if doc["state"] in states else None

    return wait_for(done, timeout)  # type: ignore[return-value]


def test_job_runs_with_its_gpus_and_logs_and_every_change_is_an_event(
    make_service: Callable[..., Any],
) -> None:
    service = make_service(gpus=2)
    spec = parse_spec(
        {
            "name": "env",
            "command": ["sh", "-c", "echo gpus=$CUDA_VISIBLE_DEVICES id=$GPUYARD_JOB_ID"],
            "resources": {"gpus": 2},
        }
    )
    job = service.submit(spec)
    doc = _run_until(service, job["id"], {"succeeded", "failed"})
    assert doc["state"] == "succeeded" and doc["exit_code"] == 0
    assert service.read_log(job["id"])["text"].strip() == f"gpus=0,1 id={job['id']}"
    assert [e["to"] for e in service.events(job["id"])] == ["queued", "scheduled", "running", "succeeded"]
    assert doc["placement"]["nodes"] == [{"node": "local", "gpus": [0, 1], "cpus": 0}]


def test_cpu_only_jobs_share_cpu_slots(make_service: Callable[..., Any]) -> None:
    service = make_service(gpus=0, cpus=1)
    ids = [service.submit(parse_spec({"name": f"c{i}", "command": ["sleep", "0.3"]}))["id"] for i in range(2)]
    service.tick()
    states = [service.get(i)["state"] for i in ids]
    assert states == ["running", "queued"]  # one CPU slot: the second waits
    for i in ids:
        assert _run_until(service, i, {"succeeded"})["state"] == "succeeded"


def test_failures_are_restarted_up_to_max_restarts(make_service: Callable[..., Any]) -> None:
    service = make_service()
    job = service.submit(
        parse_spec({"name": "bad", "command": ["sh", "-c", "echo try; exit 3"], "max_restarts": 1})
    )
    doc = _run_until(service, job["id"], {"failed"})
    assert doc["exit_code"] == 3 and doc["attempts"] == 2 and doc["failures"] == 2
    assert service.read_log(job["id"])["text"].count("try") == 2


def test_an_unrecoverable_exit_is_not_restarted(make_service: Callable[..., Any]) -> None:
    """Exit 74 (gpuyard train on a full disk, corrupt input): a restart would fail the same way."""
    service = make_service()
    cmd = ["sh", "-c", "echo try; exit 74"]
    job = service.submit(parse_spec({"name": "full", "command": cmd, "max_restarts": 3}))
    doc = _run_until(service, job["id"], {"failed"})
    assert doc["exit_code"] == 74 and doc["attempts"] == 1
    assert "unrecoverable, not restarted" in service.events(job["id"])[-1]["reason"]


def test_missing_command_fails_with_why(make_service: Callable[..., Any]) -> None:
    service = make_service()
    job = service.submit(parse_spec({"name": "nope", "command": ["/no/such/binary"]}))
    doc = _run_until(service, job["id"], {"failed"})
    assert doc["exit_code"] == 127 and "cannot start" in service.read_log(job["id"])["text"]


def test_cancel_sends_sigterm_then_sigkill_after_the_grace(
    make_service: Callable[..., Any], python: str
) -> None:
    service = make_service(grace_s=0.5)
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    stubborn = ignore + "print('up', flush=True); time.sleep(60)"
    job = service.submit(parse_spec({"name": "stubborn", "command": [python, "-c", stubborn]}))
    wait_for(lambda: (service.tick(), "up" in service.read_log(job["id"])["text"])[1])
    service.cancel(job["id"])
    doc = _run_until(service, job["id"], {"cancelled"}, timeout=20)
    assert "SIGKILL" in doc["reason"]
    assert any("SIGKILL" in (e["reason"] or "") for e in service.events(job["id"]))
    with pytest.raises(ConflictError):
        service.cancel(job["id"])


def test_queued_job_cancels_at_once(make_service: Callable[..., Any]) -> None:
    service = make_service(gpus=1)
    job = service.submit(parse_spec({"name": "q", "command": ["true"], "resources": {"gpus": 1}}))
    assert service.cancel(job["id"])["state"] == "cancelled"


def _team_a_fills_both_gpus(service: Any, script: list[str], tmp_path: Path, *args: str) -> list[int]:
    """Two 1-GPU jobs of team a running the checkpointing job script (``args`` after its checkpoint
    path), returned once both have logged step 5."""
    ids = [
        service.submit(
            parse_spec(
                {
                    "name": f"a{i}",
                    "team": "a",
                    "resources": {"gpus": 1},
                    "command": [*script, str(tmp_path / f"a{i}.ckpt"), *args],
                }
            )
        )["id"]
        for i in range(2)
    ]
    wait_for(lambda: (service.tick(), all("step 5" in service.read_log(j)["text"] for j in ids))[1])
    return ids


def test_preemption_checkpoints_requeues_and_resumes(
    make_service: Callable[..., Any], job_script: Path, python: str, tmp_path: Path
) -> None:
    service = make_service(gpus=2, policy="fair", teams={"a": 1.0, "b": 1.0}, min_run_s=0.0, grace_s=5.0)
    a_jobs = _team_a_fills_both_gpus(service, [python, str(job_script)], tmp_path, "60")
    b = service.submit(parse_spec({"name": "b", "team": "b", "resources": {"gpus": 1}, "command": ["true"]}))
    # Team a borrowed b's share; b's job takes it back by preempting one of a's jobs.
    _run_until(service, b["id"], {"succeeded"}, timeout=30)
    preempted = [j for j in a_jobs if service.get(j)["preemptions"] == 1]
    assert len(preempted) == 1
    jid = preempted[0]
    doc = _run_until(service, jid, {"succeeded"}, timeout=40)
    log = service.read_log(jid)["text"]
    saved = int(log.split("checkpointed at ")[1].split()[0])
    assert saved > 0 and f"start at {saved}" in log  # resumed from its checkpoint, not from 0
    assert doc["attempts"] == 2 and doc["exit_code"] == 0
    transitions = [(e["from"], e["to"]) for e in service.events(jid) if e["from"] != e["to"]]
    assert ("running", "preempted") in transitions and ("preempted", "queued") in transitions


def test_a_job_slow_to_checkpoint_is_not_joined_by_a_second_victim(
    make_service: Callable[..., Any], job_script: Path, python: str, tmp_path: Path
) -> None:
    # The preempted job holds its GPU until it has checkpointed; the ticks meanwhile must count that GPU
    # as on its way to b, not preempt the other a job for it too (once seen on a loaded machine).
    service = make_service(gpus=2, policy="fair", teams={"a": 1.0, "b": 1.0}, min_run_s=0.0, grace_s=60.0)
    release = tmp_path / "release"
    a_jobs = _team_a_fills_both_gpus(service, [python, str(job_script)], tmp_path, "6000", str(release))
    b = service.submit(parse_spec({"name": "b", "team": "b", "resources": {"gpus": 1}, "command": ["true"]}))
    victim = wait_for(
        lambda: (service.tick(), [j for j in a_jobs if "checkpointing" in service.read_log(j)["text"]])[1]
    )
    for _ in range(20):  # scheduling passes while the victim still holds its GPU
        service.tick()
    assert [service.get(j)["stop_requested"] for j in a_jobs].count("preempt") == 1
    assert len(victim) == 1 and service.get(b["id"])["state"] == "queued"
    release.touch()
    _run_until(service, b["id"], {"succeeded"}, timeout=30)
    assert [service.get(j)["preemptions"] for j in a_jobs].count(1) == 1
    assert sum(service.get(j)["preemptions"] for j in a_jobs) == 1


def test_bad_requests_are_refused_with_why(make_service: Callable[..., Any]) -> None:
    service = make_service(gpus=2)
    with pytest.raises(CapacityError, match=r"resources\.gpus: 4 GPUs.*at most 2"):
        service.submit(parse_spec({"name": "big", "command": ["true"], "resources": {"gpus": 4}}))
    with pytest.raises(CapacityError, match="gpu_type"):
        service.submit(
            parse_spec({"name": "h", "command": ["true"], "resources": {"gpus": 1, "gpu_type": "H100"}})
        )
    with pytest.raises(ConfigError, match="team: 'ghosts' is unknown"):
        service.submit(parse_spec({"name": "t", "command": ["true"], "team": "ghosts"}))
    with pytest.raises(NotFoundError):
        service.get(12345)
    assert service.list_jobs() == []  # nothing refused was queued


def test_dry_run_shows_the_launch_without_launching(make_service: Callable[..., Any]) -> None:
    service = make_service(gpus=2)
    out = service.dry_run(parse_spec({"name": "d", "command": ["echo", "hi"], "resources": {"gpus": 1}}))
    assert out["fits_now"] and out["plan"]["argv"] == ["echo", "hi"]
    assert out["plan"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert service.list_jobs() == []


def test_recover_requeues_a_job_whose_launch_was_never_recorded(
    make_service: Callable[..., Any], gpuyard_home: Path
) -> None:
    from gpuyard.store.tables.jobs import JobRow

    service = make_service(gpus=1)
    job = service.submit(parse_spec({"name": "r", "command": ["true"], "resources": {"gpus": 1}}))
    with service.store.session() as s:  # as if the server died between placing and launching
        row = s.get(JobRow, job["id"])
        row.state, row.attempts = "scheduled", 1
        row.placement = {"how": "test", "nodes": [{"node": "local", "gpus": [0], "cpus": 0}]}
        row.handle = {
            "pid_file": str(gpuyard_home / "none.pid"),
            "exit_file": str(gpuyard_home / "none.exit"),
        }
    again = make_service(gpus=1)
    assert again.recover() == {"adopted": 0, "requeued": 1}
    doc = _run_until(again, job["id"], {"succeeded"})
    assert doc["attempts"] == 2
    assert [e["to"] for e in again.events(job["id"])][-4:] == ["queued", "scheduled", "running", "succeeded"]


def test_the_service_runs_on_postgresql(pg_url: str, gpuyard_home: Path) -> None:
    from gpuyard.scheduler.executors.local import LocalExecutor
    from gpuyard.scheduler.placement import NodeSpec
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    node = NodeSpec("local", 1, "fake-gpu", "local", "local", cpus=1)
    service = JobService(
        get_store(url=pg_url), [node], LocalExecutor(gpuyard_home / "jobs"), ServiceConfig(tick_s=0.05)
    )
    jobs = [
        service.submit(parse_spec({"name": f"p{i}", "command": ["true"], "resources": {"gpus": 1}}))
        for i in range(2)
    ]
    for job in jobs:
        assert _run_until(service, job["id"], {"succeeded"})["state"] == "succeeded"
    assert [e["to"] for e in service.events(jobs[1]["id"])] == ["queued", "scheduled", "running", "succeeded"]
