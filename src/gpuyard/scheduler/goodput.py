"""Goodput of a job: its wall time (submitted to finished, or now) split by its timeline in the store.

From the job's state changes (``job_events``): time ``queued`` or ``preempted`` is ``queueing``;
``scheduled`` (placed, being launched) is ``startup`` for the first attempt and ``restart`` after;
``running`` time is split further when the job trained with ``gpuyard train`` and its run recorded a
goodput (``gpuyard.train.goodput``: the launcher keeps it with the database run, which carries the
job's id in its tags): the run's productive time and its losses by cause, and the running time
outside the run's launches (the job's process before the launcher starts and after it ends) as
``startup`` (first attempt) or ``restart``; while the job runs, its time since the run's goodput was
computed (``as_of``; the launcher records it every minute) counts as productive. A job without such
a run (a command job, or a run not recorded yet) counts its running time as productive, except the
attempts that failed, which are ``restart`` (nothing says what they kept).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuyard.store.base import utcnow
from gpuyard.store.db import Store
from gpuyard.store.tables.jobs import JobEventRow

CAUSES = ("queueing", "startup", "restart", "recomputed", "checkpoint", "data", "straggler", "other")
_QUEUED = ("queued", "preempted")


@dataclass(frozen=True)
class Change:
    """One state change of a job: when, and the state it went to (with why)."""

    at: datetime
    to: str
    reason: str | None = None


def job_goodput(
    submitted_at: datetime,
    changes: Sequence[Change],
    end: datetime,
    run: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``{"ettr", "wall_s", "productive_s", "lost_s": {cause: s}, "source"}`` of one job.

    Args:
        submitted_at: when it was submitted. changes: its state changes, oldest first.
        end: when it finished (or now, while it is not finished). run: the goodput its training run
            recorded, if any (``source`` is then ``job+run``, else ``job``).
    """
    lost = dict.fromkeys(CAUSES, 0.0)
    productive = 0.0
    running: list[tuple[float, str]] = []  # (seconds, how the attempt ended) of each running stretch
    attempts = 0
    state, since = "queued", submitted_at
    for ch in [*changes, Change(end, "_end")]:
        seconds = max(0.0, (min(ch.at, end) - since).total_seconds())
        if state in _QUEUED:
            lost["queueing"] += seconds
        elif state == "scheduled":
            lost["startup" if attempts <= 1 else "restart"] += seconds
        elif state == "running":
            failed = ch.to == "failed" or (ch.to == "queued" and (ch.reason or "").startswith("failed"))
            running.append((seconds, "failed" if failed else ch.to))
        if ch.to == "scheduled":
            attempts += 1
        state, since = ch.to, max(since, min(ch.at, end))
        if ch.at >= end:
            break
    ran = sum(s for s, _ in running)
    if run is not None and isinstance(run.get("lost_s"), dict):
        productive = float(run.get("productive_s") or 0.0)
        for cause, seconds in run["lost_s"].items():
            if cause in lost and isinstance(seconds, int | float):
                lost[cause] += float(seconds)
        # A job still running: its time since the run's goodput was computed is not split yet.
        pending = 0.0
        as_of = run.get("as_of")
        current = next((c.to for c in reversed(changes) if c.at <= end), "queued")
        if current == "running" and isinstance(as_of, int | float):
            pending = max(0.0, end.timestamp() - float(as_of))
            productive += pending
        outside = ran - float(run.get("wall_s") or 0.0) - pending
        lost["startup" if attempts <= 1 else "restart"] += max(0.0, outside)
    else:
        for seconds, how in running:
            if how == "failed":
                lost["restart"] += seconds
            else:
                productive += seconds
    wall = sum(lost.values()) + productive
    return {
        "ettr": round(productive / wall, 4) if wall > 0 else None,
        "wall_s": round(wall, 3),
        "productive_s": round(productive, 3),
        "lost_s": {c: round(v, 3) for c, v in lost.items()},
        "source": "job+run" if run is not None else "job",
    }


