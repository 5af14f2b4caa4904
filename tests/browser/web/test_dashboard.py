"""The dashboard in Debian's Chromium: every page loads clean, and a job is submitted and cancelled; under its
Content-Security-Policy, hostile fields from a model server's /live document are shown as text, computed
styles still apply, and the Models page's events fit 1280 px as text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Server

pytestmark = pytest.mark.browser

# Each page, and a selector that only appears once its data has been drawn.
PAGES = {
    "cluster": "table.heat td",
    "jobs": "#submit-form",
    "runs": "#curves .uplot",
    "models": ".lineage",
    "deployments": "#alerts",
    "planner": "#plan-form",
}


class Watched:
    """A page with every console error, page error and failed request recorded."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.problems: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: self.problems.append(f"pageerror: {e}"))
        page.on("requestfailed", lambda r: self.problems.append(f"requestfailed: {r.url} {r.failure}"))
        page.on(
            "response",
            lambda r: r.status >= 400 and self.problems.append(f"HTTP {r.status}: {r.url}"),
        )


@pytest.fixture
def signed_in(browser: Any, server: Server) -> Iterator[Watched]:
    """A fresh browser context signed in through the login form with the admin token."""
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    watched = Watched(page)
    page.goto(server.url + "/")
    page.fill("#token-input", server.token)
    page.click("#login-form button")
    page.wait_for_selector("#who:has-text('admin')")
    yield watched
    context.close()


def test_every_page_loads_without_console_errors(
    signed_in: Watched, server: Server, artifacts_dir: Path
) -> None:
    page = signed_in.page
    for name, ready in PAGES.items():
        page.goto(f"{server.url}/#/{name}")
        page.wait_for_selector(ready, timeout=15000)
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(artifacts_dir / f"dashboard-{name}.png"), full_page=True)
        assert page.locator(f"#nav a[data-page={name}]").get_attribute("class") == "active"
    # The planner form answers with ranked plans and a breakdown chart.
    page.click("#plan-form button")
    page.wait_for_selector("#plans tr:nth-child(2)", timeout=30000)
    assert page.locator("#breakdown .stack").count() >= 2
    page.screenshot(path=str(artifacts_dir / "dashboard-planner-result.png"), full_page=True)
    # Two runs compared: params side by side (lr differs) and both curves overlaid.
    page.goto(f"{server.url}/#/runs")
    page.wait_for_selector("#curves .uplot")
    for box in page.locator("input.pick").all():
        box.check()
    page.click("#compare")
    page.wait_for_selector("h2:has-text('Compare 2 runs')")
    assert page.locator("tr.differs", has_text="lr").count() == 1
    assert page.locator("#curves .uplot").first.locator(".u-series").count() == 3  # x + one per run
    page.screenshot(path=str(artifacts_dir / "dashboard-runs-compare.png"), full_page=True)
    # The H100 node's topology is drawn: one heatmap cell per pair of devices (8 GPUs and their NICs).
    nodes = httpx.get(
        f"{server.url}/cluster/nodes", headers={"Authorization": f"Bearer {server.token}"}
    ).json()
    devices = nodes[0]["inventory"]["node"]["topology"]["devices"]
    assert sum(d.startswith("GPU") for d in devices) == 8
    page.goto(f"{server.url}/#/cluster")
    page.wait_for_selector("table.heat td")
    assert page.locator("table.heat td").count() == len(devices) ** 2
    assert page.locator("table.heat td", has_text="NV18").count() == 8 * 7
    assert signed_in.problems == []


