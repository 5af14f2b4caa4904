"""A run in the state store: parameters, metric series, tags, artifacts, system metrics, lineage.

:class:`DbTracker` has the three methods the training runtime's tracking interface asks for
(``log_params``, ``log_metrics(step, dict)``, ``finish``), so a trainer handed one records straight into
the database instead of JSON lines. Metric points are buffered and written in batches by the run's one
writer thread (one executemany INSERT every 2 s or 500 points): a transaction per training step would
cost more than the step of a small model, and the training thread should never wait for the database.
A caller with a database thread of its own (the trainer's :mod:`gpuyard.tracking.training`) opens the
run without a writer and calls :meth:`DbTracker.tick` from that thread instead.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError, ConflictError, NotFoundError, StoreError
from gpuyard.settings import TEAM_ENV
from gpuyard.states import RunStatus
from gpuyard.store import get_artifacts, get_store
from gpuyard.store.base import utcnow
from gpuyard.store.db import Store
from gpuyard.store.tables.models import RunArtifactRow, RunMetricRow, RunRow

RUN_KINDS = ("train", "tune", "trial", "cv", "fold", "eval", "retrain")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.\-/ ]{1,200}$")
TEAM_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
FLUSH_EVERY_POINTS = 500
# Past this many unwritten points the training thread writes them itself (the database is behind).
MAX_BUFFERED_POINTS = 100_000
FLUSH_EVERY_S = 2.0


def code_version(cwd: str | Path | None = None) -> str | None:
    """The git commit of ``cwd`` (suffixed ``-dirty`` when there are uncommitted changes), or None.

    One ``git status`` gives both (``--branch`` prints the commit): each git process started from a
    training process costs tens of milliseconds at the start of every run.
    """
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain=v2", "--branch", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.splitlines()
    head = next((line.split()[2] for line in lines if line.startswith("# branch.oid ")), "")
    if not re.fullmatch(r"[0-9a-f]{40,64}", head):  # "(initial)": no commit yet
        return None
    dirty = any(line and not line.startswith("#") for line in lines)
    return f"{head}-dirty" if dirty else head


def system_info() -> dict[str, Any]:
    """Where the run ran: host, Python, library versions, CPUs, memory and GPUs when torch sees any."""
    import psutil

    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "pid": os.getpid(),
    }
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:  # PackageNotFoundError, or broken metadata: the field is optional
        pass
    torch = sys.modules.get("torch")  # only when the run already uses torch: importing it costs seconds
    if torch is not None and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def check_metric_key(key: object) -> str:
    """Return ``key`` when it is a usable metric or parameter name, else raise ConfigError."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ConfigError(
            f"metric name {key!r} is invalid: use 1-200 characters among letters, digits, '_', '-', '.', '/'"
        )
    return key


def _as_float(key: str, value: object) -> float | None:
    if isinstance(value, bool) or (not isinstance(value, int | float) and not hasattr(value, "item")):
        raise ConfigError(f"metric {key!r}: value {value!r} is not a number")
    number = float(value.item() if hasattr(value, "item") else value)  # type: ignore[union-attr,arg-type]
    return number if math.isfinite(number) else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)


