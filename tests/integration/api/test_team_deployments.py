"""Deployments scoped by team over real HTTP: a deployment is its model's team's, with its alerts."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import LiveApi
from .test_security import _user
from .test_team_models import _register

pytestmark = pytest.mark.integration


def _deployment(model: str) -> dict[str, Any]:
    """A stopped deployment record of ``model`` with one drift alert (no server is started)."""
    from gpuyard.serve.deploy import create_record
    from gpuyard.serve.options import ServeOptions
    from gpuyard.serve.records import mark
    from gpuyard.states import DeploymentState
    from gpuyard.store import get_store
    from gpuyard.store.tables.serve import DriftAlertRow

    doc = create_record(f"{model}:1", ServeOptions(device="cpu"))
    mark(doc["id"], DeploymentState.STOPPED)
    with get_store().session() as s:
        s.add(
            DriftAlertRow(
                deployment_id=doc["id"], model_name=model, model_version=1, kind="prediction_drift",
                feature=None, metric="psi", value=1.0, threshold=0.2, window_rows=100, detail={},
            )
        )  # fmt: skip
    return doc


def test_member_reads_and_lists_only_their_teams_deployments(live_api: LiveApi) -> None:
    alice = _user(live_api, "alice", "research", "member")
    victor = _user(live_api, "victor", "vision", "viewer")
    _register("seg", "vision")
    _register("clf", "research")
    seg, clf = _deployment("seg"), _deployment("clf")
    assert (seg["team"], clf["team"]) == ("vision", "research")  # the model's team
    # A member of research cannot read or list vision's deployment (403 naming the team).
    for path in (f"/deployments/{seg['id']}", f"/deployments/{seg['id']}/live", "/deployments?team=vision"):
        resp = live_api.get(path, alice)
        assert resp.status_code == 403, (path, resp.text)
        assert "'vision'" in resp.json()["detail"]
    assert live_api.get("/deployments/999999", alice).status_code == 404
    # Each sees their own team's deployments and alerts; the admin sees both.
    assert [d["id"] for d in live_api.get("/deployments?all=true", alice).json()] == [clf["id"]]
    assert [d["id"] for d in live_api.get("/deployments?all=true", victor).json()] == [seg["id"]]
    assert [a["model"] for a in live_api.get("/deployments/alerts", alice).json()] == ["clf"]
    assert live_api.get("/deployments/alerts?model=seg", alice).json() == []
    assert live_api.get(f"/deployments/{seg['id']}", victor).json()["team"] == "vision"
    admin = live_api.admin_token
    assert {d["id"] for d in live_api.get("/deployments?all=true", admin).json()} == {seg["id"], clf["id"]}
    assert {a["model"] for a in live_api.get("/deployments/alerts", admin).json()} == {"seg", "clf"}
    assert live_api.get(f"/deployments/{clf['id']}/live", admin).status_code == 200
