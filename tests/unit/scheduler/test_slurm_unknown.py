"""Three states of a Slurm job, not two: active, ended, unknown. A fake Slurm answers the executor's
tool calls (its ``subprocess.run``) as Slurm 22.05's tools do: the same output, the same error lines
when the controller is away (refused at connect, or frozen: the call times out), and "Invalid job id
specified" for a job it no longer knows. The service on that executor keeps unknown jobs as they are,
never polls under the store's write lock, and names each end truly."""

from __future__ import annotations

import sqlite3
import subprocess
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from gpuyard.scheduler.executors import slurm_poll, slurm_states, slurm_tools
from gpuyard.scheduler.executors.base import ExecutorUnreachable
from gpuyard.scheduler.executors.slurm import SlurmExecutor
from gpuyard.scheduler.spec import parse_spec

pytestmark = pytest.mark.unit

REFUSED = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"


@dataclass
class FakeJob:
    id: int
    name: str
    state: str = "RUNNING"
    exit: str = "0:0"
    submit: str = field(default_factory=lambda: datetime.now().strftime("%Y-%m-%dT%H:%M:%S"))
    node: str = "n1"


@dataclass
class FakeSlurm:
    """What a controller knows, and how it answers (``down``: "", "refused" or "frozen")."""

    jobs: dict[int, FakeJob] = field(default_factory=dict)
    down: str = ""
    next_id: int = 1
    calls: list[list[str]] = field(default_factory=list)
    cancelled: list[list[str]] = field(default_factory=list)
    node_states: dict[str, str] = field(default_factory=lambda: {"n1": "IDLE", "n2": "IDLE"})

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        if self.down == "frozen":
            raise subprocess.TimeoutExpired(argv, kwargs.get("timeout") or 0)
        if self.down == "refused":
            tool = argv[0]
            err = (
                "sbatch: error: Batch job submission failed: Unable to contact slurm controller "
                "(connect failure)\n"
                if tool == "sbatch"
                else REFUSED
            )
            return subprocess.CompletedProcess(argv, 1, "", err)
        return getattr(self, "_" + argv[0])(argv)

    def _done(self, argv: list[str], out: str = "", rc: int = 0, err: str = "") -> Any:
        return subprocess.CompletedProcess(argv, rc, out, err)

    def _unknown(self, argv: list[str]) -> Any:
        return self._done(argv, rc=1, err="slurm_load_jobs error: Invalid job id specified\n")

    def _sinfo(self, argv: list[str]) -> Any:
        return self._done(argv, "main\n")

    def _sbatch(self, argv: list[str]) -> Any:
        name = next(a.split("=", 1)[1] for a in argv if a.startswith("--job-name="))
        job = FakeJob(self.next_id, name, state="PENDING")
        self.jobs[job.id], self.next_id = job, self.next_id + 1
        return self._done(argv, f"{job.id}\n")

    def _squeue(self, argv: list[str]) -> Any:
        active = [j for j in self.jobs.values() if j.state in slurm_states.ACTIVE]
        if "-j" in argv:
            wanted = {int(x) for x in argv[argv.index("-j") + 1].split(",")}
            if not wanted & set(self.jobs):
                return self._unknown(argv)
            active = [j for j in active if j.id in wanted]
        if "-n" in argv:
            active = [j for j in active if j.name == argv[argv.index("-n") + 1]]
        fmt = argv[argv.index("-o") + 1]
        rows = []
        for j in active:
            values = {"%i": str(j.id), "%T": j.state, "%r": "None", "%N": j.node, "%S": j.submit}
            values |= {"%V": j.submit, "%j": j.name}
            rows.append("|".join(values[f] for f in fmt.split("|")))
        return self._done(argv, "".join(r + "\n" for r in rows))

    def _scontrol(self, argv: list[str]) -> Any:
        if argv[1:3] == ["show", "config"]:
            return self._done(argv, "SchedulerParameters = (null)\n")
        if argv[1:3] == ["show", "node"]:
            rows = [
                f"NodeName={n} NodeAddr=127.0.0.1 Gres=gpu:1 CPUTot=2 State={s}"
                for n, s in self.node_states.items()
            ]
            return self._done(argv, "\n".join(rows) + "\n")
        if argv[1:3] == ["show", "hostnames"]:
            return self._done(argv, "\n".join(argv[3].split(",")) + "\n")
        if argv[1:3] == ["show", "topology"]:
            return self._done(argv)
        assert argv[1:3] == ["show", "job"], argv
        ids = [int(a) for a in argv[3:] if a.isdigit()]
        jobs = [self.jobs[i] for i in ids if i in self.jobs] if ids else list(self.jobs.values())
        if ids and not jobs:
            return self._unknown(argv)
        lines = [
            f"JobId={j.id} JobName={j.name} JobState={j.state} Reason=None ExitCode={j.exit} "
            f"SubmitTime={j.submit} EndTime=Unknown NodeList={j.node}"
            for j in jobs
        ]
        return self._done(argv, "".join(x + "\n" for x in lines))

    def _sacct(self, argv: list[str]) -> Any:
        return self._done(argv, rc=1, err="Slurm accounting storage is disabled\n")

    def _scancel(self, argv: list[str]) -> Any:
        self.cancelled.append(argv)
        return self._done(argv)

    def lose_state(self) -> None:
        """A controller restarted without its state: no job known, ids from 1 again."""
        self.jobs, self.next_id = {}, 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    slurm = FakeSlurm()

    class Subprocess:
        run = staticmethod(slurm.run)
        TimeoutExpired = subprocess.TimeoutExpired

    monkeypatch.setattr(slurm_tools, "subprocess", Subprocess)
    monkeypatch.setattr(slurm_poll.shutil, "which", lambda tool, path=None: f"/usr/bin/{tool}")
    monkeypatch.setattr(slurm_poll, "STATES_TTL_S", -1.0)  # every poll asks: the test sets each answer
    monkeypatch.setattr(slurm_poll, "UNREACHABLE_RETRY_S", -1.0)
    return slurm


