"""The step model against every row of the published corpus (gpuyard/fabric/published/runs.yaml).

Each source states the largest error its rows may show (``tolerance_pct``: what the model achieves
today, see docs/fabric.md); every row must stay inside it. The leave-one-source-out procedure that
benchmarks/fabric_accuracy.py reports is tested for what makes it honest: a held-out source's figures
cannot move the constants it is predicted with.
"""

from __future__ import annotations

import pytest

from gpuyard.fabric import accuracy
from gpuyard.fabric.accuracy import Corpus, fit_efficiencies, flops_per_step, generation, published_step_s
from gpuyard.fabric.published.runs import PublishedRun, load_runs, load_sources, model_spec

pytestmark = pytest.mark.unit

RUNS = load_runs()
SOURCES = load_sources()


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.load()


@pytest.mark.parametrize("run", RUNS, ids=[r.id for r in RUNS])
def test_every_published_run_is_predicted_within_its_source_tolerance(
    run: PublishedRun, corpus: Corpus
) -> None:
    predicted = corpus.predicted(run, None)  # the shipped presets, no refit
    error = predicted / corpus.published[run.id] - 1
    tolerance = SOURCES[run.source].tolerance_pct / 100
    assert abs(error) <= tolerance, (
        f"{run.id}: predicted {predicted:.3f} s against {corpus.published[run.id]:.3f} s published "
        f"({error:+.1%}, tolerance {tolerance:.0%})"
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
        preset = accuracy.run_cluster(run.cluster, run.device).compute.gemm_efficiency
        assert preset == pytest.approx(fitted[generation(run.device)]), run.id
