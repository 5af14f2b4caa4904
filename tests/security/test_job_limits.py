"""A member's job tries to take the machine: memory, processes, log volume; each stays in its limits.

Real processes as root (CI runs as root): `gpuyard server --job-user gpuyard-{team}` with small
limits (--job-pids 64, --job-log-mb 1). Team research's jobs allocate 3x their declared memory, fork
until forking fails, flood their log and run a program that does not exist; team vision's job, started
beside them, completes, and the server answers throughout. Also: a pre-planted job folder root is
refused, and a root server whose job user cannot run the jobs' Python refuses to start in one line.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.scheduler.conftest import ServerStarter, free_port
from tests.waiting import ensure_user, wait_for

from gpuyard.auth import add_user, create_token
from gpuyard.errors import ConfigError

pytestmark = [
    pytest.mark.security,
    pytest.mark.skipif(
        os.geteuid() != 0 and not os.environ.get("CI"),
        reason="limits, job users and mount namespaces need a root server (CI runs as root)",
    ),
]
TEAMS = ("research", "vision")
# The jobs' Python: one every user can run (the test's own may sit in root's private home).
JOB_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
PIDS = 64


@pytest.fixture(scope="module")
def team_users() -> dict[str, str]:
    """The Unix user of each team's jobs (created when missing: the tests run as root)."""
    users = {}
    for team in (*TEAMS, "job"):
        users[team] = ensure_user(f"gpuyard-{team}")
    return users


@pytest.fixture
def work_root() -> Iterator[Path]:
    """A job folder root the job users can pass through (the test's tmp_path is root's alone)."""
    root = Path("/tmp") / f"gpuyard-limits-{os.getpid()}-{free_port()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _member(url: str, name: str, team: str) -> httpx.Client:
    add_user(name, team=team)
    token, _ = create_token(name)
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def _python_script(code: str) -> list[str]:
    return [JOB_PYTHON, "-I", "-c", code]


HOG = "data = bytes(range(256)) * (3 * 2**20)  # 768 MiB, every page written\nprint('allocated', len(data))"
FORK_BOMB = f"""
import os, time
children = 0
while children < {PIDS * 4}:
    try:
        pid = os.fork()
    except OSError as exc:
        print("fork failed after", children, "children:", exc.strerror, flush=True)
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children += 1
print("children", children, flush=True)
"""
FLOOD = "import sys\nline = 'y' * 1023 + '\\n'\nfor _ in range(20 * 1024):\n    sys.stdout.write(line)\n"


