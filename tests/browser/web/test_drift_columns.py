"""The Deployments page's drift tables name columns: a model served with its recipe, fed raw records."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from .conftest import Server

pytestmark = pytest.mark.browser


def _customers(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    city = rng.choice(["paris", "lyon", "nice"], n)
    income = rng.normal(52_000, 12_000, n)
    age = rng.integers(18, 80, n)
    churned = ((income < 50_000) ^ (city == "nice")).astype(np.int64)
    return pa.table({"income": income, "age": age, "city": city, "churned": churned})


@pytest.fixture
def churn_deployment(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """customers.parquet -> a recipe (z-score, one-hot city) -> fit -> register -> deploy (cpu)."""
    from gpuyard.data import IngestOptions, ingest, load_recipe, transform
    from gpuyard.models.fit import fit
    from gpuyard.models.registry import register_from_run
    from gpuyard.models.spec import ModelSpec
    from gpuyard.serve.deploy import deploy, undeploy
    from gpuyard.serve.options import ServeOptions
    from gpuyard.store.db import reset_store_cache

    monkeypatch.setenv("GPUYARD_HOME", str(server.home))
    reset_store_cache()
    path = server.home.parent / "customers.parquet"
    pq.write_table(_customers(500, 0), path)
    raw = ingest(path, "customers", IngestOptions(label_column="churned"))
    recipe = {
        "split": {"method": "random", "seed": 0},
        "normalize": [{"columns": ["income", "age"]}],
        "encode": [{"column": "city"}],
    }
    prepared = transform(raw.ref, load_recipe(recipe), output="customers-prep", engine="serial")
    spec = {
        "name": "churn",
        "experiment": "churn",
        "dataset": f"{prepared.ref}#split=train",
        "trainer": "gpuyard.models.builtin:train_sklearn",
        "metric": "accuracy",
        "params": {"estimator": "sklearn.linear_model.LogisticRegression"},
    }
    result, _ = fit(ModelSpec.model_validate(spec))
    register_from_run("churn", result.run_id)
    dep = deploy("churn", ServeOptions(port=0, device="cpu"))
    try:
        yield dep
    finally:
        undeploy(str(dep["id"]))
        reset_store_cache()


def test_drift_and_skew_tables_name_the_columns(
    browser: Any, server: Server, churn_deployment: dict[str, Any], artifacts_dir: Path
) -> None:
    records = _customers(256, 1).drop_columns(["churned"]).to_pylist()
    predict = f"{churn_deployment['url']}/v1/models/churn/predict"
    key = {"Authorization": f"Bearer {churn_deployment['api_key']}"}  # shown once by deploy
    with httpx.Client(timeout=10, headers=key) as http:
        for i in range(0, 256, 8):  # past the windows' 200-row minimum
            assert http.post(predict, json={"records": records[i : i + 8]}).status_code == 200
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(server.url + "/")
        page.fill("#token-input", server.token)
        page.click("#login-form button")
        page.wait_for_selector("#who:has-text('admin')")
        page.goto(f"{server.url}/#/deployments")
        page.locator(f"#dep-table tr[data-id='{churn_deployment['id']}']").click()
        page.wait_for_selector("#drift table.drift td:has-text('city=paris')", timeout=20000)
        page.wait_for_selector("#drift table.skew td:has-text('city')", timeout=20000)
        features = page.locator("#drift table.drift tr td:first-child").all_inner_texts()
        raw = page.locator("#drift table.skew tr td:first-child").all_inner_texts()
        page.screenshot(path=str(artifacts_dir / "dashboard-drift-columns.png"), full_page=True)
    finally:
        context.close()
    assert features == ["income", "age", "city=lyon", "city=nice", "city=paris"]
    assert raw == ["income", "age", "city"]
    assert not any(name.startswith("f") and name[1:].isdigit() for name in features + raw)
    assert errors == []
