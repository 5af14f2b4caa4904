"""Users, teams, roles and API tokens: create, check, revoke; and the admin token of the embedded default.

A token is ``gy_`` + 43 URL-safe characters (32 random bytes from :mod:`secrets`). Only its SHA-256 is
stored: with that much entropy a fast hash is enough (no dictionary to guess from), and the lookup
is one index probe followed by a constant-time comparison. A token is shown once, when it is made.

Roles: ``admin`` (everything, every team, users and tokens), ``member`` (reads everything; submits,
sees and cancels only the jobs of their own team), ``viewer`` (reads only; jobs of their own team).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from collections.abc import Generator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuyard.errors import AuthenticationError, ConfigError, ConflictError, NotFoundError, PermissionDenied
from gpuyard.settings import Settings, load_settings
from gpuyard.store.base import utcnow
from gpuyard.store.db import Store, get_store
from gpuyard.store.tables.auth import TokenRow, UserRow
from gpuyard.store.tables.jobs import JobRow

log = logging.getLogger(__name__)

ROLES = ("admin", "member", "viewer")
TOKEN_PREFIX = "gy_"
TOKEN_ENV = "GPUYARD_TOKEN"
TOKEN_FILE = "token"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# last_used_at is refreshed at most this often, so reads do not turn every request into a write.
_TOUCH_EVERY = timedelta(seconds=60)
# A job's token works while the job is in one of these states (scheduler.spec.ACTIVE's values).
_ACTIVE_JOB_STATES = ("queued", "scheduled", "running")
# The longest token lifetime: ten years (a longer one overflows the date range soon after 1e6 days).
MAX_TOKEN_DAYS = 3650


@dataclass(frozen=True)
class Principal:
    """Who is calling: a user, their team and role, and the token they used."""

    user: str
    team: str
    role: str
    token_id: int
    job_id: int | None = None  # set for a job-scoped token: it reaches only this job

    @property
    def is_admin(self) -> bool:
        """True for the admin role (sees every team)."""
        return self.role == "admin"

    @property
    def can_write(self) -> bool:
        """True for admin and member; viewers only read."""
        return self.role in ("admin", "member")


def hash_token(token: str) -> str:
    """The hex SHA-256 stored for ``token``."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ConfigError(f"{what} {value!r}: use letters, digits, '.', '_' or '-' (at most 100)")
    return value


def _user_doc(r: UserRow) -> dict[str, Any]:
    return {"name": r.name, "team": r.team, "role": r.role, "created_at": r.created_at.isoformat()}


def _token_doc(r: TokenRow) -> dict[str, Any]:
    iso = lambda d: d.isoformat() if d else None  # noqa: E731
    return {
        "id": r.id,
        "user": r.user,
        "label": r.label,
        "prefix": r.prefix,
        "created_at": iso(r.created_at),
        "expires_at": iso(r.expires_at),
        "last_used_at": iso(r.last_used_at),
        "revoked": r.revoked_at is not None,
        "job_id": r.job_id,
    }


# -- users ----------------------------------------------------------------------------------------


def add_user(
    name: str, team: str = "default", role: str = "member", store: Store | None = None
) -> dict[str, Any]:
    """Create a user in ``team`` with ``role``.

    Raises:
        ConfigError: a bad name, team or role. ConflictError: the user exists.
    """
    _check_name("user", name)
    _check_name("team", team)
    if role not in ROLES:
        raise ConfigError(f"role {role!r}: use one of {', '.join(ROLES)}")
    store = store or get_store()
    with store.session() as s:
        if s.get(UserRow, name) is not None:
            raise ConflictError(f"user {name!r} already exists")
        row = UserRow(name=name, team=team, role=role)
        s.add(row)
        s.flush()
        return _user_doc(row)


def list_users(store: Store | None = None) -> list[dict[str, Any]]:
    """Every user, by name."""
    store = store or get_store()
    with store.read() as s:
        return [_user_doc(r) for r in s.scalars(select(UserRow).order_by(UserRow.name))]


def remove_user(name: str, store: Store | None = None) -> None:
    """Delete a user and every token of theirs.

    Raises:
        NotFoundError: no such user.
    """
    store = store or get_store()
    with store.session() as s:
        row = s.get(UserRow, name)
        if row is None:
            raise NotFoundError(f"user {name!r} does not exist (see `gpuyard users ls`)")
        for tok in s.scalars(select(TokenRow).where(TokenRow.user == name)):
            s.delete(tok)
        s.delete(row)


