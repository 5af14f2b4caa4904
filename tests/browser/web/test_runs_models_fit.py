"""The Runs and Models pages with runs of every kind: they fit the window and every run's metrics show.

The seeded home has two small torch runs; this module adds scikit-learn fits on a regression table
(their metrics are validation/mse, test/mse...), a run recorded like `gpuyard train`'s (six metric
keys of its own and a whole spec's worth of params, nested and long) and a scikit-learn model
registered from two of those fits (its version metrics are {split: {metric: value}}).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from .conftest import Server

pytestmark = pytest.mark.browser

MARGIN = 2  # px: sub-pixel rounding; anything wider means a horizontal scroll bar
TRAIN_KEYS = [
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/tokens_per_s",
    "validation/loss",
    "validation/perplexity",
]


def _patients(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols = {f"x{i}": rng.normal(size=n) for i in range(6)}
    target = 3 * cols["x0"] - 2 * cols["x1"] + rng.normal(scale=0.5, size=n)
    return pa.table({**cols, "target": target})


def _train_params() -> dict[str, Any]:
    """What a `gpuyard train` run records: layout, sizes and the spec's sections, nested and long."""
    return {
        "layout": {"pp": 1, "dp": 2, "tp": 1},
        "world_size": 2,
        "num_params": 124_439_808,
        "model": {"ref": "gpuyard.train.models:gpt", "n_layer": 12, "n_head": 12, "d_model": 768},
        "optimizer": {"name": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"name": "cosine", "warmup_steps": 2000, "min_lr": 6e-5},
        "data": {
            "train": "shards:///var/lib/gpuyard/datasets/openwebtext_tokenized@9f2c4e1ab37d/train_*.bin",
            "val": "shards:///var/lib/gpuyard/datasets/openwebtext_tokenized@9f2c4e1ab37d/val_*.bin",
        },
        "checkpoint": {"every_steps": 1000, "keep": 3, "dir": "/scratch/checkpoints/gpt2_124m_owt"},
        **{f"option_{i}": f"value_{i}_" + "x" * 12 for i in range(24)},
    }


@pytest.fixture(scope="module")
def fitted(server: Server) -> Iterator[dict[str, Any]]:
    """Two scikit-learn fits (registered as diabetes-tree 1, 2), then a `gpuyard train`-like run."""
    from gpuyard.data import IngestOptions, ingest
    from gpuyard.models.fit import fit
    from gpuyard.models.registry import register_from_run
    from gpuyard.models.spec import ModelSpec
    from gpuyard.store.db import reset_store_cache
    from gpuyard.tracking.store import start_run

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUYARD_HOME", str(server.home))
        reset_store_cache()
        path = server.home.parent / "patients.parquet"
        pq.write_table(_patients(300, 0), path)
        raw = ingest(path, "patients", IngestOptions(label_column="target"))
        sklearn_runs = []
        for est, extra in (
            ("sklearn.tree.DecisionTreeRegressor", {"max_depth": 3}),
            ("sklearn.linear_model.Ridge", {"alpha": 0.5}),
        ):
            spec = {
                "name": "diabetes-tree",
                "experiment": "diabetes",
                "dataset": raw.ref,
                "trainer": "gpuyard.models.builtin:train_sklearn",
                "metric": "mse",
                "params": {"estimator": est, **extra},
            }
            result, _ = fit(ModelSpec.model_validate(spec))
            register_from_run("diabetes-tree", result.run_id)
            sklearn_runs.append(result.run_id)
        with start_run(
            "gpt2-124m",
            experiment="owt",
            params=_train_params(),
            tags={"metric": "loss"},
            system_interval_s=None,
        ) as run:
            for step in range(5):
                run.log_metrics(step, {k: 1.0 / (step + 1) + i for i, k in enumerate(TRAIN_KEYS)})
            train_run = run.run_id
        reset_store_cache()
    yield {"sklearn": sklearn_runs, "train": train_run}


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[Any]:
    """A page 1280 px wide, signed in with the admin token; no page error allowed."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.url + "/")
    pg.fill("#token-input", server.token)
    pg.click("#login-form button")
    pg.wait_for_selector("#who:has-text('admin')")
    yield pg
    context.close()
    assert errors == []


def _widths(pg: Any) -> dict[str, int]:
    return dict(
        pg.evaluate(
            "() => ({page: document.documentElement.scrollWidth, window: window.innerWidth,"
            " table: document.querySelector('#runs-table table')?.scrollWidth ?? 0,"
            " box: document.querySelector('#runs-table')?.clientWidth ?? 0})"
        )
    )


def _cells(pg: Any, table: str, row: Any) -> dict[str, str]:
    """A row of a table: column heading -> the cell's text."""
    heads = pg.locator(f"{table} tr:first-child th").all_inner_texts()
    cells = row.locator("td").all_inner_texts()
    return dict(zip([h.replace("\n", "") for h in heads], cells, strict=True))


