"""Shape and consistency of the published training-run corpus (fabric/published/runs.yaml)."""

from __future__ import annotations

from collections import Counter

import pytest

from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.presets import list_presets
from gpuyard.fabric.published.runs import (
    DIRECT_METRICS,
    ModelShape,
    PublishedRun,
    load_models,
    load_runs,
    load_sources,
    model_spec,
)
from gpuyard.fabric.step import validate
from gpuyard.hardware.catalog import get_spec

pytestmark = pytest.mark.unit

RUNS = load_runs()
SOURCES = load_sources()
IDS = [r.id for r in RUNS]
FLOP_CONVENTIONS = {
    "megatron-eq3",
    "6N",
    "6N+attn",
    "6N+attn-causal",
    "hfu",
    "mosaic-mfu",
    "none",
}


def test_corpus_size_and_sources() -> None:
    assert len(RUNS) >= 60
    used = {r.source for r in RUNS}
    assert len(used) >= 8
    assert used == set(SOURCES), "every source is used and every run's source exists"


def test_ids_are_unique() -> None:
    dupes = [i for i, n in Counter(IDS).items() if n > 1]
    assert not dupes


def test_sources_name_a_known_flop_convention() -> None:
    for key, source in SOURCES.items():
        assert source.flop_convention in FLOP_CONVENTIONS, key
        assert source.title and source.notes, key


def test_model_shapes_are_not_presets() -> None:
    assert not set(load_models()) & set(PRESETS), "a corpus shape must not shadow a gpuyard preset"


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_run_is_consistent(run: PublishedRun) -> None:
    assert run.where.strip()
    assert run.tp * run.pp * run.dp * run.cp == run.gpus
    assert run.global_batch % (run.dp * run.micro_batch) == 0
    assert get_spec(run.device).name == run.device, "device must be a canonical catalog name"
    assert run.cluster in list_presets()
    if run.metric == "mfu":
        assert run.value <= 1.0, "MFU is a fraction"
    spec = model_spec(run)
    assert spec.seq_len == run.seq_len
    # The step model accepts the layout (heads divide TP, micro-batches fill the interleaved pipeline, ...).
    validate(spec, run.gpus, run.global_batch, run.seq_len, run.parallel_config())


@pytest.mark.parametrize("run", [r for r in RUNS if r.metric in DIRECT_METRICS], ids=lambda r: r.id)
def test_direct_metrics_give_a_step_time(run: PublishedRun) -> None:
    step = run.direct_step_time_s()
    assert step is not None and 0 < step < 3600


def test_string_models_resolve() -> None:
    shapes = load_models()
    for run in RUNS:
        if not isinstance(run.model, ModelShape):
            assert run.model in PRESETS or run.model in shapes, run.id


def test_coverage() -> None:
    devices = {r.device for r in RUNS}
    assert devices & {"A100-SXM4-40GB", "A100-SXM4-80GB"}
    assert "H100-SXM5-80GB" in devices
    assert devices - {"A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB"}, "a third device family"
    assert {r.recompute for r in RUNS} == {"none", "selective", "full"}
    assert any(r.zero == 3 and r.tp == 1 and r.pp == 1 for r in RUNS), "FSDP / ZeRO-3"
    assert any(r.tp > 1 and r.pp > 1 and r.dp > 1 for r in RUNS), "Megatron-style 3D parallelism"
    assert any(r.pp > 1 and r.virtual_stages > 1 for r in RUNS), "interleaved pipeline schedule"
    assert any(r.pp > 1 and r.virtual_stages == 1 for r in RUNS), "plain 1F1B pipeline schedule"
    assert any(r.cp > 1 for r in RUNS), "context parallelism"
    assert any(r.sequence_parallel for r in RUNS), "sequence parallelism"
    params = [model_spec(r).params for r in RUNS]
    assert min(params) <= 1.5e9
    assert max(params) >= 400e9


def test_loader_is_stable() -> None:
    assert [r.id for r in load_runs()] == IDS
    assert load_sources() == SOURCES
