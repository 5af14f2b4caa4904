"""The job shim's log cap and start errors, and the reasons the local executor reads from them.

One small shim process each (no root needed): what reaches the log, the ``.why`` file it leaves, and
the :class:`ExitStatus` the executor makes of it (the reason `jobs ls`/`show` print, the events).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuyard.scheduler.executors.local import SHIM, _ended

pytestmark = pytest.mark.unit


def _shim(tmp_path: Path, argv: list[str], **job: Any) -> dict[str, Any]:
    """Run the shim once with a job file; the handle the executor would keep."""
    job_file, log = tmp_path / "job.json", tmp_path / "output.log"
    job_file.write_text(json.dumps({"env": None, "cwd": None, **job}))
    pid_file, exit_file = tmp_path / "a.pid", tmp_path / "a.exit"
    with open(log, "ab") as out:
        cmd = [sys.executable, "-I", "-S", str(SHIM), str(pid_file), str(exit_file), "--job", str(job_file)]
        subprocess.run([*cmd, "--", *argv], stdout=out, stderr=subprocess.STDOUT, timeout=60, check=False)
    limits = {
        "memory_bytes": None,
        "cpus": None,
        "pids": None,
        "nofile": None,
        "log_bytes": job.get("log_cap"),
    }
    return {"pid_file": str(pid_file), "exit_file": str(exit_file), "log": str(log), "limits": limits}


def test_output_past_the_cap_is_cut_with_a_notice_and_an_event(tmp_path: Path) -> None:
    code = "import sys\nsys.stdout.write('a' * 3000 + 'b' * 7000)\nprint('end', file=sys.stderr)"
    handle = _shim(tmp_path, [sys.executable, "-c", code], log_cap=4096)
    text = Path(handle["log"]).read_text()
    kept, _, rest = text.partition("\n[gpuyard: log cut here after 4096 bytes")
    assert kept == "a" * 3000 + "b" * 1096
    assert (
        rest.rstrip().splitlines()[-1]
        == "[gpuyard: log cut at 4096 bytes: 5908 more bytes of output discarded]"
    )
    status = _ended(handle, lost=False)
    assert status.code == 0 and status.describe() == "exit code 0"
    assert status.notes == ("log cut at 4096 bytes (--job-log-mb): 5908 more bytes of output discarded",)


def test_output_under_the_cap_is_whole_and_no_event(tmp_path: Path) -> None:
    handle = _shim(tmp_path, [sys.executable, "-c", "print('hello')"], log_cap=4096)
    assert Path(handle["log"]).read_text() == "hello\n"
    assert _ended(handle, lost=False).notes == ()


def test_a_program_that_does_not_exist_fails_with_why_in_its_reason(tmp_path: Path) -> None:
    handle = _shim(tmp_path, ["/nonexistent/prog"])
    status = _ended(handle, lost=False)
    assert status.code == 127
    assert status.describe().startswith("cannot start '/nonexistent/prog': [Errno 2] No such file")


def test_a_working_directory_it_cannot_enter_fails_with_why_in_its_reason(tmp_path: Path) -> None:
    handle = _shim(tmp_path, ["true"], cwd=str(tmp_path / "gone"))
    status = _ended(handle, lost=False)
    assert status.code == 126
    assert (
        status.describe()
        == f"cannot enter the working directory {tmp_path / 'gone'}: No such file or directory"
    )


def test_a_command_exiting_127_names_the_logs_last_line(tmp_path: Path) -> None:
    handle = _shim(tmp_path, ["sh", "-c", "no-such-command-gy"])
    status = _ended(handle, lost=False)
    assert status.code == 127 and status.describe().startswith("exit code 127: sh:")
    assert "no-such-command-gy" in status.describe() and "not found" in status.describe()


def test_rlimits_reach_the_command(tmp_path: Path) -> None:
    code = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE))"
    handle = _shim(tmp_path, [sys.executable, "-c", code], rlimits={"NOFILE": 256})
    assert Path(handle["log"]).read_text().strip() == "(256, 256)"
