"""Security of the API over real HTTP: tokens on every route, team scoping, no token in logs, no traversal."""

from __future__ import annotations

import hashlib
import re
import sys

import httpx
import pytest
from tests.waiting import wait_for

from .conftest import LiveApi

pytestmark = pytest.mark.integration

PUBLIC = {"/health", "/ready"}  # liveness and readiness probes


def _user(live: LiveApi, name: str, team: str, role: str) -> str:
    assert (
        live.post("/users", live.admin_token, json={"name": name, "team": team, "role": role}).status_code
        == 201
    )
    made = live.post(f"/users/{name}/tokens", live.admin_token, json={"label": "test"})
    assert made.status_code == 201
    return str(made.json()["token"])


def _sleeper(name: str, team: str) -> dict[str, object]:
    return {"name": name, "team": team, "command": [sys.executable, "-c", "import time; time.sleep(30)"]}


def test_every_route_but_health_needs_a_valid_token(live_api: LiveApi) -> None:
    # Every operation the server documents (its OpenAPI document; the docs themselves hold no data).
    spec = live_api.get("/openapi.json").json()
    routes = [(p, m.upper()) for p, ops in spec["paths"].items() if p not in PUBLIC for m in ops]
    assert len(routes) >= 25  # jobs, cluster, fabric, datasets, runs, models, deployments, users
    checked = 0
    for template, method in routes:
        path = re.sub(r"\{[^}]+\}", "1", template)
        for headers in (
            {},
            {"Authorization": "Bearer gy_wrong"},
            {"Authorization": "Basic YWRtaW46eA=="},
        ):
            resp = httpx.request(method, live_api.url + path, headers=headers, json={}, timeout=10)
            assert resp.status_code == 401, (method, path, headers, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer"
            checked += 1
    assert checked >= 75
    assert live_api.get("/health").status_code == 200
    assert live_api.get("/me", live_api.admin_token).json() == {
        "user": "admin",
        "team": "default",
        "role": "admin",
    }


def test_revoked_and_expired_tokens_are_refused(live_api: LiveApi) -> None:
    from gpuyard.auth import create_token
    from gpuyard.store import get_store
    from gpuyard.store.tables.auth import TokenRow

    token = _user(live_api, "bob", "research", "member")
    assert live_api.get("/me", token).status_code == 200
    token_id = next(
        t["id"] for t in live_api.get("/tokens", live_api.admin_token).json() if t["user"] == "bob"
    )
    assert live_api.post(f"/tokens/{token_id}/revoke", live_api.admin_token).json()["revoked"] is True
    assert live_api.get("/me", token).status_code == 401
    short, doc = create_token("bob", expires_days=1)
    assert live_api.get("/me", short).status_code == 200
    with get_store().session() as s:  # move its expiry into the past
        row = s.get(TokenRow, doc["id"])
        row.expires_at = row.created_at
    assert live_api.get("/me", short).status_code == 401


def test_member_reaches_only_their_teams_jobs(live_api: LiveApi) -> None:
    alice = _user(live_api, "alice", "research", "member")
    viewer = _user(live_api, "vera", "research", "viewer")
    other = live_api.post("/jobs", live_api.admin_token, json=_sleeper("theirs", "vision")).json()
    wait_for(lambda: live_api.get(f"/jobs/{other['id']}", live_api.admin_token).json()["state"] == "running")
    for method, path in (
        ("GET", f"/jobs/{other['id']}"),
        ("GET", f"/jobs/{other['id']}/events"),
        ("GET", f"/jobs/{other['id']}/logs"),
        ("POST", f"/jobs/{other['id']}/cancel"),
        ("GET", "/jobs?team=vision"),
    ):
        resp = httpx.request(method, live_api.url + path, headers={"Authorization": f"Bearer {alice}"})
        assert resp.status_code == 403, (method, path, resp.text)
        assert "vision" in resp.json()["detail"]
    # Submitting into another team is refused; into their own it runs as them, whatever the spec says.
    assert live_api.post("/jobs", alice, json=_sleeper("sneaky", "vision")).status_code == 403
    mine = live_api.post("/jobs", alice, json={**_sleeper("mine", "research"), "user": "admin"}).json()
    assert (mine["team"], mine["user"]) == ("research", "alice")
    assert [j["id"] for j in live_api.get("/jobs", alice).json()] == [mine["id"]]
    assert {j["id"] for j in live_api.get("/jobs", live_api.admin_token).json()} == {mine["id"], other["id"]}
    # A viewer of the team reads it but changes nothing.
    assert [j["id"] for j in live_api.get("/jobs", viewer).json()] == [mine["id"]]
    assert live_api.post(f"/jobs/{mine['id']}/cancel", viewer).status_code == 403
    assert live_api.post("/jobs", viewer, json=_sleeper("v", "research")).status_code == 403
    # Only an admin manages users.
    assert live_api.get("/users", alice).status_code == 403
    assert live_api.post("/users", alice, json={"name": "mallory", "role": "admin"}).status_code == 403
    # The member cancels their own job; the other team's job was never touched.
    assert live_api.post(f"/jobs/{mine['id']}/cancel", alice).status_code == 200
    assert live_api.get(f"/jobs/{other['id']}", live_api.admin_token).json()["state"] == "running"
    assert live_api.post(f"/jobs/{other['id']}/cancel", live_api.admin_token).status_code == 200


def test_tokens_are_stored_hashed_and_never_logged(live_api: LiveApi) -> None:
    from sqlalchemy import select

    from gpuyard.store import get_store
    from gpuyard.store.tables.auth import TokenRow

    alice = _user(live_api, "alice", "research", "member")
    wrong = "gy_" + "x" * 43
    live_api.get("/me", alice)
    live_api.get("/jobs", wrong)
    live_api.get("/jobs?offset=1", alice)
    live_api.post("/jobs", alice, json=_sleeper("bad name!", "research"))  # a 422 logs its request too
    live_api.get("/nope", alice)
    with get_store().read() as s:
        hashes = set(s.scalars(select(TokenRow.token_hash)))
    assert hashlib.sha256(alice.encode()).hexdigest() in hashes
    assert hashlib.sha256(live_api.admin_token.encode()).hexdigest() in hashes
    db_bytes = (live_api.home / "gpuyard.db").read_bytes()
    logs = "\n".join(live_api.records)
    assert "GET /me" in logs or '"GET /me' in logs  # the access log was captured
    for token in (alice, live_api.admin_token, wrong):
        assert token not in logs
        assert token[3:20] not in logs  # not even a slice past the public prefix
        assert token.encode() not in db_bytes


def test_path_traversal_in_artifact_log_and_static_routes_is_refused(live_api: LiveApi) -> None:
    from gpuyard.tracking.store import start_run

    with start_run("t", system_interval_s=None) as run:
        run.log_artifact("model/weights.bin", b"\x00weights")
    token = live_api.admin_token
    ok = live_api.get(f"/runs/{run.run_id}/artifacts/model/weights.bin", token)
    assert ok.status_code == 200 and ok.content == b"\x00weights"
    secret = live_api.home / "token"
    for name in (
        "..%2F..%2F..%2F..%2F..%2F..%2Fetc%2Fpasswd",
        "model/..%2F..%2F..%2Ftoken",
        "%2Fetc%2Fpasswd",
        "model%2F..%2Fweights.bin",
        "..%5C..%5Ctoken",
    ):
        resp = httpx.get(
            f"{live_api.url}/runs/{run.run_id}/artifacts/{name}", headers={"Authorization": f"Bearer {token}"}
        )
        assert resp.status_code in (400, 404, 422), (name, resp.status_code)
        assert b"root:" not in resp.content and secret.read_bytes().strip() not in resp.content
    job = live_api.post("/jobs", token, json={"name": "echo", "command": ["echo", "hi"]}).json()
    for path in (
        f"/jobs/{job['id']}/logs?offset=-1",
        "/jobs/..%2F..%2Fetc%2Fpasswd/logs",
        f"/jobs/{job['id']}/logs?path=/etc/passwd&offset=0",
    ):
        resp = httpx.get(live_api.url + path, headers={"Authorization": f"Bearer {token}"})
        assert b"root:" not in resp.content, path
        assert resp.status_code in (200, 404, 422), path
    for path in ("/static/..%2F..%2Fauth.py", "/static/%2E%2E/%2E%2E/auth.py", "/static/../../../token"):
        resp = httpx.get(live_api.url + path)
        assert resp.status_code == 404, path
    # The fabric planner reads presets by name only, never a file named in the request.
    plan = live_api.post(
        "/fabric/plan",
        token,
        json={"model": "/etc/passwd", "cluster": "dgx-h100", "gpus": 8, "global_batch": 8},
    )
    assert plan.status_code == 404 and "root:" not in plan.text
