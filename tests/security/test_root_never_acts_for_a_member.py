"""A member tries to make the root server act on what the member controls; every attempt is refused
or harmless, and the member's ordinary work still runs.

Real processes as root (CI runs as root): `gpuyard server --job-user gpuyard-{team}` runs each team's
jobs as its own Unix user, with a mount namespace per job (private /dev/shm, /proc and /tmp).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from tests.integration.scheduler.conftest import ServerStarter
from tests.waiting import ensure_user, wait_for

from gpuyard.auth import add_user, create_token

pytestmark = [
    pytest.mark.security,
    pytest.mark.skipif(os.geteuid() != 0, reason="running jobs as other Unix users needs root"),
]
TEAMS = ("research", "vision")
SECRET = "root-only-secret-5521"


@pytest.fixture(scope="module")
def team_users() -> dict[str, str]:
    return {team: ensure_user(f"gpuyard-{team}") for team in TEAMS}


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every job user can reach (pytest's tmp_path is root's alone; the machine's /tmp is not
    the jobs' /tmp), with a root-only file."""
    folder = Path("/var/tmp") / f"gpuyard-root-acts-{secrets.token_hex(4)}"
    folder.mkdir(mode=0o755)
    secret = folder / "secret"
    secret.write_text(f"model: {SECRET}\n")
    os.chmod(secret, 0o600)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def per_team(
    server: ServerStarter, team_users: dict[str, str]
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A root server running each team's jobs as gpuyard-TEAM, its job folder root under /tmp (each job
    keeps its own folder inside its private /tmp)."""
    work = Path("/tmp") / f"gpuyard-root-acts-work-{secrets.token_hex(4)}"
    teams = [f"--team={t}" for t in TEAMS]
    options = ("--gpus", "2", "--cpus", "4", "--job-user", "gpuyard-{team}", "--job-dir", str(work))
    proc, url = server(*options, *teams)
    yield url, proc, work
    shutil.rmtree(work, ignore_errors=True)


def _member(url: str, name: str, team: str) -> httpx.Client:
    add_user(name, team=team)
    token, _ = create_token(name)
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _ended(client: httpx.Client, job_id: int) -> dict[str, object]:
    wait_for(lambda: client.get(f"/jobs/{job_id}").json()["state"] in ("succeeded", "failed"), timeout=90)
    return dict(client.get(f"/jobs/{job_id}").json())


def test_job_env_that_would_steer_a_root_program_is_refused_and_path_reaches_only_the_job(
    per_team: tuple[str, subprocess.Popen[bytes], Path], shared: Path
) -> None:
    url, _, _ = per_team
    alice = _member(url, "alice", "research")
    for name, value in {
        "LD_PRELOAD": f"{shared}/evil.so",
        "LD_AUDIT": f"{shared}/evil.so",
        "SBATCH_GRES": "gpu:8",
        "SBATCH_GPUS": "8",
        "SLURM_CONF": f"{shared}/slurm.conf",
        "GPUYARD_TOKEN": "gy_forged",
    }.items():
        resp = alice.post(
            "/jobs", json={"name": "x", "team": "research", "command": ["true"], "env": {name: value}}
        )
        assert resp.status_code == 422 and name in resp.text, resp.text
        assert "\n" not in resp.json()["detail"]
    # A program path of the member's own: the job finds its programs there, the server never does.
    bin_dir = shared / "bin"
    bin_dir.mkdir()
    marker = shared / "ran-as"
    for tool in ("python3", "sh", "sbatch", "mount", "id"):
        (bin_dir / tool).write_text(f"#!/bin/sh\n/usr/bin/id -u >> {marker}\n")
        os.chmod(bin_dir / tool, 0o755)
    os.chmod(shared, 0o777)  # the job's user may write the marker
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LD_LIBRARY_PATH": str(bin_dir)}
    job = alice.post("/jobs", json={"name": "p", "team": "research", "command": ["id"], "env": env}).json()
    assert _ended(alice, job["id"])["state"] == "succeeded"
    # Its own `id` ran, as its own user; nothing of it ran as root.
    ran = marker.read_text().split()
    assert ran and "0" not in ran, ran


def test_a_log_replaced_by_a_link_to_a_root_only_file_is_never_read_back(
    per_team: tuple[str, subprocess.Popen[bytes], Path], shared: Path, gpuyard_home: Path
) -> None:
    url, _, _ = per_team
    alice = _member(url, "alice", "research")
    # The local log lies in the server's private home: the job cannot reach it to replace it.
    script = (
        f"for f in {gpuyard_home}/jobs/*/output.log; do ln -sf {shared}/secret $f && echo LINKED; done; "
        f"ln -sf {shared}/secret output.log; echo done"
    )
    job = alice.post("/jobs", json={"name": "l", "team": "research", "command": ["sh", "-c", script]}).json()
    assert _ended(alice, job["id"])["state"] == "succeeded"
    text = alice.get(f"/jobs/{job['id']}/logs").json()["text"]
    assert "done" in text and "LINKED" not in text and SECRET not in text, text


def test_a_spec_naming_a_root_only_a_huge_or_a_blocking_file_is_refused_quickly_without_its_content(
    per_team: tuple[str, subprocess.Popen[bytes], Path], shared: Path
) -> None:
    url, server, _ = per_team
    alice = _member(url, "alice", "research")
    huge = shared / "huge.yaml"
    with open(huge, "wb") as fh:
        fh.truncate(1 << 30)  # 1 GiB (sparse)
    os.chmod(huge, 0o644)
    fifo = shared / "fifo.yaml"
    os.mkfifo(fifo, 0o666)
    elastic = {"gpus": {"min": 1, "max": 2}}
    rss = psutil.Process(server.pid).memory_info().rss
    for path, why in (
        (shared / "secret", "it cannot: Permission denied"),
        (huge, "1073741824 bytes"),
        (fifo, "not a regular"),
    ):
        start = time.perf_counter()
        resp = alice.post(
            "/jobs", json={"name": "t", "team": "research", "train": str(path), "resources": elastic}
        )
        took = time.perf_counter() - start
        assert resp.status_code == 422 and why in resp.text and SECRET not in resp.text, resp.text
        print(f"{path.name}: refused in {took:.2f} s: {resp.json()['detail']}")
    grown = psutil.Process(server.pid).memory_info().rss - rss
    print(f"server memory grown by {grown / 2**20:.1f} MiB over the three submissions")
    assert grown < 200 * 2**20  # a read of the 1 GiB file would have grown it past 1 GiB
    # A spec the member can read is read, as the member, and checked: this one fits 2 GPUs only.
    good = shared / "train.yaml"
    good.write_text(
        "model: {entrypoint: pkg.mod:model}\n"
        "data: {train: {entrypoint: pkg.mod:data}, global_batch_size: 2}\n"
    )
    os.chmod(good, 0o644)
    resp = alice.post(
        "/jobs", json={"name": "t", "team": "research", "train": str(good), "resources": elastic}
    )
    assert resp.status_code in (200, 201, 422), resp.text
    if resp.status_code == 422:  # refused for what the spec says, not for how it was read
        assert "cannot read" not in resp.text and "regular" not in resp.text, resp.text
    else:
        alice.post(f"/jobs/{resp.json()['id']}/cancel")


def test_a_compiler_cache_prepared_in_tmp_never_reaches_another_teams_job(
    per_team: tuple[str, subprocess.Popen[bytes], Path], shared: Path
) -> None:
    url, _, work = per_team
    alice, victor = _member(url, "alice", "research"), _member(url, "victor", "vision")
    # Research plants what torch.compile and Triton would load as vision's next compile, in /tmp and
    # in every cache location it can think of.
    plant = (
        "for d in /tmp/torchinductor_gpuyard-vision /tmp/triton /tmp/gpuyard-planted; do "
        "mkdir -p $d && chmod 777 $d && echo 'import os; os.system(\"id\")' > $d/evil.py; done; "
        "echo tmpdir=$TMPDIR; ls -d /tmp/gpuyard-planted && echo planted"
    )
    job = alice.post(
        "/jobs", json={"name": "plant", "team": "research", "command": ["sh", "-c", plant]}
    ).json()
    assert _ended(alice, job["id"])["state"] == "succeeded"
    planted_log = alice.get(f"/jobs/{job['id']}/logs").json()["text"]
    assert "planted" in planted_log, planted_log
    # Nothing of it reached the machine's /tmp: its /tmp was its own, and is gone with it.
    assert (
        not Path("/tmp/gpuyard-planted").exists() and not Path("/tmp/torchinductor_gpuyard-vision").exists()
    )
    assert not list(work.glob(".tmp-*"))
    look = (
        "echo tmp=$(ls -A /tmp | tr '\\n' ' '); echo tmpdir=$TMPDIR; stat -c 'owner=%U mode=%a' $TMPDIR; "
        "echo triton=$TRITON_CACHE_DIR; echo inductor=$TORCHINDUCTOR_CACHE_DIR; "
        "echo made > here.txt; pwd"
    )
    victim = victor.post(
        "/jobs", json={"name": "look", "team": "vision", "command": ["sh", "-c", look]}
    ).json()
    assert _ended(victor, victim["id"])["state"] == "succeeded"
    text = victor.get(f"/jobs/{victim['id']}/logs").json()["text"]
    seen = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and " " not in line.split("=")[0]
    )
    assert "evil" not in text and "planted" not in seen["tmp"] and "torchinductor" not in seen["tmp"], text
    # Its /tmp is its attempt's own folder, 0700 and its user's, and so are its caches.
    assert seen["tmpdir"] == "/tmp" and "owner=gpuyard-vision mode=700" in text, text
    assert seen["triton"] == "/tmp/triton" and seen["inductor"] == "/tmp/torchinductor", text
    assert not list(work.glob(".tmp-*"))  # removed when it ended
    # Its own folder under /tmp stayed reachable inside its private /tmp.
    assert (work / f"job-{victim['id']}" / "here.txt").read_text() == "made\n"
    assert f"{work}/job-{victim['id']}" in text
