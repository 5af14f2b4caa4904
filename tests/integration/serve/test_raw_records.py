"""Raw records over real HTTP: the served prediction equals the offline pipeline's, through the recipe.

Three models, each trained the way a user does it (ingest -> transform with a recipe -> `fit` ->
register from the run) and served by `gpuyard serve`: digits (an 8x8 image tensor, stratified split),
diabetes (ten numbers z-scored; a torch MLP) and a shop table with categoricals (z-score, one-hot
text, an ordinal boolean). The test split's rows are sent as the ingested source held them, as JSON
objects keyed by column; the answers must equal the registered model's predictions on the test split
as `load_arrays` (the training path) reads it from the transformed version.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.waiting import wait_for

from .conftest import AUTH, Server, free_port, kget, kpost, start_server, stop_server

pytestmark = pytest.mark.integration


def _digits(folder: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    path = folder / "digits.npz"
    np.savez(path, image=(bunch.images * 15).astype(np.uint8), label=bunch.target.astype(np.int64))
    recipe = {
        "split": {"method": "stratified", "column": "label", "seed": 0},
        "augment": {"column": "image", "rotate": 10},  # the loader's, never applied at inference
    }
    params = {"estimator": "sklearn.linear_model.LogisticRegression", "max_iter": 300}
    return path, recipe, {"trainer": "gpuyard.models.builtin:train_sklearn", "params": params}


def _diabetes(folder: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes()
    cols = {str(n): np.asarray(bunch.data[:, i]) for i, n in enumerate(bunch.feature_names)}
    path = folder / "diabetes.npz"
    np.savez(path, **cols, target=np.asarray(bunch.target))  # type: ignore[arg-type]
    recipe = {"split": {"method": "random", "seed": 0}, "normalize": [{"columns": list(cols)}]}
    params = {"epochs": 5, "batch_size": 32, "hidden": 16}
    return path, recipe, {"trainer": "gpuyard.models.builtin:train_mlp", "params": params}


def shop_table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    city = rng.choice(["paris", "lyon", "nice", "lille"], n)
    income = rng.normal(52_000, 12_000, n)  # the scale of docs/serving.md's example
    age = rng.integers(18, 80, n)
    member = rng.random(n) < 0.3
    label = ((income > 52_000) ^ (city == "nice") ^ member).astype(np.int64)
    return pa.table({"income": income, "age": age, "city": city, "member": member, "label": label})


def _shop(folder: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    path = folder / "shop.parquet"
    pq.write_table(shop_table(600, 0), path)
    recipe = {
        "split": {"method": "random", "seed": 0},
        "normalize": [{"columns": ["income", "age"]}],
        "encode": [{"column": "city"}, {"column": "member", "method": "ordinal"}],
    }
    params = {"estimator": "sklearn.linear_model.LogisticRegression"}
    return path, recipe, {"trainer": "gpuyard.models.builtin:train_sklearn", "params": params}


CASES = {"digits": (_digits, "label"), "diabetes": (_diabetes, "target"), "shop": (_shop, "label")}


def _register(folder: Path, name: str) -> dict[str, Any]:
    from gpuyard.data import IngestOptions, ingest, load_recipe, transform
    from gpuyard.models.fit import fit
    from gpuyard.models.registry import register_from_run
    from gpuyard.models.spec import ModelSpec

    make, label = CASES[name]
    path, recipe, trainer = make(folder)
    raw = ingest(path, name, IngestOptions(label_column=label))
    prepared = transform(raw.ref, load_recipe(recipe), output=f"{name}-prep", engine="serial")
    spec = ModelSpec.model_validate(
        {
            "name": name,
            "experiment": name,
            "dataset": f"{prepared.ref}#split=train,val",
            "metric": "accuracy" if label == "label" else "mse",
            "split": {"val": 0.2, "test": 0.1, "seed": 0},
            **trainer,
        }
    )
    result, _model = fit(spec)
    mv = register_from_run(name, result.run_id)
    return {"raw": raw, "prepared": prepared, "ref": mv.ref, "label": label}


@pytest.fixture(scope="module")
def records_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A GPUYARD_HOME holding the three datasets, transformed, and their registered models."""
    from gpuyard.store.db import reset_store_cache

    folder = tmp_path_factory.mktemp("records")
    home = folder / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUYARD_HOME", str(home))
        mp.setenv("GPUYARD_SERVER", f"http://127.0.0.1:{free_port()}")
        for var in ("GPUYARD_DATABASE_URL", "GPUYARD_ARTIFACTS"):
            mp.delenv(var, raising=False)
        reset_store_cache()
        try:
            yield home, {name: _register(folder, name) for name in CASES}
        finally:
            reset_store_cache()


