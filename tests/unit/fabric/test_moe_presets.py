"""DeepSeek-V3 (MLA, leading dense layers, 1 shared + 256 routed experts) and Qwen3-MoE presets: their
published parameter counts, the step model's view of them, and `gpuyard plan` on them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gpuyard.cli.main import app, main
from gpuyard.fabric.hf_config import spec_from_hf_config
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, _layer_times

pytestmark = pytest.mark.unit

# Published totals and active parameters: DeepSeek-V3 report (671B, 37B active per token), Qwen3 report
# Table 2 (235B-A22B, 30B-A3B: 30.5B total, 3.3B active).
PUBLISHED = {
    "deepseek-v3": (671e9, 37e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_their_published_parameter_counts(name: str) -> None:
    model = PRESETS[name]
    total, active = PUBLISHED[name]
    assert model.params == pytest.approx(total, rel=0.01)
    assert model.active_params == pytest.approx(active, rel=0.03)


def test_attention_projections_cost_two_flops_per_parameter_and_token() -> None:
    # The GEMMs the step model runs for a layer's attention and the parameters it counts must agree,
    # for MLA (through its latents), for head_dim x heads != hidden (Qwen3) and for plain GQA.
    for name in ("deepseek-v3", "qwen3-235b-a22b", "llama3-70b"):
        model = PRESETS[name]
        flops = sum(2 * m * n * k for m, n, k in model.attention_gemms(1.0, 1))
        assert flops == pytest.approx(2 * model.attention_params), name
    v3 = PRESETS["deepseek-v3"]
    assert v3.attention_width == 128 * (128 + 64 + 128) / 2  # scores on 192-wide heads, values on 128


def test_leading_dense_layers_average_into_every_layer() -> None:
    v3 = PRESETS["deepseek-v3"]
    (dense_share, dense), (moe_share, moe) = v3.parts()
    assert (dense_share, moe_share) == pytest.approx((3 / 61, 58 / 61))
    assert not dense.is_moe and dense.ffn_hidden == 18432 and moe.ffn_hidden == 2048
    cluster = load_cluster("dgx-h100")
    cfg = ParallelConfig(tp=1, dp=64, ep=8, micro_batch=1, zero=1, recompute="full")
    mixed = _layer_times(v3, cluster, 4096, cfg).fwd
    parts = dense_share * _layer_times(dense, cluster, 4096, cfg).fwd
    parts += moe_share * _layer_times(moe, cluster, 4096, cfg).fwd
    assert mixed == pytest.approx(parts)
    # DeepSeek sized them alike: a dense 18432-wide FFN has the parameters (FLOPs per token) of the
    # 1 shared + 8 routed 2048-wide experts a token passes through in an MoE layer.
    assert dense.ffn_params == (moe.top_k + moe.shared_experts) * moe.ffn_params
    # Expert parallelism adds the MoE layers' all-to-alls; the dense layers have none.
    assert (
        _layer_times(dense, cluster, 4096, cfg).ep_comm == 0 < _layer_times(moe, cluster, 4096, cfg).ep_comm
    )


def test_hugging_face_configs_map_to_the_presets() -> None:
    v3 = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 129280, "tie_word_embeddings": False, "max_position_embeddings": 163840,
        "attention_dropout": 0.0, "n_group": 8, "topk_group": 4,
    }  # fmt: skip
    qwen = {
        "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
        "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False, "attention_dropout": 0.0,
    }  # fmt: skip
    for doc, preset in ((v3, "deepseek-v3"), (qwen, "qwen3-235b-a22b")):
        spec = spec_from_hf_config(doc, name=preset, seq_len=4096)
        assert spec == PRESETS[preset]
    with pytest.raises(Exception, match="only some layers"):
        spec_from_hf_config({**qwen, "decoder_sparse_step": 2})
    # Group-limited routing is node-limited where groups divide the experts; nonsense is ignored.
    assert spec_from_hf_config({**v3, "topk_group": 8}).route_nodes == 0
    assert spec_from_hf_config({**v3, "n_group": "8"}).route_nodes == 0
    assert spec_from_hf_config({**v3, "n_group": 7}).route_nodes == 0
    # Dropout as the config states it (None: the training stack's default).
    assert spec_from_hf_config({k: v for k, v in qwen.items() if k != "attention_dropout"}).dropout is None
    assert spec_from_hf_config({**qwen, "attention_dropout": 0.1}).dropout == 0.1
    with pytest.raises(Exception, match="dropout rates"):
        spec_from_hf_config({**qwen, "attention_dropout": 1.5})


def test_plan_accepts_deepseek_v3_at_its_published_layout_and_counts_active_flops(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # DeepSeek-V3's training layout (report section 3.2): 16-way pipeline, 64-way expert parallelism,
    # ZeRO-1 data parallelism, no tensor parallelism, on 2048 GPUs (H800; the H100 preset here).
    args = [
        "plan", "--model", "deepseek-v3", "--cluster", "dgx-h100", "--gpus", "2048",
        "--global-batch", "4096", "--tp", "1", "--pp", "16", "--cp", "1", "--ep", "64",
        "--micro-batch", "1", "--virtual-stages", "1", "--recompute", "full", "--zero", "1",
        "--no-sequence-parallel", "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    (plan,) = doc["plans"]
    assert (plan["pp"], plan["ep"], plan["dp"], plan["fits"]) == (16, 64, 128, True)
    assert plan["breakdown"]["ep_comm_s"] > 0
    v3 = PRESETS["deepseek-v3"]
    tokens = 4096 * 4096
    flops = plan["model_tflops_per_gpu"] * 1e12 * 2048 * plan["step_time_s"]
    # 6 x 37B active (not 671B) plus MLA attention per token.
    assert flops / tokens == pytest.approx(v3.model_flops_per_token(4096), rel=1e-6)
    attention = 12 * v3.layers * v3.attention_width * 4096
    assert 36e9 < (flops / tokens - attention) / 6 < 38e9  # the active weights, not the 671B
    # A size that does not divide the experts is refused in one line with exit code 2.
    with pytest.raises(SystemExit) as info:
        main([*args[:-1], "--ep", "3"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "expert-parallel size 3" in err and len(err.strip().splitlines()) == 1
