"""A member's job on the real slurmctld (conftest.py) tries to steer what the server runs as root:
its environment never reaches sbatch (a PATH of its own finds only its own programs), a log replaced
by a link to a root-only file is never read back, and its temp space and caches are its own."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.waiting import ensure_user, wait_for

from gpuyard.errors import ConfigError, ConflictError
from gpuyard.scheduler.executors.isolation import JobIsolation
from gpuyard.scheduler.executors.slurm_local import LocalSlurm
from gpuyard.scheduler.spec import parse_spec

from .conftest import make_slurm_service

pytestmark = pytest.mark.integration
SECRET = "root-only-secret-8127"
# Programs the server runs as root (and one the job runs itself): each notes who ran it.
TOOLS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "sacct", "srun", "id")


def _until(service: Any, job_id: int, states: set[str], timeout: float = 90.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        service.tick()
        doc = service.get(job_id)
        return doc if doc["state"] in states else None

    return wait_for(check, timeout=timeout, every=0.1)  # type: ignore[return-value]


@pytest.fixture
def member(slurm_cluster: LocalSlurm, gpuyard_home: Path) -> Iterator[tuple[Any, Path, Path]]:
    """(a service whose jobs run as gpuyard-research, the job folder root, a folder all can reach)."""
    entry = pwd.getpwnam(ensure_user("gpuyard-research"))
    root = Path(tempfile.mkdtemp(prefix="gpuyard-slurm-member-"))
    os.chmod(root, 0o711)
    shared = Path(tempfile.mkdtemp(prefix="gpuyard-slurm-shared-", dir="/var/tmp"))
    os.chmod(shared, 0o777)
    secret = shared / "secret"
    secret.write_text(f"{SECRET}\n")
    os.chmod(secret, 0o600)
    try:
        service = make_slurm_service(gpuyard_home, nodes=["n1", "n2", "n3"])
        service.executor.isolation = JobIsolation(
            user=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, switch=True, work_root=root
        )
        yield service, root, shared
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


def test_a_members_environment_steers_no_slurm_tool_of_the_server(member: tuple[Any, Path, Path]) -> None:
    service, root, shared = member
    for name in ("SBATCH_GRES", "SBATCH_GPUS", "SLURM_CONF", "LD_PRELOAD"):
        with pytest.raises(ConfigError, match=name):
            parse_spec({"name": "x", "command": ["true"], "env": {name: "gpu:8"}})
    bin_dir, marker = shared / "bin", shared / "ran-as"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).write_text(f"#!/bin/sh\n/usr/bin/id -u >> {marker}\n")
        os.chmod(bin_dir / tool, 0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LD_LIBRARY_PATH": str(bin_dir)}
    look = 'id; echo "tmp=$TMPDIR"; stat -c "owner=%U mode=%a" "$TMPDIR"; echo "triton=$TRITON_CACHE_DIR"'
    spec = {"name": "p", "command": ["sh", "-c", look], "env": env, "resources": {"cpus": 1}}
    job = service.submit(parse_spec(spec))
    # The server polls, and would stop it, through the same tools: none of the job's copies runs.
    doc = _until(service, job["id"], {"succeeded", "failed"})
    log = service.read_log(job["id"])["text"]
    assert doc["state"] == "succeeded", log
    ran = marker.read_text().split()  # the job's own `id` ran, as the job's user; nothing as root
    uid = str(pwd.getpwnam("gpuyard-research").pw_uid)
    assert ran == [uid], ran
    # Its temp folder and caches are in its own 0700 folder, not the node's shared /tmp.
    seen = dict(line.split("=", 1) for line in log.splitlines() if line.startswith(("tmp=", "triton=")))
    assert seen["tmp"].startswith(f"{root}/job-{job['id']}/.tmp-"), log
    assert seen["triton"] == f"{seen['tmp']}/triton" and "owner=gpuyard-research mode=700" in log, log


def test_a_log_replaced_by_a_link_to_a_root_only_file_is_not_read_back(
    member: tuple[Any, Path, Path],
) -> None:
    service, root, shared = member
    swap = f"echo before; rm -f output.log; ln -s {shared}/secret output.log; echo after"
    spec = {"name": "l", "command": ["sh", "-c", swap], "resources": {"cpus": 1}}
    job = service.submit(parse_spec(spec))
    doc = _until(service, job["id"], {"succeeded", "failed"})
    assert doc["state"] == "succeeded"
    assert (root / f"job-{job['id']}" / "output.log").is_symlink()
    with pytest.raises(ConflictError, match="symbolic link") as err:
        service.read_log(job["id"])
    assert SECRET not in str(err.value)
    # A hard link is not possible for the member (fs.protected_hardlinks), and a file of another
    # owner is refused all the same: the log must be the job user's.
    log = root / f"job-{job['id']}" / "output.log"
    log.unlink()
    shutil.copy(shared / "secret", log)  # root's file where the log was
    with pytest.raises(ConflictError, match="owned by uid 0") as err:
        service.read_log(job["id"])
    assert SECRET not in str(err.value)
