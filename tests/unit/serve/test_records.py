"""The serving contract: a registered model carries its dataset's fitted recipe; raw records become the
training features through it; malformed records and booleans among numbers are refused in one line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpuyard.serve.codec import InputMismatch, decode_json, input_spec

pytestmark = pytest.mark.unit


def body(doc: object) -> bytes:
    return json.dumps(doc).encode()


def shop_table(n: int = 300, seed: int = 0) -> pa.Table:
    """A tabular set with a number, an integer, a text category, a boolean and a label."""
    rng = np.random.default_rng(seed)
    city = rng.choice(["paris", "lyon", "nice"], n)
    income = rng.normal(50, 10, n)
    age = rng.integers(18, 80, n)
    member = rng.random(n) < 0.3
    label = ((income > 50) ^ (city == "nice")).astype(np.int64)
    return pa.table({"income": income, "age": age, "city": city, "member": member, "label": label})


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The shop set ingested, transformed (split, z-score, one-hot, ordinal), fitted and registered
    (once for the module, in a GPUYARD_HOME of its own)."""
    from gpuyard.store.db import reset_store_cache

    tmp_path = tmp_path_factory.mktemp("records")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUYARD_HOME", str(tmp_path / "home"))
        for var in ("GPUYARD_DATABASE_URL", "GPUYARD_ARTIFACTS"):
            mp.delenv(var, raising=False)
        reset_store_cache()
        try:
            yield _shop(tmp_path)
        finally:
            reset_store_cache()


def _shop(tmp_path: Path) -> dict[str, Any]:
    from gpuyard.data import IngestOptions, ingest, load_recipe, transform
    from gpuyard.models.fit import fit
    from gpuyard.models.registry import register_from_run
    from gpuyard.models.spec import ModelSpec

    table = shop_table()
    pq.write_table(table, tmp_path / "shop.parquet")
    raw = ingest(tmp_path / "shop.parquet", "shop", IngestOptions(label_column="label"))
    recipe = load_recipe(
        {
            "split": {"method": "random", "seed": 0},
            "normalize": [{"columns": ["income", "age"]}],
            "encode": [{"column": "city"}, {"column": "member", "method": "ordinal"}],
        }
    )
    prepared = transform(raw.ref, recipe, engine="serial")
    spec = ModelSpec.model_validate(
        {
            "name": "shop",
            "experiment": "shop",
            "dataset": f"{prepared.ref}#split=train",
            "trainer": "gpuyard.models.builtin:train_sklearn",
            "metric": "accuracy",
            "params": {"estimator": "sklearn.linear_model.LogisticRegression"},
            "split": {"val": 0.2, "test": 0.2, "seed": 0},
        }
    )
    result, model = fit(spec)
    mv = register_from_run("shop", result.run_id)
    return {"table": table, "raw": raw, "prepared": prepared, "version": mv, "model": model}


def test_a_registered_model_carries_its_datasets_fitted_recipe_and_feature_names(shop: dict) -> None:
    mv = shop["version"]
    contract = mv.signature["recipe"]
    # The dataset version was found from the run's record: fit passed nothing new to registration.
    assert contract["dataset"] == shop["prepared"].ref and contract["source"] == shop["raw"].ref
    assert [c["name"] for c in contract["columns"]] == ["income", "age", "city", "member"]
    assert contract["transforms"][0]["fitted"] == shop["prepared"].manifest["fitted"]
    names = ["income", "age", "city=lyon", "city=nice", "city=paris", "member"]
    assert mv.signature["inputs"]["names"] == names
    assert mv.lineage["recipe"] == f"serving recipe of {shop['prepared'].ref}"


def test_raw_records_become_exactly_the_training_features(shop: dict) -> None:
    from gpuyard.data.arrays import load_arrays
    from gpuyard.models.signature import ServingRecipe

    prepared = shop["prepared"]
    split = np.array(prepared.to_arrow(["split"]).column("split").to_pylist())
    records = shop["table"].filter(pa.array(split == "test")).drop_columns(["label"]).to_pylist()
    recipe = ServingRecipe.from_signature(shop["version"].signature)
    assert recipe is not None
    X = recipe.features_of(records)
    offline = load_arrays(f"{prepared.ref}#split=test").X
    assert X.dtype == np.float32 and np.array_equal(X, offline)
    # Through the server's decoder too: records in JSON give the same batch.
    spec = input_spec(shop["version"].signature)
    assert np.array_equal(decode_json(body({"records": records}), spec), offline)
    assert np.array_equal(decode_json(body({"records": records[0]}), spec), offline[:1])
    assert np.array_equal(decode_json(body({"inputs": records[:3]}), spec), offline[:3])