def test_a_memory_hog_a_fork_bomb_and_a_log_flood_stay_in_their_limits(
    server: ServerStarter, team_users: dict[str, str], work_root: Path, gpuyard_home: Path, tmp_path: Path
) -> None:
    teams = [f"--team={t}" for t in TEAMS]
    limits = ["--job-pids", str(PIDS), "--job-log-mb", "1", "--job-python", JOB_PYTHON]
    proc, url = server(
        "--cpus", "6", "--job-user", "gpuyard-{team}", "--job-dir", str(work_root), *teams, *limits
    )
    alice, victor = _member(url, "alice", "research"), _member(url, "victor", "vision")
    jobs = {
        "hog": {"command": _python_script(HOG), "resources": {"memory_gb": 0.25}},
        "bomb": {"command": _python_script(FORK_BOMB)},
        "flood": {"command": _python_script(FLOOD)},
        "missing": {"command": ["/nonexistent/gpuyard-prog"]},
    }
    ids = {
        name: alice.post("/jobs", json={"name": name, "team": "research", **spec}).json()["id"]
        for name, spec in jobs.items()
    }
    # Team vision's job looks for the host's /dev/shm file and the server's process meanwhile.
    marker = Path("/dev/shm") / f"gpuyard-limits-test-{os.getpid()}"
    marker.write_text("host")
    peek = f"sleep 1; test -e {marker} && echo SHARED; test -e /proc/{proc.pid} && echo SEEN; echo calm done"
    calm = {"name": "calm", "team": "vision", "command": ["sh", "-c", peek]}
    ids["calm"] = victor.post("/jobs", json=calm).json()["id"]
    owner = {name: (victor if name == "calm" else alice) for name in ids}

    def ended() -> dict[str, dict[str, object]] | None:
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # the server answers throughout
        docs = {name: owner[name].get(f"/jobs/{jid}").json() for name, jid in ids.items()}
        return docs if all(d["state"] in ("succeeded", "failed") for d in docs.values()) else None

    try:
        docs = wait_for(ended, timeout=120, every=0.2)
    finally:
        marker.unlink()
    logs = {name: owner[name].get(f"/jobs/{jid}/logs").json()["text"] for name, jid in ids.items()}
    # 3x its declared memory: failed, and the reason says so (the state's reason is what jobs ls/show print).
    assert docs["hog"]["state"] == "failed", logs["hog"]
    assert "out of memory: limit 256 MiB" in str(docs["hog"]["reason"]), docs["hog"]
    assert "allocated" not in logs["hog"]
    # The fork bomb got fewer than its process allowance; it ended (its sleeping children with it).
    assert docs["bomb"]["state"] == "succeeded", logs["bomb"]
    assert "fork failed after" in logs["bomb"], logs["bomb"]
    forked = int(logs["bomb"].split("fork failed after", 1)[1].split()[0])
    assert 0 < forked < PIDS, logs["bomb"]
    # The flood wrote 20 MiB: its log holds the first MiB and ends with the cut notice; an event says so.
    log_file = gpuyard_home / "jobs" / str(ids["flood"]) / "output.log"
    assert 2**20 < log_file.stat().st_size < 2**20 + 4096
    last = log_file.read_bytes()[-200:].decode().rstrip().splitlines()[-1]
    assert last.startswith("[gpuyard: log cut at 1 MiB: 19922944 more bytes"), last
    events = alice.get(f"/jobs/{ids['flood']}/events").json()
    assert any("log cut at 1 MiB" in (e["reason"] or "") for e in events), events
    # A command that cannot start: the reason is in the job's state, not only in its log.
    assert docs["missing"]["state"] == "failed"
    assert "cannot start '/nonexistent/gpuyard-prog'" in str(docs["missing"]["reason"]), docs["missing"]
    # Team vision's job completed beside them; no job cgroup is left behind.
    assert docs["calm"]["state"] == "succeeded" and "calm done" in logs["calm"]
    startup = (tmp_path / "server0.log").read_text()
    assert "limits: memory as declared, cores as declared, 64 processes" in startup, startup
    if "private /dev/shm" in startup:  # a mount namespace per job (root, where allowed)
        assert "SHARED" not in logs["calm"] and "SEEN" not in logs["calm"], logs["calm"]
    assert proc.poll() is None
    made = [
        json.loads(f.read_text()).get("cgroup", {}) for f in gpuyard_home.glob("jobs/*/attempt-*.job.json")
    ]
    assert len(made) == len(ids) and all(c.get("dirs") for c in made), (
        made
    )  # cgroups where the machine has them
    assert not [d for c in made for d in c["dirs"] if os.path.exists(d)]


def test_a_pre_planted_job_folder_root_is_refused(
    team_users: dict[str, str], gpuyard_home: Path, work_root: Path
) -> None:
    from gpuyard.scheduler.executors.isolation import WORK_ROOT_RECORD, resolve_isolation
    from gpuyard.settings import load_settings

    settings = load_settings()
    # Another user made the folder first (it would hold every job's working directory): refused.
    work_root.mkdir(mode=0o777)
    research = pwd.getpwnam(team_users["research"])
    os.chown(work_root, research.pw_uid, research.pw_gid)
    with pytest.raises(ConfigError, match=f"job folder root {work_root} .*refused"):
        resolve_isolation(settings, "gpuyard-job", str(work_root), JOB_PYTHON)
    # The default root has a name nobody can know beforehand; a later server refuses it when it was
    # replaced by a link meanwhile.
    first = resolve_isolation(settings, "gpuyard-job", None, JOB_PYTHON).work_root
    assert first.name.startswith("gpuyard-jobs-") and first.stat().st_mode & 0o777 == 0o711
    assert (gpuyard_home / WORK_ROOT_RECORD).read_text() == str(first)
    assert resolve_isolation(settings, "gpuyard-job", None, JOB_PYTHON).work_root == first
    first.rmdir()
    first.symlink_to(work_root)
    try:
        with pytest.raises(ConfigError, match=f"job folder root {first} \\(a link\\)"):
            resolve_isolation(settings, "gpuyard-job", None, JOB_PYTHON)
    finally:
        first.unlink()


def test_a_job_user_that_cannot_run_the_jobs_python_stops_the_server_in_one_line(
    team_users: dict[str, str], tmp_path: Path, gpuyard_home: Path
) -> None:
    from gpuyard.scheduler.setup import build_service

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    hidden = private / "python"
    hidden.symlink_to(JOB_PYTHON)
    with pytest.raises(ConfigError) as refused:  # `gpuyard server` prints it as one line, exit 2
        build_service(role="server", job_user="gpuyard-job", job_python=str(hidden))
    line = str(refused.value)
    assert "\n" not in line and f"job user gpuyard-job cannot run the Python jobs are given ({hidden}" in line
    blocker = Path(line.split("chmod o+x ", 1)[1].split()[0])  # the first folder others cannot pass
    assert "--job-python PATH" in line and blocker in hidden.parents and not blocker.stat().st_mode & 0o001
