"""Foundation tables: the nodes gpuyard has seen and their latest inventory."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from gpuyard.store.base import Base, JSONType, UTCDateTime, utcnow


class NodeRow(Base):
    """One machine: its last inventory snapshot (the `gpuyard hw --json` document) and health."""

    __tablename__ = "nodes"

    hostname: Mapped[str] = mapped_column(String(255), primary_key=True)
    inventory: Mapped[dict[str, Any]] = mapped_column(JSONType)
    health: Mapped[str] = mapped_column(String(16))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
