"""Pipeline specs: references to earlier outputs, and the errors a user sees for bad ones."""

from __future__ import annotations

import pytest

from gpuyard.errors import ConfigError
from gpuyard.pipelines.spec import parse_pipeline, references, resolve

pytestmark = pytest.mark.unit


def _doc(*stages: dict) -> dict:
    return {"name": "p", "stages": list(stages)}


def test_references_are_resolved_with_their_types() -> None:
    outputs = {"a": {"ds": "digits@abc", "params": {"lr": 0.1}}}
    got = resolve({"x": "${a.ds}", "p": "${a.params}", "s": "v=${a.ds}!", "n": 3}, outputs, "stage b")
    assert got == {"x": "digits@abc", "p": {"lr": 0.1}, "s": "v=digits@abc!", "n": 3}
    assert references(["${a.ds}", {"k": "${b.x}"}]) == [("a", "ds"), ("b", "x")]


def test_missing_output_names_what_exists() -> None:
    with pytest.raises(ConfigError, match=r"stage 'a' has no output 'nope' \(it produced: ds\)"):
        resolve("${a.nope}", {"a": {"ds": 1}}, "stage b")


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([{"name": "a", "uses": "ingest", "with": {"x": "${b.y}"}}], "not an earlier stage"),
        ([{"name": "a", "uses": "ingest"}, {"name": "a", "uses": "train"}], "appears twice"),
        ([{"name": "a", "uses": "teleport"}], "neither a stage kind"),
        ([{"name": "a b", "uses": "ingest"}], "stage name"),
        ([{"name": "a", "uses": "ingest", "colour": 1}], "colour"),
    ],
)
def test_bad_specs_are_refused_with_the_field(stages: list[dict], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_pipeline(_doc(*stages), "p.yaml")


def test_forward_reference_is_refused_even_if_the_stage_exists_later() -> None:
    doc = _doc({"name": "a", "uses": "ingest", "with": {"x": "${b.y}"}}, {"name": "b", "uses": "ingest"})
    with pytest.raises(ConfigError, match="not an earlier stage"):
        parse_pipeline(doc)
