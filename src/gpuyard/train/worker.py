"""What each rank runs under torchrun: `python -m gpuyard.train.worker SPEC.yaml [--run-dir D]`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gpuyard import exitcodes
from gpuyard.errors import ConfigError, GpuyardError, NotFoundError
from gpuyard.exitcodes import exit_now
from gpuyard.train.names import LAUNCHED_ENV


def main(argv: list[str] | None = None) -> int:
    """Run one rank of the job; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="gpuyard.train.worker")
    parser.add_argument("spec")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--parallel", default=None, help="JSON {dp, tp, pp} overriding spec.parallel")
    parser.add_argument("--plan", default=None, help="the plan file --parallel came from (recorded)")
    parser.add_argument("--tracking", default=None, help="JSON overriding fields of spec.tracking")
    args = parser.parse_args(argv)

    from gpuyard.train.checkpoint import CheckpointSaveError, DiskFullError
    from gpuyard.train.spec import load_spec
    from gpuyard.train.trainer import Trainer

    _spec_folder_on_path(args.spec)
    trainer = None
    rank = os.environ.get("RANK", "0")
    try:
        spec = load_spec(args.spec, overrides=_overrides(args))
        run_params = {"plan": {"file": args.plan, **json.loads(args.parallel)}} if args.plan else None
        trainer = Trainer(spec, run_params=run_params)
        result = trainer.fit()
    except GpuyardError as exc:
        print(f"gpuyard train (rank {rank}): error: {exc}", file=sys.stderr, flush=True)
        configuration = isinstance(exc, (ConfigError, NotFoundError))  # not a store or capacity error
        if configuration and os.environ.get(LAUNCHED_ENV) == "1" and _report_config_error(str(exc), rank):
            # A configuration error is the same on every start: exit 0 so that torchrun does not
            # restart into it; the launcher reads the status and exits with the usage code.
            return exitcodes.SUCCESS
        return exitcodes.USAGE
    except (CheckpointSaveError, DiskFullError) as exc:
        if not exc.disk_full:
            raise  # (a peer lost mid-save, say): torchrun's restart may well get past it
        if rank == "0":
            print(f"gpuyard train (rank {rank}): error: {exc}", file=sys.stderr, flush=True)
        # Every rank got it (the ranks agree on a save's outcome); under the launcher, which reads
        # status.json, exit 0 so that torchrun does not restart into the same full disk.
        return exitcodes.SUCCESS if os.environ.get(LAUNCHED_ENV) == "1" else exitcodes.UNRECOVERABLE
    finally:
        if trainer is not None:
            trainer.close()
    code = result.status.exit_code
    if os.environ.get(LAUNCHED_ENV) == "1" and code in (exitcodes.PREEMPTED, exitcodes.DIVERGED):
        return exitcodes.SUCCESS
    return code


def _report_config_error(error: str, rank: str) -> bool:
    """Tell the launcher (its private status folder) that this rank stopped on a configuration error,
    which a restart would repeat; False when there is no such folder or it cannot be written."""
    from pathlib import Path

    from gpuyard.states import TrainOutcome
    from gpuyard.train.names import STATUS_FALLBACK_ENV, STATUS_FILE
    from gpuyard.train.status import TrainStatus, write_status

    folder = os.environ.get(STATUS_FALLBACK_ENV)
    if not folder:
        return False
    report = TrainStatus(
        TrainOutcome.FAILED,
        unrecoverable=True,
        config_error=True,
        error=error,
        rank=int(rank) if rank.isdigit() else None,
    )
    try:  # ranks may report at once: each through a temporary file of its own
        write_status(report, [Path(folder)], f".{STATUS_FILE}.{rank if rank.isdigit() else 'x'}.tmp")
    except OSError:
        return False
    return True


def _spec_folder_on_path(spec: str) -> None:
    """The spec's folder first on the import path: `model: shapes:make` imports shapes.py next to it
    (the launcher also puts it in the ranks' PYTHONPATH, for imports before this runs)."""
    folder = os.path.dirname(os.path.abspath(spec))
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    if args.run_dir:
        out["run_dir"] = args.run_dir
    if args.parallel:
        out["parallel"] = json.loads(args.parallel)
    if args.tracking:
        out["tracking"] = json.loads(args.tracking)
    return out


if __name__ == "__main__":
    # By then the run has closed what it wrote (checkpoints waited for, trackers flushed, the process
    # group left); the threads still alive are daemons, which a normal exit abandons too.
    exit_now(main())
