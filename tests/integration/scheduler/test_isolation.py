"""Jobs isolated from `gpuyard server`: an unprivileged user, an allow-listed environment, their own folder.

Real processes: a root server runs each job as ``gpuyard-job`` (created here when missing). The job
prints its environment, tries to read the database and the admin token, and writes its own files.
"""

from __future__ import annotations

import getpass
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.waiting import ensure_user

from gpuyard.scheduler.client import JobClient
from gpuyard.scheduler.executors.isolation import DEFAULT_JOB_USER, PRIVATE_TMP_VARS
from gpuyard.scheduler.spec import parse_spec

from .conftest import free_port, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="running jobs as another Unix user needs root"),
]

SECRET = "server-only-secret-4711"
GPUYARD = [sys.executable, "-m", "gpuyard.cli.main"]


@pytest.fixture(scope="session")
def job_user() -> str:
    """The unprivileged job user (created when missing: the tests run as root)."""
    return ensure_user(DEFAULT_JOB_USER)


@pytest.fixture
def job_dir() -> Iterator[Path]:
    """A fresh work root the job user can pass through (the test's tmp_path is root's alone)."""
    root = Path("/tmp") / f"gpuyard-isolation-{os.getpid()}-{free_port()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _start(home: Path, tmp_path: Path, *options: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / f"server-{port}.log"
    env = {**os.environ, "GPUYARD_HOME": str(home), "GPUYARD_TOKEN": SECRET, "SERVER_SECRET": SECRET}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuyard.cli.main",
                "server",
                "--port",
                str(port),
                "--cpus",
                "2",
                *options,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            assert proc.poll() is None, log_path.read_text()
            return False

    wait_for(healthy, timeout=60, every=0.1)
    return proc, url, log_path


@pytest.fixture
def isolated(
    gpuyard_home: Path, tmp_path: Path, job_user: str, job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[JobClient, Path, Path]]:
    """A root server running jobs as the job user; (client, home, server log)."""
    # The job user must run the jobs' Python or the server refuses to start: the test's own may sit in
    # root's private home, the system's is readable by all.
    proc, url, log = _start(
        gpuyard_home, tmp_path, "--job-dir", str(job_dir), "--job-python", "/usr/bin/python3"
    )
    monkeypatch.delenv("GPUYARD_TOKEN", raising=False)  # the client reads the admin token file
    client = JobClient(url)
    yield client, gpuyard_home, log
    client.close()
    proc.kill()
    proc.wait()


def _run(client: JobClient, command: list[str], state: str = "succeeded") -> tuple[dict[str, object], str]:
    job = client.submit(parse_spec({"name": "probe", "command": command}))
    done = wait_for(lambda: client.get(job["id"])["state"] in ("succeeded", "failed"), timeout=60)
    assert done
    doc = client.get(job["id"])
    text = "".join(client.logs(job["id"]))
    assert doc["state"] == state, text
    return doc, text


def test_job_environment_holds_no_token_and_no_server_variable(
    isolated: tuple[JobClient, Path, Path], job_dir: Path
) -> None:
    client, _, log = isolated
    doc, text = _run(client, ["env"])
    env = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert SECRET not in text
    assert not {"GPUYARD_TOKEN", "GPUYARD_HOME", "GPUYARD_DATABASE_URL", "SERVER_SECRET"} & env.keys()
    assert env["GPUYARD_JOB_ID"] == str(doc["id"]) and env["USER"] == DEFAULT_JOB_USER
    assert env["HOME"] == str(job_dir / f"job-{doc['id']}")
    assert set(env) <= {
        "PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "HOME", "USER", "LOGNAME", "CUDA_VISIBLE_DEVICES",
        "GPUYARD_JOB_ID", "GPUYARD_JOB_NAME", "GPUYARD_ATTEMPT", "GPUYARD_SERVER", "GPUYARD_TEAM",
        "GPUYARD_NODE", "PWD", "SHLVL", "_", *PRIVATE_TMP_VARS,
    }  # fmt: skip
    # Its temp folder and caches are the attempt's own, in the work root: its /tmp when it has a mount
    # namespace (a root server here), removed when it ended.
    tmp = env["TMPDIR"]
    assert tmp == "/tmp" or tmp.startswith(f"{job_dir}/.tmp-{doc['id']}-1-"), tmp
    assert env["TRITON_CACHE_DIR"] == f"{tmp}/triton" and env["TORCHINDUCTOR_CACHE_DIR"].startswith(tmp)
    assert not list(job_dir.glob(".tmp-*"))
    assert f"jobs run as user {DEFAULT_JOB_USER}" in log.read_text()


