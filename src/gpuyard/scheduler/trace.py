"""Job traces for the simulator: the generic CSV and the Philly trace, read into plain records.

Alibaba's openb GPU-sharing traces (shares of GPUs, CPU, memory, GPU models) have their own reader,
:mod:`gpuyard.scheduler.openb`; ``load_trace`` tells them apart by the header and points there.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.scheduler.openb import MILLI, GpuTask, check_profile

GENERIC_COLUMNS = ("submit_time", "duration", "num_gpus")
PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "cluster")
OPENB_POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")  # gpuyard.scheduler.openb


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace: submitted at ``submit`` (s), runs ``duration`` s on ``gpus`` GPUs."""

    id: int
    submit: float
    duration: float
    gpus: int
    team: str = "default"
    priority: int = 0
    user: str = ""


def _number(row: dict[str, str], column: str, where: str) -> float:
    try:
        return float(row[column])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: column {column!r} is {row.get(column)!r}, not a number") from None


def load_trace(path: str | Path) -> list[TraceJob]:
    """Read a trace CSV, sorted by submit time, times made relative to the first submission.

    Two formats, told apart by the header: generic ``submit_time,duration,num_gpus[,team][,priority]``
    (seconds) and Philly ``timestamp,duration,num_gpus,gpu_time,cluster`` (the cluster is the team).

    Raises:
        NotFoundError: the file does not exist.
        ConfigError: the header or a value is not of either format; the message names row and column.
    """
    path = Path(path)
    if not path.is_file():
        raise NotFoundError(f"trace {path}: no such file")
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        header = set(reader.fieldnames or [])
        philly = set(PHILLY_COLUMNS) <= header
        mig_column = "mig" in header and not philly
        if set(OPENB_POD_COLUMNS) <= header:
            raise ConfigError(
                f"trace {path} is an openb pod list (GPU shares): read it with gpuyard.scheduler.openb;"
                " `gpuyard sim --trace` places it on the openb node list (--node-list)"
            )
        if not philly and not set(GENERIC_COLUMNS) <= header:
            raise ConfigError(
                f"trace {path}: header {sorted(header)} has neither "
                f"{','.join(GENERIC_COLUMNS)}[,team][,priority]"
                f" nor the Philly columns {','.join(PHILLY_COLUMNS)}"
            )
        rows = []
        for i, row in enumerate(reader, start=2):
            where = f"trace {path} line {i}"
            if philly:
                try:
                    submit = datetime.fromisoformat(row["timestamp"]).timestamp()
                except ValueError:
                    raise ConfigError(f"{where}: timestamp {row['timestamp']!r} is not a date") from None
                team = row["cluster"] or "default"
                priority = 0
            else:
                submit = _number(row, "submit_time", where)
                team = row.get("team") or "default"
                priority = int(_number(row, "priority", where)) if row.get("priority") else 0
            duration = _number(row, "duration", where)
            if mig_column and (row.get("mig") or "").strip():
                raise ConfigError(
                    f"{where}: mig {row['mig']!r}: a job asking for MIG slices, which `gpuyard sim` places"
                    " slice by slice with --packing (load_share_trace)"
                )
            asked = _number(row, "num_gpus", where)
            if asked != int(asked):
                raise ConfigError(
                    f"{where}: num_gpus {asked:g} is a share of a GPU: a GPU-sharing trace, which"
                    " `gpuyard sim` places GPU by GPU with --packing (load_share_trace)"
                )
            gpus = int(asked)
            if duration < 0 or gpus < 0:
                raise ConfigError(f"{where}: duration and num_gpus must be >= 0")
            rows.append((submit, duration, gpus, team, priority))
    if not rows:
        raise ConfigError(f"trace {path}: no jobs")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceJob(i, s - t0, d, g, t, p) for i, (s, d, g, t, p) in enumerate(rows)]


def has_gpu_shares(path: str | Path) -> bool:
    """True when ``path`` is a generic trace with a job asking for part of a GPU (num_gpus < 1) or
    for MIG slices (a ``mig`` column with a value)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if not set(GENERIC_COLUMNS) <= set(reader.fieldnames or []):
            return False
        for row in reader:
            if (row.get("mig") or "").strip():
                return True
            try:
                asked = float(row["num_gpus"])
            except (TypeError, ValueError):
                return False  # load_trace names the bad value
            if asked != int(asked):
                return True
    return False


def load_share_trace(path: str | Path) -> list[GpuTask]:
    """Read a generic trace whose ``num_gpus`` may be a share of one GPU (0.25), for the packing
    simulator (:mod:`gpuyard.scheduler.packing`): submit time and duration become creation and
    duration, a share ``gpu_milli`` thousandths of one GPU; no CPU or memory is asked.

    An optional ``mig`` column names a MIG profile (``3g.40gb``, :mod:`gpuyard.hardware.mig`); a job
    with one there asks for ``num_gpus`` (a whole number >= 1) slices of it on one node, and nothing
    else of a GPU; an empty ``mig`` is an ordinary job.

    Raises:
        NotFoundError: the file does not exist.
        ConfigError: not the generic format, or a bad value (a share above 1 GPU, such as 1.5; an
            unknown MIG profile; a MIG job whose num_gpus is not a count of slices).
    """
    path = Path(path)
    if not path.is_file():
        raise NotFoundError(f"trace {path}: no such file")
    tasks: list[GpuTask] = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if not set(GENERIC_COLUMNS) <= set(reader.fieldnames or []):
            raise ConfigError(
                f"trace {path}: a GPU-sharing trace needs the columns {','.join(GENERIC_COLUMNS)}"
            )
        for i, row in enumerate(reader, start=2):
            where = f"trace {path} line {i}"
            submit, duration = _number(row, "submit_time", where), _number(row, "duration", where)
            asked = _number(row, "num_gpus", where)
            if duration < 0 or asked < 0:
                raise ConfigError(f"{where}: duration and num_gpus must be >= 0")
            if (row.get("mig") or "").strip():
                profile = check_profile(row["mig"], where)
                if asked < 1 or asked != int(asked):
                    raise ConfigError(
                        f"{where}: mig {profile} with num_gpus {asked:g}: for a MIG job num_gpus counts"
                        " its slices (1, 2, ...)"
                    )
                tasks.append(
                    GpuTask(
                        f"job-{i - 2}", 0, 0, int(asked), 0, creation=submit, duration=duration, mig=profile
                    )
                )
                continue
            if asked > 1 and asked != int(asked):
                raise ConfigError(f"{where}: num_gpus {asked:g}: a share of one GPU (< 1) or whole GPUs")
            whole = asked >= 1 or asked == 0
            milli = MILLI if asked >= 1 else round(asked * MILLI)
            if not whole and milli < 1:
                raise ConfigError(f"{where}: num_gpus {asked:g} is less than a thousandth of a GPU")
            num = int(asked) if whole else 1
            tasks.append(
                GpuTask(f"job-{i - 2}", 0, 0, num, milli if num else 0, creation=submit, duration=duration)
            )
    if not tasks:
        raise ConfigError(f"trace {path}: no jobs")
    return tasks
