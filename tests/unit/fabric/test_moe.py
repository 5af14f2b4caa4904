"""Mixture of experts in the step model: shared experts, capacity padding, load imbalance, presets."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.fabric.models import PRESETS, load_model
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, estimate_step, memory_per_gpu

pytestmark = pytest.mark.unit

MIXTRAL = PRESETS["mixtral-8x7b"]


def _step(model: object, ep: int = 8) -> object:
    cfg = ParallelConfig(tp=1, dp=64, ep=ep, micro_batch=1, zero=1, recompute="full")
    return estimate_step(model, load_cluster("dgx-h100"), 64, 256, 4096, cfg)  # type: ignore[arg-type]


def test_mixtral_8x22b_has_its_published_parameter_counts() -> None:
    m = PRESETS["mixtral-8x22b"]
    active = m.layers * m.active_layer_params + m.embedding_params
    # Mistral AI: 141B parameters, 39B active per token.
    assert m.params / 1e9 == pytest.approx(141, rel=0.01)
    assert active / 1e9 == pytest.approx(39, rel=0.01)


def test_shared_experts_are_dense_parameters_every_token_computes() -> None:
    shared = replace(MIXTRAL, shared_experts=1)
    assert shared.params - MIXTRAL.params == MIXTRAL.layers * MIXTRAL.ffn_params
    assert shared.active_layer_params - MIXTRAL.active_layer_params == MIXTRAL.ffn_params
    assert shared.expert_params == MIXTRAL.expert_params  # not sharded by expert parallelism
    base, more = _step(MIXTRAL), _step(shared)
    # One more FFN per token: about half as much again as the two routed ones, on every token.
    assert 1.15 < more.step_time_s / base.step_time_s < 1.6  # type: ignore[attr-defined]
    cfg = ParallelConfig(tp=1, dp=64, ep=8, micro_batch=1, zero=0)
    grow = memory_per_gpu(shared, 4096, cfg, 4)["weights"] - memory_per_gpu(MIXTRAL, 4096, cfg, 4)["weights"]
    assert grow == pytest.approx(MIXTRAL.layers * MIXTRAL.ffn_params * 2)  # replicated, bf16


def test_load_imbalance_slows_expert_parallel_steps_only() -> None:
    skewed = replace(MIXTRAL, load_imbalance=1.5)
    base, slow = _step(MIXTRAL), _step(skewed)
    assert slow.step_time_s > 1.05 * base.step_time_s  # type: ignore[attr-defined]
    assert slow.breakdown.ep_comm_s == pytest.approx(1.5 * base.breakdown.ep_comm_s, rel=0.1)  # type: ignore[attr-defined]
    # Without expert parallelism every expert is local: the imbalance costs nothing.
    assert _step(skewed, ep=1).step_time_s == pytest.approx(_step(MIXTRAL, ep=1).step_time_s)  # type: ignore[attr-defined]


def test_capacity_factor_pads_every_expert_even_without_expert_parallelism() -> None:
    padded = replace(MIXTRAL, capacity_factor=1.25)
    assert _step(padded, ep=1).step_time_s > _step(MIXTRAL, ep=1).step_time_s  # type: ignore[attr-defined]
    # Model FLOPs (the MFU numerator) do not count the padding.
    assert padded.model_flops_per_token(4096) == MIXTRAL.model_flops_per_token(4096)


def test_model_file_takes_the_moe_fields_and_refuses_them_on_a_dense_model(tmp_path: Path) -> None:
    good = tmp_path / "moe.yaml"
    good.write_text(
        "layers: 4\nhidden: 512\nheads: 8\nffn_hidden: 256\nvocab: 1000\nseq_len: 512\n"
        "experts: 16\ntop_k: 2\nshared_experts: 1\nload_imbalance: 1.3\n"
    )
    m = load_model(str(good))
    assert (m.shared_experts, m.load_imbalance, m.capacity_factor) == (1, 1.3, None)
    bad = tmp_path / "dense.yaml"
    bad.write_text(
        "layers: 4\nhidden: 512\nheads: 8\nffn_hidden: 256\nvocab: 1000\nseq_len: 512\nshared_experts: 2\n"
    )
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        load_model(str(bad))
    low = tmp_path / "low.yaml"
    low.write_text(good.read_text().replace("load_imbalance: 1.3", "load_imbalance: 0.5"))
    with pytest.raises(ConfigError, match="load_imbalance"):
        load_model(str(low))
