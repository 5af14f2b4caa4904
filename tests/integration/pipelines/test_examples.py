"""The examples on small settings (in-process stages), the content-hash cache, and a failing stage's job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuyard.pipelines.runner import StageFailed, run_pipeline
from gpuyard.pipelines.spec import parse_pipeline

pytestmark = pytest.mark.integration


def set_inputs(doc: dict[str, Any], name: str, **values: Any) -> None:
    """Override inputs of stage ``name`` in a pipeline document."""
    next(st for st in doc["stages"] if st["name"] == name).setdefault("with", {}).update(values)


def test_diabetes_baseline_against_tuned_mlp(gpuyard_home: Path, example_doc: Any) -> None:
    doc, folder = example_doc("diabetes")
    search = next(st for st in doc["stages"] if st["name"] == "search")
    search["with"]["spec"]["params"]["epochs"] = 20
    result = run_pipeline(parse_pipeline(doc), folder, executor="inline")
    base, mlp = result.outputs("baseline-test")["metrics"], result.outputs("mlp-test")["metrics"]
    assert set(base) == set(mlp) == {"mse", "mae", "r2"}
    assert result.outputs("register-baseline")["promoted"]  # first version: nothing to beat
    # Promotion scores both on the same held-out rows the evaluate stages used.
    assert result.outputs("register-mlp")["promoted"] == (mlp["mse"] < base["mse"])
    from gpuyard.models.registry import get_version

    assert get_version("diabetes:1").flavor == "sklearn" and get_version("diabetes:2").flavor == "torch"


def test_friends_gnn_and_the_cache(gpuyard_home: Path, example_doc: Any) -> None:
    doc, folder = example_doc("friends-gnn")
    set_inputs(doc, "graph", people=400)
    set_inputs(doc, "train", epochs=15)
    first = run_pipeline(parse_pipeline(doc), folder, executor="inline")
    shard, train = first.outputs("shard"), first.outputs("train")
    # Friends are close in age: cutting by age keeps more friendships inside a shard than hashing.
    assert shard["age_range"]["cut_share"] < shard["hash"]["cut_share"]
    assert sum(shard["hash"]["nodes"]) == 400 and 0 <= train["auc"] <= 1 and train["test_pairs"] > 0

    again = run_pipeline(parse_pipeline(doc), folder, executor="inline")
    assert all(st.cached for st in again.stages) and again.outputs("train") == train

    set_inputs(doc, "train", epochs=16)  # only the training stage's inputs change
    third = run_pipeline(parse_pipeline(doc), folder, executor="inline")
    assert [st.name for st in third.stages if not st.cached] == ["train"]


def test_failing_stage_job_reports_its_log_and_keeps_earlier_results(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    (tmp_path / "mystages.py").write_text(
        "def ok(inputs, ctx):\n    return {'value': inputs['n'] * 2}\n\n"
        "def boom(inputs, ctx):\n    print('about to fail with', inputs['got'])\n"
        "    raise ValueError('no good: ' + str(inputs['got']))\n"
    )
    doc = {
        "name": "fails",
        "stages": [
            {"name": "first", "uses": "mystages:ok", "with": {"n": 21}},
            {"name": "second", "uses": "mystages:boom", "with": {"got": "${first.value}"}},
        ],
    }
    with pytest.raises(StageFailed, match=r"(?s)stage 'second'.*failed.*no good: 42"):
        run_pipeline(parse_pipeline(doc), tmp_path, executor="jobs")
    doc["stages"] = doc["stages"][:1]
    again = run_pipeline(parse_pipeline(doc), tmp_path, executor="jobs")
    assert again.stages[0].cached and again.outputs("first") == {"value": 42}
