"""What the server's own programs get from their environment, what a job may name in its env, and how
the server reads a file a job can change (gpuyard.privileged)."""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import tracemalloc
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.privileged import (
    READ_CAP,
    SYSTEM_PATH,
    environment,
    job_env_refusal,
    program,
    read_as,
    read_beneath,
)
from gpuyard.scheduler.executors.base import LaunchPlan, NodeSlots
from gpuyard.scheduler.executors.isolation import PRIVATE_TMP_VARS
from gpuyard.scheduler.executors.slurm import SlurmConfig, SlurmExecutor
from gpuyard.scheduler.spec import parse_spec

pytestmark = pytest.mark.unit


def test_a_privileged_program_gets_the_allow_list_whatever_the_environment_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in {
        "PATH": "/tmp/evil:/usr/bin",
        "LD_PRELOAD": "/tmp/evil.so",
        "PYTHONPATH": "/tmp/evil",
        "SBATCH_GRES": "gpu:8",
        "TZ": ":/tmp/evil-zone",
    }.items():
        monkeypatch.setenv(key, value)
    env = environment({"SLURM_CONF": "/etc/slurm/slurm.conf"})
    assert set(env) == {"PATH", "LANG", "LC_ALL", "HOME", "SLURM_CONF"}  # TZ naming a file is dropped
    assert env["PATH"] == SYSTEM_PATH and env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    for bad in ("LD_PRELOAD", "PYTHONHOME", "GCONV_PATH", "A B"):
        with pytest.raises(ConfigError, match="not a variable gpuyard passes"):
            environment({bad: "x"})
    assert program("sh").startswith("/") and os.path.dirname(program("sh")) in SYSTEM_PATH.split(":")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("LD_PRELOAD", "dynamic-loader"),
        ("LD_AUDIT", "dynamic-loader"),
        ("SBATCH_GRES", "Slurm tools"),
        ("SLURM_CONF", "Slurm tools"),
        ("SRUN_CPUS_PER_TASK", "Slurm tools"),
        ("GPUYARD_TOKEN", "gpuyard sets it"),
        ("GPUYARD_SERVER", "gpuyard sets it"),
        ("A;touch /x", "not a variable name"),
        ("1A", "not a variable name"),
    ],
)
def test_a_job_env_name_that_could_steer_a_root_program_is_refused_at_submit(name: str, why: str) -> None:
    assert why in (job_env_refusal(name) or "")
    with pytest.raises(ConfigError, match=why) as err:
        parse_spec({"name": "x", "command": ["true"], "env": {name: "v"}})
    assert "\n" not in str(err.value)


def test_what_only_reaches_the_job_is_accepted() -> None:
    env = {"PATH": "/opt/venv/bin:/usr/bin", "LD_LIBRARY_PATH": "/opt/cuda/lib64", "PYTHONPATH": "src"}
    assert parse_spec({"name": "x", "command": ["true"], "env": env}).env == env


def test_read_beneath_follows_no_link_and_checks_the_owner(tmp_path: Path) -> None:
    base = tmp_path / "jobs"
    (base / "7").mkdir(parents=True)
    log = base / "7" / "output.log"
    log.write_bytes(b"hello world")
    me = {os.geteuid()}
    assert read_beneath(base, "7/output.log", me) == b"hello world"
    assert read_beneath(base, "7/output.log", me, offset=6, limit=3) == b"wor"
    assert read_beneath(base, "7/output.log", me, offset=99) == b""
    secret = tmp_path / "secret"
    secret.write_text("root-secret-4412")
    log.unlink()
    log.symlink_to(secret)  # the job replaced its log by a link
    with pytest.raises(PermissionError, match="symbolic link") as err:
        read_beneath(base, "7/output.log", me)
    assert "root-secret" not in str(err.value)
    (base / "8").symlink_to(tmp_path)  # a link on the way
    with pytest.raises(PermissionError, match="symbolic link"):
        read_beneath(base, "8/secret", me)
    log.unlink()
    os.mkfifo(log)  # a FIFO would block a reader forever
    with pytest.raises(PermissionError, match="not a regular file"):
        read_beneath(base, "7/output.log", me)
    log.unlink()
    log.write_text("x")
    with pytest.raises(PermissionError, match="owned by uid"):
        read_beneath(base, "7/output.log", {os.geteuid() + 1})
    with pytest.raises(PermissionError, match="not a path below"):
        read_beneath(base, "../secret", me)
    with pytest.raises(FileNotFoundError):
        read_beneath(base, "9/output.log", me)