def test_job_cannot_read_the_database_the_token_or_the_server_home(
    isolated: tuple[JobClient, Path, Path],
) -> None:
    client, home, _ = isolated
    db, token = home / "gpuyard.db", home / "token"
    assert db.exists() and token.exists()
    script = f"cat {db} >/dev/null; echo db=$?; cat {token}; echo token=$?; ls {home}; echo ls=$?"
    _, text = _run(client, ["sh", "-c", script])
    assert "db=1" in text and "token=1" in text and "ls=2" in text, text
    # Refused, or (its /tmp private, when the home is under the machine's /tmp) not there at all.
    assert text.count("Permission denied") + text.count("No such file") == 3 and "gy_" not in text
    assert (home.stat().st_mode & 0o777, db.stat().st_mode & 0o777) == (0o700, 0o600)


def test_job_writes_its_own_files_in_a_folder_it_owns(
    isolated: tuple[JobClient, Path, Path], job_dir: Path
) -> None:
    client, _, _ = isolated
    doc, text = _run(client, ["sh", "-c", "echo hello > mine.txt && cat mine.txt && id -un && pwd"])
    work = job_dir / f"job-{doc['id']}"
    assert text.split() == ["hello", DEFAULT_JOB_USER, str(work)]
    job_uid = pwd.getpwnam(DEFAULT_JOB_USER).pw_uid
    assert (work / "mine.txt").read_text() == "hello\n" and (work / "mine.txt").stat().st_uid == job_uid
    assert work.stat().st_uid == job_uid and work.stat().st_mode & 0o777 == 0o700
    assert job_dir.stat().st_mode & 0o777 == 0o711  # the job user passes through, lists nothing


def test_a_workdir_the_job_user_cannot_enter_is_refused(isolated: tuple[JobClient, Path, Path]) -> None:
    client, home, _ = isolated
    job = client.submit(parse_spec({"name": "sneaky", "command": ["cat", "token"], "workdir": str(home)}))
    wait_for(lambda: client.get(job["id"])["state"] == "failed", timeout=60)
    text = "".join(client.logs(job["id"]))
    assert f"cannot enter the working directory {home}: Permission denied" in text and "gy_" not in text


def test_a_server_user_job_gets_the_store_but_no_token(
    gpuyard_home: Path, tmp_path: Path, job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    me = getpass.getuser()
    proc, url, log = _start(gpuyard_home, tmp_path, "--job-user", me, "--job-dir", str(job_dir))
    monkeypatch.delenv("GPUYARD_TOKEN", raising=False)
    try:
        client = JobClient(url)
        _, text = _run(client, ["env"])
        env = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        assert SECRET not in text and "GPUYARD_TOKEN" not in env and "SERVER_SECRET" not in env
        assert env["GPUYARD_HOME"] == str(gpuyard_home) and env["USER"] == me
        lines = [ln for ln in log.read_text().splitlines() if "jobs run as" in ln]
        assert len(lines) == 1 and "WARNING" in lines[0] and "NOT isolated" in lines[0]
    finally:
        proc.kill()
        proc.wait()


def test_a_missing_job_user_refuses_to_start_in_one_line(gpuyard_home: Path) -> None:
    out = subprocess.run(
        [*GPUYARD, "server", "--port", str(free_port()), "--job-user", "no-such-user-gy"],
        capture_output=True,
        text=True,
        env={**os.environ, "GPUYARD_HOME": str(gpuyard_home)},
        timeout=60,
    )
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "'no-such-user-gy' does not exist" in lines[0]


def test_the_startup_line_warns_when_the_job_user_cannot_run_the_servers_python(
    job_user: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuyard.scheduler.executors.isolation import _python_problem

    entry = pwd.getpwnam(job_user)
    assert _python_problem(0, 0) is None  # root runs any interpreter
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    hidden = private / "python"
    hidden.symlink_to(shutil.which("python3") or "/usr/bin/python3")
    monkeypatch.setattr(sys, "executable", str(hidden))
    problem = _python_problem(entry.pw_uid, entry.pw_gid)
    assert problem is not None and str(hidden) in problem and "ermission denied" in problem
