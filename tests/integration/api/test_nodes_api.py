"""/nodes over real HTTP and `gpuyard nodes`: anyone lists, only admins drain and undrain."""

from __future__ import annotations

import pytest

from .conftest import LiveApi
from .test_security import _user

pytestmark = pytest.mark.integration


def test_members_list_and_admins_drain_and_undrain(live_api: LiveApi) -> None:
    alice = _user(live_api, "alice", "research", "member")
    victor = _user(live_api, "victor", "vision", "viewer")
    nodes = live_api.get("/nodes", alice).json()
    assert len(nodes) == 1 and nodes[0]["state"] == "healthy" and nodes[0]["gpus"] == 1
    name = nodes[0]["node"]
    assert live_api.get("/nodes", victor).status_code == 200
    # Members and viewers cannot drain (403 naming the role); nothing changes.
    for token, role in ((alice, "member"), (victor, "viewer")):
        resp = live_api.post(f"/nodes/{name}/drain", token, json={"reason": "mine"})
        assert resp.status_code == 403 and role in resp.json()["detail"]
    assert live_api.get(f"/nodes/{name}", alice).json()["state"] == "healthy"
    # The admin drains it: the scheduler's view and the history say so.
    admin = live_api.admin_token
    resp = live_api.post(f"/nodes/{name}/drain", admin, json={"reason": "fan swap"})
    assert resp.status_code == 200
    assert (resp.json()["state"], resp.json()["reason"], resp.json()["by"]) == (
        "drained",
        "fan swap",
        "admin",
    )
    shown = live_api.get(f"/nodes/{name}", alice).json()
    assert shown["state"] == "drained" and shown["history"][-1]["to"] == "drained"
    assert live_api.post(f"/nodes/{name}/drain", admin, json={"reason": ""}).status_code == 422
    # Undrain: admin only; a second undrain is a conflict; unknown nodes are 404.
    assert live_api.post(f"/nodes/{name}/undrain", alice).status_code == 403
    assert (
        live_api.post(f"/nodes/{name}/undrain", admin, json={"reason": "fixed"}).json()["state"] == "healthy"
    )
    resp = live_api.post(f"/nodes/{name}/undrain", admin)
    assert resp.status_code == 409 and "not drained" in resp.json()["detail"]
    resp = live_api.get("/nodes/no-such-node", admin)
    assert resp.status_code == 404 and "no-such-node" in resp.json()["detail"]


def test_cli_drains_and_says_one_line_when_refused(
    live_api: LiveApi, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.cli.main import main

    alice = _user(live_api, "alice", "research", "member")
    monkeypatch.setenv("GPUYARD_SERVER", live_api.url)
    name = live_api.get("/nodes", alice).json()[0]["node"]

    def run(*argv: str, token: str) -> int:
        monkeypatch.setenv("GPUYARD_TOKEN", token)
        try:
            main(list(argv))
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    assert run("nodes", "drain", name, "--reason", "mine", token=alice) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "needs an admin" in err
    assert run("nodes", "drain", name, "--reason", "PSU swap", token=live_api.admin_token) == 0
    assert capsys.readouterr().out.strip() == f"node {name}: drained (PSU swap)"
    assert run("nodes", "ls", "--json", token=alice) == 0
    import json

    assert json.loads(capsys.readouterr().out)[0]["state"] == "drained"
    monkeypatch.setenv("COLUMNS", "250")  # the table on one line, whatever the host name's length
    assert run("nodes", "ls", token=alice) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if name in line)
    assert "drained" in row and "PSU swap" in row
    assert run("nodes", "show", name, token=alice) == 0
    assert json.loads(capsys.readouterr().out)["history"][-1]["reason"] == "PSU swap"
    assert run("nodes", "undrain", "nope", token=live_api.admin_token) == 2
    assert "'nope' is not one of the scheduler's nodes" in capsys.readouterr().err
    assert run("nodes", "undrain", name, token=live_api.admin_token) == 0
    assert capsys.readouterr().out.strip() == f"node {name}: healthy"
