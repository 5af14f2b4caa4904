"""The trainer's tracker under ``tracking: db``: metrics.jsonl plus one state-store run, kept across restarts.

Rank 0 writes ``metrics.jsonl`` as always and, through :class:`DbRunTracker`, one run in the state
store (``gpuyard runs ls``). All database work, the metric points and system samples included, runs on
the run's one writer thread, so a slow or unreachable database never holds a training step;
``tracking.json`` in the run folder names the run, so a job resumed from its checkpoint continues the
same run without duplicate steps.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpuyard.states import RunStatus, TrainOutcome
from gpuyard.tracking.files import JsonlTracker

# The run folder's record of its run in the state store (id, store, where its lines start in metrics.jsonl).
RUN_FILE = "tracking.json"
# How long the end of a run waits for the database to take its last points; metrics.jsonl has them anyway.
FINISH_WAIT_S = 60.0
FAIL_WAIT_S = 10.0
# How often the database thread takes the steps' metrics over (the training thread only appends them).
DRAIN_EVERY_S = 0.5
# A run file's statuses of a run that ended well: a job started over from scratch starts a new run.
_ENDED = (TrainOutcome.COMPLETED, TrainOutcome.EARLY_STOPPED)
_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.\-/ ]")
_log = logging.getLogger("gpuyard.train")


def db_metric_key(key: str) -> str:
    """The state store's name of a trainer metric: ``val_loss`` becomes ``validation/loss``.

    ``gpuyard runs ls`` and ``runs best --split validation`` look validation metrics up under that prefix.
    """
    return f"validation/{key[4:]}" if key.startswith("val_") and len(key) > 4 else key


def flatten_params(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``optimizer.lr``), so ``gpuyard runs compare`` lines runs up."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = _BAD_KEY_CHARS.sub("_", f"{prefix}{key}")[:200]  # user kwargs may hold any character
        if isinstance(value, dict) and value:
            out.update(flatten_params(value, name + "."))
        else:
            out[name] = value
    return out


def read_run_file(run_dir: str | Path) -> dict[str, Any]:
    """The run folder's ``tracking.json`` ({} when the run was never recorded in a database)."""
    try:
        doc = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def tracked_run_id(run_dir: str | Path) -> str | None:
    """The id of the state-store run that a training run folder records into, or None."""
    run_id = read_run_file(run_dir).get("run_id")
    return str(run_id) if run_id else None


def _number(value: Any) -> float | None:
    # metrics.jsonl writes non-finite floats as strings ("nan", "inf"): read those back as floats.
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


# Trainer events that also reach the run in the state store (its ``events`` tag; the last 100 kept):
# what a user looks for after the fact. Per-step metrics stay in metrics.jsonl and the metric table.
RUN_EVENTS = ("checkpoint", "diverged", "straggler", "memory_snapshot_failed")