def test_an_unseen_category_is_all_zeros_as_in_training_and_a_null_one_too(shop: dict) -> None:
    spec = input_spec(shop["version"].signature)
    rec = {"income": 50.0, "age": 30, "city": "oslo", "member": True}
    x = decode_json(body({"records": [rec, {**rec, "city": None}]}), spec)
    assert x[:, 2:5].tolist() == [[0, 0, 0], [0, 0, 0]] and x[0, 5] == 1


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"income": True}, "record 0, column 'income': a boolean where a number is expected"),
        ({"income": "12"}, "record 0, column 'income': a string where a number is expected"),
        ({"income": None}, "record 0, column 'income': null, but the model needs a number"),
        ({"age": 30.5}, "record 0, column 'age': 30.5 is not an integer"),
        ({"city": 3}, "record 0, column 'city': a number where a string is expected"),
        ({"member": 1}, "record 0, column 'member': a number where true or false is expected"),
        ({"incme": 3}, "record 0: unknown column 'incme' (the model reads income, age, city, member)"),
        ({"income": 1e30}, "outside the accepted range"),
    ],
)
def test_malformed_records_are_refused_in_one_line(shop: dict, change: dict, words: str) -> None:
    spec = input_spec(shop["version"].signature)
    rec = {"income": 50.0, "age": 30, "city": "lyon", "member": False} | change
    with pytest.raises(InputMismatch) as err:
        decode_json(body({"records": [rec]}), spec)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"records": [{"income": 50.0, "city": "lyon", "member": False}]}, "column 'age' is missing"),
        ({"records": [[1, 2, 3]]}, "record 0 is a list, not an object keyed by column"),
        ({"records": []}, "non-empty"),
        ({"records": "x"}, "non-empty"),
    ],
)
def test_missing_columns_and_non_objects_are_refused(shop: dict, doc: dict, words: str) -> None:
    with pytest.raises(InputMismatch, match=words):
        decode_json(body(doc), input_spec(shop["version"].signature))


def test_the_label_and_unused_columns_of_the_source_may_come_along(shop: dict) -> None:
    spec = input_spec(shop["version"].signature)
    rec = {"income": 50.0, "age": 30, "city": "lyon", "member": False}
    with_label = decode_json(body({"records": [rec | {"label": 1}]}), spec)
    assert np.array_equal(with_label, decode_json(body({"records": [rec]}), spec))


SIG = {
    "inputs": {
        "dtype": "float32",
        "shape": [-1, 3],
        "min": [0.0, -1.0, 5.0],
        "max": [1.0, 1.0, 5.0],
        "names": ["a", "b", "c"],
    }
}


@pytest.mark.parametrize("inputs", [[[0.5, True, 5]], [0.5, 0, False], [[0.5, 0, 5], [1, 1, True]]])
def test_booleans_among_numbers_are_refused_as_the_docs_say(inputs: list) -> None:
    with pytest.raises(InputMismatch, match="booleans"):
        decode_json(body({"inputs": inputs}), input_spec(SIG))


def test_a_model_without_a_recipe_takes_records_keyed_by_its_feature_names() -> None:
    spec = input_spec(SIG)
    x = decode_json(body({"records": [{"a": 0.5, "b": 0, "c": 5}, {"c": 5, "b": 1, "a": 1}]}), spec)
    assert x.tolist() == [[0.5, 0, 5], [1, 1, 5]]
    with pytest.raises(InputMismatch, match="column 'b' is missing"):
        decode_json(body({"records": {"a": 0.5, "c": 5}}), spec)
    with pytest.raises(InputMismatch, match="booleans"):
        decode_json(body({"records": {"a": 0.5, "b": True, "c": 5}}), spec)
    unnamed = input_spec({"inputs": {"shape": [-1, 3]}})
    with pytest.raises(InputMismatch, match="takes no raw records"):
        decode_json(body({"records": {"a": 0.5, "b": 0, "c": 5}}), unnamed)


