"""`gpuyard train`: check the spec, start torchrun (elastic, restarts, rendezvous) and map the outcome.

The launcher splits a dry run (:func:`torchrun_command`, inspectable) from carrying it out
(:func:`launch`). Workers report how the run ended in ``<run_dir>/status.json``; the launcher turns
it into the exit code the scheduler understands (see ``gpuyard.exitcodes``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
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
from gpuyard.train.names import LAUNCHED_ENV, SNAPSHOT_DIR_ENV, STATUS_FALLBACK_ENV, STATUS_FILE
from gpuyard.train.spec import TrainSpec, load_plan, load_spec
from gpuyard.train.status import UNKNOWN, StatusFileError, TrainStatus, read_status

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
        fresh: start a new run even when the run folder holds one (the old folder is kept, renamed).
        world_size: the job's ranks over all its nodes, when nodes run different numbers of them (a
            gang placed 8 + 4); None: nproc x nnodes (equal nodes). Every check made before the
            ranks start (the parallel layout, resuming a checkpoint) uses it.
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
    fresh: bool = False
    world_size: int | None = None

    @property
    def world(self) -> int:
        """The job's ranks over all its nodes."""
        return self.world_size if self.world_size is not None else self.nproc * self.nnodes


# The ranks' stderr goes to this file in the run folder (appended); the terminal gets gpuyard's own
# lines and a summary of restarts, not the tracebacks of every attempt.
LOG_FILE = "train.log"


def spec_folder(spec_path: str | Path) -> str:
    """The folder of the spec: first on the import path of the launcher and the ranks."""
    return str(Path(spec_path).expanduser().resolve().parent)


def _on_import_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)


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
    check_world_size(cfg)
    overrides: dict[str, Any] = {}
    if cfg.run_dir:
        overrides["run_dir"] = str(Path(cfg.run_dir).expanduser().resolve())
    if cfg.plan_path:
        overrides["parallel"] = load_plan(cfg.plan_path)
    tracking = {"backend": cfg.tracking, "experiment": cfg.experiment}
    if any(tracking.values()):
        overrides["tracking"] = {k: v for k, v in tracking.items() if v}
    spec = load_spec(cfg.spec_path, overrides)
    _on_import_path(spec_folder(cfg.spec_path))  # `model: shapes:make` next to the spec
    for field, ref in _entrypoints(spec):
        import_ref(ref, field)
    from gpuyard.train.elastic import check_resume

    try:
        layout = resolve_layout(spec.parallel, cfg.world)
        check_resume(spec, layout)  # a resume at another world size the workers would refuse
    except ConfigError as exc:
        if cfg.nnodes == 1:
            raise
        # Say where this launcher's world size came from: one of the nodes may run other counts.
        raise ConfigError(f"{exc} ({_world_source(cfg)})") from None
    if cfg.nnodes > 1 and cfg.nproc % layout.tp:
        # torchrun numbers each node's ranks in one block and tp groups are blocks of tp ranks: one
        # crosses this node's edge exactly when tp does not divide its ranks (an unequal gang's too).
        _log.warning(
            "gpuyard train: warning: parallel.tp=%d does not divide --nproc %d on this node: a "
            "tensor-parallel group spans two nodes (its collectives of every layer go over the network)",
            layout.tp,
            cfg.nproc,
        )
    return spec, overrides


def check_components(cfg: LaunchConfig, spec: TrainSpec) -> None:
    """What a rank builds before its first step, built here as rank 0 would, without a process group:
    the model (its factory and kwargs) and the train and val data (factories, kwargs, datasets and
    splits). `gpuyard train --dry-run` runs it, so a spec error is caught before any process starts
    (for a model loaded from weights, this loads them once).

    Raises:
        ConfigError: what the ranks would stop on, in the same words.
    """
    from types import SimpleNamespace

    from gpuyard.train.parallel import resolve_layout
    from gpuyard.train.trainer import Trainer

    trainer = Trainer(spec)
    trainer.ctx = SimpleNamespace(layout=resolve_layout(spec.parallel, cfg.world), dp_rank=0)  # type: ignore[assignment]
    trainer._build_model()
    trainer._build_source("train")
    trainer._build_source("val")


