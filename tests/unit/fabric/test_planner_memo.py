"""The planner's memoised search gives every layout exactly what a lone, cold estimate gives it.

The search shares per-knob terms (layer times, output layer, pipeline hop, data-parallel traffic, memory
terms) between layouts and builds estimates only for the plans it returns. A memo keyed on too few knobs
would hand one layout another's term; these cases evaluate each layout alone with every cache cleared
and compare the whole ranked list, bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuyard.fabric import step
from gpuyard.fabric.models import PRESETS, ModelSpec
from gpuyard.fabric.planner import Knobs, _rank_key, layouts, plan
from gpuyard.fabric.presets import load_cluster

pytestmark = pytest.mark.unit

# Small enough to evaluate every layout cold (well under a second each), varied enough to cross every
# memo: MoE with dense layers, MLA and expert parallelism; unfused attention with pipeline
# scatter/gather, context parallelism and interleaving; per-op recompute with async TP; a TPU slice.
CASES = [
    (
        replace(PRESETS["deepseek-v3"], name="deepseek-v3-6l", layers=6, dense_layers=1),
        "dgx-h100",
        32,
        32,
        Knobs(micro_batch=1, virtual_stages=1, zero=1),
    ),
    (
        replace(PRESETS["llama3-70b"], name="llama3-70b-16l", layers=16),
        "dgx-h100",
        16,
        16,
        Knobs(stack="megatron-lm-2021", zero=1),
    ),
    (PRESETS["llama3-8b"], "dgx-a100", 16, 16, Knobs(stack="torchtitan", micro_batch=1, virtual_stages=1)),
    (PRESETS["llama3-8b"], "tpu-v5p-512", 64, 64, Knobs(stack="maxtext")),
]


@pytest.mark.parametrize(
    ("model", "cluster_name", "gpus", "batch", "knobs"), CASES, ids=lambda c: getattr(c, "name", None)
)
def test_the_search_equals_each_layout_estimated_alone(
    model: ModelSpec, cluster_name: str, gpus: int, batch: int, knobs: Knobs
) -> None:
    cluster = load_cluster(cluster_name)
    step.clear_caches()
    searched = plan(model, cluster, gpus, batch, knobs=knobs, top=10**6)
    alone = []
    considered = 0
    for cfg in layouts(model, cluster, gpus, batch, model.seq_len, knobs):
        considered += 1
        step.clear_caches()  # nothing carried over from another layout
        est = step.estimate_step(model, cluster, gpus, batch, model.seq_len, cfg)
        if est.fits:
            alone.append(est)
    alone.sort(key=_rank_key)
    assert len(alone) > 20 and considered > len(alone)  # the case has layouts on both sides of the limit
    assert (searched.considered, searched.fitting) == (considered, len(alone))
    assert searched.plans == alone  # every figure, breakdown and memory term, compared exactly
    # and a lone estimate with the search's memos warm agrees too
    best = searched.plans[0]
    again = step.estimate_step(model, cluster, gpus, batch, model.seq_len, best.config)
    assert again == best
