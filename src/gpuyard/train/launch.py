"""`gpuyard train`: check the spec, start torchrun (elastic, restarts, rendezvous) and map the outcome.

The launcher splits a dry run (:func:`torchrun_command`, inspectable) from carrying it out
(:func:`launch`). Workers report how the run ended in ``<run_dir>/status.json``; the launcher turns
it into the exit code the scheduler understands (see ``gpuyard.exitcodes``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuyard import exitcodes
from gpuyard.errors import ConfigError
from gpuyard.refs import import_ref
from gpuyard.states import RunStatus, TrainOutcome
from gpuyard.tracking.training import tracked_run_id
from gpuyard.train.names import LAUNCHED_ENV, SNAPSHOT_DIR_ENV, STATUS_FILE
from gpuyard.train.spec import TrainSpec, load_plan, load_spec

_log = logging.getLogger("gpuyard.train")


@dataclass(frozen=True)
class LaunchConfig:
    """How to start a training job.

    Attributes:
        spec_path: the SPEC.yaml.
        nproc: processes (ranks) per node.
        nnodes: nodes taking part (>1 needs rdzv).
        rdzv: HOST:PORT of the c10d rendezvous (same on every node).
        max_restarts: worker-group restarts after a failure (None: the spec's max_restarts).
        run_dir: overrides spec.run_dir.
        plan_path: a `gpuyard plan --json` file whose {dp, tp, pp} override spec.parallel.
        tracking: overrides spec.tracking.backend (db or jsonl).
        experiment: overrides spec.tracking.experiment.
    """

    spec_path: Path
    nproc: int = 1
    nnodes: int = 1
    rdzv: str | None = None
    max_restarts: int | None = None
    run_dir: str | None = None
    plan_path: Path | None = None
    tracking: str | None = None
    experiment: str | None = None


@dataclass(frozen=True)
class LaunchResult:
    """Outcome of a launched job: the exit code for the scheduler and what the workers reported."""

    exit_code: int
    status: dict[str, Any]
    run_dir: Path


def prepare(cfg: LaunchConfig) -> tuple[TrainSpec, dict[str, Any]]:
    """Validate everything checkable before starting processes: fields, entrypoints, mesh layout.

    Returns:
        The spec (with overrides applied) and the overrides to hand to the workers.

    Raises:
        ConfigError: naming the field, entrypoint or option at fault.
    """
    from gpuyard.train.parallel import resolve_layout

    if cfg.nproc < 1 or cfg.nnodes < 1:
        raise ConfigError(f"--nproc {cfg.nproc} / --nnodes {cfg.nnodes}: must be at least 1")
    if cfg.nnodes > 1 and not cfg.rdzv:
        raise ConfigError("--rdzv HOST:PORT is required with --nnodes > 1 (every node uses the same one)")
    overrides: dict[str, Any] = {}
    if cfg.run_dir:
        overrides["run_dir"] = str(Path(cfg.run_dir).expanduser().resolve())
    if cfg.plan_path:
        overrides["parallel"] = load_plan(cfg.plan_path)
    tracking = {"backend": cfg.tracking, "experiment": cfg.experiment}
    if any(tracking.values()):
        overrides["tracking"] = {k: v for k, v in tracking.items() if v}
    spec = load_spec(cfg.spec_path, overrides)
    for field, ref in _entrypoints(spec):
        import_ref(ref, field)
    layout = resolve_layout(spec.parallel, cfg.nproc * cfg.nnodes)
    from gpuyard.train.elastic import check_resume

    check_resume(spec, layout)  # a resume at another world size the workers would refuse
    return spec, overrides


def _entrypoints(spec: TrainSpec) -> list[tuple[str, str]]:
    refs = []
    if spec.model:
        refs.append(("model.entrypoint", spec.model.entrypoint))
    if spec.data.train:
        refs.append(("data.train.entrypoint", spec.data.train.entrypoint))
    if spec.data.val:
        refs.append(("data.val.entrypoint", spec.data.val.entrypoint))
    if ":" in spec.loss:
        refs.append(("loss", spec.loss))
    refs.extend(("callbacks", c) for c in spec.callbacks)
    return refs


def torchrun_command(cfg: LaunchConfig, spec: TrainSpec, overrides: dict[str, Any]) -> list[str]:
    """The torchrun (torch.distributed.run) command line for this job, without running it."""
    restarts = spec.max_restarts if cfg.max_restarts is None else cfg.max_restarts
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.nproc}",
        f"--max-restarts={restarts}",
    ]
    if cfg.rdzv:
        cmd += [
            f"--nnodes={cfg.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv}",
            f"--rdzv-id={spec.name}",
        ]
    else:
        cmd += ["--standalone", "--nnodes=1"]
    cmd += [
        "-m",
        "gpuyard.train.worker",
        str(Path(cfg.spec_path).resolve()),
        "--run-dir",
        str(spec.resolved_run_dir()),
    ]
    if "parallel" in overrides:
        cmd += ["--parallel", json.dumps(overrides["parallel"])]
        if cfg.plan_path:
            cmd += ["--plan", str(Path(cfg.plan_path).resolve())]
    if "tracking" in overrides:
        cmd += ["--tracking", json.dumps(overrides["tracking"])]
    return cmd


def _term_with_parent() -> None:
    """In the torchrun child, before exec: get SIGTERM when the launcher dies (even by SIGKILL).

    torchrun runs in a session of its own, so without this a launcher killed outright would leave
    torchrun and its workers running; with it they checkpoint and stop as on preemption.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """What the workers reported in status.json ({} when they did not get that far)."""
    path = Path(run_dir) / STATUS_FILE
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError):
        return {}


