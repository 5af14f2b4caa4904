"""gpuyard's jobs as Slurm jobs on a real slurmctld with four slurmd (conftest.py): placement, gang
(equal, and unequal as a heterogeneous job), cancel with grace, preemption and requeue, a Slurm-side
time limit, adoption after a restart, drain."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.waiting import ensure_user, free_port, wait_for

from gpuyard.scheduler.executors.slurm_local import LocalSlurm
from gpuyard.scheduler.spec import parse_spec

from .conftest import make_slurm_service, slurm_components, slurm_job

pytestmark = pytest.mark.integration

# Counts, checkpoints its counter on SIGTERM and exits 75 (PREEMPTED); started again it resumes.
CHECKPOINTING = r"""
import os, signal, sys, time
ckpt, steps = sys.argv[1], int(sys.argv[2])
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
print(f"start at {start} on {os.environ.get('GPUYARD_NODE')}", flush=True)
state = {"i": start}
def on_term(*_):
    open(ckpt, "w").write(str(state["i"]))
    print(f"checkpointed at {state['i']}", flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
while state["i"] < steps:
    time.sleep(0.05)
    state["i"] += 1
    if state["i"] == start + 10:
        print(f"step {state['i']}", flush=True)
print("finished", flush=True)
"""


def _until(service: Any, job_id: int, states: set[str], timeout: float = 60.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        service.tick()
        doc = service.get(job_id)
        return doc if doc["state"] in states else None

    return wait_for(check, timeout=timeout, every=0.1)  # type: ignore[return-value]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.py"
    path.write_text(CHECKPOINTING)
    return path


@pytest.fixture(scope="module")
def time_limited(slurm_cluster: LocalSlurm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A job with a 1-minute limit, started when the module starts: Slurm's limit (minutes, checked
    every 30 s) ends it while the other tests run; the last test reads how it ended."""
    home = tmp_path_factory.mktemp("time-limit-home")
    service = make_slurm_service(home, nodes=["n4"], own_store=True)
    spec = parse_spec(
        {"name": "slow", "command": ["sleep", "600"], "time_limit_min": 1, "resources": {"cpus": 1}}
    )
    job = service.submit(spec)
    _until(service, job["id"], {"running"})
    return {"service": service, "job": job["id"]}


def test_nodes_gpus_and_switches_come_from_slurm(slurm_cluster: LocalSlurm, gpuyard_home: Path) -> None:
    service = make_slurm_service(gpuyard_home)
    nodes = {n.name: n for n in service.nodes}
    assert {k: v.gpus for k, v in nodes.items()} == {"n1": 1, "n2": 1, "n3": 2, "n4": 0}
    assert nodes["n1"].leaf == nodes["n2"].leaf == "s1" and nodes["n3"].leaf == "s2"
    assert nodes["n4"].cpus == 2


def test_a_job_runs_as_a_slurm_job_on_the_placed_node(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path
) -> None:
    service = make_slurm_service(gpuyard_home, nodes=["n1", "n2", "n3"])
    cmd = ["bash", "-c", "echo on $GPUYARD_NODE gpus=$SLURM_GPUS_ON_NODE; exit 3"]
    job = service.submit(parse_spec({"name": "two", "command": cmd, "resources": {"gpus": 2}}))
    doc = _until(service, job["id"], {"succeeded", "failed"})
    # Two GPUs on one node: topology placement keeps it on n3, and Slurm ran it there.
    assert [p["node"] for p in doc["placement"]["nodes"]] == ["n3"]
    slurm = slurm_job(slurm_cluster, service.executor.prefix, job["id"])
    assert slurm["NodeList"] == "n3" and slurm["UserId"].startswith("root")
    assert doc["state"] == "failed" and doc["exit_code"] == 3
    assert "on n3 gpus=2" in service.read_log(job["id"])["text"]


def test_a_gang_job_is_one_allocation_over_the_nodes_gpuyard_chose(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path
) -> None:
    # Only n1 and n2 (one GPU each, one switch) are this service's: a 2-GPU job must span both.
    service = make_slurm_service(gpuyard_home, nodes=["n1", "n2"])
    cmd = ["bash", "-c", "echo rank=$SLURM_NODEID node=$GPUYARD_NODE master=$MASTER_ADDR:$MASTER_PORT"]
    job = service.submit(parse_spec({"name": "gang", "command": cmd, "resources": {"gpus": 2}}))
    doc = _until(service, job["id"], {"succeeded", "failed"})
    assert doc["state"] == "succeeded", service.read_log(job["id"])["text"]
    slurm = slurm_job(slurm_cluster, service.executor.prefix, job["id"])
    assert slurm["NumNodes"] == "2" and slurm_cluster.run(
        "scontrol", "show", "hostnames", slurm["NodeList"]
    ).split() == [
        "n1",
        "n2",
    ]
    lines = sorted(x for x in service.read_log(job["id"])["text"].splitlines() if x.startswith("rank="))
    assert [x.split()[:2] for x in lines] == [["rank=0", "node=n1"], ["rank=1", "node=n2"]]
    assert len({x.split()[2] for x in lines}) == 1  # one rendezvous address for both


def test_an_unequal_gang_is_one_heterogeneous_slurm_job_with_each_nodes_gpus(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path
) -> None:
    """4 GPUs over n3 (2) and n1, n2 (1 each): one component per GPU count, one srun over both; the
    job runs (polled by its first component's id) until a cancel's SIGTERM reaches every node."""
    service = make_slurm_service(gpuyard_home, nodes=["n1", "n2", "n3"])
    body = (
        'trap "echo term on $GPUYARD_NODE; exit 75" TERM; '
        'echo "up node=$GPUYARD_NODE id=$SLURM_NODEID of=$SLURM_NNODES gpus=$SLURM_GPUS_ON_NODE"; '
        "while true; do sleep 0.05; done"
    )
    job = service.submit(
        parse_spec({"name": "het", "command": ["bash", "-c", body], "resources": {"gpus": 4}})
    )
    _until(service, job["id"], {"running"})
    ups = wait_for(
        lambda: (
            len(x := [y for y in service.read_log(job["id"])["text"].splitlines() if y.startswith("up ")])
            == 3
            and x
        ),
        timeout=30,
    )
    placed = {p["node"]: len(p["gpus"]) for p in service.get(job["id"])["placement"]["nodes"]}
    assert placed == {"n3": 2, "n1": 1, "n2": 1}
    # Each node's task sees its own GPUs; Slurm numbers the nodes 0-2 across the components.
    assert sorted(x.split()[1:] for x in ups) == [
        ["node=n1", "id=1", "of=3", "gpus=1"],
        ["node=n2", "id=2", "of=3", "gpus=1"],
        ["node=n3", "id=0", "of=3", "gpus=2"],
    ]
    comps = slurm_components(slurm_cluster, service.executor.prefix, job["id"])
    asked = [(c["NodeList"], c["TresPerNode"]) for c in comps]
    assert asked == [("n3", "gres:gpu:2"), ("n[1-2]", "gres:gpu:1")]
    assert service.get(job["id"])["state"] == "running"
    service.cancel(job["id"])
    doc = _until(service, job["id"], {"cancelled", "failed", "succeeded"})
    log = service.read_log(job["id"])["text"]
    assert doc["state"] == "cancelled", log
    assert sorted(x for x in log.splitlines() if x.startswith("term on")) == [
        f"term on n{i}" for i in (1, 2, 3)
    ]


def test_cancel_gives_the_grace_period_to_checkpoint(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path, script: Path, tmp_path: Path
) -> None:
    service = make_slurm_service(gpuyard_home, nodes=["n1", "n2", "n3"])
    ckpt = tmp_path / "ckpt"
    spec = {
        "name": "c",
        "command": [sys.executable, str(script), str(ckpt), "100000"],
        "resources": {"gpus": 1},
    }
    job = service.submit(parse_spec(spec))
    _until(service, job["id"], {"running"})
    wait_for(lambda: "step 10" in service.read_log(job["id"])["text"], timeout=30)
    service.cancel(job["id"])
    _until(service, job["id"], {"cancelled"})
    assert ckpt.exists() and int(ckpt.read_text()) >= 10  # SIGTERM reached the task: it checkpointed
    assert "checkpointed at" in service.read_log(job["id"])["text"]


def test_preemption_requeues_as_a_new_slurm_job_that_resumes(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path, script: Path, tmp_path: Path
) -> None:
    service = make_slurm_service(
        gpuyard_home, nodes=["n1", "n2"], policy="fair", teams={"a": 1.0, "b": 1.0}, min_run_s=0.0
    )
    a_jobs = []
    for i in range(2):
        argv = [sys.executable, str(script), str(tmp_path / f"a{i}"), "1200"]
        spec = {
            "name": f"a{i}",
            "team": "a",
            "command": argv,
            "resources": {"gpus": 1},
            "checkpoint_dir": "x",
        }
        a_jobs.append(service.submit(parse_spec(spec))["id"])
    for j in a_jobs:
        _until(service, j, {"running"})
    for j in a_jobs:
        wait_for(lambda j=j: "step 10" in service.read_log(j)["text"], timeout=30)
    b = service.submit(parse_spec({"name": "b", "team": "b", "resources": {"gpus": 1}, "command": ["true"]}))
    _until(service, b["id"], {"succeeded"}, timeout=60)
    victim = next(j for j in a_jobs if service.get(j)["preemptions"] == 1)
    doc = _until(service, victim, {"running", "succeeded"}, timeout=60)
    assert doc["attempts"] == 2
    log = wait_for(lambda: (t := service.read_log(victim)["text"]).count("start at") == 2 and t, timeout=30)
    saved = int(log.split("checkpointed at ")[1].split()[0])
    assert saved > 0 and f"start at {saved}" in log  # the second Slurm job resumed from the checkpoint
    names = slurm_cluster.run("squeue", "-h", "-o", "%j").split()
    assert f"{service.executor.prefix}{victim}-2" in names or service.get(victim)["state"] == "succeeded"
    for j in a_jobs:
        service.cancel(j)
    for j in a_jobs:
        _until(service, j, {"cancelled", "succeeded"})


def test_a_restarted_server_adopts_running_slurm_jobs(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    cmd = ["bash", "-c", f"while [ ! -e {release} ]; do sleep 0.05; done; echo released"]
    first = make_slurm_service(gpuyard_home, nodes=["n1", "n2", "n3"])
    job = first.submit(parse_spec({"name": "long", "command": cmd, "resources": {"gpus": 1}}))
    _until(first, job["id"], {"running"})
    first.lease.release()  # the server goes away (as its run() ends); Slurm keeps the job
    second = make_slurm_service(gpuyard_home, nodes=["n1", "n2", "n3"])
    counts = second.recover()
    assert counts["adopted"] >= 1
    assert second.get(job["id"])["state"] == "running"
    release.touch()
    doc = _until(second, job["id"], {"succeeded", "failed"})
    assert doc["state"] == "succeeded"
    assert "released" in second.read_log(job["id"])["text"]
    assert slurm_job(slurm_cluster, second.executor.prefix, job["id"])["JobState"] == "COMPLETED"
    assert second.get(job["id"])["attempts"] == 1  # adopted, not run again


def test_a_job_runs_as_its_unix_user_with_the_allow_listed_environment(
    slurm_cluster: LocalSlurm,
    time_limited: dict[str, Any],
    gpuyard_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under an isolating server, sbatch --uid runs the job as the job user, in its own 0700 folder,
    with none of the server's variables."""
    import pwd
    import shutil

    from gpuyard.scheduler.executors.isolation import DEFAULT_JOB_USER, JobIsolation

    entry = pwd.getpwnam(ensure_user(DEFAULT_JOB_USER))
    root = Path(tempfile.mkdtemp(prefix="gpuyard-slurm-iso-"))
    os.chmod(root, 0o711)
    monkeypatch.setenv("SERVER_SECRET", "must-not-reach-jobs")
    try:
        service = make_slurm_service(gpuyard_home, nodes=["n1", "n2", "n3"])
        service.executor.isolation = JobIsolation(
            user=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, switch=True, work_root=root
        )
        cmd = ["bash", "-c", 'echo "user=$(id -un) pwd=$PWD secret=${SERVER_SECRET:-none}"']
        job = service.submit(parse_spec({"name": "iso", "command": cmd, "resources": {"gpus": 1}}))
        doc = _until(service, job["id"], {"succeeded", "failed"})
        log = service.read_log(job["id"])["text"]
        assert doc["state"] == "succeeded", log
        folder = root / f"job-{job['id']}"
        assert f"user={DEFAULT_JOB_USER} pwd={folder} secret=none" in log
        st = folder.stat()
        assert st.st_uid == entry.pw_uid and st.st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_drains_go_both_ways(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path
) -> None:
    from gpuyard.scheduler.executors.slurm_monitor import SlurmNodeMonitor

    service = make_slurm_service(gpuyard_home, nodes=["n1", "n2", "n3"])
    monitor = SlurmNodeMonitor(service, service.executor)
    try:
        service.node_states.drain("n1", "xid 79 on GPU 0", by="admin")
        monitor.check_once()
        info = slurm_cluster.run("sinfo", "-h", "-n", "n1", "-o", "%T|%E").strip()
        assert info.startswith("drain") and "gpuyard: xid 79 on GPU 0" in info
        # Drained in Slurm by its admin: gpuyard stops placing there too, and takes it back after.
        slurm_cluster.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=bad fan")
        docs = monitor.check_once()
        assert docs["n2"]["state"] == "drained" and "bad fan" in docs["n2"]["reason"]
        job = service.submit(parse_spec({"name": "x", "command": ["true"], "resources": {"gpus": 1}}))
        doc = _until(service, job["id"], {"succeeded", "failed"})
        assert [p["node"] for p in doc["placement"]["nodes"]] == ["n3"]
        slurm_cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME")
        service.node_states.undrain("n1", by="admin")
        # Slurm pings a resumed node before it counts it responding again: until then it stays out.
        wait_for(lambda: monitor.check_once()["n2"]["state"] == "healthy", timeout=30, every=0.2)
        # Resumed in Slurm too; a slurmd that answers Slurm's ping late shows "idle*" meanwhile.
        in_service = ("idle", "mixed", "allocated")
        wait_for(
            lambda: slurm_cluster.run("sinfo", "-h", "-n", "n1", "-o", "%T").strip() in in_service,
            timeout=60,
            every=0.2,
        )
    finally:
        slurm_cluster.run("scontrol", "update", "NodeName=n1,n2", "State=RESUME", check=False)


def test_gpuyard_server_slurm_runs_a_job_through_the_api(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path, tmp_path: Path
) -> None:
    """`gpuyard server --slurm` as a command: the API's job becomes a Slurm job; a bad option is one line."""

    port = free_port()  # below the ephemeral range (tests.waiting)
    bad = subprocess.run(
        [sys.executable, "-m", "gpuyard.cli.main", "server", "--slurm", "--ray", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        env={**os.environ, "GPUYARD_HOME": str(gpuyard_home)},
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "choose one" in bad.stderr
    me = "root"
    log = tmp_path / "server.log"
    env = {**os.environ, "GPUYARD_HOME": str(gpuyard_home), "GPUYARD_TOKEN": "t0ken-for-slurm-test"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuyard.cli.main",
                "server",
                "--slurm",
                "--port",
                str(port),
                "--job-user",
                me,
                "--job-dir",
                str(tmp_path / "jobs"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=60, every=0.1)
        from gpuyard.scheduler.client import JobClient
        from gpuyard.scheduler.executors.slurm_config import instance_tag
        from gpuyard.store import get_store

        prefix = f"gpuyard-{instance_tag(get_store().url)}-"

        client = JobClient(url)
        spec = {"name": "api", "command": ["bash", "-c", "echo via $GPUYARD_NODE"], "resources": {"gpus": 1}}
        job = client.submit(parse_spec(spec))
        doc = wait_for(
            lambda: (d := client.get(job["id"]))["state"] in ("succeeded", "failed") and d, timeout=60
        )
        assert doc["state"] == "succeeded", log.read_text()
        assert slurm_job(slurm_cluster, prefix, job["id"])["JobState"] == "COMPLETED"
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# The model of the training test: each rank notes where it runs and the world it is in, then trains
# the example MLP.
PROBE = """
import os
from pathlib import Path
from gpuyard.train.examples import mlp as _mlp

def mlp(**kwargs):
    out = Path(__file__).with_name("ranks")
    out.mkdir(exist_ok=True)
    keys = ("GPUYARD_NODE", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
    (out / os.environ["RANK"]).write_text(" ".join(os.environ[k] for k in keys))
    return _mlp(**kwargs)
"""


def test_gpuyard_train_spans_unequal_slurm_nodes_with_one_rendezvous(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any], gpuyard_home: Path, tmp_path: Path
) -> None:
    """A 3-GPU training job over n3 (2 GPUs) and n1 (1): srun starts `gpuyard train --nproc 2 --nnodes
    2` on n3 and `--nproc 1` on n1 (a heterogeneous job), torchrun's c10d rendezvous meets on the first
    node, and the three ranks train as one world of 3 (the 8 + 4 GPU case, scaled to this cluster)."""
    import yaml

    (tmp_path / "probe.py").write_text(PROBE)
    spec_path = tmp_path / "train.yaml"
    doc = {
        "name": "slurm-ddp",
        "run_dir": str(tmp_path / "run"),
        "seed": 3,
        "model": {"entrypoint": "probe:mlp"},
        "data": {
            "train": {"entrypoint": "gpuyard.train.examples:classification_data", "kwargs": {"n": 72}},
            "batch_size": 8,
        },
        "optimizer": {"name": "adamw", "lr": 0.01},
        "epochs": 1,
    }
    spec_path.write_text(yaml.safe_dump(doc))
    service = make_slurm_service(gpuyard_home, nodes=["n1", "n3"])
    env = {"OMP_NUM_THREADS": "1", "GPUYARD_HOME": str(gpuyard_home)}
    job = service.submit(
        parse_spec({"name": "ddp", "train": str(spec_path), "resources": {"gpus": 3}, "env": env})
    )
    done = _until(service, job["id"], {"succeeded", "failed"}, timeout=180)
    log = service.read_log(job["id"])["text"]
    assert done["state"] == "succeeded", log[-3000:]
    assert {p["node"]: len(p["gpus"]) for p in done["placement"]["nodes"]} == {"n3": 2, "n1": 1}
    # Ranks 0-2 of one world of 3: two on n3, one on n1.
    ranks = {int(p.name): p.read_text().split() for p in (tmp_path / "ranks").iterdir()}
    assert sorted(ranks) == [0, 1, 2]
    assert sorted(ranks.values()) == [["n1", "1", "3"], ["n3", "2", "3"], ["n3", "2", "3"]]
    # 72 samples, 8 per rank and step: one epoch is 3 steps in a world of 3 (4 with 2, 2 with 4).
    assert "completed at step 3 " in log and "step 4" not in log, log[-2000:]
    # Each node's launcher was told the job's world (--world-size 3), so a resume of this world-3
    # checkpoint (a per-rank batch: it cannot change world size) passes its checks on both nodes;
    # with its own --nproc x --nnodes (4 on n3, 2 on n1) it was refused.
    from gpuyard.errors import ConfigError
    from gpuyard.train.launch import LaunchConfig, prepare

    script = gpuyard_home / "jobs" / str(job["id"]) / "attempt-1.sbatch"
    srun = shlex.split(script.read_text().splitlines()[-1])
    cut = srun.index(":")  # srun's heterogeneous step: n3's component, then n1's
    for opts in (srun[:cut], srun[cut + 1 :]):
        nproc, nnodes = int(opts[opts.index("--nproc") + 1]), int(opts[opts.index("--nnodes") + 1])
        rdzv, world = opts[opts.index("--rdzv") + 1], int(opts[opts.index("--world-size") + 1])
        assert (nnodes, world) == (2, 3)
        prepare(LaunchConfig(spec_path, nproc=nproc, nnodes=nnodes, rdzv=rdzv, world_size=world))
        with pytest.raises(ConfigError, match=rf"size 3 \(batch 8 per rank\), this run has {2 * nproc} "):
            prepare(LaunchConfig(spec_path, nproc=nproc, nnodes=nnodes, rdzv=rdzv))


def test_a_slurm_time_limit_ends_the_job_with_that_reason(
    slurm_cluster: LocalSlurm, time_limited: dict[str, Any]
) -> None:
    """Last in the module: slurmctld checks time limits every 30 s, so the 1-minute job started with the
    module ends 60-90 s after it started (88 s measured); every test before it, the training test
    included, runs in that time rather than after it."""
    service = time_limited["service"]
    doc = _until(service, time_limited["job"], {"failed", "succeeded", "cancelled"}, timeout=150)
    assert doc["state"] == "failed"
    reasons = " ".join(e["reason"] or "" for e in service.events(time_limited["job"]))
    assert "time limit" in reasons and "TIMEOUT" in reasons
    assert slurm_job(slurm_cluster, service.executor.prefix, time_limited["job"])["JobState"] == "TIMEOUT"
