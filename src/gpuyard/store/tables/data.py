"""Data-management tables: the dataset catalog and its immutable, content-addressed versions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from gpuyard.store.base import Base, JSONType, UTCDateTime, utcnow


class DatasetRow(Base):
    """A named dataset; its content lives in versions."""

    __tablename__ = "datasets"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    # The team the dataset belongs to (every version of it is that team's).
    team: Mapped[str] = mapped_column(String(100), default="default", server_default="default", index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class DatasetVersionRow(Base):
    """One immutable version: where its manifest and shards are, and how many rows were quarantined."""

    __tablename__ = "dataset_versions"

    dataset: Mapped[str] = mapped_column(
        String(128), ForeignKey("datasets.name", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    parent: Mapped[str | None] = mapped_column(String(200), nullable=True)
    kind: Mapped[str] = mapped_column(String(16))
    num_rows: Mapped[int] = mapped_column(BigInteger)
    num_shards: Mapped[int] = mapped_column(Integer)
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    rows_in: Mapped[int] = mapped_column(BigInteger)
    rows_quarantined: Mapped[int] = mapped_column(BigInteger)
    quarantine_counts: Mapped[dict[str, Any]] = mapped_column(JSONType)
    manifest_key: Mapped[str] = mapped_column(Text)
    manifest_sha256: Mapped[str] = mapped_column(String(64))
    quarantine_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    source: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