def test_inputs_and_records_together_are_refused() -> None:
    from gpuyard.serve.codec import BadInput

    with pytest.raises(BadInput, match='either an "inputs" field'):
        decode_json(body({"inputs": [[0.5, 0, 5]], "records": [{"a": 0.5, "b": 0, "c": 5}]}), input_spec(SIG))


def _skew_monitor(shop: dict) -> Any:
    from gpuyard.models.signature import ServingRecipe
    from gpuyard.serve.drift import DriftConfig, DriftMonitor, build_skew_reference

    recipe = ServingRecipe.from_signature(shop["version"].signature)
    assert recipe is not None
    columns = recipe.training_columns()
    # The training rows: the rows of the splits the model learnt from (train), as the source held them.
    split = np.array(shop["prepared"].to_arrow(["split"]).column("split").to_pylist())
    train_income = np.asarray(shop["table"].column("income").to_numpy())[split == "train"]
    assert columns["income"][0] == "numeric" and np.array_equal(columns["income"][1], train_income)
    assert columns["city"][0] == "categorical" and set(columns["city"][1]) == {"paris", "lyon", "nice"}
    ref = build_skew_reference(columns, "test")
    cfg = DriftConfig(window=200, min_rows=100, interval_s=60)
    return recipe, DriftMonitor(ref, cfg, kind="input_skew")


def test_raw_records_in_the_training_distribution_show_no_skew(shop: dict) -> None:
    from gpuyard.serve.drift import skew_rows

    recipe, monitor = _skew_monitor(shop)
    calm = shop_table(200, seed=5).drop_columns(["label"]).to_pylist()
    monitor.observe(skew_rows(monitor.reference, recipe.table(calm)))
    report = monitor.evaluate()
    assert [f["feature"] for f in report["features"]] == ["income", "age", "city", "member"]
    assert not any(f["drift_psi"] or f["drift_ks"] for f in report["features"]), report["features"]
    assert report["predictions"] is None and monitor._new_alerts(report) == []


def test_shifted_numbers_and_unseen_categories_are_skew_alerts_named_by_raw_column(shop: dict) -> None:
    from gpuyard.serve.drift import skew_rows

    recipe, monitor = _skew_monitor(shop)
    alerts: list[dict] = []
    monitor.on_alert = alerts.extend
    shifted = shop_table(200, seed=6).drop_columns(["label"]).to_pylist()
    for i, rec in enumerate(shifted):
        rec["income"] += 25.0  # 2.5 standard deviations: a unit or upstream change
        if i % 2:
            rec["city"] = "oslo"  # half the traffic from a city training never saw
    monitor.observe(skew_rows(monitor.reference, recipe.table(shifted)))
    report = monitor.evaluate()
    by_name = {f["feature"]: f for f in report["features"]}
    assert by_name["income"]["drift_psi"] and by_name["income"]["drift_ks"]
    assert by_name["city"]["drift_psi"] and by_name["city"]["ks"] is None  # categories: PSI only
    assert not by_name["age"]["drift_psi"] and not by_name["member"]["drift_psi"]
    flagged = {(a["kind"], a["feature"], a["metric"]) for a in alerts}
    assert flagged == {
        ("input_skew", "income", "psi"),
        ("input_skew", "income", "ks"),
        ("input_skew", "city", "psi"),
    }


def test_a_version_registered_without_its_recipe_gets_it_when_served(shop: dict) -> None:
    """Versions registered before signatures carried the recipe: the server takes it from the
    training dataset version the registry recorded."""
    from sqlalchemy import select

    from gpuyard.serve.model import load_served
    from gpuyard.store import get_store
    from gpuyard.store.tables.models import ModelVersionRow

    mv = shop["version"]
    bare = {k: v for k, v in mv.signature.items() if k != "recipe"}
    bare["inputs"] = {k: v for k, v in mv.signature["inputs"].items() if k != "names"}

    def set_signature(signature: dict) -> None:
        with get_store().session() as s:
            q = select(ModelVersionRow).where(
                ModelVersionRow.name == mv.name, ModelVersionRow.version == mv.version
            )
            s.scalars(q).one().signature = signature

    set_signature(bare)
    try:
        served = load_served(mv.ref)
    finally:
        set_signature(mv.signature)
    assert served.spec.recipe is not None and served.spec.names == tuple(mv.signature["inputs"]["names"])
    rec = {"income": 50.0, "age": 30, "city": "lyon", "member": False}
    x = decode_json(body({"records": [rec]}), served.spec)
    assert served.forward(x)["predictions"].tolist() == shop["model"].predict(x).tolist()


