"""Datasets scoped by team over real HTTP: two teams' members, an admin, the listing and the versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import LiveApi
from .test_security import _user

pytestmark = pytest.mark.integration


def _ingest(tmp_path: Path, name: str, team: str | None, rows: int = 3) -> Any:
    from gpuyard.data import ingest

    src = tmp_path / f"{name}-{rows}.csv"
    src.write_text("x,label\n" + "".join(f"{i},{i % 2}\n" for i in range(rows)))
    return ingest(src, name, team=team)


def test_member_reads_and_lists_only_their_teams_datasets(live_api: LiveApi, tmp_path: Path) -> None:
    from gpuyard.data.catalog import dataset_team

    alice = _user(live_api, "alice", "research", "member")
    victor = _user(live_api, "victor", "vision", "viewer")
    _ingest(tmp_path, "images", "vision")
    _ingest(tmp_path, "tabular", "research")
    assert (dataset_team("images"), dataset_team("tabular")) == ("vision", "research")
    # A member of research cannot read or list vision's dataset (403 naming the team).
    for path in ("/datasets/images", "/datasets?team=vision"):
        resp = live_api.get(path, alice)
        assert resp.status_code == 403, (path, resp.text)
        assert "'vision'" in resp.json()["detail"]
    assert live_api.get("/datasets/nope", alice).status_code == 404
    # Each sees their own team's dataset; the admin sees both, and filters by team.
    assert [(d["dataset"], d["team"]) for d in live_api.get("/datasets", alice).json()] == [
        ("tabular", "research")
    ]
    assert [d["dataset"] for d in live_api.get("/datasets?team=research", alice).json()] == ["tabular"]
    assert [d["dataset"] for d in live_api.get("/datasets", victor).json()] == ["images"]
    own = live_api.get("/datasets/images", victor)
    assert own.status_code == 200 and own.json()[0]["team"] == "vision"
    admin = live_api.admin_token
    assert {d["dataset"] for d in live_api.get("/datasets", admin).json()} == {"images", "tabular"}
    assert [d["dataset"] for d in live_api.get("/datasets?team=vision", admin).json()] == ["images"]
    assert live_api.get("/datasets/tabular", admin).status_code == 200


def test_a_new_version_keeps_its_datasets_team(live_api: LiveApi, tmp_path: Path) -> None:
    from gpuyard.data import Recipe, transform
    from gpuyard.data.catalog import dataset_team
    from gpuyard.errors import ConflictError

    _ingest(tmp_path, "plain", None)
    assert dataset_team("plain") == "default"  # no team named: the default team
    _ingest(tmp_path, "seg", "vision")
    _ingest(tmp_path, "seg", None, rows=4)  # a new version goes where its dataset is
    assert dataset_team("seg") == "vision"
    with pytest.raises(ConflictError, match="belongs to team 'vision'"):
        _ingest(tmp_path, "seg", "research", rows=5)
    with pytest.raises(ConflictError, match="belongs to team 'vision'"):
        _ingest(tmp_path, "seg", "research", rows=4)  # even an unchanged version
    recipe = Recipe()
    transform("seg", recipe, engine="serial")  # a new version of seg: vision's
    assert dataset_team("seg") == "vision"
    transform("seg", recipe, output="seg-out", engine="serial", team="research")
    assert dataset_team("seg-out") == "research"
    assert len(live_api.get("/datasets/seg", live_api.admin_token).json()) >= 2