def test_submit_and_cancel_a_job_through_the_page(
    signed_in: Watched, server: Server, artifacts_dir: Path
) -> None:
    page = signed_in.page
    page.goto(f"{server.url}/#/jobs")
    page.fill("#submit-form input[name=name]", "browser-sleeper")
    page.fill("#submit-form input[name=command]", "sh -c 'echo hello from the browser; sleep 60'")
    page.fill("#submit-form input[name=gpus]", "1")
    page.fill("#submit-form input[name=team]", "research")
    page.click("#submit-form button")
    row = page.locator("#jobs tr", has_text="browser-sleeper")
    row.locator(".badge.running").wait_for(timeout=30000)
    job_id = int(row.get_attribute("data-id") or 0)
    row.locator("button.logs").click()
    page.wait_for_selector("#log:has-text('hello from the browser')", timeout=15000)
    page.screenshot(path=str(artifacts_dir / "dashboard-jobs-running.png"), full_page=True)
    row.locator("button.cancel").click()
    row.locator(".badge.cancelled").wait_for(timeout=30000)
    page.screenshot(path=str(artifacts_dir / "dashboard-jobs-cancelled.png"), full_page=True)
    job = httpx.get(f"{server.url}/jobs/{job_id}", headers={"Authorization": f"Bearer {server.token}"}).json()
    assert job["name"] == "browser-sleeper" and job["team"] == "research" and job["state"] == "cancelled"
    assert signed_in.problems == []


