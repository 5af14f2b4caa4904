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
from gpuyard.fabric.published.ceilings import causal_mfu, load_ceilings, mfu_warning, seq_band
from gpuyard.fabric.published.runs import model_spec

pytestmark = pytest.mark.unit


def test_the_shipped_ceilings_are_the_corpus_best() -> None:
    assert load_ceilings() == mfu_ceilings(Corpus.load())


def test_below_the_ceiling_no_warning_above_it_one_line() -> None:
    model = PRESETS["llama3-70b"]
    ceiling = load_ceilings()["H100-SXM5-80GB/bf16/4k-16k"]
    best = float(str(ceiling["mfu"]))
    # The plan's MFU comes in PaLM's count (full attention); the ceiling is causal: recount before comparing.
    full_at_best = best / (causal_mfu(1.0, model, 8192))
    assert mfu_warning("H100-SXM5-80GB", "bf16", full_at_best - 0.01, model, 8192) is None
    warning = mfu_warning("H100-SXM5-80GB", "bf16", full_at_best + 0.02, model, 8192)
    assert warning is not None and "\n" not in warning and "H100-SXM5-80GB" in warning
    assert str(ceiling["figure"]) in warning and str(ceiling["run"]) in warning  # quotes the source
    assert mfu_warning("H100-SXM5-80GB", "fp4", 0.99, model, 8192) is None  # nothing published


def test_the_llama3_long_context_row_is_its_own_38_percent_not_54() -> None:
    # Llama 3 paper, Table 4: 380 TFLOP/s per GPU at 131,072 tokens, "BF16 MFU 38%". Recounting it
    # with full (non-causal) attention FLOPs doubled its attention term and made it a 54% ceiling.
    corpus = Corpus.load()
    run = next(r for r in corpus.runs if r.id == "llama3-paper/table4/16384gpus-cp16-seq131072")
    ceiling = load_ceilings()["H100-SXM5-80GB/bf16/gt16k"]
    assert ceiling["run"] == run.id
    assert float(str(ceiling["source_mfu"])) == pytest.approx(0.384, abs=0.005)
    assert float(str(ceiling["mfu"])) == pytest.approx(float(str(ceiling["source_mfu"])), abs=1e-3)
    model = model_spec(run)
    full = float(str(ceiling["mfu"])) / causal_mfu(1.0, model, run.seq_len)
    assert full > 0.5  # what the old ceiling said
    # And no H100 bf16 ceiling at any length is above the best the sources print themselves (43%).
    h100 = [v for k, v in load_ceilings().items() if k.startswith("H100-SXM5-80GB/bf16/")]
    assert max(float(str(v["mfu"])) for v in h100) < 0.47


def test_a_band_without_rows_uses_the_nearest_band() -> None:
    model = PRESETS["llama3-8b"]
    warning = mfu_warning("H200-SXM-141GB", "fp8", 0.9, model, 2048)  # H200 fp8 rows are at 8K only
    assert warning is not None and "nearest band with a published run: 4k-16k" in warning
    assert seq_band(4096) == "le4k" and seq_band(4097) == "4k-16k" and seq_band(131072) == "gt16k"


def test_llama3_8b_at_8k_above_metas_own_rows_is_flagged() -> None:
    # The case: a 53-57% (PaLM count) plan for Llama 3 8B at 8K on H100 went unflagged.
    knobs = Knobs(tp=1, pp=1, cp=1, virtual_stages=1)
    result = plan(PRESETS["llama3-8b"], load_cluster("dgx-h100"), 64, 128, None, knobs, 1)
    top = result.plans[0]
    causal = causal_mfu(top.mfu, PRESETS["llama3-8b"], 8192)
    best = float(str(load_ceilings()["H100-SXM5-80GB/bf16/4k-16k"]["mfu"]))
    assert bool(result.warnings) == (causal > best)


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
