"""gpuyard's Slurm jobs while Slurm's own parts fail, on a real cluster of this module's own (munged,
slurmctld, three slurmd with one GPU each): the controller stopped for 30 s, the controller frozen
(its tools time out), a controller restarted without its state (Slurm then reuses job ids), an
outside ``scancel``, and a slurmd killed under a two-node gang.

The service's loop runs in a thread as in ``gpuyard server``; the test calls the service as the API
does. Every job appends one line per run to its own marker file, so "ran once" is counted, not
assumed. Each test asserts, for every acknowledged job: it ended once, with the right state and
reason, and no job ran twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.waiting import free_port, wait_for

from gpuyard.scheduler.executors import slurm_tools
from gpuyard.scheduler.executors.slurm_local import LocalSlurm
from gpuyard.scheduler.spec import parse_spec

from .conftest import FAST_BACKFILL, _why_not

pytestmark = pytest.mark.integration

# Slurm's clients give up on an absent controller after about MessageTimeout (10 s by default, 3 here:
# the tests wait for fewer unanswered calls; nothing in gpuyard depends on it).
FAULT_CONF = [FAST_BACKFILL, "MessageTimeout=3", "SlurmdTimeout=10"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalSlurm]:
    why = _why_not()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    folder = Path(tempfile.mkdtemp(prefix="gpuyard-slurm-faults-"))
    os.chmod(folder, 0o755)
    local = LocalSlurm(folder, nodes={"n1": 1, "n2": 1, "n3": 1}, extra_conf=FAULT_CONF)
    local.start()
    yield local
    local.stop()


class Server:
    """A JobService on the cluster with its scheduling loop in a thread (as ``gpuyard server``)."""

    def __init__(self, cluster: LocalSlurm, home: Path, grace_s: float = 5.0) -> None:
        from gpuyard.scheduler.executors.slurm import SlurmConfig, SlurmExecutor
        from gpuyard.scheduler.service import JobService, ServiceConfig
        from gpuyard.store import get_store

        home.mkdir(parents=True, exist_ok=True)
        self.store = get_store(url=f"sqlite:///{home / 'state.db'}")
        self.executor = SlurmExecutor(home / "jobs", SlurmConfig(env=cluster.env), instance=self.store.url)
        nodes = self.executor.nodes()
        self.service = JobService(
            self.store, nodes, self.executor, ServiceConfig(tick_s=0.2, grace_s=grace_s)
        )
        self.markers = home / "markers"
        self.markers.mkdir()
        os.chmod(self.markers, 0o777)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Server:
        self._stop.clear()
        self._thread = threading.Thread(target=self.service.run, args=(self._stop,), daemon=True)
        self._thread.start()
        return self

    def pause(self) -> None:
        """End the loop (its lease given up), as a server going away; start() resumes it."""
        self._stop.set()
        self.service.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
            assert not self._thread.is_alive(), "the scheduling loop did not end"

    def submit(self, name: str, body: str, **spec: Any) -> int:
        """A job running ``body`` (bash) after appending "ATTEMPT NODE PID" to its marker file."""
        marker = self.markers / name
        cmd = f'echo "$GPUYARD_ATTEMPT $SLURMD_NODENAME $$" >> {marker}; {body}'
        doc = {"name": name, "command": ["bash", "-c", cmd], "resources": {"gpus": 1}, **spec}
        return int(self.service.submit(parse_spec(doc))["id"])

    def runs(self, name: str) -> list[str]:
        path = self.markers / name
        return path.read_text().splitlines() if path.exists() else []

    def wait(self, job: int, states: set[str], timeout: float = 90.0) -> dict[str, Any]:
        return wait_for(  # type: ignore[no-any-return]
            lambda: (d := self.service.get(job))["state"] in states and d, timeout=timeout, every=0.2
        )

    def reasons(self, job: int) -> list[str]:
        return [e["reason"] or "" for e in self.service.events(job)]


@pytest.fixture
def server(cluster: LocalSlurm, tmp_path: Path) -> Iterator[Server]:
    srv = Server(cluster, tmp_path / "home").start()
    yield srv
    srv.pause()
    ids = cluster.run("squeue", "-h", "-o", "%i", check=False).split()
    if ids:
        cluster.run("scancel", *{i.partition("+")[0] for i in ids}, check=False)
        wait_for(lambda: not cluster.run("squeue", "-h", "-o", "%i", check=False).strip(), timeout=60)


def _no_job_ran_twice(srv: Server, names: list[str]) -> None:
    for name in names:
        attempts = [line.split()[0] for line in srv.runs(name)]
        assert len(attempts) == len(set(attempts)), f"{name} ran an attempt twice: {srv.runs(name)}"


# How long the controller stays away (CI: 30 s; GPUYARD_TEST_SLURM_OUTAGE_S=150 runs the long outage).
OUTAGE_S = float(os.environ.get("GPUYARD_TEST_SLURM_OUTAGE_S", "30"))


def test_a_controller_away_for_30_s_loses_nothing_and_runs_nothing_twice(
    cluster: LocalSlurm, server: Server, tmp_path: Path
) -> None:
    """slurmctld stopped for 30 s (OUTAGE_S) with jobs running, one finishing and one failing meanwhile,
    one queued in gpuyard and one submitted during the outage: each ends once, as Slurm saw it."""
    release = tmp_path / "release"
    long = server.submit("long", f"while [ ! -e {release} ]; do sleep 0.1; done")
    short = server.submit("short", "sleep 6")
    flaky = server.submit("flaky", '[ "$GPUYARD_ATTEMPT" = 2 ] || { sleep 6; exit 3; }', max_restarts=1)
    queued = server.submit("queued", "true")
    for job in (long, short, flaky):
        server.wait(job, {"running"})
    wait_for(lambda: all(server.runs(n) for n in ("long", "short", "flaky")), timeout=60)
    assert server.service.get(queued)["state"] == "queued"  # three GPUs, three jobs running

    cluster.stop_controller()
    began = time.monotonic()
    # The API meanwhile: the store is not held by the loop's Slurm calls (each ~3 s unanswered here).
    t0 = time.monotonic()
    during = server.submit("during", "true")
    submit_s = time.monotonic() - t0
    t0 = time.monotonic()
    assert server.service.get(long)["state"] == "running"
    read_s = time.monotonic() - t0
    wait_for(lambda: time.monotonic() - began >= OUTAGE_S, timeout=OUTAGE_S + 60, every=0.5)  # the outage
    # Unknown is not gone: nothing ended, nothing was requeued, the GPUs stayed with their jobs.
    for job in (long, short, flaky):
        assert server.service.get(job)["state"] == "running"
    assert {server.service.get(j)["state"] for j in (queued, during)} == {"queued"}
    cluster.start_controller()
    outage_s = time.monotonic() - began
    release.touch()

    assert server.wait(long, {"succeeded", "failed"})["reason"] == "exit code 0"
    assert server.wait(short, {"succeeded", "failed"})["reason"] == "exit code 0"
    doc = server.wait(flaky, {"succeeded", "failed"}, timeout=120)
    assert doc["state"] == "succeeded" and doc["attempts"] == 2
    assert "failed (exit code 3); restart 1 of 1" in server.reasons(flaky)
    assert server.wait(queued, {"succeeded", "failed"}, timeout=120)["state"] == "succeeded"
    assert server.wait(during, {"succeeded", "failed"}, timeout=120)["state"] == "succeeded"
    assert [len(server.runs(n)) for n in ("long", "short", "flaky", "queued", "during")] == [1, 1, 2, 1, 1]
    _no_job_ran_twice(server, ["long", "short", "flaky", "queued", "during"])
    print(f"\noutage {outage_s:.1f} s; during it a submission took {submit_s:.3f} s, a read {read_s:.3f} s")
    assert submit_s < outage_s and read_s < outage_s  # answered while the controller was away


def test_a_frozen_controller_whose_tools_time_out_is_unknown_not_gone(
    cluster: LocalSlurm, server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmctld frozen (SIGSTOP): its port accepts and nothing answers, so every tool runs into
    gpuyard's own timeout (2 s here, CALL_TIMEOUT_S); a job finishing meanwhile is seen to have
    finished once it answers."""
    monkeypatch.setattr(slurm_tools, "CALL_TIMEOUT_S", 2.0)
    release = tmp_path / "release"
    long = server.submit("long", f"while [ ! -e {release} ]; do sleep 0.1; done")
    short = server.submit("short", "sleep 4")
    for job in (long, short):
        server.wait(job, {"running"})
    wait_for(lambda: server.runs("long") and server.runs("short"), timeout=60)
    cluster.stop_controller(signal.SIGSTOP)
    try:
        wait_for(lambda: server.executor.unavailable() is not None, timeout=60, every=0.5)
        frozen_at = time.monotonic()
        during = server.submit("during", "true")
        wait_for(lambda: time.monotonic() - frozen_at >= 15, timeout=60, every=0.5)
        assert [server.service.get(j)["state"] for j in (long, short, during)] == [
            "running",
            "running",
            "queued",
        ]
    finally:
        cluster.start_controller()
    release.touch()
    for job in (long, short, during):
        doc = server.wait(job, {"succeeded", "failed", "cancelled"}, timeout=120)
        assert (doc["state"], doc["reason"], doc["attempts"]) == ("succeeded", "exit code 0", 1)
    assert [len(server.runs(n)) for n in ("long", "short", "during")] == [1, 1, 1]


