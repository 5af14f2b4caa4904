"""exit_now: the process ends with its code and its output flushed, without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = """
import atexit, logging, sys
from gpuyard.exitcodes import exit_now
atexit.register(lambda: print("atexit ran"))
logging.basicConfig(stream=sys.stderr, format="%(message)s")
logging.getLogger("t").warning("logged")
print("buffered", end="")
sys.stderr.write("err buffered")
exit_now(3)
"""


def test_output_is_flushed_the_code_kept_and_atexit_skipped() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "buffered"  # flushed, and no "atexit ran": teardown skipped
    assert proc.stderr.splitlines() == ["logged", "err buffered"]
