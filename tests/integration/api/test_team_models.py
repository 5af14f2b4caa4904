"""Models scoped by team over real HTTP: two teams' members, an admin, the stage route and the listings."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import LiveApi
from .test_security import _user

pytestmark = pytest.mark.integration


def _register(name: str, team: str | None) -> Any:
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    from gpuyard.models.registry import register_model
    from gpuyard.models.signature import infer_signature

    X = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    model = LogisticRegression().fit(X, y)
    return register_model(name, model, "classification", infer_signature(X, y, "classification"), team=team)


def test_member_changes_reads_and_lists_only_their_teams_models(live_api: LiveApi) -> None:
    alice = _user(live_api, "alice", "research", "member")
    victor = _user(live_api, "victor", "vision", "member")
    assert _register("seg", "vision").team == "vision"
    assert _register("clf", "research").team == "research"
    # A member of research cannot move, read or list vision's model (403 naming the team).
    for method, path, body in (
        ("POST", "/models/seg/versions/1/stage", {"stage": "archived"}),
        ("GET", "/models/seg", None),
        ("GET", "/models/seg/versions/1", None),
        ("GET", "/models?team=vision", None),
    ):
        resp = live_api.post(path, alice, json=body) if method == "POST" else live_api.get(path, alice)
        assert resp.status_code == 403, (method, path, resp.text)
        assert "'vision'" in resp.json()["detail"]
    assert live_api.get("/models/seg/versions/1", victor).json()["stage"] == "none"  # untouched
    assert live_api.post("/models/nope/versions/1/stage", alice, json={"stage": "staging"}).status_code == 404
    # Each member sees and moves their own team's model; the admin sees and moves both.
    assert [m["name"] for m in live_api.get("/models", alice).json()] == ["clf"]
    assert [(m["name"], m["team"]) for m in live_api.get("/models", victor).json()] == [("seg", "vision")]
    moved = live_api.post("/models/clf/versions/1/stage", alice, json={"stage": "staging"})
    assert moved.status_code == 200 and moved.json()["stage"] == "staging"
    assert {m["name"] for m in live_api.get("/models", live_api.admin_token).json()} == {"clf", "seg"}
    admin = live_api.post("/models/seg/versions/1/stage", live_api.admin_token, json={"stage": "staging"})
    assert admin.status_code == 200


def test_a_new_version_keeps_its_models_team(live_api: LiveApi) -> None:
    from gpuyard.errors import ConflictError

    assert _register("clf", None).team == "default"  # no team named: the default team
    assert _register("clf", None).team == "default"
    _register("seg", "vision")
    assert _register("seg", None).team == "vision"  # a new version goes where its model is
    with pytest.raises(ConflictError, match="belongs to team 'vision'"):
        _register("seg", "research")
