"""A team filter that names no team is a 404 naming the known ones, not an empty listing."""

from __future__ import annotations

import pytest

from .conftest import LiveApi
from .test_security import _user

pytestmark = pytest.mark.integration

LISTINGS = ("/jobs", "/datasets", "/models", "/deployments", "/deployments/alerts")


@pytest.mark.parametrize("path", LISTINGS)
def test_unknown_team_filter_is_named(live_api: LiveApi, path: str) -> None:
    _user(live_api, "olga", "ops", "member")  # a team known only through its user
    resp = live_api.get(f"{path}?team=reserach", live_api.admin_token)  # a typo of research
    assert resp.status_code == 404, resp.text
    detail = resp.json()["detail"]
    assert "'reserach' is unknown" in detail and "research" in detail and "ops" in detail
    # Known teams with nothing in them are an empty listing, as before.
    for team in ("research", "vision", "ops", "default"):
        resp = live_api.get(f"{path}?team={team}", live_api.admin_token)
        assert resp.status_code == 200 and resp.json() == [], (team, resp.text)
