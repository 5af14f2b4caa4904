"""Registry: versions from runs with lineage, aliases and stages, promotion only when better, bad input."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gpuyard.cli.main import app
from gpuyard.errors import ConfigError, ConflictError, IntegrityError, NotFoundError
from gpuyard.models.fit import fit
from gpuyard.models.promote import promote
from gpuyard.models.registry import (
    delete_alias,
    export,
    get_version,
    list_models,
    load,
    model_events,
    register_file,
    register_from_run,
    set_alias,
    set_stage,
)
from gpuyard.models.spec import parse_spec
from gpuyard.tracking.store import start_run

pytestmark = pytest.mark.integration


def tree_spec(depth: int) -> dict:
    return {
        "name": f"tree{depth}",
        "experiment": "reg",
        "dataset": "sklearn:breast_cancer",
        "trainer": "gpuyard.models.builtin:train_sklearn",
        "params": {"estimator": "sklearn.tree.DecisionTreeClassifier", "max_depth": depth},
        "metric": "accuracy",
        "split": {"val": 0.2, "test": 0.3, "seed": 1},
    }


def test_register_from_run_with_lineage_and_signature(any_db: str) -> None:
    result, model = fit(parse_spec(tree_spec(3)))
    mv = register_from_run("cancer", result.run_id[:8], description="first")
    assert mv.ref == "cancer:1" and mv.flavor == "sklearn" and mv.stage == "none"
    assert mv.run_id == result.run_id and mv.dataset_version.startswith("sklearn:breast_cancer@")
    assert mv.lineage["dataset_ref"] == "sklearn:breast_cancer" and mv.lineage["params"]["max_depth"] == 3
    assert mv.metrics["test"]["accuracy"] == pytest.approx(result.evaluations["test"]["accuracy"])
    assert mv.metrics["validation"] != mv.metrics["test"]  # recorded apart
    assert mv.signature["inputs"]["shape"] == [-1, 30] and mv.signature["outputs"]["classes"] == [0, 1]
    assert set(mv.files) == {"model.skops", "config.json", "signature.json"}
    loaded = load("cancer:1")
    from sklearn.datasets import load_breast_cancer

    X, _ = load_breast_cancer(return_X_y=True)
    assert np.array_equal(loaded.predictor.predict(X.astype(np.float32)), model.predict(X.astype(np.float32)))


def test_promotion_only_when_the_challenger_beats_production(home: Path) -> None:
    weak, _ = fit(parse_spec(tree_spec(1)))
    strong, _ = fit(parse_spec(tree_spec(4)))
    v1 = register_from_run("cancer", weak.run_id)
    v2 = register_from_run("cancer", strong.run_id)
    first = promote(v1.ref)
    assert first.promoted and first.production is None
    assert get_version("cancer@production").version == 1
    better = promote(v2.ref)
    # The decision is what the two models score on the same holdout rows, both recorded.
    assert better.promoted == (better.challenger_score > better.production_score)
    assert better.promoted, better.reason
    assert get_version("cancer:1").stage == "archived" and get_version("cancer@production").version == 2
    back = promote("cancer:1")
    assert not back.promoted and "does not beat" in back.reason
    assert get_version("cancer@production").version == 2
    actions = [e["action"] for e in model_events("cancer")]
    assert actions[0] == "promotion_refused" and actions.count("promoted") == 2


def test_promotion_bad_input(home: Path) -> None:
    result, _ = fit(parse_spec(tree_spec(2)))
    register_from_run("cancer", result.run_id)
    with pytest.raises(NotFoundError, match="has versions 1"):
        promote("cancer:7")
    with pytest.raises(NotFoundError, match="not registered"):
        promote("nomodel:1")
    with pytest.raises(ConfigError, match="unknown metric"):
        promote("cancer:1", metric="acc")
    with pytest.raises(ConfigError, match="regression metric"):
        promote("cancer:1", metric="mse")
    with pytest.raises(ConfigError, match="unknown direction"):
        promote("cancer:1", direction="upwards")
    with pytest.raises(ConfigError, match="does not match the model's signature"):
        promote("cancer:1", holdout="sklearn:digits")


def test_registering_a_failed_or_modelless_run_is_refused(home: Path) -> None:
    with pytest.raises(RuntimeError), start_run("bad", system_interval_s=None) as t:
        raise RuntimeError("diverged")
    with pytest.raises(ConflictError, match="is failed"):
        register_from_run("m", t.run_id)
    with start_run("empty", system_interval_s=None) as t2:
        pass
    with pytest.raises(NotFoundError, match="stored no model"):
        register_from_run("m", t2.run_id)
    with pytest.raises(ConfigError, match="model name"):
        register_from_run("bad name!", t2.run_id)


def test_aliases_stages_export_and_tampering(home: Path, tmp_path: Path) -> None:
    result, _ = fit(parse_spec(tree_spec(2)))
    register_from_run("cancer", result.run_id)
    register_from_run("cancer", result.run_id)
    assert set_alias("cancer:1", "champion").aliases == ("champion",)
    assert get_version("cancer@champion").version == 1 and get_version("cancer").version == 2
    set_alias("cancer:2", "champion")
    assert get_version("cancer@champion").version == 2
    with pytest.raises(ConfigError, match="reserved"):
        set_alias("cancer:1", "production")
    assert set_stage("cancer:1", "staging").stage == "staging"
    assert get_version("cancer@staging").version == 1
    with pytest.raises(ConfigError, match="only through"):
        set_stage("cancer:1", "production")
    delete_alias("cancer", "champion")
    with pytest.raises(NotFoundError, match="no alias"):
        get_version("cancer@champion")
    assert list_models()[0]["versions"] == 2 and list_models()[0]["staging"] == 1
    out = export("cancer:1", tmp_path / "exp")
    assert json.loads((out / "model.json").read_text())["version"] == 1 and (out / "model.skops").exists()
    with pytest.raises(ConflictError, match="not empty"):
        export("cancer:1", out)
    # Someone rewrites the stored weights: loading notices.
    from gpuyard.store import get_artifacts

    mv = get_version("cancer:2")
    key = mv.files["model.skops"]["key"]
    path = Path(get_artifacts().root) / key
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    import shutil

    from gpuyard.models.registry import model_cache_dir

    shutil.rmtree(model_cache_dir(mv), ignore_errors=True)
    with pytest.raises(IntegrityError):
        load("cancer:2")


def test_register_file_refuses_pickle_and_accepts_skops(home: Path, tmp_path: Path) -> None:
    (tmp_path / "model.pkl").write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ConfigError, match="pickle"):
        register_file("m", tmp_path / "model.pkl")
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigError, match="not a safetensors, skops or ONNX"):
        register_file("m", tmp_path / "weights.bin")
    import skops.io as sio
    from sklearn.datasets import load_iris
    from sklearn.tree import DecisionTreeClassifier

    X, y = load_iris(return_X_y=True)
    sio.dump(DecisionTreeClassifier().fit(X, y), tmp_path / "tree.bin")  # the name does not matter
    mv = register_file("iris", tmp_path / "tree.bin")
    assert mv.flavor == "sklearn" and np.array_equal(load("iris").predictor.predict(X), y)


def test_models_cli(home: Path, tmp_path: Path) -> None:
    result, _ = fit(parse_spec(tree_spec(2)))
    runner = CliRunner()
    out = runner.invoke(app, ["models", "register", "cancer", "--run", result.run_id[:8], "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["version"] == 1
    out = runner.invoke(app, ["models", "promote", "cancer:1", "--json"])
    assert out.exit_code == 0 and json.loads(out.stdout)["promoted"]
    out = runner.invoke(app, ["models", "promote", "cancer:1"])
    assert out.exit_code == 1 and "not promoted" in out.stdout
    out = runner.invoke(app, ["models", "show", "cancer"])
    assert out.exit_code == 0 and "production" in out.stdout
    out = runner.invoke(app, ["models", "ls", "--json"])
    assert json.loads(out.stdout)[0]["production"] == 1
    out = runner.invoke(app, ["models", "export", "cancer@production", "--out", str(tmp_path / "e")])
    assert out.exit_code == 0 and (tmp_path / "e" / "model.skops").exists()
