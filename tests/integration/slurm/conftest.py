"""A real Slurm cluster for the Slurm executor's tests: munged, slurmctld and four slurmd on this host.

Nodes: n1 and n2 (one GPU each, switch s1), n3 (two GPUs, switch s2), n4 (CPUs only, switch s2). The
GPUs are GRES over plain files. A gang over n3 and n1 (2 + 1 GPUs) is a heterogeneous job: Slurm
starts those from its backfill pass only, every second here (30 s by default). Needs root and Debian's
slurmctld, slurmd, slurm-client and munge (`.ci/run` installs them); outside CI the tests skip without
them, in CI they fail.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuyard.scheduler.executors.slurm_local import LocalSlurm, missing_tools

IN_CI = os.environ.get("CI", "").lower() == "true"
NODES = {"n1": 1, "n2": 1, "n3": 2, "n4": 0}
SWITCHES = {"s1": ["n1", "n2"], "s2": ["n3", "n4"]}
# The later SchedulerParameters line is the one Slurm keeps: LocalSlurm's, with a backfill pass each
# second (heterogeneous jobs would otherwise wait up to 30 s for one).
FAST_BACKFILL = "SchedulerParameters=sched_min_interval=0,bf_interval=1"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root"
    missing = missing_tools()
    return f"Slurm is not installed ({', '.join(missing)} missing)" if missing else None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalSlurm]:
    """The running cluster; SLURM_CONF points every Slurm tool (and the executor) at it."""
    why = _why_not()
    if why:
        if IN_CI:
            pytest.fail(f"{why}: .ci/run installs slurmctld slurmd slurm-client munge and runs as root")
        pytest.skip(why)
    folder = Path(tempfile.mkdtemp(prefix="gpuyard-slurm-"))
    cluster = LocalSlurm(
        folder, nodes=dict(NODES), switches=SWITCHES, cpus=2, memory_mb=2000, extra_conf=[FAST_BACKFILL]
    )
    cluster.start()
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    yield cluster
    _end_jobs(cluster)
    cluster.stop()
    if saved is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = saved


def _end_jobs(cluster: LocalSlurm) -> None:
    """Cancel every job and wait until Slurm has ended them: a slurmd stopped while it still ends a job
    leaves that job's slurmstepd behind (seen after a run of some tests, with the time-limited job
    still running)."""
    from tests.waiting import wait_for

    ids = cluster.run("squeue", "-h", "-o", "%i", check=False).split()
    if not ids:
        return
    cluster.run("scancel", *{i.partition("+")[0] for i in ids}, check=False)
    wait_for(lambda: not cluster.run("squeue", "-h", "-o", "%i", check=False).strip(), timeout=30, every=0.1)


def slurm_components(cluster: LocalSlurm, prefix: str, job_id: int, attempt: int = 1) -> list[dict[str, str]]:
    """``scontrol show job`` of the Slurm job of a gpuyard job's attempt (named PREFIX-ID-ATTEMPT): one
    row, or one per component of a heterogeneous job (in their order)."""
    from gpuyard.scheduler.executors.slurm_states import parse_kv_line

    name = f"{prefix}{job_id}-{attempt}"
    rows = [parse_kv_line(x) for x in cluster.run("scontrol", "show", "job", "-o").splitlines()]
    found = sorted(
        (r for r in rows if r.get("JobName") == name), key=lambda r: int(r.get("HetJobOffset", "0"))
    )
    jobs = {r.get("HetJobId", r["JobId"]) for r in found}
    assert len(jobs) == 1, f"{len(jobs)} Slurm jobs named {name}"
    return found


def slurm_job(cluster: LocalSlurm, prefix: str, job_id: int, attempt: int = 1) -> dict[str, str]:
    """The Slurm job of a gpuyard job's attempt (a heterogeneous job's first component)."""
    return slurm_components(cluster, prefix, job_id, attempt)[0]


def make_slurm_service(
    home: Path, nodes: list[str] | None = None, own_store: bool = False, **config: Any
) -> Any:
    """A JobService on the Slurm executor (only ``nodes`` of the cluster, when given); ``own_store``: a
    SQLite store in ``home`` rather than the configured one."""
    from gpuyard.scheduler.executors.slurm import SlurmExecutor
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    store = get_store(url=f"sqlite:///{home / 'state.db'}") if own_store else get_store()
    executor = SlurmExecutor(home / "jobs", instance=store.url)
    found = [n for n in executor.nodes() if nodes is None or n.name in nodes]
    config.setdefault("tick_s", 0.1)
    config.setdefault("grace_s", 5.0)
    return JobService(store, found, executor, ServiceConfig(**config))