def test_read_as_refuses_a_huge_file_or_a_fifo_without_reading_it(tmp_path: Path) -> None:
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as fh:
        fh.truncate(1 << 30)  # 1 GiB, sparse: reading it would cost a GiB of memory
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=f"1073741824 bytes, more than the {READ_CAP}"):
            read_as(None, None, huge)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # refused from its size, never read into memory
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_as(None, None, fifo)
    assert read_as(None, None, tmp_path / "missing") is None
    (tmp_path / "ok.yaml").write_text("a: 1\n")
    assert read_as(None, None, tmp_path / "ok.yaml") == b"a: 1\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user needs root")
def test_read_as_a_member_reads_only_what_that_member_can(tmp_path: Path) -> None:
    import pwd

    from tests.waiting import ensure_user

    entry = pwd.getpwnam(ensure_user("gpuyard-research"))
    folder = Path(tempfile.mkdtemp(prefix="gpuyard-read-as-"))  # pytest's tmp_path is root's alone
    os.chmod(folder, 0o755)
    try:
        _read_as_member(folder, entry.pw_uid, entry.pw_gid)
    finally:
        shutil.rmtree(folder)


def _read_as_member(tmp_path: Path, uid: int, gid: int) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root-secret-9031\n")
    os.chmod(secret, 0o600)
    with pytest.raises(
        ConfigError, match=r"not read as user gpuyard-research \(it cannot: Permission denied"
    ) as err:
        read_as(uid, gid, secret)
    assert "root-secret" not in str(err.value)
    mine = tmp_path / "mine.yaml"
    mine.write_text("a: 1\n")
    os.chown(mine, uid, gid)
    os.chmod(mine, 0o600)
    assert read_as(uid, gid, mine) == b"a: 1\n"


def test_the_batch_script_carries_the_job_env_and_private_temp_space(tmp_path: Path) -> None:
    ex = object.__new__(SlurmExecutor)  # no cluster: plan() and script() only read these
    ex.jobs_dir, ex.prefix, ex.isolation = tmp_path / "jobs", "gpuyard-t-", None
    ex.config = SlurmConfig()
    ex._addr = {"n1": "10.0.0.1"}
    # A value with a newline and an #SBATCH line in it: never read as an sbatch option.
    hostile = "x\n#SBATCH --gres=gpu:8\n"
    spec = parse_spec({"name": "x", "command": ["true"], "env": {"NOTE": hostile, "HF_HOME": "/data/hf"}})
    plan: LaunchPlan = ex.plan(3, spec, [NodeSlots("n1", ())], 1)
    script = ex.script(plan)
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    sbatch_line = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert first_command < sbatch_line  # sbatch stops reading directives at the first command
    assert f"export NOTE={shlex.quote(hostile)}" in script
    tmp = str(tmp_path / "jobs" / "3" / ".tmp")
    assert f'GPUYARD_TMP={tmp}-"$SLURM_JOB_ID"' in script
    for key, sub in PRIVATE_TMP_VARS.items():
        if key != "HF_HOME":  # the job's own choice stands
            assert f'export {key}="$GPUYARD_TMP{"/" + sub if sub else ""}"' in script
    assert "export HF_HOME=/data/hf" in script and 'export HF_HOME="$GPUYARD_TMP' not in script
