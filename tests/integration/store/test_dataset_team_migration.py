"""Migrations 0011_dataset_team and 0012_deployment_team: rows from before them go to team 'default'."""

from __future__ import annotations

import pytest

from .conftest import backfill_round_trip

pytestmark = pytest.mark.integration


def test_existing_datasets_go_to_the_default_team(db_url: str) -> None:
    old = "INSERT INTO datasets (name, created_at) VALUES ('old', CURRENT_TIMESTAMP)"
    backfill_round_trip(
        db_url, "0002_data", [old], "SELECT team FROM datasets WHERE name = 'old'", "default", "datasets"
    )


def test_existing_deployments_go_to_the_default_team(db_url: str) -> None:
    old = (
        "INSERT INTO serve_deployments (model_name, model_version, model_ref, replicas, device,"
        " status, pids, config, created_at, updated_at) VALUES ('clf', 1, 'clf', 1, 'cpu',"
        " 'stopped', '{}', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
    )
    backfill_round_trip(
        db_url, "0008_serve_job", [old], "SELECT team FROM serve_deployments", "default", "serve_deployments"
    )
