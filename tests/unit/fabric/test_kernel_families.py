"""Efficiency by kernel family and shape (issue 31 item 3), torchtitan's async TP and per-op recompute.

Attention is priced by the stack's kernel family (unfused, FA1, FA2, FA3, cuDNN) on each device; the GEMM
shape law's half-efficiency sizes follow each device's ridge point; torchtitan's async TP hides only what
PyTorch's micro-pipeline pass fuses; torchtitan's "selective" recompute reruns every second matmul.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.published.runs import load_runs
from gpuyard.fabric.stacks import ATTENTION_FAMILIES, STACKS, Stack
from gpuyard.fabric.step import (
    ParallelConfig,
    _layer_times,
    attention_efficiency,
    comm_time,
    estimate_step,
    memory_per_gpu,
)
from gpuyard.hardware.catalog import get_spec

pytestmark = pytest.mark.unit

GPT = PRESETS["gpt3-175b"]


def _attention(cluster: Cluster, family: str, seq: int = 2048, tp: int = 8) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention under ``family``, isolated from the rest."""
    stack = replace(STACKS["megatron-lm"], attention=family)
    flash = replace(STACKS["megatron-lm"], attention="fa3")
    cfg = ParallelConfig(tp=tp, micro_batch=1, recompute="none")
    mine = _layer_times(GPT, cluster, seq, cfg, stack)
    base = _layer_times(GPT, cluster, seq, cfg, flash)
    # Everything but attention is the same under both stacks: the difference is attention's.
    return mine.fwd - base.fwd + base.attention_fwd, mine.bwd - base.bwd + 2.5 * base.attention_fwd


@pytest.mark.parametrize("preset", ["dgx-a100", "dgx-h100"])
def test_older_kernel_families_are_slower_on_every_device(preset: str) -> None:
    cluster = load_cluster(preset)
    times = {f: sum(_attention(cluster, f)) for f in ATTENTION_FAMILIES}
    assert times["unfused"] > times["fa1"] > times["fa2"] >= times["fa3"] == times["cudnn"]
    # FlashAttention 2 is about twice FlashAttention 1 (Dao 2023), on Ampere and Hopper alike.
    assert times["fa1"] / times["fa2"] == pytest.approx(2.0)


def test_fa2_is_the_best_kernel_before_hopper_and_not_after() -> None:
    a100, h100 = load_cluster("dgx-a100"), load_cluster("dgx-h100")
    assert attention_efficiency(a100, "fa3") == attention_efficiency(a100, "fa2")  # FA3 needs Hopper
    assert attention_efficiency(h100, "fa2") == pytest.approx(0.6 * attention_efficiency(h100, "fa3"))


def test_unfused_attention_is_quadratic_and_pays_for_the_scores_in_memory() -> None:
    a100 = load_cluster("dgx-a100")
    short, long = sum(_attention(a100, "unfused", 2048)), sum(_attention(a100, "unfused", 4096))
    # Per layer and micro-batch of one sequence: twice the tokens, each attending to twice the keys.
    assert 3.5 < long / short < 4.5
    # Its score traffic alone: (9 + 11) bytes per score of the layer's 96/8 heads at the memory bandwidth.
    scores = 2048 * 2048 * GPT.heads / 8
    assert sum(_attention(a100, "unfused")) > scores * 20 / (a100.memory_bw_GBps * 1e9)
    # Without recomputation the backward keeps 5 bytes per score (Korthikanti et al. 2022); selective
    # recomputation reruns them instead.
    cfg = ParallelConfig(tp=8, pp=8, dp=1, micro_batch=1, recompute="none", stack="megatron-lm-2021")
    kept = memory_per_gpu(GPT, 2048, cfg, 8)["activations"]
    flash = memory_per_gpu(GPT, 2048, replace(cfg, stack="megatron-lm"), 8)["activations"]
    layers_in_flight = 8 * GPT.layers // 8
    assert kept - flash == pytest.approx(layers_in_flight * scores * 5)
    sel = memory_per_gpu(GPT, 2048, replace(cfg, recompute="selective"), 8)["activations"]
    sel_flash = memory_per_gpu(GPT, 2048, replace(cfg, recompute="selective", stack="megatron-lm"), 8)
    assert sel == pytest.approx(sel_flash["activations"])
    # ... and pays for it in time: the core attention's forward runs again.
    stack = STACKS["megatron-lm-2021"]
    rerun = _layer_times(GPT, a100, 2048, replace(cfg, recompute="selective"), stack)
    kept_layer = _layer_times(GPT, a100, 2048, cfg, stack)
    assert rerun.recompute > _attention(a100, "unfused")[0] > 0 == kept_layer.recompute