class DbRunTracker:
    """Rank 0's tracker under ``tracking: db``: metrics.jsonl as before, plus one run in the state store.

    The run's id is kept in ``<run_dir>/tracking.json``, so a job restarted by torchrun or the scheduler
    (resuming from its checkpoint) continues the same run: points past the checkpoint's step are
    dropped before the replayed steps are logged again, and points the killed job had not flushed yet
    are refilled from metrics.jsonl. Every database call runs on a thread of its own, so a slow,
    locked or unreachable database never stalls a step; on the first error it logs one warning and
    the run carries on with the JSON-lines file only.
    """

    def __init__(
        self,
        jsonl: JsonlTracker,
        *,
        name: str,
        experiment: str,
        start_step: int,
        resumed: bool,
        dataset_version: Callable[[], str | None] | None = None,
        params: dict[str, Any] | None = None,
        tags: dict[str, Any] | None = None,
    ) -> None:
        """Claim the run (a new one, or the run folder's own) and start the writer thread.

        Args:
            jsonl: rank 0's metrics.jsonl tracker; its folder is the run folder.
            name: the run's name. experiment: the experiment it is compared in.
            start_step: the step training starts from (the checkpoint's, 0 for a fresh start).
            resumed: whether training resumed from a checkpoint.
            dataset_version: gives ``NAME@<version id>[#split=...]`` of the rows it trains on (or None);
                called on the writer thread, as resolving it may query the database.
            params: settings recorded besides the ones :meth:`log_params` gets (layout, sizes).
            tags: labels, over ``source`` and ``run_dir``.
        """
        self.jsonl = jsonl
        self.run_dir = jsonl.path.parent
        self.start_step = start_step
        self.run_id: str | None = None
        self.reused = False
        self._name, self._experiment, self._dataset = name, experiment, dataset_version
        self._extra_params = flatten_params(params or {})
        self._tags = {"source": "gpuyard train", "run_dir": str(self.run_dir), **(tags or {})}
        self._queue: queue.SimpleQueue[tuple[str, tuple[Any, ...]]] = queue.SimpleQueue()
        # Per-step metrics skip the queue: a list append is all a step pays (a queue item per step
        # wakes the database thread each step, and its share of the GIL tripled the cost per step).
        self._points: list[tuple[int, dict[str, Any]]] = []
        self._points_lock = threading.Lock()
        self._db: Any = None
        self._failed = False
        self._fail_lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._offset = 0
        self._started_at = datetime.now(timezone.utc)  # the database may record the run a while later
        try:
            self._claim_run(resumed)
        except Exception as exc:  # e.g. an unusable database URL: not a reason to stop training
            self._fail(exc)
            return
        self._thread = threading.Thread(target=self._serve, name="gpuyard-tracking", daemon=True)
        self._thread.start()

    # -- the trainer's tracking interface ----------------------------------------------------------

    def log_params(self, params: dict[str, Any]) -> None:
        """Write the params to metrics.jsonl; record them flattened (``optimizer.lr``) with the run."""
        self.jsonl.log_params(params)
        self._put("params", {**flatten_params(params), **self._extra_params})

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Write the step's metrics to metrics.jsonl and hand them to the database thread."""
        self.jsonl.log_metrics(step, metrics)
        if not self._failed and not self._closed and self._thread is not None:
            with self._points_lock:  # the database's names are given on its thread
                self._points.append((step, dict(metrics)))

    def log_event(self, event: str, **fields: Any) -> None:
        """Write an event to metrics.jsonl; those of :data:`RUN_EVENTS` also go to the run's events."""
        self.jsonl.log_event(event, **fields)
        if event in RUN_EVENTS:
            self._put("event", event, fields)

    def finish(self, status: str, error: str | None = None) -> None:
        """Close the run (waiting at most FINISH_WAIT_S for the database), then metrics.jsonl."""
        self._close(status, error, FINISH_WAIT_S)

    def fail(self, error: str) -> None:
        """Close the run as failed (an exception ended training); waits at most FAIL_WAIT_S."""
        self._close(RunStatus.FAILED, error, FAIL_WAIT_S)

    @property
    def failed(self) -> bool:
        """True once the database part has given up (the run goes on in metrics.jsonl only)."""
        return self._failed

    # -- internals -----------------------------------------------------------------------------------

    def _close(self, status: str, error: str | None, wait_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        if self.run_id is not None:
            try:
                self._write_run_file(status)
            except OSError as exc:  # a full disk under the run folder: the database still gets the end
                _log.warning("gpuyard train: warning: could not update %s: %s", RUN_FILE, exc)
        if self._thread is not None:
            self._queue.put(("finish", (status, error)))
            self._thread.join(wait_s)
            if self._thread.is_alive():
                late = f"the database did not take the run's last points within {wait_s:.0f} s"
                self._fail(TimeoutError(late))
        self.jsonl.finish(status)

    def _put(self, op: str, *args: Any) -> None:
        if not self._failed and not self._closed and self._thread is not None:
            self._queue.put((op, args))

    def _fail(self, exc: BaseException) -> None:
        with self._fail_lock:
            if self._failed:
                return
            self._failed = True
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]  # one line: drivers wrap theirs
        _log.warning(
            "gpuyard train: warning: the tracking database is unavailable (%s); run %s carries on, "
            "recorded in %s only",
            reason,
            (self.run_id or "?")[:8],
            self.jsonl.path,
        )
        self.jsonl.log_event("tracking_error", error=reason, run_id=self.run_id)

    def _claim_run(self, resumed: bool) -> None:
        """Pick the run id (the folder's own when this job continues it) and write tracking.json."""
        from sqlalchemy.engine import make_url

        from gpuyard.settings import load_settings

        store = make_url(load_settings().database_url).render_as_string(hide_password=True)
        prev = read_run_file(self.run_dir)
        # A resumed job continues its run; so does a restart from scratch of a run that never ended
        # (killed before its first checkpoint). A finished run started over is a new run.
        self.reused = bool(prev.get("run_id")) and prev.get("store") == store
        self.reused = self.reused and (resumed or prev.get("status") not in _ENDED)
        if self.reused:
            self.run_id, self._offset = str(prev["run_id"]), int(prev.get("jsonl_offset", 0))
        else:
            self.run_id = uuid.uuid4().hex
            # A new run that starts from a checkpoint takes its earlier steps from the whole file.
            size = self.jsonl.path.stat().st_size if self.jsonl.path.exists() else 0
            self._offset = 0 if resumed else size
        self._store = store
        self._write_run_file(RunStatus.RUNNING)

    def _write_run_file(self, status: str) -> None:
        doc = {"run_id": self.run_id, "store": self._store, "jsonl_offset": self._offset, "status": status}
        tmp = self.run_dir / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.run_dir / RUN_FILE)

    def _serve(self) -> None:
        try:
            self._open()
        except Exception as exc:
            self._fail(exc)
        while True:
            try:
                op, args = self._queue.get(timeout=DRAIN_EVERY_S)
            except queue.Empty:
                op, args = "drain", ()
            with self._points_lock:
                points, self._points = self._points, []
            if self._failed:
                if op == "finish":
                    return
                continue
            try:
                for step, metrics in points:
                    self._db.log_metrics(step, {db_metric_key(k): v for k, v in metrics.items()})
                if op == "finish":
                    self._finish_run(*args)
                    return
                if op == "params":
                    self._db.log_params(*args)
                elif op == "event":
                    self._db.log_event(args[0], **args[1])
                self._db.tick()  # this thread is the run's writer: points and system samples
            except Exception as exc:
                self._fail(exc)

    def _open(self) -> None:
        """Create the run, or reopen it where the checkpoint left it and refill what the last job lost."""
        from gpuyard.errors import NotFoundError
        from gpuyard.store import get_store
        from gpuyard.tracking import store as tr

        run_id = str(self.run_id)
        dataset = self._dataset() if self._dataset is not None else None
        store = get_store()
        db = None
        if self.reused:
            try:
                db = tr.reopen_run(run_id, after_step=self.start_step, store=store, writer=False)
            except NotFoundError:  # deleted, or never created because the database was down then
                db = None
        if db is None:
            db = tr.start_run(
                self._name,
                experiment=self._experiment,
                kind="train",
                tags=self._tags,
                dataset_version=dataset,
                run_id=run_id,
                store=store,
                started_at=self._started_at,
                writer=False,
            )
        else:
            db.set_tags(self._tags)
            if dataset:
                db.set_dataset_version(dataset)
        self._db = db
        if self.start_step > 0:
            tr.fill_metrics(run_id, self._logged_points(), store)
            db.log_event("resume", step=self.start_step)

    def _logged_points(self) -> dict[int, dict[str, float | None]]:
        """Steps up to the resumed one, as this run's lines of metrics.jsonl have them (last line wins)."""
        points: dict[int, dict[str, float | None]] = {}
        with self.jsonl.path.open("rb") as fh:
            fh.seek(self._offset)
            for raw in fh:
                try:
                    doc = json.loads(raw)
                except ValueError:  # the torn last line of a killed job
                    continue
                step = doc.get("step") if isinstance(doc, dict) else None
                if doc.get("event") != "metrics" or not isinstance(step, int) or step > self.start_step:
                    continue
                row = points.setdefault(step, {})
                for key, value in doc.items():
                    number = _number(value)
                    if key not in ("time", "event", "step") and number is not None:
                        row[db_metric_key(key)] = number
        return points

    def _finish_run(self, status: str, error: str | None) -> None:
        self._db.finish(RunStatus.ended_as(status), error=error, tags={"train_status": status})
