"""Migrations 0014_token_job (tokens stay users' own) and 0015_run_team (runs go to team default)."""

from __future__ import annotations

import pytest

from .conftest import backfill_round_trip

pytestmark = pytest.mark.integration


def test_existing_tokens_belong_to_no_job(db_url: str) -> None:
    rows = [
        "INSERT INTO auth_users (name, team, role, created_at)"
        " VALUES ('u', 't', 'member', CURRENT_TIMESTAMP)",
        'INSERT INTO auth_tokens ("user", label, token_hash, prefix, created_at)'
        " VALUES ('u', 'mine', 'ab', 'gy_x', CURRENT_TIMESTAMP)",
    ]
    backfill_round_trip(
        db_url, "0006_auth", rows, "SELECT job_id FROM auth_tokens WHERE label = 'mine'", None, "auth_tokens"
    )


def test_existing_runs_go_to_the_default_team(db_url: str) -> None:
    # Runs (studies, trials, their artifacts) from before 0015 are team default's.
    run = (
        "INSERT INTO runs (id, name, experiment, kind, status, params, tags, system, started_at)"
        " VALUES ('r1', 'old', 'default', 'train', 'finished', '{}', '{}', '{}', CURRENT_TIMESTAMP)"
    )
    query = "SELECT team FROM runs WHERE id = 'r1'"
    backfill_round_trip(db_url, "0010_model_team", [run], query, "default", "runs")