def test_a_drift_reference_stored_with_f0_names_is_read_with_the_columns_names_and_gains_skew(
    shop: dict,
) -> None:
    from gpuyard.serve.alerts import load_reference, reference_for, save_reference
    from gpuyard.serve.drift import build_reference
    from gpuyard.serve.model import load_served

    served = load_served(shop["version"].ref)
    X = np.random.default_rng(0).normal(size=(300, 6)).astype(np.float32)
    old = build_reference(X, np.zeros(300), "classification", [f"f{i}" for i in range(6)], "old")
    save_reference(served.name, served.version, old)
    ref, note = reference_for(served)
    assert ref is not None and "stored reference (old)" in note
    assert [f["name"] for f in ref["features"]] == list(shop["version"].signature["inputs"]["names"])
    assert [f["name"] for f in ref["skew"]["features"]] == ["income", "age", "city", "member"]
    assert load_reference(served.name, served.version)["skew"] == ref["skew"]  # kept for the next start


def test_a_null_gets_the_value_ingest_imputed_for_that_column(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.data import IngestOptions, ValidationSpec, ingest, load_recipe, transform
    from gpuyard.models.signature import ServingRecipe, serving_recipe

    income = pa.array([10.0, None, 30.0, 40.0, None, 60.0] * 20, pa.float64())
    pq.write_table(pa.table({"income": income, "y": [0, 1] * 60}), tmp_path / "t.parquet")
    checks = ValidationSpec.model_validate({"columns": {"income": {"impute": "median"}}})
    raw = ingest(tmp_path / "t.parquet", "imputed", IngestOptions(label_column="y", checks=checks))
    prepared = transform(raw.ref, load_recipe({"normalize": [{"columns": ["income"]}]}), engine="serial")
    contract = serving_recipe(prepared.ref)
    assert contract is not None and contract["columns"] == [
        {"name": "income", "kind": "float", "type": "double", "impute": 35.0}
    ]
    X = ServingRecipe(contract).features_of([{"income": None}, {"income": 35.0}, {"income": 10.0}])
    assert X[0, 0] == X[1, 0] == 0.0 and X[2, 0] < 0  # the median, z-scored: 0


def test_a_chain_of_transforms_with_derived_hashed_and_dropped_columns(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    """Two recipes one after the other: records of the ingested columns give the second version's rows."""
    from gpuyard.data import IngestOptions, ingest, load_recipe, transform
    from gpuyard.data.arrays import load_arrays
    from gpuyard.models.signature import ServingRecipe, serving_recipe

    rng = np.random.default_rng(0)
    n = 300
    table = pa.table(
        {
            "a": rng.normal(size=n),
            "b": rng.integers(1, 9, n),
            "note": rng.choice(["red fox", "blue cat", "green owl dog"], n),
            "city": rng.choice(["paris", "lyon"], n),
            "id": [f"x{i}" for i in range(n)],
            "y": rng.integers(0, 2, n),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    raw = ingest(tmp_path / "t.parquet", "chain", IngestOptions(label_column="y"))
    first = load_recipe(
        {
            "derive": [{"name": "ab", "expr": "a * b"}],
            "text_hash": [{"column": "note", "buckets": 4}],
            "encode": [{"column": "city"}],
            "drop": ["id"],
        }
    )
    one = transform(raw.ref, first, engine="serial", output="chain-1")
    second = load_recipe({"split": {"seed": 1}, "normalize": [{"columns": ["ab", "a"], "method": "minmax"}]})
    two = transform(one.ref, second, engine="serial", output="chain-2")
    contract = serving_recipe(f"{two.ref}#split=test")
    assert contract is not None and [t["dataset"] for t in contract["transforms"]] == [one.ref, two.ref]
    assert [c["name"] for c in contract["columns"]] == ["a", "b", "note", "city"]
    assert contract["ignored"] == ["id", "y"] and contract["splits"] == ["test"]
    assert "city=lyon" in contract["names"] and "note[3]" in contract["names"] and "ab" in contract["names"]
    split = np.array(two.to_arrow(["split"]).column("split").to_pylist())
    records = table.filter(pa.array(split == "test")).to_pylist()  # id and y come along: ignored
    X = ServingRecipe(contract).features_of(records)
    assert np.array_equal(X, load_arrays(f"{two.ref}#split=test").X)
