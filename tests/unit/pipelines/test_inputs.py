"""Typed stage inputs: unknown or missing names when parsed, bad values before a stage runs; one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.pipelines.demo import demo_spec
from gpuyard.pipelines.inputs import INPUTS, TrainInputs, parse_inputs, stage_inputs
from gpuyard.pipelines.spec import parse_pipeline
from gpuyard.pipelines.stages import KINDS

pytestmark = pytest.mark.unit


def _refused(doc_stages: list[dict], match: str) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        parse_pipeline({"name": "p", "stages": doc_stages}, "p.yaml")
    return str(info.value)


def test_every_kind_has_an_input_model() -> None:
    assert set(INPUTS) == set(KINDS)


def test_an_unknown_input_is_refused_when_the_spec_is_parsed() -> None:
    stage = {"name": "fit-it", "uses": "train", "with": {"dataset": "d", "epoch": 3}}
    msg = _refused([stage], r"stage 'fit-it': train takes no input 'epoch' \(it takes: dataset, params")
    assert "\n" not in msg


def test_a_missing_input_is_refused_when_the_spec_is_parsed() -> None:
    msg = _refused(
        [{"name": "in", "uses": "ingest", "with": {"name": "x"}}], "stage 'in': input 'source' is required"
    )
    assert "\n" not in msg


def test_references_pass_the_parse_and_module_function_stages_take_anything() -> None:
    spec = demo_spec()
    assert [st.uses for st in spec.stages][:3] == ["ingest", "transform", "tune"]
    assert stage_inputs("mystages:ok", {"anything": object()}, "s") is None


@pytest.mark.parametrize(
    ("kind", "inputs", "match"),
    [
        (
            "train",
            {"dataset": "d", "nproc": "two"},
            r"stage 's': input 'nproc': Input should be a valid integer",
        ),
        ("evaluate", {"dataset": "d", "require": {"accuracy": "high"}}, r"input 'require.accuracy': "),
        ("evaluate", {"dataset": "d", "task": "ranking"}, r"input 'task': Input should be 'classification'"),
        ("plan", {"model_dir": "m", "gpu_counts": []}, r"input 'gpu_counts': List should have at least 1"),
        ("serve", {"model": "m"}, r"stage 's': input 'dataset' is required"),
        ("ingest", {"source": "sklearn:iris", "name": "i", "inject_bad": -1}, r"input 'inject_bad': "),
    ],
)
def test_a_bad_value_names_the_stage_and_the_input_in_one_line(kind: str, inputs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        stage_inputs(kind, inputs, "s")
    assert "\n" not in str(info.value)


def test_typed_values_and_defaults() -> None:
    got = parse_inputs(TrainInputs, {"dataset": "digits", "nproc": "4", "seed": 3}, "t")
    assert (got.nproc, got.seed, got.classes, got.column, got.epochs) == (4, 3, 10, "image", None)


def test_the_runner_refuses_a_bad_value_before_the_stage_runs(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.pipelines.runner import run_pipeline

    doc = {"name": "p", "stages": [{"name": "in", "uses": "ingest", "with": {"source": "x", "name": 7.5}}]}
    doc["stages"][0]["with"]["inject_bad"] = "lots"
    with pytest.raises(ConfigError, match=r"stage 'in': input 'inject_bad': Input should be a valid integer"):
        run_pipeline(parse_pipeline(doc), tmp_path, executor="inline")
    assert not (gpuyard_home / "pipelines" / "p").exists()  # no stage folder: nothing ran