def _version_cells(pg: Any, table: str, version: str) -> dict[str, str]:
    """The row of a table whose first cell is the version number: column heading -> text."""
    first = pg.locator("td:first-child", has_text=re.compile(rf"^{version}$"))
    return _cells(pg, table, pg.locator(f"{table} tr").filter(has=first))


def _metric_cells(pg: Any, run_id: str) -> dict[str, str]:
    """The run's row in the Runs table: column heading -> the cell's text."""
    return _cells(pg, "#runs-table table", pg.locator(f"#runs-table tr[data-id='{run_id}']"))


def test_runs_page_fits_and_shows_every_runs_metrics(
    page: Any, server: Server, fitted: dict[str, Any], artifacts_dir: Path
) -> None:
    page.goto(f"{server.url}/#/runs")
    # The newest run (the one with a whole spec as params) is shown below the table.
    page.wait_for_selector(f"#run-detail h2:has-text('{fitted['train'][:8]}')")
    page.wait_for_selector("#curves .uplot")
    page.screenshot(path=str(artifacts_dir / "dashboard-runs-all-kinds.png"), full_page=True)
    w = _widths(page)
    assert w["page"] <= w["window"] + MARGIN, w
    assert w["table"] <= w["box"] + MARGIN, w  # the table fits its card, not a scroll inside it

    # Every run's metrics have a column: the scikit-learn fits' objective and the train run's.
    for run_id in fitted["sklearn"]:
        cells = _metric_cells(page, run_id)
        assert cells.get("validation/mse", "-") != "-", cells
        assert cells.get("test/mse", "-") != "-", cells
    train = _metric_cells(page, fitted["train"])
    assert train.get("validation/loss", "-") != "-", train
    # Each row names its params, wrapped inside its cell.
    params = page.locator(f"#runs-table tr[data-id='{fitted['sklearn'][1]}'] td.params").inner_text()
    assert "estimator=sklearn.linear_model.Ridge" in params and "alpha=0.5" in params

    # A scikit-learn run's detail, then all runs compared: still no horizontal scroll.
    page.locator(f"#runs-table tr[data-id='{fitted['sklearn'][0]}'] td.mono").first.click()
    page.wait_for_selector(f"#run-detail h2:has-text('{fitted['sklearn'][0]}')")
    assert "max_depth=3" in page.locator("#run-detail .pairs").inner_text()
    for box in page.locator("input.pick").all():
        box.check()
    page.click("#compare")
    page.wait_for_selector("#run-detail h2:has-text('Compare 5 runs')")
    page.wait_for_selector("#curves .uplot")
    page.screenshot(path=str(artifacts_dir / "dashboard-runs-all-kinds-compare.png"), full_page=True)
    w = _widths(page)
    assert w["page"] <= w["window"] + MARGIN, w
    # Narrower than its columns, the runs table scrolls inside its card; the page still does not.
    page.set_viewport_size({"width": 1024, "height": 900})
    w = _widths(page)
    assert w["page"] <= w["window"] + MARGIN, w


def test_models_page_shows_metrics_by_version_for_a_sklearn_model(
    page: Any, server: Server, fitted: dict[str, Any], artifacts_dir: Path
) -> None:
    page.goto(f"{server.url}/#/models")
    page.locator("#models-table tr[data-name='diabetes-tree']").click()
    # The detail is drawn at once (table, chart and all) when its heading appears.
    page.wait_for_selector("#model-detail h2:has-text('diabetes-tree: versions')")
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(artifacts_dir / "dashboard-models-sklearn.png"), full_page=True)
    # The versions table: a column per split/metric (the objective first), filled for both versions.
    versions = "#model-detail > .card:first-child table"
    for v in ("1", "2"):
        cells = _version_cells(page, versions, v)
        assert cells.get("test/mse", "-") != "-" and cells.get("validation/mse", "-") != "-", cells
        assert cells.get("test/r2", "-") != "-", cells
    # Metrics by version: a chart with one series per metric; pointing at version 1, then version 2,
    # the legend reads each version's test/mse (uPlot shows "--" where a series has no value).
    assert page.locator("#model-metrics .uplot").count() == 1
    legend = page.locator("#model-metrics .u-legend .u-series", has_text="test/mse")
    assert legend.count() == 1
    over = page.locator("#model-metrics .u-over")
    box = over.bounding_box()
    read = []
    for x in (2, box["width"] - 2):
        over.hover(position={"x": x, "y": box["height"] / 2})
        read.append(legend.locator(".u-value").inner_text())
    assert "--" not in read and read[0] != read[1], read
    for width in (1280, 1024):  # narrower than its columns, the table scrolls in its card, not the page
        page.set_viewport_size({"width": width, "height": 900})
        w = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert w[0] <= w[1] + MARGIN, (width, w)
