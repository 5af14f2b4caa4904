"""The security tier: attacks a member could try, each expected to be refused.

The servers and their fixtures are the scheduler integration tests' own (real `gpuyard server`
processes on 127.0.0.1); tests that run jobs as other Unix users need root (CI has it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.integration.scheduler.conftest import server  # noqa: F401 - a fixture, used by name

IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture
def small_home(gpuyard_home: Path) -> Iterator[Path]:
    """GPUYARD_HOME on its own 64 MiB tmpfs (mounted here: needs root)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        if IN_CI:
            pytest.fail("CI runs the security tier as root: the full-disk test must run there")
        pytest.skip("mounting a small tmpfs as GPUYARD_HOME needs root")
    gpuyard_home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(gpuyard_home)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        if IN_CI:
            pytest.fail(f"cannot mount a tmpfs: {done.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield gpuyard_home
    finally:
        subprocess.run(["umount", "-l", str(gpuyard_home)], check=False)