@pytest.fixture
def deployment(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A real deployment (a tiny MLP with a drift reference) on the server's home; undeployed after."""
    from gpuyard.serve.deploy import deploy, undeploy
    from gpuyard.serve.examples import register_example
    from gpuyard.serve.options import ServeOptions
    from gpuyard.store.db import reset_store_cache

    monkeypatch.setenv("GPUYARD_HOME", str(server.home))
    reset_store_cache()
    _, X = register_example("tiny-mlp", "mlp", in_features=4)
    dep = deploy("tiny-mlp", ServeOptions(port=0, device="cpu"))
    dep["inputs"] = X
    try:
        yield dep
    finally:
        undeploy(str(dep["id"]))
        reset_store_cache()


def test_deployment_page_charts_live_latency_and_drift(
    signed_in: Watched, server: Server, deployment: dict[str, Any], artifacts_dir: Path
) -> None:
    X = deployment["inputs"]
    predict = f"{deployment['url']}/v1/models/tiny-mlp/predict"
    key = {"Authorization": f"Bearer {deployment['api_key']}"}  # shown once by deploy
    with httpx.Client(timeout=10, headers=key) as http:
        for i in range(0, 256, 4):  # 256 rows: past the drift window's 200-row minimum
            assert http.post(predict, json={"inputs": X[i : i + 4].tolist()}).status_code == 200
    page = signed_in.page
    page.goto(f"{server.url}/#/deployments")
    page.wait_for_selector(f"#dep-table tr[data-id='{deployment['id']}'] .badge.running")
    page.wait_for_selector("#lat-chart .uplot", timeout=15000)
    page.wait_for_selector("#tput-chart .uplot")
    page.wait_for_selector("#drift td:has-text('f3')", timeout=15000)  # one row per input feature
    assert page.locator("#drift tr").count() == 1 + 4
    with httpx.Client(timeout=10, headers=key) as http:  # a second poll adds a point to the live series
        for i in range(0, 64, 4):
            http.post(predict, json={"inputs": X[i : i + 4].tolist()})
    page.wait_for_function(
        "() => GY.pages.deployments.history.t.length >= 2", timeout=15000
    )  # a function: no eval under the CSP
    page.screenshot(path=str(artifacts_dir / "dashboard-deployments-live.png"), full_page=True)
    assert "p99" in page.locator("#lat-chart").inner_text()
    assert signed_in.problems == []


def test_a_wrong_token_is_refused_at_sign_in(browser: Any, server: Server, artifacts_dir: Path) -> None:
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(server.url + "/#/jobs")
        page.fill("#token-input", "gy_not-a-real-token")
        page.click("#login-form button")
        page.wait_for_selector("#login-error:has-text('invalid API token')")
        assert page.locator("#jobs").count() == 0 and page.evaluate("localStorage.length") == 0
        page.screenshot(path=str(artifacts_dir / "dashboard-login-refused.png"))
    finally:
        context.close()


# -- the Content-Security-Policy and escaping ---------------------------------------------------------

PAYLOAD = '<img src=x id="injected">'
CSP_MARGIN = 2  # px: rounding


@pytest.fixture
def csp_page(browser: Any, server: Server) -> Iterator[Any]:
    """A signed-in page 1280 px wide; every console error (a CSP refusal is one) is kept."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.problems = []
    pg.on("console", lambda m: m.type == "error" and pg.problems.append(m.text))
    pg.on("pageerror", lambda e: pg.problems.append(str(e)))
    pg.goto(server.url + "/")
    pg.fill("#token-input", server.token)
    pg.click("#login-form button")
    pg.wait_for_selector("#who:has-text('admin')")
    yield pg
    context.close()


def _json(route: Any, body: Any) -> None:
    route.fulfill(status=200, content_type="application/json", body=json.dumps(body))


def test_a_hostile_live_document_is_shown_as_text(csp_page: Any, server: Server) -> None:
    page = csp_page
    deployment = {
        "id": 7,
        "model": "m",
        "version": 1,
        "ref": "m:1",
        "status": "running",
        "replicas": 1,
        "device": "cpu",
        "pids": {},
        "job": None,
        "url": "http://127.0.0.1:1",
        "created_at": "2026-01-01T00:00:00",
    }
    feature = {
        "feature": PAYLOAD,
        "psi": 0.1,
        "ks": 0.1,
        "ks_pvalue": 0.5,
        "drift_psi": False,
        "drift_ks": False,
    }
    live = {
        "reachable": True,
        "stats": {"p50_ms": 1.0, "p95_ms": 2.0, "p99_ms": 3.0, "throughput_rps": 4.0, "window_s": PAYLOAD},
        "drift": {
            "enabled": True,
            "reason": "",
            # The three fields that once reached innerHTML unescaped.
            "report": {
                "rows": PAYLOAD,
                "psi_threshold": PAYLOAD,
                "ks_pvalue_threshold": 0.05,
                "features": [feature],
            },
            "skew": {"rows": PAYLOAD, "features": [feature]},
        },
    }
    page.route(re.compile(r"/deployments\?all=true$"), lambda r: _json(r, [deployment]))
    page.route(re.compile(r"/deployments/alerts"), lambda r: _json(r, []))
    page.route(re.compile(r"/deployments/7/live$"), lambda r: _json(r, live))
    page.goto(f"{server.url}/#/deployments")
    page.wait_for_selector("#drift table.drift")
    text = page.locator("#drift").inner_text()
    assert text.count(PAYLOAD) >= 4, text  # rows, threshold, skew rows, the features: as text
    assert page.locator("#injected").count() == 0
    assert not [p for p in page.problems if "Content Security Policy" in p], page.problems


def test_computed_styles_apply_under_the_policy(csp_page: Any, server: Server) -> None:
    page = csp_page
    page.goto(f"{server.url}/#/cluster")
    page.wait_for_selector("table.heat td")
    # A heatmap cell's colour comes from data-css, set through the DOM (style="..." would be refused).
    colour = page.locator("table.heat td", has_text="NV18").first.evaluate(
        "(el) => getComputedStyle(el).backgroundColor"
    )
    assert colour not in ("rgba(0, 0, 0, 0)", "transparent"), colour
    assert page.locator("[data-css]").count() == 0
    assert not [p for p in page.problems if "Content Security Policy" in p], page.problems


def test_model_events_read_as_text_and_fit_1280_px(csp_page: Any, server: Server) -> None:
    page = csp_page
    from gpuyard.models.registry import record_event
    from gpuyard.store.db import Store

    store = Store(f"sqlite:///{server.home / 'gpuyard.db'}")
    detail = {"note": "x" * 400, "path": "/very/long/" + "segment/" * 60, "nested": {"a": [1, 2, 3]}}
    with store.session() as s:
        record_event(s, "digits-clf", 2, "annotated", detail)
    store.dispose()
    page.goto(f"{server.url}/#/models")
    page.locator("#models-table tr[data-name='digits-clf']").click()
    page.wait_for_selector("table.events td.detail")
    cell = page.locator("table.events tr", has_text="annotated").locator("td.detail").inner_text()
    assert "note=" in cell and "path=" in cell and '{"note"' not in cell, cell
    w = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert w[0] <= w[1] + CSP_MARGIN, w
