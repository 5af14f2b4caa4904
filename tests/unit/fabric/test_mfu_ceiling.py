"""The MFU sanity rule: a plan predicted above the best published MFU for its device and precision says so."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gpuyard.cli.main import app
from gpuyard.fabric.accuracy import Corpus, mfu_ceilings
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.planner import Knobs, plan
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.published.ceilings import load_ceilings, mfu_warning

pytestmark = pytest.mark.unit


def test_the_shipped_ceilings_are_the_corpus_best() -> None:
    assert load_ceilings() == mfu_ceilings(Corpus.load())


def test_below_the_ceiling_no_warning_above_it_one_line() -> None:
    best = float(str(load_ceilings()["H100-SXM5-80GB/bf16"]["mfu"]))
    assert mfu_warning("H100-SXM5-80GB", "bf16", best - 0.01) is None
    warning = mfu_warning("H100-SXM5-80GB", "bf16", best + 0.05)
    assert warning is not None and "\n" not in warning and "H100-SXM5-80GB" in warning
    assert mfu_warning("H100-SXM5-80GB", "fp4", 0.99) is None  # nothing published: nothing to hold it to


def _optimistic(name: str) -> Cluster:
    data = load_cluster(name).model_dump()
    data["compute"] = {**data["compute"], "gemm_efficiency": 1.0, "attention_efficiency": 1.0}
    return Cluster.model_validate(data)


def test_a_plan_faster_than_any_published_run_is_flagged() -> None:
    knobs = Knobs(
        tp=8, pp=4, cp=1, micro_batch=1, virtual_stages=1, recompute="none", zero=1, sequence_parallel=True
    )
    honest = plan(PRESETS["llama3-70b"], load_cluster("dgx-h100"), 256, 512, None, knobs, 1)
    flagged = plan(PRESETS["llama3-70b"], _optimistic("dgx-h100"), 256, 512, None, knobs, 1)
    assert flagged.plans[0].mfu > honest.plans[0].mfu
    assert flagged.warnings and "above the best published bf16 run" in flagged.warnings[0]
    assert not honest.warnings


def test_plan_json_carries_the_warnings(tmp_path: object) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "llama3-70b",
            "--cluster",
            "dgx-h100",
            "--gpus",
            "64",
            "--global-batch",
            "128",
            "--top",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert isinstance(doc["warnings"], list)