def test_a_controller_restarted_without_its_state_reuses_ids_and_no_job_is_taken_for_another(
    cluster: LocalSlurm, server: Server, tmp_path: Path
) -> None:
    """After a restart that lost Slurm's state, new jobs get the old ids. gpuyard's attempts Slurm has
    no trace of end "lost: ..." and are not run again (one had finished, one was killed by the
    restart); jobs of others under the reused ids are neither adopted, cancelled nor ended."""
    server.pause()
    cluster.stop_controller()
    cluster.start_controller(lose_state=True)  # numbering from 1 again, so the ids below are known
    server.start()
    long = server.submit("long", "sleep 600")
    short = server.submit("short", "sleep 4")
    for job in (long, short):
        server.wait(job, {"running"})
    wait_for(lambda: server.runs("long") and server.runs("short"), timeout=60)
    server.pause()  # held here, so that the others' jobs below take the ids before gpuyard looks
    cluster.stop_controller()
    wait_for(lambda: len(server.runs("short")) == 1 and _ended(server, "short"), timeout=30)
    cluster.start_controller(lose_state=True)
    others = [
        cluster.run("sbatch", "--parsable", "-J", "else", "-o", "/dev/null", "--wrap", "sleep 600").strip()
        for _ in range(2)
    ]
    assert sorted(others) == ["1", "2"]  # the ids gpuyard's two attempts had
    server.start()
    for job in (long, short):
        doc = server.wait(job, {"succeeded", "failed", "cancelled", "queued"})
        assert doc["state"] == "failed", doc
        assert doc["reason"].startswith("lost: Slurm has no trace of the attempt"), doc["reason"]
        assert "not run again" in doc["reason"] and doc["attempts"] == 1
    states = dict(
        line.split("|") for line in cluster.run("squeue", "-h", "-o", "%i|%T").split() if "|" in line
    )
    assert [states.get(i) in ("RUNNING", "PENDING") for i in others] == [True, True]  # untouched
    assert [len(server.runs(n)) for n in ("long", "short")] == [1, 1]
    # The restarted controller has its slurmd end the job it no longer knows (when the node registers).
    wait_for(lambda: _ended(server, "long"), timeout=90, every=0.2)


