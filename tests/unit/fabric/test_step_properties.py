"""Properties of the step model over many random layouts (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, estimate_step

pytestmark = pytest.mark.unit

CLUSTERS = {name: load_cluster(name) for name in ("dgx-a100", "dgx-h100", "gb200-nvl72", "pcie-l40s")}


@st.composite
def layouts(draw: st.DrawFn) -> tuple[str, str, int, int, ParallelConfig]:
    model = draw(st.sampled_from(["llama3-8b", "llama3-70b", "gpt3-175b", "mixtral-8x7b"]))
    spec = PRESETS[model]
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if spec.heads % t == 0 and spec.kv_heads % t == 0]))
    pp = draw(st.sampled_from([1, 2, 4, 8]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 4, 8]))
    mb = draw(st.sampled_from([1, 2]))
    m = draw(st.sampled_from([8, 16]))
    v = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if dp % e == 0])) if spec.is_moe else 1
    cfg = ParallelConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        micro_batch=mb,
        virtual_stages=v,
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        zero=draw(st.integers(0, 3)),
        sequence_parallel=tp > 1 and draw(st.booleans()),
        ep=ep,
    )
    return model, draw(st.sampled_from(sorted(CLUSTERS))), cfg.gpus, dp * mb * m, cfg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_step_time_adds_up_and_figures_agree(case: tuple[str, str, int, int, ParallelConfig]) -> None:
    model_name, cluster_name, gpus, batch, cfg = case
    model, cluster = PRESETS[model_name], CLUSTERS[cluster_name]
    est = estimate_step(model, cluster, gpus, batch, model.seq_len, cfg)
    b = est.breakdown
    assert min(b.compute_s, b.bubble_s, b.exposed_comm_s, b.tp_comm_s, b.pp_comm_s, b.dp_comm_s) >= 0
    assert est.step_time_s == pytest.approx(b.compute_s + b.bubble_s + b.exposed_comm_s)
    assert b.exposed_comm_s <= b.tp_comm_s + b.cp_comm_s + b.pp_comm_s + b.dp_comm_s + b.ep_comm_s + 1e-9
    assert est.tokens_per_s == pytest.approx(batch * model.seq_len / est.step_time_s)
    assert est.hardware_tflops_per_gpu >= est.model_tflops_per_gpu * (1 - 1e-9)
    assert est.fits == (est.memory_gib_per_gpu * 2**30 <= cluster.device_memory_bytes)
    if cfg.pp == 1:
        assert b.bubble_s == 0 and b.pp_comm_s == 0


def _llama70b_fsdp(cluster_name: str, cp: int, mb: int) -> float:
    cfg = ParallelConfig(tp=1, pp=1, dp=512 // cp, cp=cp, micro_batch=mb, recompute="selective", zero=3)
    return estimate_step(PRESETS["llama3-70b"], load_cluster(cluster_name), 512, 1024, 8192, cfg).step_time_s


def test_context_parallelism_costs_something_at_equal_tokens_per_gpu() -> None:
    # cp=2/mb=1, cp=4/mb=2 and cp=8/mb=4 give every GPU the same 4,096 tokens per micro-batch and the same
    # sharding group; more ring steps on shorter K/V blocks must make the step longer, not tie it.
    times = [_llama70b_fsdp("dgx-h100", cp, mb) for cp, mb in ((2, 1), (4, 2), (8, 4))]
    assert times[0] < times[1] < times[2]


def test_hidden_fsdp_traffic_still_slows_the_step() -> None:
    # Halving the NIC bandwidth doubles the (mostly overlapped) ZeRO-3 traffic; overlap is not free, so
    # the step must get longer even where the gathers stay hidden behind compute.
    base = CLUSTERS["dgx-h100"]
    slow = base.model_copy(update={"name": "slow-nics", "nic": base.nic.model_copy(update={"gbps": 200})})
    cfg = ParallelConfig(tp=1, pp=1, dp=256, cp=2, micro_batch=1, recompute="selective", zero=3)
    fast_est = estimate_step(PRESETS["llama3-70b"], base, 512, 1024, 8192, cfg)
    slow_est = estimate_step(PRESETS["llama3-70b"], slow, 512, 1024, 8192, cfg)
    assert slow_est.breakdown.dp_comm_s > 1.5 * fast_est.breakdown.dp_comm_s
    assert slow_est.step_time_s > fast_est.step_time_s
    assert slow_est.breakdown.exposed_comm_s > fast_est.breakdown.exposed_comm_s


def test_float8_factors_reproduce_torchaos_published_ratios() -> None:
    # torchao float8 README (H100, torchtitan Llama 3 8B, 8 GPUs, FSDP2, torch.compile, per-op SAC, batch
    # 1 x 8192): bf16 6,150 tokens/s, tensorwise 7,689.5, rowwise 6,768. The fp8 GEMM factor and the
    # rowwise factor are set from these, on an H100 at its measured bf16 GEMM efficiency (0.72), not on
    # the corpus-fitted preset.
    from dataclasses import replace

    from gpuyard.fabric.accuracy import MEASURED_GEMM_EFFICIENCY
    from gpuyard.fabric.cluster import Cluster
    from gpuyard.fabric.stacks import get_stack

    model, titan = PRESETS["llama3-8b"], get_stack("torchtitan")
    data = load_cluster("dgx-h100").model_dump()
    data["compute"]["gemm_efficiency"] = MEASURED_GEMM_EFFICIENCY["hopper"]
    h100 = Cluster.model_validate(data)
    rowwise = replace(titan, fp8_recipe="rowwise")

    def step(precision: str, stack: object) -> float:
        cfg = ParallelConfig(
            dp=8, micro_batch=1, zero=3, recompute="selective", precision=precision, stack="torchtitan",
            compiled=True,
        )  # fmt: skip
        return estimate_step(model, h100, 8, 8, 8192, cfg, stack=stack).step_time_s  # type: ignore[arg-type]

    assert step("bf16", titan) / step("fp8", titan) == pytest.approx(7689.5 / 6150, rel=0.005)
    assert step("fp8", rowwise) / step("fp8", titan) == pytest.approx(7689.5 / 6768, rel=0.005)
    # The recipe only concerns fp8 linears: a bf16 run is the same under either profile.
    assert step("bf16", rowwise) == step("bf16", titan)
    with pytest.raises(ValueError, match="fp8_recipe"):
        replace(titan, fp8_recipe="blockwise")
    # A calibration that measured fp8 GEMMs replaces the factor: fp8 at its measured efficiency.
    data["compute"]["dtype_efficiency"] = {"fp8": 0.72}
    measured = Cluster.model_validate(data)
    cfg = ParallelConfig(dp=8, micro_batch=1, zero=3, recompute="selective", precision="fp8")
    faster = estimate_step(model, measured, 8, 8, 8192, cfg).step_time_s
    assert faster < estimate_step(model, h100, 8, 8, 8192, cfg).step_time_s


def test_the_corpus_names_the_rowwise_rows_it_has() -> None:
    from gpuyard.fabric.published.runs import load_runs

    rowwise = [r for r in load_runs() if r.fp8_recipe == "rowwise"]
    assert len(rowwise) == 4 and all("rowwise" in r.id and r.precision == "fp8" for r in rowwise)


def test_memory_bound_kernels_run_at_their_measured_share_of_the_datasheet() -> None:
    # An H100 streamed 2.92-3.02 of 3.35 TB/s and ran eager norm/GELU/dropout/add at 1.91-1.98 TB/s
    # (BENCHMARKS.md): memory-bound terms use those shares where nothing was measured on the cluster.
    from gpuyard.fabric.cluster import GPU_EAGER_ELEMENTWISE_SHARE, GPU_STREAM_SHARE, Cluster
    from gpuyard.fabric.stacks import get_stack

    h100 = load_cluster("dgx-h100")
    assert h100.memory_bound_bw_GBps() == pytest.approx(3350 * GPU_STREAM_SHARE)
    assert h100.memory_bound_bw_GBps(eager_elementwise=True) == pytest.approx(
        3350 * GPU_EAGER_ELEMENTWISE_SHARE
    )
    data = h100.model_dump()
    # A datasheet figure for the cluster's own parts (torchtitan's 2.4 TB/s HBM2e H100s) takes the shares too.
    data["compute"]["datasheet_memory_bw_GBps"] = 2400.0
    hbm2e = Cluster.model_validate(data)
    assert hbm2e.memory_bound_bw_GBps() == pytest.approx(2400 * GPU_STREAM_SHARE)
    # A calibration's measured rate replaces both shares; a TPU (XLA fuses its operators) keeps its figure.
    data["compute"]["memory_bw_GBps"] = 1950.0
    measured = Cluster.model_validate(data)
    assert measured.memory_bound_bw_GBps() == measured.memory_bound_bw_GBps(True) == 1950.0
    tpu = load_cluster("tpu-v5p-512")
    assert tpu.memory_bound_bw_GBps(True) == tpu.memory_bw_GBps
    # An eager stack's layer is slower than the same stack compiled, and a fused stack's is not slowed
    # by the eager share: only the memory-bound operators differ.
    model = PRESETS["llama3-8b"]
    titan = get_stack("torchtitan")
    assert titan.eager_elementwise and not get_stack("megatron-lm").eager_elementwise

    def step(stack: str, compiled: bool, cluster: Cluster) -> float:
        cfg = ParallelConfig(dp=8, micro_batch=1, zero=3, stack=stack, compiled=compiled)
        return estimate_step(model, cluster, 8, 8, 8192, cfg).step_time_s

    eager, compiled = step("torchtitan", False, h100), step("torchtitan", True, h100)
    assert eager > compiled
    # A calibration that measured the eager rate prices a fused stack's operators at it too.
    data["compute"]["memory_bw_GBps"] = 3350 * GPU_EAGER_ELEMENTWISE_SHARE
    slow = Cluster.model_validate(data)
    assert step("megatron-lm", False, slow) > step("megatron-lm", False, h100)
