"""Authentication tables: users (team and role) and their API tokens (only a SHA-256 of each is kept)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from gpuyard.store.base import Base, UTCDateTime, utcnow


class UserRow(Base):
    """One user of the API: the team whose jobs they see and their role (admin, member, viewer)."""

    __tablename__ = "auth_users"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    team: Mapped[str] = mapped_column(String(100))
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TokenRow(Base):
    """One API token of a user. The token itself is never stored: only its SHA-256 and a short prefix."""

    __tablename__ = "auth_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user: Mapped[str] = mapped_column(String(100), ForeignKey("auth_users.name", ondelete="CASCADE"))
    label: Mapped[str] = mapped_column(String(100))
    # hex SHA-256 of the whole token: looked up by index, then compared in constant time.
    token_hash: Mapped[str] = mapped_column(String(64))
    # The first characters (e.g. "gy_AbCd12"), so a user can tell tokens apart in `tokens ls`.
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # A job-scoped token (given to job N by the server): it reaches only that job, while it is active.
    job_id: Mapped[int | None] = mapped_column(Integer, nullable=True)

    __table_args__ = (
        Index("ix_auth_tokens_token_hash", "token_hash", unique=True),
        Index("ix_auth_tokens_user", "user"),
        Index("ix_auth_tokens_job_id", "job_id"),
    )