def check_world_size(cfg: LaunchConfig) -> None:
    """Refuse a --world-size this node's part cannot belong to: on one node it is --nproc; over
    several, at least --nproc here plus one rank on each other node (more is possible: other nodes
    may run more ranks than this one).

    Raises:
        ConfigError: naming --world-size and the least (or the only) value that fits.
    """
    world = cfg.world_size
    if world is None:
        return
    if cfg.nnodes == 1 and world != cfg.nproc:
        raise ConfigError(
            f"--world-size {world}: one node (--nnodes 1) runs --nproc {cfg.nproc} ranks; "
            f"give --world-size {cfg.nproc} or leave it out"
        )
    least = cfg.nproc + cfg.nnodes - 1
    if world < least:
        raise ConfigError(
            f"--world-size {world} is too small: --nproc {cfg.nproc} ranks on this node and at least one "
            f"on each of the other {cfg.nnodes - 1} node(s) of --nnodes {cfg.nnodes} make at least {least}"
        )
    if world != cfg.nproc * cfg.nnodes and os.environ.get(_IDENTICAL_ENV) == "1":
        # torchrun would number the ranks as node rank x --nproc + local rank: wrong, or colliding.
        raise ConfigError(
            f"{_IDENTICAL_ENV}=1 makes torchrun number ranks as if every node ran --nproc {cfg.nproc}, "
            f"but this job's world is {world} over {cfg.nnodes} nodes: unset it"
        )


_IDENTICAL_ENV = "TORCH_ELASTIC_WORKER_IDENTICAL"


def _world_source(cfg: LaunchConfig) -> str:
    if cfg.world_size is not None:
        return f"world size {cfg.world} from --world-size; --nproc {cfg.nproc} on this node"
    return (
        f"world size {cfg.world} = --nproc {cfg.nproc} x --nnodes {cfg.nnodes}: give the job's total "
        f"with --world-size when its nodes run different numbers of ranks"
    )


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


LAUNCH_PREFIX = "gpuyard-launch-"
_PID_FILE = "launcher.pid"


