"""What the server's start line says of jobs run as its own user: the fix that applies to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.scheduler.executors import isolation
from gpuyard.scheduler.executors.isolation import JobIsolation

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("euid", "user", "fix"),
    [
        (0, "root", "pass an unprivileged --job-user to run them as that user"),
        (1000, "alice", "start the server as root to run them as an unprivileged --job-user"),
    ],
)
def test_jobs_as_the_servers_user_are_told_the_fix_that_applies(
    euid: int, user: str, fix: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(isolation.os, "geteuid", lambda: euid)
    line = JobIsolation(user=user, uid=euid, gid=euid, switch=False, work_root=tmp_path).describe()
    assert line.startswith(f"jobs run as the server's user {user}: NOT isolated") and f"({fix})" in line