# -- tokens ---------------------------------------------------------------------------------------


def create_token(
    user: str, label: str = "", expires_days: float | None = None, store: Store | None = None
) -> tuple[str, dict[str, Any]]:
    """Make a new token for ``user``; returns (the token, shown only now; its record).

    Raises:
        NotFoundError: no such user. ConfigError: an expiry not in (0, MAX_TOKEN_DAYS].
    """
    if expires_days is not None and not 0 < expires_days <= MAX_TOKEN_DAYS:
        raise ConfigError(f"expires_days: {expires_days} must be > 0 and at most {MAX_TOKEN_DAYS}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    store = store or get_store()
    with store.session() as s:
        if s.get(UserRow, user) is None:
            raise NotFoundError(f"user {user!r} does not exist (see `gpuyard users ls`)")
        row = TokenRow(
            user=user,
            label=label[:100],
            token_hash=hash_token(token),
            prefix=token[:9],
            expires_at=utcnow() + timedelta(days=expires_days) if expires_days else None,
        )
        s.add(row)
        s.flush()
        return token, _token_doc(row)


def list_tokens(user: str | None = None, store: Store | None = None) -> list[dict[str, Any]]:
    """Token records (never the tokens), optionally of one user."""
    store = store or get_store()
    q = select(TokenRow).order_by(TokenRow.id)
    if user:
        q = q.where(TokenRow.user == user)
    with store.read() as s:
        return [_token_doc(r) for r in s.scalars(q)]


def revoke_token(token_id: int, store: Store | None = None) -> dict[str, Any]:
    """Revoke a token at once; later requests with it get 401.

    Raises:
        NotFoundError: no such token.
    """
    store = store or get_store()
    with store.session() as s:
        row = s.get(TokenRow, token_id)
        if row is None:
            raise NotFoundError(f"token {token_id} does not exist (see `gpuyard tokens ls`)")
        row.revoked_at = row.revoked_at or utcnow()
        return _token_doc(row)


def create_job_token(s: Session, job_id: int, user: str) -> str | None:
    """A token for job ``job_id`` to call the API as ``user`` on its own job only (None: no such user).

    Made in the caller's session ``s`` (the job's launch and its token commit together). It is given
    to the job in GPUYARD_TOKEN, refused once the job is no longer queued, scheduled or running, and
    revoked when its attempt ends (:func:`revoke_job_tokens`). A job submitted by someone who is not
    an API user (an in-process service's OS user) gets none.
    """
    if s.get(UserRow, user) is None:
        return None
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    s.add(
        TokenRow(
            user=user, label=f"job {job_id}", token_hash=hash_token(token), prefix=token[:9], job_id=job_id
        )
    )
    return token


def revoke_job_tokens(s: Session, job_id: int) -> int:
    """Revoke the live tokens of job ``job_id`` in session ``s`` (its attempt ended); returns how many."""
    live = list(s.scalars(select(TokenRow).where(TokenRow.job_id == job_id, TokenRow.revoked_at.is_(None))))
    for row in live:
        row.revoked_at = utcnow()
    return len(live)


def _job_active(s: Session, job_id: int) -> bool:
    row = s.get(JobRow, job_id)
    return row is not None and row.state in _ACTIVE_JOB_STATES


def authenticate(token: str | None, store: Store | None = None) -> Principal:
    """The principal behind ``token``.

    Raises:
        AuthenticationError: no token, or an unknown, revoked or expired one. The message never
            repeats the token.
    """
    if not token:
        raise AuthenticationError(
            "an API token is required: send 'Authorization: Bearer <token>' "
            "(the CLI sends GPUYARD_TOKEN, else the token file in GPUYARD_HOME)"
        )
    digest = hash_token(token)
    store = store or get_store()
    with store.read() as s:
        row = s.scalars(select(TokenRow).where(TokenRow.token_hash == digest)).first()
        # The index found the row; compare anyway in constant time so no path leaks timing.
        if row is None or not hmac.compare_digest(row.token_hash, digest):
            raise AuthenticationError("invalid API token")
        now = utcnow()
        if row.job_id is not None and (row.revoked_at is not None or not _job_active(s, row.job_id)):
            # Revoked when the attempt ends; the job's state is checked too, for one that ended while
            # no server ran (nobody revoked its token then).
            raise AuthenticationError(
                f"API token {row.prefix}... was job {row.job_id}'s, whose attempt has ended"
            )
        if row.revoked_at is not None:
            raise AuthenticationError(f"API token {row.prefix}... was revoked")
        if row.expires_at is not None and row.expires_at <= now:
            raise AuthenticationError(f"API token {row.prefix}... expired at {row.expires_at.isoformat()}")
        user = s.get(UserRow, row.user)
        if user is None:
            raise AuthenticationError("invalid API token")
        principal = Principal(
            user=user.name, team=user.team, role=user.role, token_id=row.id, job_id=row.job_id
        )
        stale = row.last_used_at is None or now - row.last_used_at > _TOUCH_EVERY
    if stale:
        with store.session() as s:
            fresh = s.get(TokenRow, principal.token_id)
            if fresh is not None:
                fresh.last_used_at = now
    return principal


# -- team scoping ---------------------------------------------------------------------------------


def require_write(principal: Principal) -> None:
    """Refuse a viewer.

    Raises:
        PermissionDenied: the principal only reads.
    """
    if not principal.can_write:
        raise PermissionDenied(f"user {principal.user!r} is a {principal.role}: read-only")


def require_admin(principal: Principal) -> None:
    """Refuse anyone but an admin.

    Raises:
        PermissionDenied: the principal is not an admin.
    """
    if not principal.is_admin:
        raise PermissionDenied(f"user {principal.user!r} is a {principal.role}: this needs an admin")


def check_team(principal: Principal, team: str, what: str = "denied") -> None:
    """Refuse a non-admin acting on another team's thing.

    Raises:
        PermissionDenied: ``team`` is not the principal's.
    """
    if not principal.is_admin and team != principal.team:
        raise PermissionDenied(
            f"{what}: team {team!r} is not yours; user {principal.user!r} is in team {principal.team!r}"
        )


def visible_team(principal: Principal, requested: str | None) -> str | None:
    """The team filter a listing must use: any (or the one asked) for an admin, else the caller's own.

    Raises:
        PermissionDenied: a non-admin asked for another team.
    """
    if principal.is_admin:
        return requested
    if requested is not None:
        check_team(principal, requested, "listing")
    return principal.team


# -- the embedded default's admin token -----------------------------------------------------------


def token_path(settings: Settings | None = None) -> Path:
    """Where the admin token of the embedded default is kept (``GPUYARD_HOME/token``)."""
    return (settings or load_settings()).home / TOKEN_FILE


def _write_private(path: Path, text: str) -> None:
    # Created 0600 from the first byte (no window where another user could read it), then renamed.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_admin_token(settings: Settings | None = None, store: Store | None = None) -> Path | None:
    """On the embedded default (SQLite) with no user yet: create user ``admin`` and its token file.

    Returns the token file's path when one was written now, else None (users exist, or the store is
    a shared database where the first admin is made with ``gpuyard users add`` / ``tokens create``).
    """
    settings = settings or load_settings()
    if not settings.is_sqlite:
        return None
    store = store or get_store(settings)
    with store.session() as s:
        if s.scalars(select(UserRow).limit(1)).first() is not None:
            return None
        s.add(UserRow(name="admin", team="default", role="admin"))
    token, _ = create_token("admin", label="embedded default (first start)", store=store)
    path = token_path(settings)
    settings.ensure_home()
    _write_private(path, token + "\n")
    log.info("created user 'admin' and its API token in %s (mode 0600)", path)
    return path


def read_token(settings: Settings | None = None) -> str | None:
    """The token a client sends: ``GPUYARD_TOKEN``, else the token file in ``GPUYARD_HOME``, else None."""
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env
    try:
        text = token_path(settings).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        return None
    return text or None


class TokenAuth(httpx.Auth):
    """httpx auth that sends ``Authorization: Bearer`` with :func:`read_token`, read at each request.

    Read lazily: a client made before the server's first start still finds the token it writes.
    """

    def __init__(self, token: str | None = None) -> None:
        self._token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self._token or read_token()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


def bearer_headers(token: str | None = None) -> dict[str, str]:
    """``{"Authorization": "Bearer ..."}`` with ``token`` or :func:`read_token` (empty when none)."""
    token = token or read_token()
    return {"Authorization": f"Bearer {token}"} if token else {}