SNAPSHOT_PREFIX = "gpuyard-snap-launch-"


def snapshot_dir(base: Path | None = None) -> Path:
    """The node's folder for in-memory snapshots of this launch, in /dev/shm (host memory).

    The launcher owns it: it outlives the ranks and torchrun's restarts of them, and is removed when
    torchrun exits. Folders left by launchers that no longer run (killed outright) are removed here.
    """
    if base is None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    for stale in base.glob(f"{SNAPSHOT_PREFIX}*"):
        try:
            pid = int(stale.name[len(SNAPSHOT_PREFIX) :])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:  # another user's live launcher
            continue
    return base / f"{SNAPSHOT_PREFIX}{os.getpid()}"


def launch(cfg: LaunchConfig, stdout: Any = None, stderr: Any = None) -> LaunchResult:
    """Start torchrun, forward SIGTERM/SIGINT to it, wait, and map the outcome to an exit code.

    Exit codes: 0 completed (or early-stopped); PREEMPTED (75) stopped by SIGTERM after a checkpoint;
    DIVERGED (76) non-finite loss; otherwise torchrun's own failure code (restarts exhausted).
    The launch and its end are events in metrics.jsonl; the run's goodput so far (all its launches)
    is in the result's status (``goodput``) and recorded with its database run.
    """
    spec, overrides = prepare(cfg)
    run_dir = spec.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STATUS_FILE).unlink(missing_ok=True)
    _launch_event(run_dir, "launch", pid=os.getpid(), job_id=os.environ.get("GPUYARD_JOB_ID"))
    result = _launch(cfg, spec, overrides, run_dir, stdout, stderr)
    _launch_event(run_dir, "launch_end", exit_code=result.exit_code)
    _record_goodput(spec, run_dir, result.status)
    return result


def _launch_event(run_dir: Path, name: str, **fields: Any) -> None:
    """Append an event to metrics.jsonl (no rank writes to it before torchrun starts or after it ends)."""
    line = json.dumps({"time": round(time.time(), 3), "event": name, **fields})
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(line + "\n")


# While torchrun runs, the run's goodput is recorded this often (more seldom when computing it takes
# long: at most 5% of the time), so a job's goodput is split by its run's causes as it goes.
GOODPUT_EVERY_S = 60.0


