"""The demo pipeline (``gpuyard demo``): the digits example shipped with the package, optionally smaller."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from gpuyard.pipelines.spec import PipelineSpec, parse_pipeline


def demo_doc(quick: bool = False) -> dict[str, Any]:
    """The demo pipeline as a document; ``quick`` shortens training (tests), keeping every stage."""
    doc: dict[str, Any] = yaml.safe_load(
        resources.files("gpuyard.pipelines").joinpath("demo.yaml").read_text()
    )
    doc["name"] = "demo"
    if quick:
        stages = {st["name"]: st for st in doc["stages"]}
        stages["search"]["with"]["spec"]["params"]["epochs"] = 3
        stages["train"]["with"]["epochs"] = 8
        stages["test"]["with"]["require"] = {"accuracy": 0.85}
    return doc


def demo_spec(quick: bool = False) -> PipelineSpec:
    """The validated demo pipeline."""
    return parse_pipeline(demo_doc(quick), "gpuyard demo")