def test_gemm_half_sizes_follow_the_ridge_point_of_each_device() -> None:
    h100, a100 = load_cluster("dgx-h100"), load_cluster("dgx-a100")
    assert h100.gemm_halves == h100.compute.gemm_half  # measured on an H100
    ridge = lambda name: get_spec(name).bf16_tflops / get_spec(name).memory_bw_GBps  # noqa: E731
    ratio = ridge("A100-SXM4-80GB") / ridge("H100-SXM5-80GB")
    assert 0.4 < ratio < 0.6
    assert a100.gemm_halves == pytest.approx(tuple(x * ratio for x in h100.compute.gemm_half))
    # A calibration measures the halves on its own device: they are used as measured.
    data = a100.model_dump()
    data["compute"] = {**data["compute"], "gemm_half": (8.0, 16.0, 32.0), "gemm_half_device": None}
    assert Cluster.model_validate(data).gemm_halves == (8.0, 16.0, 32.0)


def test_megatron_2021_splits_pipeline_sends_over_the_tensor_ranks() -> None:
    a100 = load_cluster("dgx-a100")
    cfg = ParallelConfig(tp=8, pp=8, dp=16, micro_batch=1, recompute="full", stack="megatron-lm-2021")
    split = estimate_step(GPT, a100, 1024, 1536, 2048, cfg)
    whole_stack = replace(STACKS["megatron-lm-2021"], pp_scatter_gather=False)
    whole = estimate_step(GPT, a100, 1024, 1536, 2048, cfg, stack=whole_stack)
    # Each rank sends 1/8 over its own NIC, then the next stage gathers the slices over NVLink.
    assert split.breakdown.pp_comm_s < 0.5 * whole.breakdown.pp_comm_s
    # With sequence parallelism the activations are split already: the flag changes nothing.
    sp = replace(cfg, sequence_parallel=True)
    assert estimate_step(GPT, a100, 1024, 1536, 2048, sp).step_time_s == pytest.approx(
        estimate_step(GPT, a100, 1024, 1536, 2048, sp, stack=whole_stack).step_time_s
    )


LLAMA = PRESETS["llama3-70b"]
TP8 = ParallelConfig(tp=8, dp=8, micro_batch=1, zero=3, sequence_parallel=True, recompute="full")


def test_async_tp_leaves_the_backward_reduce_scatters_exposed() -> None:
    h100 = load_cluster("dgx-h100")
    titan = _layer_times(LLAMA, h100, 8192, replace(TP8, stack="torchtitan", tp_overlap=True))
    userbuffers = _layer_times(LLAMA, h100, 8192, replace(TP8, stack="nemo"))
    assert titan.tp_comm == pytest.approx(userbuffers.tp_comm)
    rs = comm_time(h100, "reduce_scatter", 8192 * LLAMA.hidden * 2, 8)
    # Two input-gradient reduce-scatters per layer take a sum of matmuls: PyTorch does not fuse them.
    assert titan.tp_exposed >= 2 * rs
    assert userbuffers.tp_exposed < titan.tp_exposed < titan.tp_comm
    # Without sequence parallelism there is no all-gather or reduce-scatter to decompose.
    no_sp = replace(TP8, stack="torchtitan", tp_overlap=True, sequence_parallel=False)
    plain = _layer_times(LLAMA, h100, 8192, no_sp)
    assert plain.tp_exposed == pytest.approx(plain.tp_comm)


def test_torchtitan_selective_recompute_reruns_every_second_matmul() -> None:
    h100 = load_cluster("dgx-h100")
    cfg = replace(TP8, recompute="selective", tp=1, sequence_parallel=False)
    op = _layer_times(LLAMA, h100, 8192, replace(cfg, stack="torchtitan"))
    megatron_like: Stack = replace(STACKS["torchtitan"], selective="megatron")
    layer = _layer_times(LLAMA, h100, 8192, cfg, megatron_like)
    full = _layer_times(LLAMA, h100, 8192, replace(cfg, recompute="full"), megatron_like)
    # wk, wo and w3 of the seven matmuls: more than the memory-bound operators, less than a forward.
    assert layer.recompute < op.recompute < full.recompute
    assert 0.25 < (op.recompute - layer.recompute) / full.recompute < 0.5


