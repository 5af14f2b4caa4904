"""Mixture of experts in the step model: shared experts, capacity padding, load imbalance, presets."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.fabric import step as step_mod
from gpuyard.fabric import step_layer
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


def _ep_comm(model: object, ep: int, gpus: int = 512) -> float:
    cfg = ParallelConfig(tp=1, dp=gpus, ep=ep, micro_batch=1, zero=1, recompute="none")
    step = estimate_step(model, load_cluster("dgx-h100"), gpus, gpus, 4096, cfg)  # type: ignore[arg-type]
    return step.breakdown.ep_comm_s  # type: ignore[attr-defined]


def test_expert_all_to_all_grows_once_expert_parallelism_leaves_the_node() -> None:
    v3 = replace(PRESETS["deepseek-v3"], route_nodes=0)
    inside, two, eight = _ep_comm(v3, 8), _ep_comm(v3, 16), _ep_comm(v3, 64)
    # Over NVLink inside one node, then over the NICs (each GPU's 50 GB/s against 450 GB/s of NVLink).
    assert two > 2 * inside
    assert eight > two  # more of each token's copies leave the node: (n - 8) / n of them


def test_node_limited_routing_sends_fewer_copies_over_the_network() -> None:
    v3 = PRESETS["deepseek-v3"]
    unlimited = replace(v3, route_nodes=0)
    assert v3.route_nodes == 4
    # 64-way EP over 8 nodes: 8 picks reach about 4.6 other nodes, capped at 4, against 7 of 8 copies.
    assert step_mod.remote_share(v3, 64, 8) == pytest.approx(0.5)
    assert step_mod.remote_share(unlimited, 64, 8) is None
    assert step_mod.remote_share(v3, 8, 8) is None  # inside one node: nothing to limit
    assert _ep_comm(v3, 64) < 0.7 * _ep_comm(unlimited, 64)
    assert _ep_comm(v3, 8) == pytest.approx(_ep_comm(unlimited, 8))


def test_token_permutation_is_memory_traffic_of_every_routed_copy() -> None:
    m = PRESETS["qwen3-30b-a3b"]
    # Megatron-Core's dispatcher: 14 h bytes per routed copy and 2 h per token, forward.
    assert step_mod.permutation_bytes_per_token(m) == (14 * 8 + 2) * m.hidden
    assert step_mod.permutation_bytes_per_token(PRESETS["llama3-8b"]) == 0.0
    cluster = load_cluster("dgx-h100")
    cfg = ParallelConfig(tp=1, dp=8, ep=8, micro_batch=1, zero=1, recompute="none")
    with_it = estimate_step(m, cluster, 8, 64, 4096, cfg).step_time_s
    # The constants live with the layer model (gpuyard.fabric.step_layer), which reads them.
    orig = (step_layer.PERMUTE_BYTES_PER_COPY_H, step_layer.PERMUTE_BYTES_PER_TOKEN_H)
    step_mod.clear_caches()
    try:
        step_layer.PERMUTE_BYTES_PER_COPY_H, step_layer.PERMUTE_BYTES_PER_TOKEN_H = 0, 0
        without = estimate_step(m, cluster, 8, 64, 4096, cfg).step_time_s
    finally:
        step_layer.PERMUTE_BYTES_PER_COPY_H, step_layer.PERMUTE_BYTES_PER_TOKEN_H = orig
        step_mod.clear_caches()
    assert with_it > without * 1.005


def test_route_nodes_needs_a_mixture_of_experts_model(tmp_path: Path) -> None:
    bad = tmp_path / "dense.yaml"
    bad.write_text(
        "layers: 4\nhidden: 512\nheads: 8\nffn_hidden: 256\nvocab: 1000\nseq_len: 512\nroute_nodes: 2\n"
    )
    with pytest.raises(ConfigError, match="route_nodes"):
        load_model(str(bad))


def _layer(model: object, stack: object, ep: int, cluster: object = None) -> step_layer._Layer:
    return step_layer._layer_times_cached(
        model,  # type: ignore[arg-type]
        cluster or load_cluster("dgx-h100"),  # type: ignore[arg-type]
        4096,
        1,
        1,
        1,
        "none",
        False,
        ep,
        "bf16",
        stack,  # type: ignore[arg-type]
    )


def test_a_dropless_megatron_moe_layer_waits_on_the_host_to_launch_its_expert_gemms() -> None:
    from gpuyard.fabric.stacks import STACKS

    synced = STACKS["megatron-lm"]
    assert synced.moe_host_sync and STACKS["nemo"].moe_host_sync and not STACKS["torchtitan"].moe_host_sync
    free = replace(synced, moe_host_sync=False)
    m = PRESETS["qwen3-30b-a3b"]  # 128 experts of 768: at ep 1 every expert's GEMMs are launched here
    gap = {ep: _layer(m, synced, ep).fwd - _layer(m, free, ep).fwd for ep in (1, 8)}
    launch = step_layer.GPU_DISPATCH_US * 1e-6
    # At most the launches of 2 GEMMs per local expert, and something where they outlast the GEMMs.
    assert 0 < gap[1] <= step_layer.EXPERT_GEMMS_FWD * 128 * launch
    assert 0 <= gap[8] < gap[1]  # 16 local experts: fewer launches, and larger GEMMs to hide them
    # The backward keeps the forward's counts: no sync, so the same time either way.
    assert _layer(m, synced, 1).bwd == _layer(m, free, 1).bwd
    # A token-dropping router has static shapes (no counts to copy), and a dense model no experts.
    padded = replace(m, capacity_factor=1.25)
    assert _layer(padded, synced, 1).fwd == _layer(padded, free, 1).fwd
    dense = PRESETS["llama3-8b"]
    assert _layer(dense, synced, 1) == _layer(dense, free, 1)


def test_kernel_dispatch_is_the_calibrations_else_the_measured_gpu_figure() -> None:
    h100 = load_cluster("dgx-h100")
    assert step_layer.dispatch_us(h100) == step_layer.GPU_DISPATCH_US
    measured = h100.model_validate(
        {**h100.model_dump(), "compute": {**h100.model_dump()["compute"], "op_overhead_us": 1000.0}}
    )
    assert step_layer.dispatch_us(measured) == 1000.0
    assert step_layer.dispatch_us(load_cluster("tpu-v5p-512")) == 0.0  # one compiled XLA program
    # At 1 ms per launch the host sets the pace: the backward is its launches, expert GEMMs included.
    from gpuyard.fabric.stacks import STACKS

    layer = _layer(PRESETS["qwen3-30b-a3b"], STACKS["torchtitan"], 8, measured)
    kernels = 2 * step_layer.KERNELS_PER_LAYER_FWD + step_layer.EXPERT_GEMMS_BWD * 128 / 8
    assert layer.bwd == pytest.approx(kernels * 1e-3)


def test_expert_gemms_slow_per_token_as_each_expert_sees_fewer_tokens() -> None:
    """Per-expert GEMM efficiency falls with the rows each expert gets (the device's GEMM shape law)."""
    from gpuyard.fabric.stacks import STACKS

    # torchtitan (no host sync) on an H100 whose launches cost next to nothing: only the GEMMs' shapes differ.
    h100 = load_cluster("dgx-h100")
    data = h100.model_dump()
    quiet = h100.model_validate({**data, "compute": {**data["compute"], "op_overhead_us": 1e-6}})
    m = PRESETS["qwen3-30b-a3b"]
    per_token = {}
    for ep in (1, 8):  # each token's 8 routed copies land on 128 or 16 local experts: same FLOPs per GPU
        per_token[ep] = _layer(m, STACKS["torchtitan"], ep, quiet).fwd
    # ep 8: each local expert sees 8x the rows, so its GEMMs run nearer the large-GEMM efficiency.
    assert per_token[8] < per_token[1]
    # The same FLOPs split over twice the experts of half the width take longer still.
    finer = replace(m, experts=2 * m.experts, top_k=2 * m.top_k, ffn_hidden=m.ffn_hidden // 2)
    # (the router, h x experts, doubles: under 1% of the layer)
    assert finer.active_layer_params == pytest.approx(m.active_layer_params, rel=1e-2)
    assert _layer(finer, STACKS["torchtitan"], 8, quiet).fwd > per_token[8]


def test_moe_gaps_spread_a_rows_miss_over_its_micro_batches_layers_and_local_experts() -> None:
    from gpuyard.fabric.accuracy import RunError, moe_gaps
    from gpuyard.fabric.published.runs import load_runs

    runs = {r.id: r for r in load_runs()}
    moe = runs["megatron-bridge-25.11/dgx-b200/qwen3_30b_a3b-8gpus-fp8mx"]  # 48 layers, pp 1, ep 8
    dense = next(r for r in runs.values() if r.model == "llama2-70b")
    gaps = moe_gaps([RunError(moe, 20.0, 12.0), RunError(dense, 10.0, 9.0)])
    assert [g.error.run.id for g in gaps] == [moe.id]  # dense rows have no experts to spread over
    (g,) = gaps
    assert g.micro_batches == 512 // (8 * 1) and g.layers_per_stage == 48 and g.local_experts == 128 // 8
    assert g.tokens_per_micro_batch == 4096
    assert g.per_layer_s * g.micro_batches * g.layers_per_stage == pytest.approx(8.0)
    assert g.per_local_expert_s == pytest.approx(g.per_layer_s / 16)
    # Predicted slow: the gap is negative.
    assert moe_gaps([RunError(moe, 10.0, 12.0)])[0].per_layer_s < 0


def test_transformer_engine_stacks_pay_the_multi_stream_issue_time_per_expert_gemm() -> None:
    from gpuyard.fabric.stacks import STACKS, TE_MULTI_STREAM_GEMM_US

    nemo = STACKS["nemo"]
    assert nemo.expert_gemm_issue_us == STACKS["megatron-lm"].expert_gemm_issue_us == TE_MULTI_STREAM_GEMM_US
    assert STACKS["torchtitan"].expert_gemm_issue_us == 0.0  # torch._grouped_mm: one kernel, a launch
    launch_only = replace(nemo, expert_gemm_issue_us=0.0)
    m = PRESETS["qwen3-30b-a3b"]  # 16 local experts at ep 8, GEMMs of 512 rows at micro-batch 1
    te, plain = _layer(m, nemo, 8), _layer(m, launch_only, 8)
    issue = (TE_MULTI_STREAM_GEMM_US - step_layer.GPU_DISPATCH_US) * 1e-6
    # Forward: the sync leaves the expert GEMMs' issue on the critical path, up to its whole extra time.
    assert 0 < te.fwd - plain.fwd <= step_layer.EXPERT_GEMMS_FWD * 16 * issue + 1e-12
    # Backward: the host-bound max grows by at most the extra issue time (and never shrinks).
    assert 0 <= te.bwd - plain.bwd <= step_layer.EXPERT_GEMMS_BWD * 16 * issue + 1e-12
    # Expert GEMMs long enough to hide it (DeepSeek-V3 at ep 64: 4 local experts of 1,024 rows): no change.
    big = PRESETS["deepseek-v3"]
    assert _layer(big, nemo, 64) == _layer(big, replace(nemo, expert_gemm_issue_us=0.0), 64)
    # A dense model has no expert GEMMs, and a TPU no host launches: nothing changes.
    dense = PRESETS["llama3-8b"]
    assert _layer(dense, nemo, 1) == _layer(dense, launch_only, 1)
    tpu = load_cluster("tpu-v5p-512")
    assert _layer(m, nemo, 8, tpu) == _layer(m, launch_only, 8, tpu)
    with pytest.raises(ValueError, match="expert_gemm_issue_us"):
        replace(nemo, expert_gemm_issue_us=-1.0)


def test_hybridep_prices_each_token_once_per_destination_gpu_at_its_measured_bandwidth() -> None:
    from gpuyard.fabric.stacks import STACKS

    # One copy per destination GPU: top-8 over 8 GPUs reaches 5.25 of them on average, over 64 GPUs 7.6.
    one = step_layer.hybridep_time(4096, 7168, 8, 8)
    d8, c8 = step_layer.HYBRIDEP_GBPS[8]
    copies = 8 * (1 - (7 / 8) ** 8)
    assert one == pytest.approx(4096 * copies * 7168 * 2 * (1 / (d8 * 1e9) + 1 / (c8 * 1e9)))
    assert step_layer.hybridep_time(4096, 7168, 8, 1) == 0.0
    # Wider groups: more destinations per token and a lower measured bandwidth, never faster.
    times = [step_layer.hybridep_time(4096, 7168, 8, ep) for ep in (8, 16, 32, 64, 128)]
    assert times == sorted(times) and times[0] < times[-1]
    # In a step: GB200 NVL72 at ep 32 is slower under Hybrid-EP than the NVLink 5 link model prices...
    nemo = STACKS["nemo"]
    hep = replace(nemo, moe_dispatcher="hybridep")
    m = PRESETS["qwen3-235b-a22b"]
    gb200 = load_cluster("gb200-nvl72")
    assert _layer(m, hep, 32, gb200).ep_comm > _layer(m, nemo, 32, gb200).ep_comm
    # ...and never faster than that link model, nor anything but the all-to-all changes.
    for ep in (8, 16, 32, 64):
        a, b = _layer(m, hep, ep, gb200), _layer(m, nemo, ep, gb200)
        assert a.ep_comm >= b.ep_comm and (a.fwd, a.bwd) == (b.fwd, b.bwd)
    with pytest.raises(ValueError, match="moe_dispatcher"):
        replace(nemo, moe_dispatcher="deepep-v9")


def test_a_published_row_can_name_its_moe_dispatcher() -> None:
    from gpuyard.fabric.accuracy import predict_at
    from gpuyard.fabric.published.runs import load_runs
    from gpuyard.fabric.stacks import STACKS

    runs = {r.id: r for r in load_runs()}
    row = runs["megatron-bridge-25.11/dgx-gb200/qwen3_235b_a22b-256gpus-bf16"]
    assert row.moe_dispatcher == "hybridep"
    assert runs["megatron-bridge-25.11/dgx-b200/qwen3_30b_a3b-8gpus-fp8mx"].moe_dispatcher is None
    plain = row.model_copy(update={"moe_dispatcher": None})
    assert predict_at(row, STACKS["nemo"], 0.6) > predict_at(plain, STACKS["nemo"], 0.6)