def _ended(server: Server, name: str) -> bool:
    """Whether the job's process has ended (its marker's PID is gone)."""
    pid = int(server.runs(name)[0].split()[2])
    return not Path(f"/proc/{pid}").exists()


def test_an_outside_scancel_is_a_cancel_not_a_preemption(cluster: LocalSlurm, server: Server) -> None:
    """An admin's scancel: the job ends cancelled in Slurm; one whose spec allows a restart runs once
    more (a job that checkpoints and exits 75 on SIGTERM is not taken for preempted)."""
    trap = "trap 'exit 75' TERM; while true; do sleep 0.1; done"
    plain = server.submit("plain", "sleep 600")
    again = server.submit("again", trap, max_restarts=1)
    for job in (plain, again):
        server.wait(job, {"running"})
    wait_for(lambda: server.runs("plain") and server.runs("again"), timeout=60)
    cluster.run("scancel", "-n", f"{server.executor.prefix}{plain}-1")
    cluster.run("scancel", "-n", f"{server.executor.prefix}{again}-1")
    doc = server.wait(plain, {"cancelled", "failed", "succeeded", "queued"})
    assert doc["state"] == "cancelled" and doc["reason"].startswith("cancelled in Slurm"), doc
    wait_for(lambda: server.service.get(again)["attempts"] == 2, timeout=60)
    restart = next(r for r in server.reasons(again) if "restart 1 of 1" in r)
    assert restart.startswith("ended (cancelled in Slurm") and "exit code 75" in restart, restart
    server.wait(again, {"running"})
    wait_for(lambda: len(server.runs("again")) == 2, timeout=60)
    cluster.run("scancel", "-n", f"{server.executor.prefix}{again}-2")
    doc = server.wait(again, {"cancelled", "failed", "succeeded", "queued"})
    assert doc["state"] == "cancelled" and doc["preemptions"] == 0
    assert not any("preempt" in r for j in (plain, again) for r in server.reasons(j))
    assert [len(server.runs(n)) for n in ("plain", "again")] == [1, 2]