def test_torchtitan_layer_wise_selective_checkpointing_reruns_every_other_layer() -> None:
    """selective_ac_option "2": every second block fully checkpointed, the others keep everything."""
    h100 = load_cluster("dgx-h100")
    model = PRESETS["llama3-8b"]
    cfg = ParallelConfig(dp=8, micro_batch=1, zero=3, recompute="selective", stack="torchtitan")
    layer_wise: Stack = replace(STACKS["torchtitan"], selective="every-2nd-layer")
    none_cfg, full_cfg = replace(cfg, recompute="none"), replace(cfg, recompute="full")
    half = _layer_times(model, h100, 8192, cfg, layer_wise)
    full = _layer_times(model, h100, 8192, full_cfg, layer_wise)
    assert half.recompute == pytest.approx(full.recompute / 2)
    assert half.fwd == pytest.approx(full.fwd) and half.bwd == pytest.approx(full.bwd)
    # Memory: the average of a layer that keeps only its input and one that keeps everything, and one
    # checkpointed layer rebuilt in full during its backward (as under full recomputation).
    kept = memory_per_gpu(model, 8192, cfg, 1, layer_wise)["activations"]
    none = memory_per_gpu(model, 8192, none_cfg, 1, layer_wise)["activations"]
    only_input = memory_per_gpu(model, 8192, full_cfg, 1, layer_wise)["activations"]
    rebuilt = (none - only_input) / model.layers  # about one layer's full activations
    assert kept == pytest.approx((none + only_input) / 2 + rebuilt / 2, rel=0.01)
    assert only_input < kept < none
    # Hardware FLOPs count half a recomputed forward; model FLOPs do not change.
    step = estimate_step(model, h100, 8, 8, 8192, cfg, stack=layer_wise)
    step_full = estimate_step(model, h100, 8, 8, 8192, full_cfg, stack=layer_wise)
    step_op = estimate_step(model, h100, 8, 8, 8192, cfg)
    extra = step.hardware_tflops_per_gpu * step.step_time_s - step.model_tflops_per_gpu * step.step_time_s
    extra_full = (step_full.hardware_tflops_per_gpu - step_full.model_tflops_per_gpu) * step_full.step_time_s
    assert extra == pytest.approx(extra_full / 2)
    assert step_op.step_time_s < step.step_time_s < step_full.step_time_s
    with pytest.raises(ValueError, match="selective"):
        replace(STACKS["torchtitan"], selective="every-3rd-layer")


def test_only_torchtitans_selective_layer_rows_carry_the_layer_wise_policy() -> None:
    marked = {r.id for r in load_runs() if r.selective == "every-2nd-layer"}
    assert marked == {
        "torchtitan-2024-08/llama3-8b-64-a100-selective-layer",
        "torchtitan-2024-08/llama2-13b-64-a100-selective-layer-lbs2",
    }
    assert all(r.recompute == "selective" for r in load_runs() if r.id in marked)


def test_corpus_rows_marked_fa1_are_the_ones_run_without_flashattention_2() -> None:
    # llm-foundry's tables before January 2024 were run by a sweep that could not load FlashAttention 2
    # (PURE rows before July 2023; the DEFAULT rows of commit b2a43a147 pin llm-foundry v0.3.0, whose gpu
    # extra is flash-attn 1.0.9, and its attn_impl default is the Triton FA1 port); the large-scale H100
    # table's sweep.py passes triton for 13b and 30b and flash with the gpu-flash2 extra for the rest.
    marked = {r.id for r in load_runs() if r.attention == "fa1"}
    large_scale_fa2 = {
        r.id
        for r in load_runs()
        if r.id.startswith("llm-foundry/h100-large/")
        and not r.id.startswith(("llm-foundry/h100-large/mpt-13b", "llm-foundry/h100-large/mpt-30b"))
    }
    expected = {r.id for r in load_runs() if r.source == "llm-foundry"} - large_scale_fa2
    assert marked == expected and len(marked) == 204 and len(large_scale_fa2) == 12


def test_only_grand_teton_rows_carry_the_sources_hbm2e_bandwidth() -> None:
    carried = {r.id for r in load_runs() if r.memory_bw_GBps is not None}
    grand_teton = {
        r.id
        for r in load_runs()
        if r.source in ("torchtitan-2024-12", "torchtitan-asynctp-2025-06")
        or r.id.startswith("torchtitan-2024-08/llama3.1-405b")
    }
    assert carried == grand_teton and len(carried) == 33
    assert {r.memory_bw_GBps for r in load_runs() if r.id in carried} == {2400}
