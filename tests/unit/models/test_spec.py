"""The YAML spec names the field that is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.models.spec import load_spec, parse_spec

pytestmark = pytest.mark.unit

BASE = {"name": "m", "dataset": "sklearn:digits"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({**BASE, "metric": "acc"}, "unknown metric 'acc'"),
        ({**BASE, "direction": "up"}, "direction"),
        ({**BASE, "metric": "mse", "direction": "maximize"}, "better when minimized"),
        ({**BASE, "task": "regression", "metric": "accuracy"}, "classification metric"),
        ({**BASE, "search": {"space": {}}}, "search"),
        ({**BASE, "search": {"space": {"lr": {"type": "float", "low": 1, "high": 0}}}}, "search.space.lr"),
        (
            {**BASE, "search": {"sampler": "grid", "space": {"lr": {"type": "float", "low": 0, "high": 1}}}},
            "step",
        ),
        ({**BASE, "cv": {"folds": 1}}, "cv.folds"),
        ({**BASE, "colour": "red"}, "colour"),
    ],
)
def test_bad_spec_names_the_field(doc: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec(doc)


def test_defaults_and_yaml(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: d\ndataset: sklearn:diabetes\nmetric: mae\n")
    spec = load_spec(path)
    assert spec.resolved_direction == "minimize" and spec.resolved_task == "regression"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_spec(tmp_path / "missing.yaml")
