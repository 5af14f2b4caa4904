"""The step model against every row of the published corpus (gpuyard/fabric/published/runs.yaml).

Each source states a regression guard (``regression_guard_pct``: its worst error today plus a margin,
see docs/fabric.md); every row must stay inside it. That is not an accuracy check: the accuracy goal
(median <= 5%, worst <= 15% leave-one-source-out) is a figure of benchmarks/fabric_accuracy.py. The
leave-one-source-out procedure is tested for what makes it honest: a held-out source's figures cannot
move the constants it is predicted with, not even through a preset or a borrowed generation.
"""

from __future__ import annotations

import pytest

from gpuyard.fabric import accuracy
from gpuyard.fabric.accuracy import (
    Corpus,
    borrowed_efficiency,
    borrowed_generation,
    fit_efficiencies,
    flops_per_step,
    generation,
    leave_one_source_out,
    published_step_s,
)
from gpuyard.fabric.published.runs import PublishedRun, load_runs, load_sources, model_spec

pytestmark = pytest.mark.unit

RUNS = load_runs()
SOURCES = load_sources()


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.load()


@pytest.mark.parametrize("run", RUNS, ids=[r.id for r in RUNS])
def test_no_published_run_regresses_past_its_source_guard(run: PublishedRun, corpus: Corpus) -> None:
    predicted = corpus.predicted(run, None)  # the shipped presets, no refit
    error = predicted / corpus.published[run.id] - 1
    guard = (run.regression_guard_pct or SOURCES[run.source].regression_guard_pct) / 100
    assert abs(error) <= guard, (
        f"{run.id}: predicted {predicted:.3f} s against {corpus.published[run.id]:.3f} s published "
        f"({error:+.1%}, regression guard {guard:.0%})"
    )


def test_megatron_throughput_converts_back_to_the_papers_step_time() -> None:
    # SC'21 Table 1, 1008B: 163 TFLOP/s per GPU on 3072 GPUs, batch 3072, with equation 3's FLOP count.
    run = next(r for r in RUNS if r.id == "megatron-sc21/table1/1008b")
    model = model_spec(run)
    flops = flops_per_step(run, model, "megatron-eq3")
    assert published_step_s(run, SOURCES[run.source]) == pytest.approx(flops / (3072 * 163e12))
    # Equation 3 counts the recomputed forward: 4/3 of 6N per token, plus attention and logits.
    assert flops > 8 * model.layers * 12 * model.hidden**2 * run.tokens_per_step


def test_a_held_out_source_cannot_move_the_constants_it_is_predicted_with(corpus: Corpus) -> None:
    held = "llm-foundry"
    others = set(SOURCES) - {held}
    before = fit_efficiencies(corpus, others)
    # Scale the held-out source's published figures by 3x: a fit that looked at them would move.
    skewed = Corpus(
        corpus.runs,
        corpus.sources,
        {k: v * (3.0 if k.startswith(held) else 1.0) for k, v in corpus.published.items()},
        corpus._cache,
    )
    assert fit_efficiencies(skewed, others) == before
    assert fit_efficiencies(skewed, set(SOURCES)) != fit_efficiencies(corpus, set(SOURCES))


def test_every_source_weighs_the_same_in_a_fit(corpus: Corpus) -> None:
    # Doubling a source's rows (same figures) must not change the fit: each source scores by its median.
    doubled = Corpus(
        corpus.runs + [r for r in corpus.runs if r.source == "llm-foundry"],
        corpus.sources,
        corpus.published,
        corpus._cache,
    )
    assert fit_efficiencies(doubled, set(SOURCES)) == fit_efficiencies(corpus, set(SOURCES))


def test_the_shipped_presets_hold_the_whole_corpus_fit(corpus: Corpus) -> None:
    fitted = fit_efficiencies(corpus, set(SOURCES))
    for run in RUNS:
        if run.power_limit_w is not None:  # a power-limited class has its own fit and no preset
            continue
        preset = accuracy.run_cluster(run.cluster, run.device).compute.gemm_efficiency
        assert preset == pytest.approx(fitted[generation(run.device)]), run.id


def _skewed(corpus: Corpus, held: str, factor: float) -> Corpus:
    return Corpus(
        corpus.runs,
        corpus.sources,
        {k: v * (factor if k.startswith(held + "/") else 1.0) for k, v in corpus.published.items()},
        corpus._cache,  # predictions do not depend on the published figures: share them
    )


def test_a_held_out_sources_predictions_do_not_depend_on_its_own_figures(corpus: Corpus) -> None:
    # megatron-bridge-25.11 is the only source with Blackwell rows: before the fix its Blackwell rows
    # were predicted with the preset, fitted on every source, itself included. Skewing its published
    # figures must leave every one of its predictions unchanged.
    held = "megatron-bridge-25.11"
    base = leave_one_source_out(corpus, only=held)[held]
    skewed = leave_one_source_out(_skewed(corpus, held, 0.5), only=held)[held]
    assert base.borrowed == {"blackwell": "hopper"}
    assert [e.predicted_s for e in skewed.errors] == pytest.approx([e.predicted_s for e in base.errors])
    assert any(generation(e.run.device) == "blackwell" for e in base.rows(borrowed=True))
    assert not any(generation(e.run.device) == "blackwell" for e in base.rows(borrowed=False))