class DbTracker:
    """One run recorded in the state store. Create with :func:`start_run`.

    Thread-safe: a writer thread (or the caller's own, through :meth:`tick`) writes buffered points
    and samples system metrics.
    """

    def __init__(
        self,
        store: Store,
        run_id: str,
        system_interval_s: float | None = 10.0,
        system_step: int = 0,
        writer: bool = True,
    ) -> None:
        self.store = store
        self.run_id = run_id
        # Plain tuples, written with one driver-level executemany: ORM objects cost ~100 us per point to
        # build and flush, and SQLAlchemy's per-row parameter processing another ~20 us.
        self._buffer: list[tuple[str, str, int, float | None, datetime]] = []
        self._keys: set[str] = set()
        self._lock = threading.Lock()
        self._finished = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        # A reopened run (a resumed training job) continues its system series after the last point.
        self._sys_step = system_step
        self._sys_interval = system_interval_s
        self._sample_system()
        self._last_sample = self._last_flush = time.monotonic()
        self._writer: threading.Thread | None = None
        if writer:
            self._writer = threading.Thread(
                target=self._background, name=f"tracker-{run_id[:8]}", daemon=True
            )
            self._writer.start()

    # -- the training runtime's tracking interface --------------------------------------------------

    def log_params(self, params: dict[str, Any]) -> None:
        """Merge ``params`` into the run's parameters (later calls override earlier keys)."""
        for key in params:
            check_metric_key(key)
        with self.store.session() as s:
            row = self._row(s)
            row.params = {**row.params, **_jsonable(params)}

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` at ``step``; written in batches, always by :meth:`flush` or :meth:`finish`."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"metric step {step!r} must be a non-negative integer")
        now = utcnow()
        keys = self._keys
        rows = []
        for k, v in metrics.items():
            if k not in keys:  # a regex per point costs more than the rest of this call
                keys.add(check_metric_key(k))
            rows.append((self.run_id, k, step, _as_float(k, v), now))
        with self._lock:
            self._buffer.extend(rows)
            pending = len(self._buffer)
        if pending >= MAX_BUFFERED_POINTS:
            self.flush()  # back-pressure: the writer thread is not keeping up
        elif pending >= FLUSH_EVERY_POINTS:
            self._wake.set()

    def finish(
        self, status: str = RunStatus.FINISHED, error: str | None = None, tags: dict[str, Any] | None = None
    ) -> None:
        """Flush, stop the system sampler and close the run with ``status`` (see :meth:`RunStatus.ended_as`),
        merging ``tags`` into the run's in the same transaction.

        Raises:
            ConfigError: a status a run cannot end with. StoreError: metric points could not be written.
        """
        ended = RunStatus.ended_as(status)
        if self._finished:
            return
        self._finished = True
        self._stop.set()
        self._wake.set()
        if self._writer is not None:
            self._writer.join(timeout=30)
        self._sample_system()
        self.flush()
        if self._error is not None:
            raise StoreError(f"run {self.run_id[:8]}: metric points could not be written: {self._error}")
        with self.store.session() as s:
            row = self._row(s)
            row.status, row.error, row.ended_at = ended, error, utcnow()
            if tags:
                row.tags = {**row.tags, **_jsonable(tags)}

    # -- more than the interface --------------------------------------------------------------------

    @property
    def write_error(self) -> BaseException | None:
        """The error of the background writer's last failed flush (those points are lost), or None."""
        return self._error

    def log_event(self, event: str, **fields: Any) -> None:
        """Record a free-form event (resume, checkpoint, stop) in the run's ``events`` tag (last 100 kept)."""
        with self.store.session() as s:
            row = self._row(s)
            events = list(row.tags.get("events", []))[-99:]
            events.append({"event": event, "at": utcnow().isoformat(), **_jsonable(fields)})
            row.tags = {**row.tags, "events": events}

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Merge ``tags`` (free-form labels) into the run."""
        with self.store.session() as s:
            row = self._row(s)
            row.tags = {**row.tags, **_jsonable(tags)}

    def set_dataset_version(self, dataset_version: str) -> None:
        """Record the dataset version (``name@version``) the run used."""
        with self.store.session() as s:
            self._row(s).dataset_version = dataset_version

    def log_artifact(self, name: str, src: bytes | str | Path) -> RunArtifactRow:
        """Store a file (or bytes) as artifact ``name`` of the run; replaces an artifact of that name."""
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ConfigError(f"artifact name {name!r} must be a relative path without '..'")
        info = get_artifacts().put(f"runs/{self.run_id}/{name}", src)
        with self.store.session() as s:
            old = s.query(RunArtifactRow).filter_by(run_id=self.run_id, name=name).one_or_none()
            if old is not None:
                s.delete(old)
                s.flush()
            row = RunArtifactRow(
                run_id=self.run_id, name=name, key=info.key, sha256=info.sha256, size=info.size
            )
            s.add(row)
        return row

    def tick(self, force: bool = False) -> None:
        """Sample system metrics when due; write the buffered points when 500 have gathered, 2 s have
        passed since the last write, or ``force``: the writer's loop, for a run opened without one.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: the database refused the points (they are lost).
        """
        now = time.monotonic()
        if self._sys_interval and now - self._last_sample >= self._sys_interval:
            self._sample_system()
            self._last_sample = now
        with self._lock:
            pending = len(self._buffer)
        if force or pending >= FLUSH_EVERY_POINTS or now - self._last_flush >= FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Write buffered metric points now."""
        self._last_flush = time.monotonic()
        with self._lock:
            rows, self._buffer = self._buffer, []
        if rows:
            with self.store.session() as s:
                conn = s.connection()
                if conn.dialect.name == "sqlite":
                    # The text form SQLAlchemy's SQLite DateTime writes (UTC), so reads parse it back.
                    fmt = "%Y-%m-%d %H:%M:%S.%f"
                    params: list[tuple[Any, ...]] = [
                        (*r[:4], r[4].astimezone(timezone.utc).strftime(fmt)) for r in rows
                    ]
                    mark = "?"
                else:
                    params, mark = list(rows), "%s"
                columns = "run_id, key, step, value, logged_at"
                marks = ", ".join([mark] * 5)
                conn.exec_driver_sql(f"INSERT INTO run_metrics ({columns}) VALUES ({marks})", params)

    def __enter__(self) -> DbTracker:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.finish(RunStatus.FINISHED)
        else:
            self.finish(RunStatus.FAILED, error=f"{type(exc).__name__}: {exc}"[:2000])

    # -- internals ----------------------------------------------------------------------------------

    def _row(self, s: Any) -> RunRow:
        row = s.get(RunRow, self.run_id)
        if row is None:
            raise ConflictError(f"run {self.run_id} was deleted while it was being tracked")
        return row  # type: ignore[no-any-return]

    def _sample_system(self) -> None:
        import psutil

        proc = psutil.Process()
        points: dict[str, float] = {
            "sys/cpu_percent": psutil.cpu_percent(interval=None),
            "sys/memory_percent": psutil.virtual_memory().percent,
            "sys/process_rss_mb": proc.memory_info().rss / 2**20,
        }
        torch = sys.modules.get("torch")
        # Another thread may be importing torch right now (a partial module without .cuda yet): then
        # this sample has no GPU figures rather than failing the run's metrics.
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        with contextlib.suppress(AttributeError):
            if cuda is not None and cuda.is_available():
                for i in range(cuda.device_count()):
                    points[f"sys/gpu{i}_memory_mb"] = cuda.memory_allocated(i) / 2**20
        self._sys_step += 1
        with self._lock:
            now = utcnow()
            self._buffer.extend((self.run_id, k, self._sys_step, v, now) for k, v in points.items())

    def _background(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(FLUSH_EVERY_S)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.tick(force=True)
            except Exception as exc:  # kept, and raised by finish(): never kill training from here
                self._error = exc


def start_run(
    name: str,
    *,
    experiment: str = "default",
    kind: str = "train",
    params: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
    dataset_version: str | None = None,
    parent_id: str | None = None,
    system_interval_s: float | None = 10.0,
    store: Store | None = None,
    run_id: str | None = None,
    started_at: datetime | None = None,
    writer: bool = True,
    team: str | None = None,
) -> DbTracker:
    """Open a new run in the state store and return its tracker.

    Args:
        name: a human-readable name (several runs may share it).
        experiment: group of runs compared together.
        kind: one of train, tune, trial, cv, fold, eval, retrain.
        params: hyperparameters and settings.
        tags: free-form labels.
        dataset_version: the ``name@version`` of the data the run reads.
        parent_id: the tuning study or cross-validation this run belongs to.
        system_interval_s: seconds between CPU/memory/GPU samples; None samples only at start and end.
        store: the state store (default: the configured one).
        run_id: the id to give the run (32 hex digits; default: a new random one). The training
            runtime chooses it up front so the run folder names its run before the database answers.
        started_at: when the run started (default: now), for a run recorded after it began.
        writer: start the run's writer thread (False: the caller calls :meth:`DbTracker.tick`).
        team: the team the run belongs to (default: the parent run's, else GPUYARD_TEAM, which
            `gpuyard server` sets for its jobs, else ``default``).

    Raises:
        ConfigError: bad kind, names, team or run id.
    """
    if kind not in RUN_KINDS:
        raise ConfigError(f"run kind {kind!r} must be one of {', '.join(RUN_KINDS)}")
    if not name or len(name) > 200 or not experiment or len(experiment) > 200:
        raise ConfigError("run name and experiment must be 1-200 characters")
    for key in params or {}:
        check_metric_key(key)
    if run_id is not None and not re.fullmatch(r"[0-9a-f]{32}", run_id):
        raise ConfigError(f"run id {run_id!r} must be 32 lowercase hex digits")
    store = store or get_store()
    run_id = run_id or uuid.uuid4().hex
    with store.session() as s:
        parent = s.get(RunRow, parent_id) if parent_id else None
        team = team or (parent.team if parent is not None else None) or os.environ.get(TEAM_ENV) or "default"
        if not TEAM_RE.fullmatch(team):
            raise ConfigError(f"run team {team!r}: use letters, digits, '.', '_' or '-' (at most 100)")
        s.add(
            RunRow(
                id=run_id,
                name=name,
                experiment=experiment,
                team=team,
                kind=kind,
                status=RunStatus.RUNNING,
                parent_id=parent_id,
                params=_jsonable(params or {}),
                tags=_jsonable(tags or {}),
                system=system_info(),
                code_version=code_version(),
                dataset_version=dataset_version,
                started_at=started_at or utcnow(),
            )
        )
    return DbTracker(store, run_id, system_interval_s=system_interval_s, writer=writer)


def append_metrics(run_id: str, step: int, metrics: dict[str, Any], store: Store | None = None) -> None:
    """Add metric points to an existing (possibly finished) run, e.g. its test score chosen afterwards."""
    store = store or get_store()
    now = utcnow()
    with store.session() as s:
        s.add_all(
            RunMetricRow(
                run_id=run_id, key=check_metric_key(k), step=step, value=_as_float(k, v), logged_at=now
            )
            for k, v in metrics.items()
        )


def reopen_run(
    run_id: str,
    *,
    after_step: int,
    store: Store | None = None,
    system_interval_s: float | None = 10.0,
    writer: bool = True,
) -> DbTracker:
    """Continue an existing run (a training job resumed from its checkpoint at ``after_step``).

    Metric points past ``after_step`` (system metrics excepted) are deleted first: the resumed job
    logs those steps again, and metric rows are not unique per (run, key, step), so keeping them
    would leave two points per replayed step. The run is marked running again.

    Raises:
        NotFoundError: no run ``run_id`` in this store.
    """
    from sqlalchemy import delete, func, select

    store = store or get_store()
    with store.session() as s:
        row = s.get(RunRow, run_id)
        if row is None:
            raise NotFoundError(f"run {run_id} not found in {store.safe_url}")
        s.execute(
            delete(RunMetricRow).where(
                RunMetricRow.run_id == run_id,
                RunMetricRow.step > after_step,
                RunMetricRow.key.not_like("sys/%"),
            )
        )
        row.status, row.error, row.ended_at = RunStatus.RUNNING, None, None
        last_sys = s.scalar(
            select(func.max(RunMetricRow.step)).where(
                RunMetricRow.run_id == run_id, RunMetricRow.key.like("sys/%")
            )
        )
    last = int(last_sys or 0)
    return DbTracker(store, run_id, system_interval_s=system_interval_s, system_step=last, writer=writer)


def fill_metrics(run_id: str, points: dict[int, dict[str, Any]], store: Store | None = None) -> int:
    """Insert the points of ``{step: {key: value}}`` that the run does not have yet; returns how many.

    A training job killed between two background flushes loses its last buffered points; on resume
    they are refilled from the job's own crash-safe log without duplicating those that were written.
    """
    from sqlalchemy import select

    if not points:
        return 0
    store = store or get_store()
    now = utcnow()
    with store.session() as s:
        have = {
            (key, step)
            for key, step in s.execute(
                select(RunMetricRow.key, RunMetricRow.step).where(
                    RunMetricRow.run_id == run_id,
                    RunMetricRow.step.between(min(points), max(points)),
                    RunMetricRow.key.not_like("sys/%"),
                )
            )
        }
        rows = [
            RunMetricRow(
                run_id=run_id, key=check_metric_key(k), step=step, value=_as_float(k, v), logged_at=now
            )
            for step, metrics in sorted(points.items())
            for k, v in metrics.items()
            if (k, step) not in have
        ]
        s.add_all(rows)
    return len(rows)


def close_run(run_id: str, status: str, error: str | None = None, *, store: Store | None = None) -> bool:
    """Close a run that is still marked running (its process died before it could); True if it was.

    Raises:
        ConfigError: unknown status.
    """
    ended = RunStatus.ended_as(status)
    store = store or get_store()
    with store.session() as s:
        row = s.get(RunRow, run_id)
        if row is None or row.status != RunStatus.RUNNING:
            return False
        row.status, row.error, row.ended_at = ended, error, utcnow()
    return True
