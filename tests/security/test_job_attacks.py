"""A member's job attacks the server and another team's job; every attempt is refused.

Real processes as root (CI runs as root): `gpuyard server --job-user gpuyard-{team}` runs each team's
jobs as its own unprivileged Unix user. Team vision's job keeps a secret in its folder and its log;
team research's job then tries to read the admin token, the database, vision's log, folder and
artifacts, the server's environment, and to signal vision's process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from tests.integration.scheduler.conftest import ServerStarter, free_port
from tests.waiting import ensure_user, wait_for

from gpuyard.auth import add_user, create_token

pytestmark = [
    pytest.mark.security,
    pytest.mark.skipif(os.geteuid() != 0, reason="running jobs as other Unix users needs root"),
]
TEAMS = ("research", "vision")


@pytest.fixture(scope="module")
def team_users() -> dict[str, str]:
    """The Unix user of each team's jobs (created when missing: the tests run as root)."""
    users = {}
    for team in TEAMS:
        users[team] = ensure_user(f"gpuyard-{team}")
    return users


@pytest.fixture
def per_team_server(
    server: ServerStarter, team_users: dict[str, str]
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A root server running each team's jobs as gpuyard-TEAM; (url, process, job folder root)."""
    work = Path("/tmp") / f"gpuyard-attacks-{os.getpid()}-{free_port()}"
    teams = [f"--team={t}" for t in (*TEAMS, "nousers")]  # team nousers has no Unix user of its own
    proc, url = server("--cpus", "4", "--job-user", "gpuyard-{team}", "--job-dir", str(work), *teams)
    yield url, proc, work  # the server fixture stops the server and the jobs' process groups
    shutil.rmtree(work, ignore_errors=True)


def _member(url: str, name: str, team: str) -> httpx.Client:
    add_user(name, team=team)
    token, _ = create_token(name)
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def _state(client: httpx.Client, job_id: int) -> str:
    return str(client.get(f"/jobs/{job_id}").json()["state"])


def test_a_members_job_reaches_nothing_of_the_server_or_another_team(
    per_team_server: tuple[str, subprocess.Popen[bytes], Path], gpuyard_home: Path
) -> None:
    url, server, work = per_team_server
    alice, victor = _member(url, "alice", "research"), _member(url, "victor", "vision")
    secret = "vision-secret-8817"
    keep = f"echo {secret} > secret.txt; echo {secret}; exec sleep 120"
    spec = {"name": "victim", "team": "vision", "command": ["sh", "-c", keep]}
    victim = victor.post("/jobs", json=spec).json()
    vid = victim["id"]
    wait_for(lambda: (work / f"job-{vid}" / "secret.txt").exists(), timeout=60)
    shim = int(next(gpuyard_home.glob(f"jobs/{vid}/attempt-*.pid")).read_text())
    victim_pid = wait_for(lambda: [c.pid for c in psutil.Process(shim).children()], timeout=30)[0]
    assert psutil.Process(victim_pid).username() == "gpuyard-vision"
    db, token = gpuyard_home / "gpuyard.db", gpuyard_home / "token"
    attacks = {
        "token": f"cat {token}",
        "db": f"cat {db}",
        "log": f"cat {gpuyard_home}/jobs/{vid}/output.log",
        "folder": f"cat {work}/job-{vid}/secret.txt",
        "listing": f"ls {work}",
        "artifacts": f"ls {gpuyard_home}/artifacts",
        "signal": f"kill -TERM {victim_pid}",
        "victim-env": f"cat /proc/{victim_pid}/environ",
        "server-env": f"cat /proc/{server.pid}/environ",
        "trace": f"cat /proc/{victim_pid}/mem",
    }
    script = "".join(f"{cmd} >/dev/null 2>&1; echo {name}=$?\n" for name, cmd in attacks.items())
    script += f"{' ; '.join(attacks.values())} 2>&1 | head -c 20000\n"  # what an attacker would see
    spec = {"name": "attack", "team": "research", "command": ["sh", "-c", script]}
    job = alice.post("/jobs", json=spec).json()
    wait_for(lambda: _state(alice, job["id"]) in ("succeeded", "failed"), timeout=60)
    text = alice.get(f"/jobs/{job['id']}/logs").json()["text"]
    codes = dict(line.split("=", 1) for line in text.splitlines() if line.split("=", 1)[0] in attacks)
    assert set(codes) == set(attacks) and all(code != "0" for code in codes.values()), text
    assert secret not in text and "gy_" not in text and "GPUYARD_HOME" not in text, text
    # The victim runs on, untouched; and over the API alice cannot read or stop it either.
    assert _state(victor, vid) == "running" and psutil.Process(victim_pid).is_running()
    assert alice.get(f"/jobs/{vid}/logs").status_code == 403
    assert alice.post(f"/jobs/{vid}/cancel").status_code == 403
    victor.post(f"/jobs/{vid}/cancel")


def test_a_team_without_its_unix_user_is_refused_at_submit(
    per_team_server: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    url, _, _ = per_team_server
    nora = _member(url, "nora", "nousers")
    resp = nora.post("/jobs", json={"name": "x", "team": "nousers", "command": ["true"]})
    assert resp.status_code == 422 and "no Unix user 'gpuyard-nousers'" in resp.text, resp.text
