"""``status.json``: how a training run ended, as its ranks report it to the launcher.

One typed document, :class:`TrainStatus`, written by the trainer (rank 0, at the end of a run or on
an unrecoverable failure) and by a worker that stopped on a configuration error, and read back by
the launcher (``gpuyard train``). Its ``status`` is a :class:`~gpuyard.states.TrainOutcome`; a file
whose status or fields are not what a rank writes is a :class:`StatusFileError` in one line, never
read as some other outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuyard.errors import GpuyardError
from gpuyard.states import TrainOutcome
from gpuyard.train.names import STATUS_FALLBACK_ENV, STATUS_FILE

__all__ = ["UNKNOWN", "StatusFileError", "TrainStatus", "read_status", "status_places", "write_status"]

# The launcher's word (in its result, never in status.json) for a run whose status.json could not be
# read: how it ended is not known, which is not the same as failed.
UNKNOWN = "unknown"

# The largest status.json read back: a rank writes a few KiB (its stragglers and last metrics).
MAX_STATUS_BYTES = 4 << 20


class StatusFileError(GpuyardError):
    """A status.json that is not a document a rank writes (unreadable JSON, an unknown status, a
    field of the wrong type): the run's outcome is unknown."""


@dataclass(frozen=True)
class TrainStatus:
    """What a run's ranks report in status.json.

    ``unrecoverable`` marks a failure a restart would repeat (the launcher stops torchrun at once);
    ``config_error`` one that was a configuration error (the launcher exits with the usage code).
    """

    status: TrainOutcome
    step: int | None = None
    epoch: int | None = None
    checkpoint: str | None = None
    run_id: str | None = None
    tracking_failed: bool = False
    unrecoverable: bool = False
    config_error: bool = False
    error: str | None = None
    rank: int | None = None
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def stopped_for_good(self) -> bool:
        """A rank stopped on a failure a restart would repeat."""
        return self.status is TrainOutcome.FAILED and self.unrecoverable

    def to_doc(self) -> dict[str, Any]:
        """The JSON document (other unset fields left out; ``status`` is the outcome's string)."""
        # run_id, checkpoint, stragglers and metrics are always there (null or empty when there is
        # none), as `gpuyard train --json` has always had them.
        doc: dict[str, Any] = {
            "status": self.status.value,
            "run_id": self.run_id,
            "checkpoint": self.checkpoint,
            "stragglers": list(self.stragglers),
            "metrics": dict(self.metrics),
        }
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                doc[name] = value
        for name in _FLAGS:
            if getattr(self, name):
                doc[name] = True
        return doc

    @classmethod
    def from_doc(cls, doc: Any, source: str = STATUS_FILE) -> TrainStatus:
        """Read a status document back.

        Raises:
            StatusFileError: one line naming ``source`` and what is wrong with it.
        """
        if not isinstance(doc, dict):
            raise StatusFileError(f"{source}: not a JSON object")
        try:
            status = TrainOutcome.parse(doc.get("status"))
        except ValueError as exc:
            raise StatusFileError(f"{source}: {exc}") from None
        values: dict[str, Any] = {}
        for name, kind in _TYPES.items():
            value = doc.get(name)
            if value is None:
                continue
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                what = f"is a {type(value).__name__}, not {kind.__name__}"
                raise StatusFileError(f"{source}: field {name!r} {what}")
            values[name] = value
        if not all(isinstance(s, dict) for s in values.get("stragglers", [])):
            raise StatusFileError(f"{source}: field 'stragglers' must be a list of objects")
        metrics = values.get("metrics", {})
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in metrics.values()):
            raise StatusFileError(f"{source}: field 'metrics' must map names to numbers")
        values["metrics"] = {str(k): float(v) for k, v in metrics.items()}
        return cls(status=status, **values)


_OPTIONAL = ("step", "epoch", "checkpoint", "run_id", "error", "rank")
_FLAGS = ("tracking_failed", "unrecoverable", "config_error")
_TYPES: dict[str, type] = {
    "step": int,
    "epoch": int,
    "checkpoint": str,
    "run_id": str,
    "tracking_failed": bool,
    "unrecoverable": bool,
    "config_error": bool,
    "error": str,
    "rank": int,
    "stragglers": list,
    "metrics": dict,
}


def status_places(run_dir: Path) -> list[Path]:
    """Where a rank writes status.json, in order: the run folder, then the launcher's private folder
    (``GPUYARD_TRAIN_STATUS_DIR``) where the run folder cannot take it (a full disk)."""
    places = [Path(run_dir)]
    if os.environ.get(STATUS_FALLBACK_ENV):
        places.append(Path(os.environ[STATUS_FALLBACK_ENV]))
    return places


def write_status(report: TrainStatus, places: list[Path], tmp_name: str = f".{STATUS_FILE}.tmp") -> Path:
    """Write ``report`` as status.json in the first of ``places`` that takes it (atomically: a temporary
    file renamed over it); returns the file written.

    Raises:
        OSError: no place took it (the last place's error).
    """
    text = json.dumps(report.to_doc())
    for i, folder in enumerate(places):
        tmp = folder / tmp_name
        try:
            tmp.write_text(text)
            tmp.replace(folder / STATUS_FILE)
            return folder / STATUS_FILE
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if i == len(places) - 1:
                raise
    raise OSError("write_status: no place to write status.json")


def read_status(folder: str | Path) -> TrainStatus | None:
    """The status.json in ``folder``, or None when there is none (the ranks did not get that far).

    Raises:
        StatusFileError: it exists but cannot be read, or is not a document a rank writes.
    """
    path = Path(folder) / STATUS_FILE
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_STATUS_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StatusFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_STATUS_BYTES:
        raise StatusFileError(f"{path}: larger than {MAX_STATUS_BYTES >> 20} MiB; a rank writes a few KiB")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise StatusFileError(f"{path}: not JSON ({exc})") from None
    return TrainStatus.from_doc(doc, str(path))
