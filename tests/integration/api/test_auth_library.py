"""gpuyard.auth on real stores: hashed tokens, the embedded default's admin token file, the CLI commands."""

from __future__ import annotations

import hashlib
import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuyard.auth import (
    Principal,
    add_user,
    authenticate,
    create_token,
    ensure_admin_token,
    list_tokens,
    read_token,
    remove_user,
    revoke_token,
    visible_team,
)
from gpuyard.errors import AuthenticationError, ConfigError, ConflictError, NotFoundError, PermissionDenied

pytestmark = pytest.mark.integration


def test_first_start_writes_one_private_admin_token(
    gpuyard_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUYARD_TOKEN", raising=False)
    path = ensure_admin_token()
    assert path == gpuyard_home / "token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert token.startswith("gy_") and len(token) >= 40
    assert authenticate(token) == Principal("admin", "default", "admin", 1)
    assert read_token() == token
    assert ensure_admin_token() is None  # a second start keeps the first token
    assert path.read_text().strip() == token
    monkeypatch.setenv("GPUYARD_TOKEN", "gy_from_env")
    assert read_token() == "gy_from_env"  # the environment wins over the file


def test_tokens_hashed_revoked_expired_and_users_removed(gpuyard_home: Path) -> None:
    add_user("ann", team="research", role="viewer")
    with pytest.raises(ConflictError):
        add_user("ann")
    with pytest.raises(ConfigError, match="role"):
        add_user("bo", role="root")
    with pytest.raises(ConfigError, match="user"):
        add_user("../x")
    token, doc = create_token("ann", label="ci")
    assert doc["prefix"] == token[:9] and "token" not in doc
    assert all(token not in json.dumps(t) for t in list_tokens())
    assert authenticate(token).role == "viewer"
    for bad in (None, "", token + "x", token[:-1], hashlib.sha256(token.encode()).hexdigest()):
        with pytest.raises(AuthenticationError):
            authenticate(bad)
    revoke_token(doc["id"])
    with pytest.raises(AuthenticationError, match="revoked"):
        authenticate(token)
    with pytest.raises(ConfigError):
        create_token("ann", expires_days=0)
    with pytest.raises(NotFoundError):
        create_token("nobody")
    second, _ = create_token("ann")
    remove_user("ann")
    with pytest.raises(AuthenticationError):
        authenticate(second)


def test_team_scoping_rules() -> None:
    admin = Principal("root", "ops", "admin", 1)
    member = Principal("ann", "research", "member", 2)
    assert visible_team(admin, None) is None and visible_team(admin, "vision") == "vision"
    assert visible_team(member, None) == "research" and visible_team(member, "research") == "research"
    with pytest.raises(PermissionDenied, match="vision"):
        visible_team(member, "vision")


def test_users_and_tokens_commands(gpuyard_home: Path) -> None:
    from gpuyard.cli.main import app

    runner = CliRunner()
    made = runner.invoke(app, ["users", "add", "cy", "--team", "vision", "--role", "member", "--json"])
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout) == {**json.loads(made.stdout), "name": "cy", "team": "vision"}
    token = runner.invoke(app, ["tokens", "create", "cy", "--label", "laptop"]).stdout.strip()
    assert authenticate(token).team == "vision"
    listed = json.loads(runner.invoke(app, ["tokens", "ls", "--json"]).stdout)
    assert [(t["user"], t["label"], t["revoked"]) for t in listed] == [("cy", "laptop", False)]
    assert token not in runner.invoke(app, ["tokens", "ls"]).stdout
    assert runner.invoke(app, ["tokens", "revoke", str(listed[0]["id"])]).exit_code == 0
    dup = subprocess.run(
        [sys.executable, "-m", "gpuyard.cli.main", "users", "add", "cy"], capture_output=True, text=True
    )
    assert dup.returncode == 2 and "already exists" in dup.stderr and "Traceback" not in dup.stderr


def test_postgres_store_has_no_automatic_admin(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from gpuyard.store.db import reset_store_cache

    monkeypatch.setenv("GPUYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUYARD_DATABASE_URL", pg_url)
    reset_store_cache()
    assert ensure_admin_token() is None and not (tmp_path / "home" / "token").exists()
    add_user("ops", role="admin")
    token, _ = create_token("ops")
    assert authenticate(token).is_admin