def _submitted(ex: SlurmExecutor, fake: FakeSlurm, job: int = 1) -> dict[str, Any]:
    """A launched attempt's handle (as launch() returns it), and Slurm running it."""
    before = datetime.now().timestamp()
    sid = fake._sbatch(["sbatch", f"--job-name={ex.prefix}{job}-1"]).stdout.strip()
    fake.jobs[int(sid)].state = "RUNNING"
    return {
        "slurm_id": sid,
        "slurm_name": f"{ex.prefix}{job}-1",
        "launched": True,
        "submit_window": [before - 1, datetime.now().timestamp() + 1],
    }


def test_an_unanswered_squeue_is_unknown_not_gone(fake: FakeSlurm, tmp_path: Path) -> None:
    ex = SlurmExecutor(tmp_path, instance="store")
    handle = _submitted(ex, fake)
    assert ex.poll(handle) is None and ex.unavailable() is None
    for how in ("refused", "frozen"):
        fake.down = how
        asked = len(fake.calls)
        assert ex.poll(handle) is None  # the job keeps its state: it is not "gone"
        assert len(fake.calls) == asked + 1  # one squeue for all jobs, no scontrol/sacct after it
        why = ex.unavailable()
        assert why is not None and ("controller" in why or "did not answer" in why), why
    fake.down = ""
    assert ex.poll(handle) is None and ex.unavailable() is None  # back, still running
    fake.jobs[1].state, fake.jobs[1].exit = "COMPLETED", "0:0"
    status = ex.poll(handle)
    assert status is not None and status.code == 0 and not status.untraced