def test_a_slurmd_killed_under_a_gang_ends_the_attempt_everywhere_before_its_retry(
    cluster: LocalSlurm, server: Server
) -> None:
    """A two-node job loses one node's slurmd: Slurm ends it NODE_FAIL and ends its task on the other
    node, but cannot reach the silent one, whose task runs on. gpuyard holds the attempt's end (and
    its GPUs) until that slurmd answers again and has ended it, then runs the job once more
    (max_restarts 1). The retry's tasks look for the first attempt's: none may still run."""
    from gpuyard.scheduler.executors.slurm_monitor import SlurmNodeMonitor

    marker = server.markers / "gang"
    overlap = server.markers / "overlap"
    body = (
        '[ "$GPUYARD_ATTEMPT" = 1 ] && exec bash -c "while true; do sleep 0.2; done"; '
        f"for p in $(awk '$1 == 1 {{print $3}}' {marker}); do "
        f'kill -0 "$p" 2>/dev/null && echo "$SLURMD_NODENAME sees $p" >> {overlap}; done; true'
    )
    job = server.submit("gang", body, max_restarts=1, resources={"gpus": 2})
    server.wait(job, {"running"})
    first = wait_for(lambda: len(server.runs("gang")) == 2 and server.runs("gang"), timeout=60)
    victim = sorted(line.split()[1] for line in first)[-1]  # not the batch host (the first node)
    orphan = next(int(line.split()[2]) for line in first if line.split()[1] == victim)
    name = f"{server.executor.prefix}{job}-1"
    slurm_id = cluster.run("squeue", "-h", "-n", name, "-o", "%i").strip()
    monitor = SlurmNodeMonitor(server.service, server.executor)
    began = time.monotonic()
    cluster.kill_slurmd(victim)
    restarted = False
    try:
        # Slurm finds the node silent after SlurmdTimeout (10 s here) and ends the job NODE_FAIL; the
        # server's node monitor (called here) drains the node in gpuyard.
        wait_for(lambda: monitor.check_once()[victim]["state"] == "drained", timeout=120, every=1)
        wait_for(lambda: slurm_id in server.executor._held, timeout=60)  # gpuyard saw the end
        ended_s = time.monotonic() - began
        assert Path(f"/proc/{orphan}").exists()  # what Slurm could not end: the silent node's task
        doc = server.service.get(job)
        assert (doc["state"], doc["attempts"]) == ("running", 1)  # held: no retry beside it
        cluster.start_slurmd(victim)  # back (as systemd restarts it): it ends the orphaned task
        restarted = True
        doc = server.wait(job, {"succeeded", "failed"}, timeout=180)
        retried_s = time.monotonic() - began
        reasons = server.reasons(job)
        assert doc["state"] == "succeeded" and doc["attempts"] == 2, reasons
        restart = "failed (a node of the job failed (Slurm NODE_FAIL)); restart 1 of 1"
        assert restart in reasons, reasons
        assert len([line for line in server.runs("gang") if line.startswith("2 ")]) == 2
        seen = overlap.read_text() if overlap.exists() else ""
        print(f"\nslurmd of {victim} killed: end seen {ended_s:.1f} s, retry done {retried_s:.1f} s later")
        assert seen == "", f"the first attempt still ran when its retry started: {seen}"
    finally:
        if not restarted:
            cluster.start_slurmd(victim)
        for line in server.runs("gang"):
            if line.startswith("1 "):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[2]), signal.SIGKILL)
        cluster.run("scontrol", "update", f"NodeName={victim}", "State=RESUME", check=False)


