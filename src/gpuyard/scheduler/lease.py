"""The scheduler lease: exactly one active job service (scheduler) per state store.

Any number of processes may submit, cancel and read jobs, but only the lease holder starts, reaps and
recovers them; otherwise two services on one store (a ``gpuyard server`` and a pipeline's in-process
service, or two servers on one PostgreSQL) would both start a queued job and each "recover" the
other's running jobs as orphans.

The lease is one row of ``scheduler_lease``, read and written in one write transaction: on SQLite the
store begins write transactions IMMEDIATE (the database write lock is held from the read on), on
PostgreSQL the row is read ``FOR UPDATE``; a first insert that races another fails on the primary key
and is retried. A lease is stale, and taken over, when it has expired or when its holder ran on this
host and that process is gone or a zombie, exited but not yet reaped by its parent (so a server
restarted after kill -9 does not wait for the expiry).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta

import psutil
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError as SAIntegrityError

from gpuyard.errors import ConflictError
from gpuyard.store.base import utcnow
from gpuyard.store.db import Store
from gpuyard.store.tables.jobs import SchedulerLeaseRow

log = logging.getLogger(__name__)

LEASE_NAME = "scheduler"
DEFAULT_TTL_S = 15.0


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds (or held) the lease."""

    holder: str
    host: str
    pid: int
    role: str
    expires_at: datetime

    def describe(self) -> str:
        """One phrase naming the holder, e.g. ``gpuyard server pid 123 on vm (lease until 06:50:01Z)``."""
        what = "gpuyard server" if self.role == "server" else f"an {self.role} job service"
        until = self.expires_at.strftime("%H:%M:%SZ")
        return f"{what} pid {self.pid} on {self.host} (holder {self.holder}, lease until {until})"


def _process_start(pid: int) -> float | None:
    """When ``pid`` started; ``None`` when it is gone or a zombie (exited, not yet reaped: dead)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class SchedulerLease:
    """This process's claim on the scheduler lease of ``store``.

    Args:
        store: the state store.
        role: ``server`` or ``in-process``; shown to whoever is refused.
        ttl_s: a lease not renewed for this long is stale (the holder is presumed dead).
    """

    def __init__(self, store: Store, role: str = "in-process", ttl_s: float = DEFAULT_TTL_S) -> None:
        self.store, self.role, self.ttl_s = store, role, ttl_s
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.pid_started = _process_start(self.pid) or 0.0
        self.holder = f"{self.host}:{self.pid}:{secrets.token_hex(4)}"
        self.held = False
        self._renewed: datetime | None = None

    def acquire(self) -> LeaseHolder | None:
        """Take or renew the lease; ``None`` when this service holds it, else the live holder.

        Raises:
            StoreError: the store cannot be reached.
        """
        try:
            other = self._acquire_once()
        except SAIntegrityError:  # another process inserted the first row at the same moment
            other = self._acquire_once()
        was_held, self.held = self.held, other is None
        if was_held and not self.held:
            log.error("scheduler lease lost to %s: this service stops scheduling", other and other.describe())
        if self.held:
            self._renewed = utcnow()
        return other

    def renew_due(self) -> bool:
        """Whether a third of the lease time has passed since the last renewal (or it is not held)."""
        if not self.held or self._renewed is None:
            return True
        return (utcnow() - self._renewed).total_seconds() >= self.ttl_s / 3

    def release(self) -> None:
        """Give the lease up at once (a clean stop), so the next service need not wait for its expiry."""
        if not self.held:
            return
        self.held = False
        with self.store.session() as s:
            row = s.get(SchedulerLeaseRow, LEASE_NAME)
            if row is not None and row.holder == self.holder:
                s.delete(row)

    def live_holder(self) -> LeaseHolder | None:
        """Another service holding a lease that is not stale, without taking it (a read)."""
        with self.store.read() as s:
            row = s.get(SchedulerLeaseRow, LEASE_NAME)
            if row is None or row.holder == self.holder or self._stale(row, utcnow()):
                return None
            return _holder(row)

    def current(self) -> LeaseHolder | None:
        """The recorded holder, stale or not (``None`` if nobody ever held it or it was released)."""
        with self.store.read() as s:
            row = s.get(SchedulerLeaseRow, LEASE_NAME)
            return _holder(row) if row is not None else None

    def _acquire_once(self) -> LeaseHolder | None:
        now = utcnow()
        with self.store.session() as s:
            query = select(SchedulerLeaseRow).where(SchedulerLeaseRow.name == LEASE_NAME)
            if not self.store.is_sqlite:
                query = query.with_for_update()
            row = s.scalars(query).one_or_none()
            if row is None:
                row = SchedulerLeaseRow(name=LEASE_NAME)
                s.add(row)
            elif row.holder != self.holder:
                if not self._stale(row, now):
                    return _holder(row)
                log.warning("taking over a stale scheduler lease from %s", _holder(row).describe())
            if row.holder != self.holder:
                row.holder, row.host, row.pid, row.role = self.holder, self.host, self.pid, self.role
                row.pid_started, row.acquired_at = self.pid_started, now
            row.expires_at = now + timedelta(seconds=self.ttl_s)
            s.flush()
        return None

    def _stale(self, row: SchedulerLeaseRow, now: datetime) -> bool:
        if row.expires_at <= now:
            return True
        if row.host != self.host:
            return False  # another machine's process: only its expiry tells
        started = _process_start(row.pid)
        # Gone, or the pid now belongs to a later process (pid reuse, e.g. a restarted container).
        return started is None or abs(started - row.pid_started) > 1.0


def _holder(row: SchedulerLeaseRow) -> LeaseHolder:
    return LeaseHolder(row.holder, row.host, row.pid, row.role, row.expires_at)


def lease_conflict(store: Store, role: str, other: LeaseHolder) -> ConflictError:
    """The error for a service of ``role`` refused the scheduler lease of ``store`` held by ``other``."""
    where = store.safe_url
    if role == "server":
        return ConflictError(
            f"state store {where} already has a scheduler: {other.describe()}; stop it first"
            " (or point this server at another GPUYARD_HOME / GPUYARD_DATABASE_URL)"
        )
    if other.role == "server":
        return ConflictError(
            f"a gpuyard server schedules the state store {where} ({other.describe()}): submit to it"
            " instead (pipelines: --executor server; GPUYARD_SERVER names its URL)"
        )
    return ConflictError(f"state store {where} is already scheduled by {other.describe()}")