def test_a_missing_generation_borrows_the_nearest_fitted_one() -> None:
    assert borrowed_generation("blackwell", {"ampere": 0.6, "hopper": 0.5}) == "hopper"
    assert borrowed_generation("blackwell", {"ampere": 0.6}) == "ampere"
    assert borrowed_generation("hopper", {"ampere": 0.6, "blackwell": 0.5}) == "ampere"  # tie: the older
    assert borrowed_generation("hopper", {"hopper": 0.7}) == "hopper"
    assert borrowed_generation("ada", {"hopper": 0.7}) is None  # not a fitted generation: preset holds
    assert borrowed_generation("hopper", {}) is None
    # A power-limited class no other source measures takes its generation's fit, else the nearest one.
    assert borrowed_generation("hopper@500W", {"hopper": 0.6, "ampere": 0.7}) == "hopper"
    assert borrowed_generation("hopper@500W", {"ampere": 0.7}) == "ampere"
    assert borrowed_generation("hopper@500W", {"hopper@500W": 0.5, "hopper": 0.6}) == "hopper@500W"


def test_a_borrowed_generation_is_scaled_by_the_measured_gemm_efficiencies() -> None:
    # A generation's own fit is used as fitted; a borrowed one is scaled by the ratio of the two
    # generations' large-GEMM efficiencies measured outside the corpus (B200 0.71 against H100 0.72).
    ratio = accuracy.MEASURED_GEMM_EFFICIENCY["blackwell"] / accuracy.MEASURED_GEMM_EFFICIENCY["hopper"]
    assert 0.9 < ratio < 1.0
    assert borrowed_efficiency("blackwell", {"hopper": 0.68}) == pytest.approx(0.68 * ratio)
    assert borrowed_efficiency("blackwell", {"blackwell": 0.63, "hopper": 0.68}) == 0.63
    assert borrowed_efficiency("hopper@500W", {"hopper": 0.68}) == 0.68  # same generation: no ratio
    assert borrowed_efficiency("blackwell", {"ampere": 0.78}) == 0.78  # no Ampere measurement: unscaled
    assert borrowed_efficiency("ada", {"hopper": 0.68}) is None


def test_power_limited_rows_have_their_own_constant_fitted_without_their_source(corpus: Corpus) -> None:
    # torchtitan's Grand Teton H100s run at 500 W: their rows form the class hopper@500W, fitted apart
    # from the 700 W Hopper rows, and a held-out 500 W source is predicted from the other one's fit.
    limited = {r.source for r in RUNS if r.power_limit_w == 500}
    assert limited == {"torchtitan-2024-12", "torchtitan-asynctp-2025-06"}
    assert accuracy.efficiency_class(next(r for r in RUNS if r.power_limit_w)) == "hopper@500W"
    assert "hopper@500W" in accuracy.fitted_constants(corpus)
    for held in sorted(limited):
        out = leave_one_source_out(corpus, only=held)[held]
        assert "hopper@500W" in out.fit and "hopper@500W" not in out.borrowed
        (other,) = limited - {held}
        assert out.fit["hopper@500W"] == fit_efficiencies(corpus, {other})["hopper@500W"]
        # Fitted below the 700 W parts: a lower clock under dense GEMMs, not a fit that follows noise.
        assert out.fit["hopper@500W"] < out.fit["hopper"]


def test_per_source_figures_weigh_every_source_the_same() -> None:
    # One source with 5 rows all 2% off, two sources of one row 20% and 30% off: a median over rows says
    # 2%, the median over sources says 20% and the worst source is the 30% one.
    runs = {s: [r for r in RUNS if r.source == s] for s in ("llm-foundry", "megatron-sc21", "nemo-24.07")}

    def held(source: str, errors: list[float]) -> accuracy.HeldOut:
        rows = [accuracy.RunError(r, 1.0, 1.0 + e) for r, e in zip(runs[source], errors, strict=False)]
        return accuracy.HeldOut(source, {}, rows, {})

    figures = accuracy.per_source(
        {
            "llm-foundry": held("llm-foundry", [0.02, -0.02, 0.02, 0.02, -0.02]),
            "megatron-sc21": held("megatron-sc21", [-0.20]),
            "nemo-24.07": held("nemo-24.07", [0.30]),
        }
    )
    assert [f.runs for f in figures.sources] == [5, 1, 1]
    assert figures.median_pct == pytest.approx(20.0)
    assert figures.worst.source == "nemo-24.07" and figures.worst.median_pct == pytest.approx(30.0)
    assert figures.sources[1].bias_pct == pytest.approx(-20.0)
    with pytest.raises(accuracy.ConfigError, match="no rows"):
        accuracy.per_source({"nemo-24.07": accuracy.HeldOut("nemo-24.07", {}, [], {})})


def test_the_fitted_constants_are_one_gemm_efficiency_per_measured_generation(corpus: Corpus) -> None:
    names = accuracy.fitted_constants(corpus)
    assert names == sorted(fit_efficiencies(corpus, set(SOURCES)))
    assert {"ampere", "hopper", "blackwell"} <= set(names)
    # v5e has no corpus row: its efficiency is not fitted from rows (it is cited, see the preset).
    assert "TPU-v5e" not in names