def test_the_api_of_gpuyard_server_answers_while_the_controller_is_away(
    cluster: LocalSlurm, gpuyard_home: Path, tmp_path: Path
) -> None:
    """`gpuyard server --slurm` as a command, its controller stopped while a job runs: once the server
    has found the controller silent (its log says so), a read and a submission over HTTP answer (the
    store is not held by the loop's unanswered Slurm calls); both jobs then end once."""
    import subprocess
    import sys

    import httpx

    from gpuyard.scheduler.client import JobClient

    log = tmp_path / "server.log"
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {
        **os.environ,
        **cluster.env,
        "GPUYARD_HOME": str(gpuyard_home),
        "GPUYARD_TOKEN": "t0ken-for-slurm-faults",
    }

    def serve() -> tuple[subprocess.Popen[bytes], str]:
        """The server on a free port; again on another if something took that one meanwhile (this
        machine's other tests pick free ports too)."""
        for _ in range(3):
            port = free_port()  # below the ephemeral range (tests.waiting)
            argv = [sys.executable, "-m", "gpuyard.cli.main", "server", "--slurm", "--port", str(port)]
            argv += ["--job-user", "root", "--job-dir", str(tmp_path / "jobs")]
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
            url = f"http://127.0.0.1:{port}"

            def up(proc: subprocess.Popen[bytes] = proc, url: str = url) -> bool:
                if proc.poll() is not None:
                    return True
                try:
                    return httpx.get(f"{url}/health", timeout=1).status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(up, timeout=60, every=0.1)
            if proc.poll() is None:
                return proc, url
            assert "address already in use" in log.read_text(), log.read_text()
        raise AssertionError(f"no free port for the server: {log.read_text()}")

    proc, url = serve()
    release = tmp_path / "release"
    stopped = False

    def job(name: str, body: str) -> dict[str, Any]:
        cmd = f"echo run >> {markers / name}; {body}"
        return {"name": name, "command": ["bash", "-c", cmd], "resources": {"gpus": 1}}

    try:
        client = JobClient(url)
        long = client.submit(parse_spec(job("long", f"while [ ! -e {release} ]; do sleep 0.1; done")))
        wait_for(lambda: (markers / "long").exists(), timeout=60)
        cluster.stop_controller()
        stopped = True
        wait_for(lambda: "unknown until it answers" in log.read_text(), timeout=60, every=0.2)
        t0 = time.monotonic()
        assert client.get(long["id"])["state"] == "running"
        read_s = time.monotonic() - t0
        t0 = time.monotonic()
        during = client.submit(parse_spec(job("during", "true")))
        submit_s = time.monotonic() - t0
        assert client.get(during["id"])["state"] == "queued"
        cluster.start_controller()
        stopped = False
        release.touch()
        for j in (long, during):
            doc = wait_for(
                lambda j=j: (d := client.get(j["id"]))["state"] in ("succeeded", "failed") and d, 120
            )
            assert (doc["state"], doc["attempts"]) == ("succeeded", 1), log.read_text()
        assert [(markers / n).read_text().count("run") for n in ("long", "during")] == [1, 1]
        print(f"\nHTTP during the outage: a read {read_s:.3f} s, a submission {submit_s:.3f} s")
        client.close()
    finally:
        if stopped:
            cluster.start_controller()
        proc.terminate()
        proc.wait(timeout=30)
