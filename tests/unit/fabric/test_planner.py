"""Model shapes, the step model's structure, the planner's search and `gpuyard plan`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.errors import CapacityError, ConfigError, NotFoundError
from gpuyard.fabric.models import PRESETS, load_model
from gpuyard.fabric.planner import Knobs, plan
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, StepEstimate, estimate_step

pytestmark = pytest.mark.unit

PLAN_FIELDS = {
    "tp",
    "pp",
    "dp",
    "cp",
    "micro_batch",
    "virtual_stages",
    "recompute",
    "zero",
    "sequence_parallel",
    "step_time_s",
    "tokens_per_s",
    "model_tflops_per_gpu",
    "hardware_tflops_per_gpu",
    "mfu",
    "memory_gib_per_gpu",
    "fits",
    "breakdown",
}
BREAKDOWN = {"compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s", "exposed_comm_s"}


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("gpt3-175b", 175),
        ("llama3-8b", 8.0),
        ("llama3-70b", 70.6),
        ("llama3-405b", 405.8),
        ("bloom-176b", 176),
    ],
)
def test_preset_parameter_counts_match_the_papers(name: str, billions: float) -> None:
    assert PRESETS[name].params / 1e9 == pytest.approx(billions, rel=0.02)


def test_model_file_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "layers: 4\nhidden: 256\nheads: 8\nkv_heads: 2\nffn_hidden: 1024\nvocab: 1000\nseq_len: 128\n"
    )
    spec = load_model(str(path))
    assert (spec.name, spec.kv_heads, spec.head_dim) == ("tiny", 2, 32)
    path.write_text("layers: 4\nhidden: 250\nheads: 8\nffn_hidden: 1024\nvocab: 1000\nseq_len: 128\n")
    with pytest.raises(ConfigError, match="heads"):
        load_model(str(path))
    path.write_text("layers: 0\nhidden: 256\nheads: 8\nffn_hidden: 1024\nvocab: 1000\nseq_len: 128\n")
    with pytest.raises(ConfigError, match="layers"):
        load_model(str(path))
    with pytest.raises(NotFoundError, match="llama3-8b"):
        load_model("no-such-model")


def _step(**kw: object) -> StepEstimate:
    cfg = ParallelConfig(**{"tp": 8, "pp": 8, "dp": 16, "micro_batch": 1, "zero": 1, **kw})  # type: ignore[arg-type]
    return estimate_step(PRESETS["gpt3-175b"], load_cluster("dgx-a100"), 1024, 1536, 2048, cfg)


def test_recomputation_trades_time_for_memory() -> None:
    none, full = _step(recompute="none"), _step(recompute="full")
    assert full.memory_gib_per_gpu < none.memory_gib_per_gpu
    assert full.step_time_s > none.step_time_s
    assert full.hardware_tflops_per_gpu > full.model_tflops_per_gpu


def test_sequence_parallel_and_zero_stages_cut_memory() -> None:
    mem = [_step(zero=z).memory_gib_per_gpu for z in (0, 1, 2, 3)]
    assert mem == sorted(mem, reverse=True) and len(set(mem)) == 4
    assert _step(sequence_parallel=True).memory_gib_per_gpu < _step().memory_gib_per_gpu


def test_interleaving_shrinks_the_bubble() -> None:
    one, four = _step(), _step(virtual_stages=4)
    assert four.breakdown.bubble_s == pytest.approx(one.breakdown.bubble_s / 4, rel=0.05)


def test_step_time_is_compute_plus_bubble_plus_exposed_comm() -> None:
    est = _step(recompute="selective", sequence_parallel=True)
    b = est.breakdown
    assert est.step_time_s == pytest.approx(b.compute_s + b.bubble_s + b.exposed_comm_s)
    assert b.exposed_comm_s <= b.tp_comm_s + b.pp_comm_s + b.dp_comm_s + b.cp_comm_s + 1e-9


def test_efficiency_falls_for_small_matrices() -> None:
    cluster = load_cluster("dgx-h100")
    cfg = ParallelConfig(tp=8, dp=1, micro_batch=1, zero=1)
    small = estimate_step(PRESETS["llama3-8b"], cluster, 8, 8, 8192, cfg)
    large = estimate_step(PRESETS["llama3-405b"], cluster, 8, 8, 8192, cfg)
    assert small.hardware_tflops_per_gpu < large.hardware_tflops_per_gpu * 0.95


def test_planner_ranks_fitting_plans_and_holds_fixed_knobs() -> None:
    cluster = load_cluster("dgx-a100")
    result = plan(PRESETS["gpt3-175b"], cluster, 1024, 1536, knobs=Knobs(tp=8, recompute="selective"), top=5)
    assert len(result.plans) == 5 and result.fitting <= result.considered
    speeds = [p.tokens_per_s for p in result.plans]
    assert speeds == sorted(speeds, reverse=True)
    for p in result.plans:
        assert p.fits and p.config.tp == 8 and p.config.recompute == "selective" and p.config.gpus == 1024
        assert p.memory_gib_per_gpu * 2**30 <= cluster.device_memory_bytes
    assert "MFU" in result.explain()


@pytest.mark.parametrize(
    ("knobs", "error", "words"),
    [
        (Knobs(tp=7), ConfigError, "does not divide the 96 heads"),
        (Knobs(tp=8, pp=3), ConfigError, "not divisible"),
        (Knobs(cp=3), ConfigError, "divisible"),
        (Knobs(recompute="some"), ConfigError, "recompute"),
        (Knobs(tp=0), ConfigError, "tp must be at least 1, got 0"),
        (Knobs(virtual_stages=0), ConfigError, "virtual-stages must be at least 1"),
        (Knobs(pp=-2), ConfigError, "pp must be at least 1, got -2"),
        (Knobs(zero=7), ConfigError, "zero must be 0, 1, 2 or 3"),
    ],
)
def test_planner_rejects_bad_knobs(knobs: Knobs, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        plan(PRESETS["gpt3-175b"], load_cluster("dgx-a100"), 64, 64, knobs=knobs)


def test_a_plan_that_cannot_fit_says_how_much_it_needs() -> None:
    fixed = Knobs(
        tp=1, pp=1, cp=1, micro_batch=1, virtual_stages=1, recompute="none", zero=0, sequence_parallel=False
    )
    with pytest.raises(CapacityError, match=r"fixed plan needs .* GiB"):
        plan(PRESETS["gpt3-175b"], load_cluster("dgx-a100"), 8, 8, knobs=fixed)
    with pytest.raises(CapacityError, match="none of"):
        plan(PRESETS["gpt3-175b"], load_cluster("dgx-a100"), 8, 8)


def test_cli_plan_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--model",
        "gpt3-175b",
        "--cluster",
        "dgx-a100",
        "--gpus",
        "1024",
        "--global-batch",
        "1536",
        "--top",
        "3",
        "--json",
    ]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["plans"]) == 3
    for p in doc["plans"]:
        assert set(p) >= PLAN_FIELDS and set(p["breakdown"]) >= BREAKDOWN
        assert p["tp"] * p["pp"] * p["dp"] * p["cp"] == 1024


@pytest.mark.parametrize("extra", [["--model", "no-such-model"], ["--model", "gpt3-175b", "--tp", "7"]])
def test_cli_plan_bad_input_is_one_line_and_exit_2(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "8", *extra])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_mixture_of_experts_counts_active_params_and_expert_parallelism() -> None:
    mixtral = PRESETS["mixtral-8x7b"]
    # Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Jiang et al. 2024).
    assert mixtral.params / 1e9 == pytest.approx(46.7, rel=0.01)
    active = mixtral.layers * mixtral.active_layer_params + mixtral.embedding_params
    assert active / 1e9 == pytest.approx(12.9, rel=0.01)
    cluster = load_cluster("dgx-h100")

    def est(ep: int) -> StepEstimate:
        cfg = ParallelConfig(tp=1, pp=1, dp=64, micro_batch=1, zero=1, ep=ep)
        return estimate_step(mixtral, cluster, 64, 256, 4096, cfg)

    one, eight = est(1), est(8)
    assert eight.memory_gib["weights"] < one.memory_gib["weights"] / 4
    assert one.breakdown.ep_comm_s == 0 and eight.breakdown.ep_comm_s > 0
    result = plan(mixtral, cluster, 64, 256, knobs=Knobs(tp=1, pp=1, cp=1), top=50)
    assert {p.config.ep for p in result.plans} > {1}


def test_expert_parallel_on_a_dense_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="expert-parallel"):
        plan(PRESETS["gpt3-175b"], load_cluster("dgx-a100"), 64, 64, knobs=Knobs(ep=2))
    with pytest.raises(ConfigError, match="expert-parallel"):
        estimate_step(
            PRESETS["gpt3-175b"],
            load_cluster("dgx-a100"),
            64,
            64,
            2048,
            ParallelConfig(tp=8, pp=8, dp=1, ep=2),
        )


def _fsdp_70b(cp: int, micro_batch: int) -> StepEstimate:
    cfg = ParallelConfig(dp=512 // cp, cp=cp, micro_batch=micro_batch, recompute="selective", zero=3)
    return estimate_step(PRESETS["llama3-70b"], load_cluster("dgx-h100"), 512, 1024, 8192, cfg)


def test_explain_names_what_separates_near_tied_plans() -> None:
    from dataclasses import replace

    from gpuyard.fabric.planner import PlanResult

    top, other = _fsdp_70b(2, 1), _fsdp_70b(4, 2)
    # Same throughput to 4 digits: a tie, broken by memory, and the note says why the two are equal.
    tied = replace(other, step_time_s=top.step_time_s, tokens_per_s=top.tokens_per_s)
    text = PlanResult([top, tied], considered=2, fitting=2).explain()
    assert "ties with the next plan" in text and "cp 2 vs 4" in text and "micro-batch 1 vs 2" in text
    assert "same tokens per micro-batch" in text
    # 0.3% apart: not a tie, but the note must not claim a meaningful lead either.
    close = replace(other, step_time_s=top.step_time_s * 1.003, tokens_per_s=top.tokens_per_s / 1.003)
    text = PlanResult([top, close], considered=2, fitting=2).explain()
    assert "only 0.3% faster" in text and "ties" not in text
    # A plan that differs in recomputation does not get the "same work" explanation.
    rc = replace(top, config=replace(top.config, recompute="full"), tokens_per_s=top.tokens_per_s / 1.003)
    text = PlanResult([top, rc], considered=2, fitting=2).explain()
    assert "recompute selective vs full" in text and "same tokens" not in text


def test_the_stack_profile_is_held_and_changes_the_prediction() -> None:
    from gpuyard.fabric.models import PRESETS
    from gpuyard.fabric.planner import Knobs, plan
    from gpuyard.fabric.presets import load_cluster

    model, cluster = PRESETS["llama3-8b"], load_cluster("dgx-h100")
    fixed = {"tp": 1, "pp": 1, "cp": 1, "micro_batch": 1, "virtual_stages": 1, "recompute": "none", "zero": 3}
    fused = plan(model, cluster, 8, 16, None, Knobs(**fixed, sequence_parallel=False), 1).plans[0]
    eager = plan(model, cluster, 8, 16, None, Knobs(**fixed, sequence_parallel=False, stack="torchtitan"), 1)
    assert fused.config.stack == "megatron-lm" and eager.plans[0].config.stack == "torchtitan"
    # torchtitan's eager norms/RoPE/SwiGLU and FA2 kernels cost time that Megatron's fused ones do not.
    assert eager.plans[0].step_time_s > fused.step_time_s


@pytest.mark.parametrize("seq_len", [0, -5])
def test_a_sequence_length_below_one_is_refused_not_planned(seq_len: int) -> None:
    """--seq-len -5 planned layouts with negative tokens/s; 0 silently took the model's default."""
    with pytest.raises(ConfigError, match=f"sequence length must be at least 1, got {seq_len}"):
        plan(PRESETS["llama3-8b"], load_cluster("dgx-h100"), 64, 512, seq_len=seq_len)
    cfg = ParallelConfig(tp=8, dp=8, micro_batch=1)
    with pytest.raises(ConfigError, match="sequence length and global batch must be at least 1"):
        estimate_step(PRESETS["llama3-8b"], load_cluster("dgx-h100"), 64, 512, seq_len, cfg)
