"""`python -m gpuyard.scheduler.executors.worker TASK.json RESULT.json`: run one task as a process.

This is the command a scheduled job runs for a task (a trial, a fold, a pipeline stage). The result
file is written only on success (``{"result": ...}``); on failure the process prints one line and
exits non-zero (2 for a user error, 1 for anything else).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpuyard.errors import GpuyardError
from gpuyard.exitcodes import exit_now


def main(argv: list[str] | None = None) -> int:
    """Run the task in ``argv[0]`` and write its result to ``argv[1]``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m gpuyard.scheduler.executors.worker TASK.json RESULT.json", file=sys.stderr)
        return 2
    from gpuyard.scheduler.executors.tasks import run_task

    # Threads: the executors set OMP_NUM_THREADS=1 in the job's environment, which torch and BLAS read
    # when (and if) the task imports them; importing torch here would cost seconds for sklearn tasks.
    try:
        result = run_task(Path(args[0]).read_text())
    except GpuyardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out = Path(args[1])
    tmp = out.with_suffix(".part")
    tmp.write_text(json.dumps({"result": result}))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    # The result file is written (or the error said) and the task closed what it opened.
    exit_now(main())
