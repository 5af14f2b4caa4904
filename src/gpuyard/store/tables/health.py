"""Node health tables: each node's state (healthy / degraded / drained) and every change of it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from gpuyard.store.base import Base, JSONType, UTCDateTime, utcnow


class NodeStateRow(Base):
    """A scheduler node's health state, why, who set it, and its last health check.

    ``source`` is ``check`` (the periodic health check set the state) or ``admin`` (drained or
    undrained by hand: the checks then do not undrain it).
    """

    __tablename__ = "node_states"

    hostname: Mapped[str] = mapped_column(String(255), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    source: Mapped[str] = mapped_column(String(16))
    by: Mapped[str | None] = mapped_column(String(100), nullable=True)
    since: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    checked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The last check: verdict, each GPU's status and reasons, Xids, NVLink error totals, self-tests.
    last_check: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)


class NodeStateEventRow(Base):
    """One change of a node's state (or a failed check of a node already drained), oldest first."""

    __tablename__ = "node_state_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hostname: Mapped[str] = mapped_column(String(255))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    source: Mapped[str] = mapped_column(String(16))
    by: Mapped[str | None] = mapped_column(String(100), nullable=True)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)

    __table_args__ = (Index("ix_node_state_events_hostname", "hostname"),)
