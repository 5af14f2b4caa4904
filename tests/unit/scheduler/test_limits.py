"""Job limits: the arithmetic (bytes, CPU quota, defaults), cgroup discovery and files, and OOM counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.scheduler.executors import limits as lim
from gpuyard.scheduler.spec import JobSpec, parse_spec

pytestmark = pytest.mark.unit


def _spec(**resources: object) -> JobSpec:
    return parse_spec({"name": "j", "command": ["true"], "resources": resources})


def test_sizes_read_in_the_unit_they_were_likely_given_in() -> None:
    assert lim.format_bytes(2**30) == "1.0 GiB"
    assert lim.format_bytes(int(1.5 * 2**30)) == "1.5 GiB"
    assert lim.format_bytes(int(0.25 * 2**30)) == "256 MiB"
    assert lim.format_bytes(512) == "512 bytes"
    assert lim.JobLimits(memory_bytes=2**30).oom_reason() == "out of memory: limit 1.0 GiB"


def test_cpu_quota_is_cores_times_the_period_never_under_a_millisecond() -> None:
    assert lim.cpu_max(1.5) == (150_000, 100_000)
    assert lim.cpu_max(2, period_us=50_000) == (100_000, 50_000)
    assert lim.cpu_max(0.001) == (1000, 100_000)  # the kernel refuses quotas under 1 ms
    with pytest.raises(ValueError):
        lim.cpu_max(0)


def test_a_job_gets_its_declared_memory_else_the_servers_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    defaults = lim.LimitDefaults(memory_gb=2, pids=128, nofile=1024, log_mb=1)
    declared = defaults.for_spec(_spec(memory_gb=0.25, cpus=3))
    assert declared == lim.JobLimits(memory_bytes=2**28, cpus=3.0, pids=128, nofile=1024, log_bytes=2**20)
    assert defaults.for_spec(_spec()).memory_bytes == 2 * 2**30
    assert lim.LimitDefaults().for_spec(_spec()).memory_bytes is None  # no default: not limited
    assert lim.LimitDefaults(log_mb=None).for_spec(_spec()).log_bytes is None


def test_cores_are_limited_for_cpu_jobs_and_gpu_jobs_that_name_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    defaults = lim.LimitDefaults()
    assert defaults.for_spec(_spec()).cpus == 1.0  # a CPU-only job: its slot
    assert defaults.for_spec(_spec(gpus=2)).cpus is None  # cpus: 1 by default is a slot count only
    stored = JobSpec.model_validate(_spec(gpus=2).model_dump(mode="json"))  # as the service keeps it
    assert defaults.for_spec(stored).cpus is None
    assert defaults.for_spec(_spec(gpus=2, cpus=8)).cpus == 8.0
    assert defaults.for_spec(_spec(cpus=64)).cpus is None  # the whole machine: nothing to limit


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [({"memory_gb": -1.0}, "--job-memory-gb"), ({"pids": 8}, "--job-pids"), ({"nofile": 10}, "--job-nofile"),
     ({"log_mb": 0.0}, "--job-log-mb")],
)  # fmt: skip
def test_bad_defaults_are_refused_naming_the_option(kwargs: dict[str, float], option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        lim.LimitDefaults(**kwargs)  # type: ignore[arg-type]


def _fake_cgroupfs(tmp_path: Path) -> tuple[str, str]:
    """A mountinfo and /proc/self/cgroup over folders of tmp_path: v1 memory and pids, a v2 without."""
    for sub in ("memory/app/me", "pids", "unified/me"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "unified/me/cgroup.controllers").write_text("hugetlb\n")
    mountinfo = "\n".join(
        [
            "22 1 0:20 / / rw,relatime - overlay overlay rw",
            f"30 22 0:26 / {tmp_path}/memory rw,relatime - cgroup cgroup rw,memory",
            f"31 22 0:27 / {tmp_path}/pids rw,relatime - cgroup cgroup rw,pids",
            f"32 22 0:28 / {tmp_path}/unified rw,relatime - cgroup2 cgroup2 rw",
        ]
    )
    return mountinfo, "4:memory:/app/me\n8:pids:/\n1:name=systemd:/\n0::/me\n"


def test_cgroup_discovery_uses_the_servers_own_cgroup_in_each_hierarchy(tmp_path: Path) -> None:
    mountinfo, mine = _fake_cgroupfs(tmp_path)
    assert lim.parse_proc_cgroup(mine) == {"memory": "/app/me", "pids": "/", "name=systemd": "/", "": "/me"}
    found = lim.detect(mountinfo, mine)
    assert found.version == 1
    assert found.bases == {"memory": tmp_path / "memory/app/me", "pids": tmp_path / "pids"}
    assert "lacks memory/pids" in found.why and "CPU cores NOT limited" in found.describe()
    handle = found.handle("gpuyard-job-7-1-ab")
    assert handle["dirs"] == [
        str(tmp_path / "memory/app/me/gpuyard-job-7-1-ab"),
        str(tmp_path / "pids/gpuyard-job-7-1-ab"),
    ]
    assert handle["leave"] == [
        str(tmp_path / "memory/app/me/cgroup.procs"),
        str(tmp_path / "pids/cgroup.procs"),
    ]
    assert handle["memory"].endswith("gpuyard-job-7-1-ab/memory.oom_control")


def test_a_cgroup_is_created_with_its_limits_and_never_reused(tmp_path: Path) -> None:
    mountinfo, mine = _fake_cgroupfs(tmp_path)
    (tmp_path / "cpu").mkdir()
    mountinfo += f"\n33 22 0:29 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu"
    handle = lim.detect(mountinfo, mine + "2:cpu:/\n").handle("gpuyard-job-1-1-cd")
    lim.create(handle, lim.JobLimits(memory_bytes=2**28, cpus=1.5, pids=64))
    cpu, mem, pids = (Path(d) for d in handle["dirs"])
    assert (mem / "memory.limit_in_bytes").read_text() == str(2**28)
    assert (cpu / "cpu.cfs_quota_us").read_text() == "150000" and (pids / "pids.max").read_text() == "64"
    with pytest.raises(FileExistsError):
        lim.create(handle, lim.JobLimits(pids=64))


def test_setrlimit_covers_what_no_cgroup_does() -> None:
    limits = lim.JobLimits(memory_bytes=2**30, pids=100, nofile=512)
    v1 = lim.Cgroups(1, {"memory": Path("/m"), "pids": Path("/p")}, {})
    assert lim.rlimits(limits, v1, uid=1000) == {"NOFILE": 512}
    none = lim.Cgroups(0)
    nobody = 2**31 - 7  # a uid with no process: NPROC is the allowance alone
    assert lim.rlimits(limits, none, uid=nobody) == {"NOFILE": 512, "DATA": 2**30, "NPROC": 100}
    assert "NPROC" not in lim.rlimits(limits, none, uid=0)  # the kernel does not count root's


def test_oom_kills_are_read_from_v2_events_v1_oom_control_or_failcnt(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert lim.oom_kills({"memory": str(events)}) == 1
    control = tmp_path / "memory.oom_control"
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert lim.oom_kills({"memory": str(control)}) == 3
    old, failcnt = tmp_path / "old.oom_control", tmp_path / "memory.failcnt"
    old.write_text("oom_kill_disable 0\nunder_oom 0\n")
    failcnt.write_text("5\n")
    assert lim.oom_kills({"memory": str(old), "failcnt": str(failcnt)}) == 1
    assert lim.oom_kills({}) == 0
