"""Runs (and so studies, trials and run artifacts) scoped by team over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import LiveApi
from .test_security import _user

pytestmark = pytest.mark.integration


def _run(name: str, team: str | None, tmp_path: Path, parent: str | None = None) -> str:
    from gpuyard.tracking.store import start_run

    tracker = start_run(
        name, kind="trial" if parent else "tune", team=team, parent_id=parent, system_interval_s=None
    )
    tracker.log_metrics(1, {"loss": 0.5})
    secret = tmp_path / f"{name}.txt"
    secret.write_text(f"{name}-secret")
    tracker.log_artifact("notes.txt", secret)
    tracker.finish()
    return tracker.run_id


def test_member_reaches_only_their_teams_runs_studies_and_artifacts(
    live_api: LiveApi, tmp_path: Path
) -> None:
    alice = _user(live_api, "alice", "research", "member")
    mine = _run("study-r", "research", tmp_path)
    theirs = _run("study-v", "vision", tmp_path)
    trial = _run("trial-v", None, tmp_path, parent=theirs)  # a study's trial has its study's team
    # Alice lists only research's runs; ?team=vision is 403.
    listed = live_api.get("/runs", alice).json()
    assert [(r["id"], r["team"]) for r in listed] == [(mine, "research")]
    assert live_api.get("/runs?team=vision", alice).status_code == 403
    # Vision's study, its trial, their metrics and artifacts, and a comparison with them: 403 naming the team.
    for path in (
        f"/runs/{theirs}",
        f"/runs/{trial}",
        f"/runs/{trial}/metrics",
        f"/runs/{theirs}/artifacts/notes.txt",
        f"/runs/compare?ids={mine}&ids={theirs}",
    ):
        resp = live_api.get(path, alice)
        assert resp.status_code == 403 and "'vision'" in resp.json()["detail"], (path, resp.text)
        assert "study-v-secret" not in resp.text
    # Her own run and its artifact she reaches; the admin reaches all, and filters by team.
    assert live_api.get(f"/runs/{mine}/artifacts/notes.txt", alice).content == b"study-r-secret"
    admin = live_api.admin_token
    assert {r["id"] for r in live_api.get("/runs", admin).json()} == {mine, theirs, trial}
    assert {r["id"] for r in live_api.get("/runs?team=vision", admin).json()} == {theirs, trial}
    assert live_api.get(f"/runs/{trial}", admin).json()["team"] == "vision"


def test_a_jobs_runs_belong_to_its_team(gpuyard_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuyard.errors import ConfigError
    from gpuyard.tracking.store import start_run

    monkeypatch.setenv("GPUYARD_TEAM", "vision")  # as gpuyard server sets it for each job
    tracker = start_run("in-a-job", system_interval_s=None)
    tracker.finish()
    from gpuyard.models.runs import get_run

    assert get_run(tracker.run_id).team == "vision"
    monkeypatch.delenv("GPUYARD_TEAM")
    other = start_run("local", system_interval_s=None)
    other.finish()
    assert get_run(other.run_id).team == "default"
    with pytest.raises(ConfigError, match="run team"):
        start_run("bad", team="../etc", system_interval_s=None)


def test_runs_ls_names_an_unknown_team(gpuyard_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpuyard.cli.main import main
    from gpuyard.tracking.store import start_run

    start_run("r", team="vision", system_interval_s=None).finish()
    with pytest.raises(SystemExit) as exit_:
        main(["runs", "ls", "--team", "visoin"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'visoin' is unknown; known teams: default, vision" in err, err
    with pytest.raises(SystemExit) as exit_:
        main(["runs", "ls", "--team", "vision", "--json"])
    assert exit_.value.code == 0 and [r["team"] for r in json.loads(capsys.readouterr().out)] == ["vision"]