def run_goodputs(s: Session, job_ids: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The goodput each job's training run recorded, by job id (a query per 500 jobs; the newest
    run wins)."""
    from gpuyard.store.tables.models import RunRow

    ids = [str(i) for i in job_ids]
    out: dict[int, dict[str, Any]] = {}
    for part in _batches(ids):
        rows = s.execute(
            select(RunRow.tags, RunRow.system)
            .where(RunRow.tags["job_id"].as_string().in_(part))
            .order_by(RunRow.started_at)
        )
        for tags, system in rows:
            goodput = (system or {}).get("goodput")
            if isinstance(goodput, dict):
                out[int(tags["job_id"])] = goodput
    return out


def _batches(ids: list[Any], size: int = 500) -> list[list[Any]]:
    """``ids`` in parts small enough for any database's limit on bound parameters."""
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def goodputs(
    s: Session, jobs: Sequence[tuple[int, datetime, datetime | None]], now: datetime | None = None
) -> dict[int, dict[str, Any]]:
    """The goodput of each ``(id, submitted_at, finished_at)`` job, by id (two queries per 500 jobs)."""
    if not jobs:
        return {}
    now = now or utcnow()
    ids = [j[0] for j in jobs]
    changes: dict[int, list[Change]] = {i: [] for i in ids}
    for part in _batches(ids):
        for job_id, at, to, reason in s.execute(
            select(JobEventRow.job_id, JobEventRow.at, JobEventRow.to_state, JobEventRow.reason)
            .where(JobEventRow.job_id.in_(part))
            .where(JobEventRow.from_state.is_distinct_from(JobEventRow.to_state))  # notes are no changes
            .order_by(JobEventRow.id)
        ):
            changes[job_id].append(Change(at, to, reason))
    runs = run_goodputs(s, ids)
    return {i: job_goodput(sub, changes[i], fin or now, runs.get(i)) for i, sub, fin in jobs}


def add_goodput(store: Store, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give each job document (``records.job_doc``) its ``goodput``; returns ``docs``."""
    jobs = [
        (
            int(d["id"]),
            datetime.fromisoformat(d["submitted_at"]),
            datetime.fromisoformat(d["finished_at"]) if d.get("finished_at") else None,
        )
        for d in docs
        if d.get("submitted_at")
    ]
    with store.read() as s:
        found = goodputs(s, jobs)
    for d in docs:
        d["goodput"] = found.get(int(d["id"]))
    return docs


def prometheus_text(docs: Sequence[dict[str, Any]]) -> bytes:
    """Prometheus text exposition of the jobs' goodput (documents with ``goodput``): per job
    ``gpuyard_job_ettr``, ``gpuyard_job_wall_seconds``, ``gpuyard_job_productive_seconds`` and
    ``gpuyard_job_lost_seconds`` by ``cause``; labels job (id), name, team, state."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily

    labels = ["job", "name", "team", "state"]
    ettr = GaugeMetricFamily("gpuyard_job_ettr", "Productive training time / wall time", labels=labels)
    wall = GaugeMetricFamily("gpuyard_job_wall_seconds", "Submitted to finished (or now)", labels=labels)
    good = GaugeMetricFamily("gpuyard_job_productive_seconds", "Productive training time", labels=labels)
    lost = GaugeMetricFamily(
        "gpuyard_job_lost_seconds", "Wall time not productive, by cause", labels=[*labels, "cause"]
    )
    for d in docs:
        gp = d.get("goodput")
        if not gp:
            continue
        values = [str(d["id"]), str(d["name"]), str(d["team"]), str(d["state"])]
        if gp.get("ettr") is not None:
            ettr.add_metric(values, float(gp["ettr"]))
        wall.add_metric(values, float(gp["wall_s"]))
        good.add_metric(values, float(gp["productive_s"]))
        for cause, seconds in gp["lost_s"].items():
            lost.add_metric([*values, cause], float(seconds))

    class _Families:
        def collect(self) -> list[GaugeMetricFamily]:
            return [ettr, wall, good, lost]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())
    return bytes(generate_latest(registry))