def test_a_failing_scontrol_after_squeue_answered_is_unknown_too(
    fake: FakeSlurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """squeue answers (the job is no longer listed) but scontrol then fails: unknown, not ended."""
    ex = SlurmExecutor(tmp_path, instance="store")
    handle = _submitted(ex, fake)
    fake.jobs[1].state = "COMPLETED"
    original = fake._scontrol
    monkeypatch.setattr(fake, "_scontrol", lambda argv: fake._done(argv, rc=1, err="Socket timed out\n"))
    assert ex.poll(handle) is None
    monkeypatch.setattr(fake, "_scontrol", lambda argv: fake._done(argv, rc=1, err="Permission denied\n"))
    assert ex.poll(handle) is None  # any failure that is not "no such job" is no answer
    monkeypatch.setattr(fake, "_scontrol", original)
    assert ex.poll(handle) == slurm_states.exit_from_state("COMPLETED", "0:0", "Unknown")


def test_a_job_still_ending_is_not_ended(fake: FakeSlurm, tmp_path: Path) -> None:
    ex = SlurmExecutor(tmp_path, instance="store")
    handle = _submitted(ex, fake)
    fake.jobs[1].state = "COMPLETING"
    assert ex.poll(handle) is None


def test_an_id_reused_after_state_loss_is_not_taken_for_the_attempt(fake: FakeSlurm, tmp_path: Path) -> None:
    """The controller lost its state and gave the attempt's id to another job (running, then ended):
    gpuyard's attempt is reported lost with what is known, never as the other job's run or end."""
    ex = SlurmExecutor(tmp_path, instance="store")
    handle = _submitted(ex, fake)
    assert ex.poll(handle) is None  # seen running
    fake.lose_state()
    fake._sbatch(["sbatch", "--job-name=someone-else"])
    fake.jobs[1].state = "RUNNING"
    status = ex.poll(handle)
    assert status is not None and status.untraced and status.code is None
    assert status.describe().startswith("lost: Slurm has no trace of the attempt (Slurm job 1")
    assert f"named {ex.prefix}1-1" in status.describe() and "last seen RUNNING" in status.describe()
    fake.jobs[1].state = "CANCELLED"  # the other job's end is not this attempt's either
    assert ex.poll(handle).untraced  # type: ignore[union-attr]
    # Same name (another store on the same prefix) but submitted long after the attempt: not it.
    fake.jobs[1].name = handle["slurm_name"]
    fake.jobs[1].submit = "2099-01-01T00:00:00"
    assert ex.poll(handle).untraced  # type: ignore[union-attr]
    assert not fake.cancelled  # nothing was done to the other job


def test_a_failed_attempt_ends_only_once_its_silent_node_answers(
    fake: FakeSlurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NODE_FAIL on a two-node job whose n2 slurmd does not answer: its task there may still run, so
    the end (and a retry) waits for n2, at most SILENT_NODE_WAIT_S, then says what may still run."""
    ex = SlurmExecutor(tmp_path, instance="store")
    handle = _submitted(ex, fake)
    fake.jobs[1].state, fake.jobs[1].node = "NODE_FAIL", "n1,n2"
    fake.node_states["n2"] = "DOWN+NOT_RESPONDING"
    assert ex.poll(handle) is None and ex.poll(handle) is None
    fake.node_states["n2"] = "IDLE"  # its slurmd is back (and ended the job's task there)
    status = ex.poll(handle)
    assert status is not None and status.describe() == "a node of the job failed (Slurm NODE_FAIL)"
    assert status.notes == ()
    fake.node_states["n2"] = "DOWN+NOT_RESPONDING"
    monkeypatch.setattr(slurm_poll, "SILENT_NODE_WAIT_S", 0.0)
    status = ex.poll(handle)
    assert status is not None and status.notes[0].startswith("its tasks on n2 may still run")
    fake.jobs[1].state, fake.jobs[1].exit = "COMPLETED", "0:0"  # a success is never held
    monkeypatch.setattr(slurm_poll, "SILENT_NODE_WAIT_S", 300.0)
    assert ex.poll(handle).code == 0  # type: ignore[union-attr]


def test_nothing_is_sent_while_the_controller_is_known_away(fake: FakeSlurm, tmp_path: Path) -> None:
    ex = SlurmExecutor(tmp_path, instance="store")
    handle = _submitted(ex, fake)
    fake.down = "refused"
    assert ex.poll(handle) is None
    with pytest.raises(ExecutorUnreachable) as refused:
        ex.stop(handle, kill=True)
    assert refused.value.submitted is False and "controller" in str(refused.value)
    assert not any(c[0] in ("scancel", "sbatch") for c in fake.calls)


def test_a_stop_names_the_attempt_so_a_reused_id_is_not_cancelled(fake: FakeSlurm, tmp_path: Path) -> None:
    ex = SlurmExecutor(tmp_path, instance="store")
    handle = _submitted(ex, fake)
    ex.stop(handle, kill=True)
    assert fake.cancelled == [["scancel", f"--name={ex.prefix}1-1", "1"]]


# -- the service on that executor --------------------------------------------------------------------


@pytest.fixture
def service(fake: FakeSlurm, tmp_path: Path) -> Any:
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    store = get_store(url=f"sqlite:///{tmp_path / 'state.db'}")
    ex = SlurmExecutor(tmp_path / "jobs", instance=store.url)
    return JobService(store, ex.nodes(), ex, ServiceConfig(tick_s=0.1))


def _job(service: Any, name: str = "j", **spec: Any) -> int:
    doc = {"name": name, "command": ["true"], "resources": {"gpus": 1}, **spec}
    return int(service.submit(parse_spec(doc))["id"])


def _write_locked(db: Path) -> bool:
    """Whether some connection holds the SQLite store's write lock now (a BEGIN IMMEDIATE fails)."""
    conn = sqlite3.connect(db, timeout=0)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.rollback()
        return False
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc)
        return True
    finally:
        conn.close()


def test_the_service_polls_slurm_outside_the_stores_write_lock(
    service: Any, fake: FakeSlurm, tmp_path: Path
) -> None:
    job = _job(service)
    service.tick()
    assert service.get(job)["state"] == "running"
    seen: list[bool] = []
    run = fake.run

    def watching(argv: list[str], **kwargs: Any) -> Any:
        seen.append(_write_locked(tmp_path / "state.db"))
        return run(argv, **kwargs)

    fake.down = "refused"
    slurm_tools.subprocess.run = staticmethod(watching)  # type: ignore[attr-defined]
    for _ in range(3):
        service.tick()
    assert seen and not any(seen)  # every Slurm call ran with the store free for the API
    assert service.get(job)["state"] == "running"
    fake.down = ""
    service.tick()
    service.cancel(job)  # its SIGTERM (scancel) is sent once the cancel is committed
    assert fake.cancelled and fake.cancelled[-1][:3] == ["scancel", "--batch", "--signal=TERM"]
    assert seen.count(True) == 0


def test_unknown_keeps_a_job_running_and_nothing_starts_until_slurm_answers(
    service: Any, fake: FakeSlurm
) -> None:
    first, second, third = _job(service, "a"), _job(service, "b"), _job(service, "c")
    service.tick()
    assert [service.get(j)["state"] for j in (first, second, third)] == ["running", "running", "queued"]
    fake.jobs[1].state = fake.jobs[2].state = "RUNNING"
    fake.down = "refused"
    fake.jobs[1].state = "COMPLETED"  # it ended meanwhile; nobody can know yet
    sbatches = sum(c[0] == "sbatch" for c in fake.calls)
    for _ in range(3):
        service.tick()
    assert [service.get(j)["state"] for j in (first, second, third)] == ["running", "running", "queued"]
    assert sum(c[0] == "sbatch" for c in fake.calls) == sbatches  # no launch tried into the outage
    fake.down = ""
    service.tick()
    service.tick()
    docs = [service.get(j) for j in (first, second, third)]
    assert (docs[0]["state"], docs[0]["reason"], docs[0]["attempts"]) == ("succeeded", "exit code 0", 1)
    assert [d["state"] for d in docs[1:]] == ["running", "running"]


def test_a_refused_submission_is_queued_again_without_using_an_attempt(service: Any, fake: FakeSlurm) -> None:
    job = _job(service)
    fake.down = "refused"  # not yet known to the executor: the sbatch itself is refused
    service.tick()
    doc = service.get(job)
    assert doc["state"] == "queued" and doc["attempts"] == 0
    assert "not launched" in doc["reason"] and "Unable to contact slurm controller" in doc["reason"]
    fake.down = ""
    service.tick()
    service.tick()
    doc = service.get(job)
    assert doc["state"] == "running" and doc["attempts"] == 1
    assert [j.name for j in fake.jobs.values()] == [f"{service.executor.prefix}{job}-1"]


def test_an_unanswered_submission_is_looked_for_before_anything_else_is_done(
    service: Any, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sbatch timed out: whether Slurm got it is unknown. The job stays scheduled (GPUs held) until
    Slurm answers; found, it runs as that attempt, never submitted a second time."""
    job = _job(service)
    sbatch = fake._sbatch

    def timed_out(argv: list[str]) -> Any:
        sbatch(argv)  # the controller got it, its answer never came
        raise subprocess.TimeoutExpired(argv, 30)

    monkeypatch.setattr(fake, "_sbatch", timed_out)
    service.tick()
    assert service.get(job)["state"] == "scheduled"
    fake.down = "refused"
    service.tick()
    assert service.get(job)["state"] == "scheduled"
    fake.down = ""
    monkeypatch.setattr(fake, "_sbatch", sbatch)
    service.tick()
    doc = service.get(job)
    assert doc["state"] == "running" and doc["attempts"] == 1
    assert len(fake.jobs) == 1  # submitted once


def test_an_attempt_slurm_has_no_trace_of_is_lost_and_not_run_again(service: Any, fake: FakeSlurm) -> None:
    job = _job(service, max_restarts=3)
    service.tick()
    fake.jobs[1].state = "RUNNING"
    service.tick()
    fake.lose_state()
    service.tick()
    doc = service.get(job)
    assert doc["state"] == "failed" and doc["attempts"] == 1
    assert doc["reason"].startswith("lost: Slurm has no trace of the attempt")
    assert doc["reason"].endswith("not run again: it may have finished")


def test_an_outside_scancel_is_cancelled_in_slurm_and_restarts_only_as_the_spec_asks(
    service: Any, fake: FakeSlurm
) -> None:
    plain, again = _job(service, "plain"), _job(service, "again", max_restarts=1)
    service.tick()
    for j in fake.jobs.values():  # both checkpointed on scancel's SIGTERM and exited 75
        j.state, j.exit = "CANCELLED", "75:0"
    service.tick()
    doc = service.get(plain)
    assert (doc["state"], doc["reason"]) == ("cancelled", "cancelled in Slurm (exit code 75)")
    doc = service.get(again)
    assert doc["state"] in ("queued", "running") and doc["preemptions"] == 0
    assert any(
        e["reason"] == "ended (cancelled in Slurm (exit code 75)); restart 1 of 1"
        for e in service.events(again)
    )


def test_node_states_stay_as_they_are_while_slurm_does_not_answer(service: Any, fake: FakeSlurm) -> None:
    from gpuyard.scheduler.executors.slurm_monitor import SlurmNodeMonitor

    monitor = SlurmNodeMonitor(service, service.executor)
    fake.node_states["n2"] = "DOWN+NOT_RESPONDING"
    assert monitor.check_once()["n2"]["state"] == "drained"
    fake.down = "refused"
    fake.node_states["n2"] = "IDLE"
    assert monitor.check_once()["n2"]["state"] == "drained"  # unknown: not taken for "back"
    fake.down = ""
    assert monitor.check_once()["n2"]["state"] == "healthy"