def launch_dir(base: Path | None = None) -> Path:
    """A new private folder for this launch, in /dev/shm (host memory): in-memory snapshots
    (``snapshots/``) and, where the run folder's disk is full, the ranks' status.json.

    Its name is random and it is created 0700 by this process (``tempfile.mkdtemp``: O_EXCL, so a
    path planted in advance is never taken over); the ranks find it through the environment the
    launcher gives them (``GPUYARD_SNAPSHOT_DIR``), also after torchrun restarts them. It is removed
    when torchrun exits; folders of this user left by launchers that no longer run (killed
    outright) are removed here.
    """
    if base is None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    _remove_stale(base)
    folder = Path(tempfile.mkdtemp(prefix=LAUNCH_PREFIX, dir=base))
    fd = os.open(folder / _PID_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(str(os.getpid()))
    return folder


def _remove_stale(base: Path) -> None:
    """Remove this user's launch folders whose launcher is gone. Only real folders owned by this user
    with mode 0700 are touched (nobody else can have put anything in them); others are left alone."""
    uid = os.getuid()
    for stale in base.glob(f"{LAUNCH_PREFIX}*"):
        try:
            st = os.lstat(stale)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700:
                continue
            fd = os.open(stale / _PID_FILE, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as fh:
                pid = int(fh.read(32))
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (OSError, ValueError):  # being created, a live launcher, not one of ours
            continue


def already_complete(spec: TrainSpec, run_dir: Path) -> dict[str, Any] | None:
    """What the last launch reported, when it finished the run this spec describes: it completed
    (or stopped early) at the step of the newest checkpoint, and the spec asks for no more steps or
    epochs than it trained. None when there is something to train."""
    from gpuyard.train.checkpoint import latest_checkpoint, step_of

    if not spec.checkpoint.resume:
        return None
    try:
        report = read_status(run_dir)
    except StatusFileError as exc:  # not known to be complete: train (from the newest checkpoint)
        print(f"gpuyard train: warning: the last launch's outcome is unknown: {exc}", file=sys.stderr)
        return None
    if report is None or report.status not in (TrainOutcome.COMPLETED, TrainOutcome.EARLY_STOPPED):
        return None
    last = latest_checkpoint(run_dir / "checkpoints")
    step = report.step
    if last is None or step is None or step_of(last) != step:
        return None
    if report.status is TrainOutcome.COMPLETED:
        epoch = report.epoch
        done_steps = bool(spec.max_steps) and step >= (spec.max_steps or 0)
        done_epochs = epoch is not None and epoch >= spec.epochs
        if not (done_steps or done_epochs):
            return None
    return {**report.to_doc(), "checkpoint": str(last), "already_complete": True}


def _keep_aside(run_dir: Path) -> Path | None:
    """--fresh: rename the run folder to ``<name>.prev-<UTC time>`` (kept, never deleted)."""
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir.with_name(f"{run_dir.name}.prev-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.prev-{stamp}-{n}")
    run_dir.rename(target)
    return target


def launch(cfg: LaunchConfig, stdout: Any = None, stderr: Any = None) -> LaunchResult:
    """Start torchrun, forward SIGTERM/SIGINT to it, wait, and map the outcome to an exit code.

    Exit codes: 0 completed (or early-stopped); PREEMPTED (75) stopped by SIGTERM after a checkpoint;
    DIVERGED (76) non-finite loss; otherwise torchrun's own failure code (restarts exhausted).
    The launch and its end are events in metrics.jsonl; the run's goodput so far (all its launches)
    is in the result's status (``goodput``) and recorded with its database run.
    """
    spec, overrides = prepare(cfg)
    run_dir = spec.resolved_run_dir()
    previous = None
    if cfg.fresh:
        previous = _keep_aside(run_dir)
    else:
        done = already_complete(spec, run_dir)
        if done is not None:
            # Nothing to train: no torchrun, no new database run; the status names the earlier one.
            return LaunchResult(exitcodes.SUCCESS, done, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STATUS_FILE).unlink(missing_ok=True)
    _launch_event(run_dir, "launch", pid=os.getpid(), job_id=os.environ.get("GPUYARD_JOB_ID"))
    result = _launch(cfg, spec, overrides, run_dir, stdout, stderr)
    if previous is not None:
        result.status["previous_run_dir"] = str(previous)
    with contextlib.suppress(OSError):  # a full disk: the outcome is decided all the same
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
    private = launch_dir()
    path = os.pathsep.join(p for p in (spec_folder(cfg.spec_path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, LAUNCHED_ENV: "1", STATUS_FALLBACK_ENV: str(private), "PYTHONPATH": path}
    if spec.checkpoint.memory_every:
        snapshots = private / "snapshots"
        snapshots.mkdir(mode=0o700)
        env[SNAPSHOT_DIR_ENV] = str(snapshots)
    log = _RankLog(run_dir / LOG_FILE) if stderr is None else None
    # A session of its own: a signal reaches torchrun once (through us), which then stops its workers.
    try:
        proc = subprocess.Popen(
            torchrun_command(cfg, spec, overrides),
            env=env,
            stdout=stdout,
            stderr=subprocess.PIPE if log is not None else stderr,
            start_new_session=True,
            preexec_fn=_term_with_parent if sys.platform == "linux" else None,
        )
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    if log is not None and proc.stderr is not None:
        log.start(proc.stderr)

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
    fatal: TrainStatus | None = None
    try:
        while True:
            try:
                code = proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            if fatal is None and (fatal := _unrecoverable(run_dir, private, strict=False)) is not None:
                # A rank stopped on a failure a restart would repeat (a full disk); the others may
                # only see their peer gone, and torchrun would restart them into it: stop it now.
                proc.send_signal(signal.SIGTERM)
    finally:
        stop.set()
        meter.join()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if log is not None:
            log.close()
        unknown: str | None = None
        try:
            report = fatal or _unrecoverable(run_dir, private) or read_status(run_dir) or read_status(private)
        except StatusFileError as exc:
            report, unknown = None, str(exc)
        shutil.rmtree(private, ignore_errors=True)
    status: dict[str, Any] = report.to_doc() if report is not None else {}
    notes = _launch_notes(run_dir, log)
    if notes:
        status["notes"] = notes
    if log is not None:
        status["log"] = str(log.path)
    if report is not None and report.stopped_for_good:
        # The ranks stopped on a failure a restart would repeat (a full disk, a configuration error)
        # and said so.
        _close_tracked_run(spec, run_dir, RunStatus.FAILED, str(report.error))
        code = exitcodes.USAGE if report.config_error else report.status.exit_code
        return LaunchResult(code, status, run_dir)
    if report is not None and report.status is not TrainOutcome.FAILED:
        return LaunchResult(report.status.exit_code, status, run_dir)
    if unknown is not None:
        # A status.json no rank of this version writes: how the run ended is not known (its database
        # run is left as the ranks left it, not closed as failed).
        status.update(status=UNKNOWN, error=unknown)
        return LaunchResult(code if code > 0 else exitcodes.UNRECOVERABLE, status, run_dir)
    if signalled:
        # Stopped before the workers could report (e.g. during start-up): resumable from the last
        # checkpoint, or from the start.
        status = {"status": TrainOutcome.PREEMPTED, "signal": signalled[0]}
        _close_tracked_run(
            spec, run_dir, RunStatus.PREEMPTED, f"signal {signalled[0]} before the workers reported"
        )
        return LaunchResult(exitcodes.PREEMPTED, status, run_dir)
    code = code if code > 0 else 1
    status["status"] = TrainOutcome.FAILED.value
    if log is not None and log.last_error:
        status.setdefault("error", log.last_error)
    _close_tracked_run(
        spec, run_dir, RunStatus.FAILED, f"torchrun exited with code {code} (restarts exhausted)"
    )
    return LaunchResult(code, status, run_dir)


_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)|[\w.]+Exception): ")


class _RankLog:
    """torchrun's stderr (the ranks' too): every line appended to the run's train.log; lines gpuyard
    writes for the user (``gpuyard ...``) also to the terminal. Remembers which local ranks failed
    (torchrun's ``failed (exitcode: C) local_rank: R``) and the last exception line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failures: list[tuple[int, int]] = []  # (local rank, exit code), in order
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._fh: Any = None
        with contextlib.suppress(OSError):
            self._fh = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())

    def start(self, stream: Any) -> None:
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        # Read to the end whatever happens (torchrun would block on a full pipe); lines cut at 64 KiB.
        for raw in iter(lambda: stream.readline(65536), b""):
            line = raw.decode("utf-8", "replace")
            if self._fh is not None:
                try:
                    self._fh.write(line)
                except OSError:  # a full disk: the terminal still gets gpuyard's lines
                    self._fh = None
            text = line.rstrip("\n")
            if text.startswith("gpuyard"):
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(line)
                    sys.stderr.flush()
            elif (m := _FAILED.search(text)) is not None:
                self.failures.append((int(m.group(2)), int(m.group(1))))
            elif _EXCEPTION.match(text.strip()):
                self.last_error = text.strip()[:300]

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(10)
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()


def _unrecoverable(run_dir: Path, private: Path, strict: bool = True) -> TrainStatus | None:
    """The status a rank wrote when it stopped on an unrecoverable failure, if one did.

    Raises:
        StatusFileError: a status.json that is not a rank's (unless not ``strict``: then it is
            passed over, as while the run goes on, for the final read to report).
    """
    for folder in (run_dir, private):
        try:
            report = read_status(folder)
        except StatusFileError:
            if strict:
                raise
            continue
        if report is not None and report.stopped_for_good:
            return report
    return None


def _signal_name(code: int) -> str:
    if code >= 0:
        return f"exit {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _launch_notes(run_dir: Path, log: _RankLog | None) -> list[str]:
    """What this launch did besides training, from its events in metrics.jsonl: checkpoints set
    aside and the step resumed from; restarts (which rank died, from which step it resumed)."""
    from gpuyard.tracking.files import read_metrics

    try:
        events = read_metrics(run_dir)
    except (OSError, ValueError):
        return []
    starts = [i for i, e in enumerate(events) if e.get("event") == "launch"]
    events = events[starts[-1] :] if starts else events
    notes = []
    aside = [e for e in events if e.get("event") == "checkpoint_set_aside"]
    resumes = [e for e in events if e.get("event") == "resume"]
    attempts = [e for e in events if e.get("event") == "attempt"]
    if aside:
        what = ", ".join(f"step {e.get('step')} ({e.get('reason')})" for e in aside)
        start = attempts[0].get("step") if attempts else None
        resumed = f"resumed from step {start}" if start else "started from step 0"
        notes.append(f"{resumed} after setting aside {what}")
    restarts = [a for a in attempts if a.get("restart")]
    failures = list(log.failures) if log is not None else []
    for n, attempt in enumerate(restarts):
        died = (
            f"local rank {failures[n][0]} died ({_signal_name(failures[n][1])})"
            if n < len(failures)
            else "a rank died"
        )
        src = next((r.get("source") for r in resumes if r.get("step") == attempt.get("step")), None)
        where = f"step {attempt.get('step')}" + (f" ({src})" if src else "")
        notes.append(f"restart {attempt.get('restart')}: {died}; resumed from {where}")
    if restarts and log is not None:
        notes[-1] += f"; tracebacks in {log.path}"
    return notes


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