def _record_goodput(spec: TrainSpec, run_dir: Path, status: dict[str, Any], now: float | None = None) -> None:
    """Put the run's goodput into ``status`` and keep it with the database run (never fatal).
    ``now``: the launch is still running (its time so far)."""
    from gpuyard.train.goodput import record, run_goodput

    try:
        goodput = run_goodput(run_dir, now)
    except (OSError, ValueError) as exc:
        _log.warning("gpuyard train: warning: goodput not computed: %s", exc)
        return
    if goodput is None:
        return
    status["goodput"] = goodput
    run_id = tracked_run_id(run_dir)
    if spec.tracking.backend != "db" or run_id is None:
        return
    try:
        record(run_id, goodput)
    except Exception as exc:  # the database is a record of the outcome, not part of it
        _log.warning("gpuyard train: warning: could not record goodput of run %s: %s", run_id[:8], exc)


def _goodput_loop(spec: TrainSpec, run_dir: Path, stop: threading.Event) -> None:
    every = GOODPUT_EVERY_S
    while not stop.wait(every):
        began = time.monotonic()
        _record_goodput(spec, run_dir, {}, now=time.time())
        every = max(GOODPUT_EVERY_S, 20 * (time.monotonic() - began))


def _launch(
    cfg: LaunchConfig,
    spec: TrainSpec,
    overrides: dict[str, Any],
    run_dir: Path,
    stdout: Any,
    stderr: Any,
) -> LaunchResult:
    env = {**os.environ, LAUNCHED_ENV: "1"}
    snapshots = None
    if spec.checkpoint.memory_every:
        snapshots = snapshot_dir()
        snapshots.mkdir(mode=0o700, parents=True, exist_ok=True)
        env[SNAPSHOT_DIR_ENV] = str(snapshots)
    # A session of its own: a signal reaches torchrun once (through us), which then stops its workers.
    proc = subprocess.Popen(
        torchrun_command(cfg, spec, overrides),
        env=env,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=_term_with_parent if sys.platform == "linux" else None,
    )

    signalled = []

    def forward(signum: int, frame: Any) -> None:
        signalled.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = threading.Event()
    # On a thread of its own: the main thread keeps forwarding signals at once.
    meter = threading.Thread(target=_goodput_loop, args=(spec, run_dir, stop), daemon=True)
    meter.start()
    try:
        code = proc.wait()
    finally:
        stop.set()
        meter.join()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if snapshots is not None:
            shutil.rmtree(snapshots, ignore_errors=True)
    status = read_status(run_dir)
    if status.get("status") in set(TrainOutcome):
        return LaunchResult(TrainOutcome(status["status"]).exit_code, status, run_dir)
    if signalled:
        # Stopped before the workers could report (e.g. during start-up): resumable from the last
        # checkpoint, or from the start.
        status = {"status": TrainOutcome.PREEMPTED, "signal": signalled[0]}
        _close_tracked_run(
            spec, run_dir, RunStatus.PREEMPTED, f"signal {signalled[0]} before the workers reported"
        )
        return LaunchResult(exitcodes.PREEMPTED, status, run_dir)
    code = code if code > 0 else 1
    _close_tracked_run(
        spec, run_dir, RunStatus.FAILED, f"torchrun exited with code {code} (restarts exhausted)"
    )
    return LaunchResult(code, status, run_dir)


def _close_tracked_run(spec: TrainSpec, run_dir: Path, status: RunStatus, error: str) -> None:
    """Close the database run that workers killed outright left marked running (never fatal)."""
    run_id = tracked_run_id(run_dir)
    if spec.tracking.backend != "db" or run_id is None:
        return
    try:
        from gpuyard.tracking.store import close_run

        close_run(run_id, status, error)
    except Exception as exc:  # the job's outcome is already decided; the database is a record of it
        _log.warning("gpuyard train: warning: could not close run %s in the database: %s", run_id[:8], exc)