def _test_records(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The test split's rows as the ingested source holds them (before any transform), label removed."""
    split = np.array(case["prepared"].to_arrow(["split"]).column("split").to_pylist())
    table = case["raw"].to_arrow().filter(pa.array(split == "test")).drop_columns([case["label"]])
    rows: list[dict[str, Any]] = []
    tensors = case["raw"].tensor_specs()
    for i, row in enumerate(table.to_pylist()):
        for col, spec in tensors.items():  # a tensor cell is bytes in Arrow; a client sends nested lists
            row[col] = np.frombuffer(row[col], dtype=spec.dtype).reshape(spec.shape).tolist()
        rows.append(row)
        assert i < 1024
    return rows


def _offline(case: dict[str, Any]) -> np.ndarray:
    """The registered model's predictions on the test split, read the way training reads data."""
    from gpuyard.data.arrays import load_arrays
    from gpuyard.models.registry import load

    X = load_arrays(f"{case['prepared'].ref}#split=test").X
    return np.asarray(load(case["ref"]).predictor.predict(X))


@pytest.mark.parametrize("name", list(CASES))
def test_served_predictions_of_raw_records_equal_the_offline_pipeline(
    records_home: tuple[Path, dict[str, Any]], name: str
) -> None:
    home, cases = records_home
    case = cases[name]
    records = _test_records(case)
    offline = _offline(case)
    server = start_server(home, case["ref"], "--drift-window", "20", "--drift-interval", "0.2")
    try:
        url = f"{server.url}/v1/models/{name}/predict"
        r = kpost(url, json={"records": records}, timeout=60)
        assert r.status_code == 200, r.text
        served = np.asarray(r.json()["predictions"])
        assert len(served) == len(offline) > 0
        if name == "diabetes":  # torch: the same float32 graph, summed in the server's own threads
            np.testing.assert_allclose(served, offline, rtol=1e-5, atol=1e-5)
        else:
            assert served.tolist() == offline.tolist()
        one = kpost(url, json={"records": records[0]}).json()  # one object, not a list
        np.testing.assert_allclose(one["predictions"], served[:1], rtol=1e-5)
        _feature_names_reach_the_drift_report(server, name, case)
    finally:
        stop_server(server)


def _feature_names_reach_the_drift_report(server: Server, name: str, case: dict[str, Any]) -> None:
    info = kget(f"{server.url}/v1/models/{name}").json()
    names = info["signature"]["inputs"]["names"]
    doc = wait_for(lambda: (d := kget(f"{server.url}/v1/models/{name}/drift").json()).get("report") and d)
    shown = [f["feature"] for f in doc["report"]["features"]]
    assert shown == names[: len(shown)]
    expect = {
        "digits": ["image[0,0]", "image[0,1]"],
        "diabetes": ["age", "sex"],
        "shop": ["income", "age", "city=lille", "city=lyon", "city=nice", "city=paris", "member"],
    }[name]
    assert shown[: len(expect)] == expect


def test_malformed_records_get_a_4xx_with_one_line_never_a_5xx(
    records_home: tuple[Path, dict[str, Any]],
) -> None:
    home, cases = records_home
    server = start_server(home, cases["shop"]["ref"], "--no-drift")
    good = {"income": 48_000.0, "age": 30, "city": "lyon", "member": False}
    bad = [
        ({"records": [good | {"income": True}]}, "column 'income': a boolean where a number is expected"),
        ({"records": [good | {"age": "30"}]}, "column 'age': a string where a number is expected"),
        ({"records": [{k: v for k, v in good.items() if k != "city"}]}, "column 'city' is missing"),
        ({"records": [good | {"zip": 75001}]}, "unknown column 'zip'"),
        ({"records": [good, 3]}, "record 1 is a number, not an object"),
        ({"records": [good | {"member": "yes"}]}, "where true or false is expected"),
        ({"records": [good | {"income": 1e9}]}, "outside the accepted range"),
        ({"records": []}, "non-empty"),
        ({"records": [good] * 1025}, "1 to 1024 samples"),
        ({"inputs": [[0.1, 0.2, 0, 0, 1, 0, True]]}, "booleans"),
    ]
    try:
        url = f"{server.url}/v1/models/shop/predict"
        assert kpost(url, json={"records": [good]}).status_code == 200
        for doc, words in bad:
            r = kpost(url, content=json.dumps(doc).encode(), headers={"content-type": "application/json"})
            detail = r.json()["detail"]
            assert r.status_code == 422 and words in detail and "\n" not in detail, (
                doc,
                r.status_code,
                detail,
            )
        text = kget(f"{server.url}/metrics").text
        assert 'gpuyard_serve_requests_total{code="500"' not in text
    finally:
        stop_server(server)


def test_the_curl_example_of_the_docs_runs(records_home: tuple[Path, dict[str, Any]]) -> None:
    """docs/serving.md's raw-record request, as written there, against the shop model."""
    home, cases = records_home
    server = start_server(home, cases["shop"]["ref"], "--no-drift")
    doc = (Path(__file__).parents[3] / "docs" / "serving.md").read_text()
    example = doc.split("<!-- raw-record-example -->", 2)[1]
    body = example.split("-d '", 1)[1].split("'", 1)[0]
    try:
        r = kpost(f"{server.url}/v1/models/shop/predict", content=body.encode())
        assert r.status_code == 200, r.text
        assert len(r.json()["predictions"]) == len(json.loads(body)["records"])
    finally:
        stop_server(server)


def test_raw_records_are_checked_for_skew_against_the_training_rows(
    records_home: tuple[Path, dict[str, Any]],
) -> None:
    """Calm raw traffic: no skew; income moved and an unseen city: input_skew alerts named by column."""
    home, cases = records_home
    server = start_server(home, cases["shop"]["ref"], "--drift-window", "200", "--drift-interval", "0.2")
    try:
        url = f"{server.url}/v1/models/shop/predict"
        before = {a["id"] for a in kget(f"{server.url}/v1/models/shop/alerts").json()}
        calm = shop_table(200, 1).drop_columns(["label"]).to_pylist()
        assert kpost(url, json={"records": calm}).status_code == 200
        doc = kget(f"{server.url}/v1/models/shop/drift").json()
        assert [f["feature"] for f in doc["skew"]["features"]] == ["income", "age", "city", "member"]
        assert not any(f["drift_psi"] or f["drift_ks"] for f in doc["skew"]["features"])
        assert doc["skew_reference"] == f"dataset:{cases['shop']['raw'].ref}"
        shifted = shop_table(200, 2).drop_columns(["label"]).to_pylist()
        for i, rec in enumerate(shifted):
            rec["income"] += 30_000.0
            if i % 2:
                rec["city"] = "oslo"
        assert kpost(url, json={"records": shifted}).status_code == 200

        def new(kind: str) -> set[tuple[str, str]]:
            # This server's alerts: earlier servers of this model (other tests) left theirs in the store.
            alerts = kget(f"{server.url}/v1/models/shop/alerts").json()
            mine = [a for a in alerts if a["kind"] == kind and a["id"] not in before]
            return {(a["feature"], a["metric"]) for a in mine}

        wait_for(lambda: {("income", "psi"), ("city", "psi")} <= new("input_skew"))
        assert not {f for f, _ in new("input_skew")} & {"age", "member"}
        # The features the recipe made drift too, by their names (city=oslo is no category: all zeros).
        assert "income" in {f for f, _ in wait_for(lambda: new("input_drift"))}
        text = kget(f"{server.url}/metrics").text
        assert 'gpuyard_serve_drift{feature="income",metric="skew_psi",model="shop",version="1"}' in text
    finally:
        stop_server(server)


def _fuzz(op: Any, mode: Any, base_url: str) -> set[int]:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    codes: set[int] = set()

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(op.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, headers=AUTH)
        codes.add(response.status_code)
        assert response.status_code < 500, (case.body, response.text)

    check()
    return codes


def test_schemathesis_finds_no_server_error_in_raw_records(records_home: tuple[Path, dict[str, Any]]) -> None:
    """The predict body's schema offers records keyed by the raw columns; fuzzing them gives no 5xx."""
    import schemathesis
    from schemathesis import GenerationMode

    home, cases = records_home
    server = start_server(home, cases["shop"]["ref"], "--no-drift")
    try:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH)
        body = schema.raw_schema["paths"]["/v1/models/shop/predict"]["post"]["requestBody"]
        record = body["content"]["application/json"]["schema"]["properties"]["records"]["oneOf"][1]
        assert record["required"] == ["income", "age", "city", "member"]
        op = schema["/v1/models/shop/predict"]["POST"]
        seen = {mode.value: _fuzz(op, mode, server.url) for mode in GenerationMode}
        assert seen["positive"] <= {200, 422} and 200 in seen["positive"]
        assert seen["negative"] <= {400, 413, 422}
    finally:
        stop_server(server)
