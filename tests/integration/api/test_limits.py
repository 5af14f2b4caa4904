"""Bounds at the edge over real HTTP: huge or negative integers, long strings, NaN and oversized specs
give a 4xx naming the field, never a 500."""

from __future__ import annotations

import re
import sys
from typing import Any

import httpx
import pytest
from tests.waiting import wait_for

from gpuyard.limits import MAX_OFFSET

from .conftest import LiveApi

pytestmark = pytest.mark.integration

HUGE = (2**70, -(2**70), 2**63, 2**31)


def _operations(live: LiveApi) -> list[tuple[str, str, list[dict[str, Any]]]]:
    spec = live.get("/openapi.json").json()
    return [
        (path, method.upper(), op.get("parameters", []))
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
    ]


def _fill(
    template: str, params: list[dict[str, Any]], name: str, value: object
) -> tuple[str, dict[str, str]]:
    path = template
    query: dict[str, str] = {}
    for p in params:
        if p["in"] == "path":
            filler = value if p["name"] == name else ("1" if "int" in str(p["schema"]) else "abcd")
            path = path.replace("{" + p["name"] + "}", str(filler)).replace(
                "{" + p["name"] + ":path}", str(filler)
            )
        elif p["name"] == name and p["in"] == "query":
            query[name] = str(value)
    return re.sub(r"\{[^}]+\}", "1", path), query


def _names_field(resp: httpx.Response, name: str) -> bool:
    detail = resp.json()["detail"]
    if isinstance(detail, list):
        return any(name in [str(x) for x in d["loc"]] for d in detail)
    return name in detail


def test_every_integer_parameter_is_bounded(live_api: LiveApi) -> None:
    token = live_api.admin_token
    checked = 0
    for template, method, params in _operations(live_api):
        for p in params:
            if "integer" not in str(p["schema"]):
                continue
            for value in HUGE:
                path, query = _fill(template, params, p["name"], value)
                resp = httpx.request(
                    method,
                    live_api.url + path,
                    params=query,
                    headers={"Authorization": f"Bearer {token}"},
                    json={},
                    timeout=10,
                )
                assert 400 <= resp.status_code < 500, (method, path, query, resp.status_code, resp.text)
                if value != 2**31:  # 2**31 is past every id; 404 or 422 are both right for it
                    assert resp.status_code == 422 and _names_field(resp, p["name"]), (
                        method,
                        path,
                        resp.text,
                    )
                checked += 1
    assert checked >= 40  # job, deployment, version and token ids, offsets and limits


def test_every_string_parameter_is_length_bounded(live_api: LiveApi) -> None:
    token = live_api.admin_token
    checked = 0
    for template, method, params in _operations(live_api):
        for p in params:
            if not re.search(r"'(string|array)'", str(p["schema"])):
                continue
            path, query = _fill(template, params, p["name"], "x" * 5000)
            headers = {"Authorization": f"Bearer {token}"}
            if p["in"] == "header":
                headers[p["name"]] = "x" * 5000
            resp = httpx.request(
                method,
                live_api.url + path,
                params=query,
                headers=headers,
                timeout=10,
            )
            assert resp.status_code == 422 and _names_field(resp, p["name"]), (method, path, resp.text[:300])
            assert len(resp.content) < 2000  # the answer names the field, it does not echo the input
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/users/admin/tokens", '{"expires_days": 1e9}', "expires_days"),
        ("/users/admin/tokens", '{"expires_days": 1e300}', "expires_days"),
        ("/users/admin/tokens", '{"expires_days": NaN}', "expires_days"),
        ("/users/admin/tokens", '{"expires_days": Infinity}', "expires_days"),
        ("/users/admin/tokens", '{"label": "' + "l" * 101 + '"}', "label"),
        ("/users", '{"name": "' + "n" * 5000 + '"}', "name"),
        ("/jobs", '{"name": "a", "command": ["true"], "priority": 1180591620717411303424}', "priority"),
        ("/jobs", '{"name": "a", "command": ["true"], "priority": 1e400}', "priority"),
        ("/jobs", '{"name": "a", "command": ["true"], "resources": {"memory_gb": NaN}}', "memory_gb"),
        ("/jobs", '{"name": "a", "command": ["true"], "resources": {"gpus": -9223372036854775809}}', "gpus"),
        ("/jobs", '{"name": "a", "command": ["' + "c" * 140_000 + '"]}', "command"),
        ("/jobs", '{"name": "a", "command": "' + "c " * 600_000 + '"}', "command"),
        (
            "/jobs/dry-run",
            '{"name": "a", "command": ["true"], "workload": {"model": "llama3-8b", "global_batch": 1e30}}',
            "global_batch",
        ),
        (
            "/fabric/plan",
            '{"model": "llama3-8b", "cluster": "dgx-h100", "gpus": 8, "global_batch": 8, '
            '"micro_batch": 1180591620717411303424}',
            "micro_batch",
        ),
        ("/models/m/versions/1/stage", '{"stage": "' + "s" * 5000 + '"}', "stage"),
    ],
)
def test_out_of_range_bodies_are_422_naming_the_field(
    live_api: LiveApi, path: str, body: str, field: str
) -> None:
    resp = httpx.post(
        live_api.url + path,
        content=body,
        headers={"Authorization": f"Bearer {live_api.admin_token}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 422, resp.text[:300]
    assert field in resp.text
    assert len(resp.content) < 2000


def test_log_offsets_up_to_the_bound_read_nothing_past_it_are_refused(live_api: LiveApi) -> None:
    token = live_api.admin_token
    job = live_api.post(
        "/jobs", token, json={"name": "echo", "command": [sys.executable, "-c", "print('hi')"]}
    ).json()
    wait_for(lambda: live_api.get(f"/jobs/{job['id']}", token).json()["state"] == "succeeded")
    assert live_api.get(f"/jobs/{job['id']}/logs", token).json()["text"].strip() == "hi"
    far = live_api.get(f"/jobs/{job['id']}/logs?offset={MAX_OFFSET}", token)
    assert far.status_code == 200 and far.json()["text"] == "" and far.json()["done"] is True
    for offset in (MAX_OFFSET + 1, 2**63, -1):
        resp = live_api.get(f"/jobs/{job['id']}/logs?offset={offset}", token)
        assert resp.status_code == 422 and _names_field(resp, "offset"), resp.text
    # A token lifetime at the bound is made; the API still answers for it.
    made = live_api.post("/users/admin/tokens", token, json={"expires_days": 3650})
    assert made.status_code == 201 and made.json()["expires_at"]
