"""Memory of the loss by stack: unfused cross-entropy keeps fp32 log-probabilities of the micro-batch,
a fused one only the bf16 logits it writes the gradient into (gpuyard.fabric.stacks.fused_loss)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuyard.fabric.accuracy import run_cluster
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.published.runs import load_runs, load_sources, model_spec
from gpuyard.fabric.stacks import STACKS
from gpuyard.fabric.step import ParallelConfig, estimate_step, memory_per_gpu

pytestmark = pytest.mark.unit


def test_a_fused_loss_keeps_half_the_bytes_per_logit() -> None:
    model = PRESETS["llama3-8b"]
    cfg = ParallelConfig(tp=2, pp=1, dp=4, micro_batch=2, zero=3)
    plain = memory_per_gpu(model, 8192, replace(cfg, stack="torchtitan"), 4)
    fused = memory_per_gpu(model, 8192, replace(cfg, stack="llm-foundry"), 4)
    assert STACKS["llm-foundry"].fused_loss and not STACKS["torchtitan"].fused_loss
    saved = plain["activations"] - fused["activations"]
    assert saved == pytest.approx(2 * 8192 * model.vocab * 2 / 2)  # micro-batch 2, 2 bytes, tp 2
    assert {k: v for k, v in plain.items() if k != "activations"} == {
        k: v for k, v in fused.items() if k != "activations"
    }


def test_llm_foundry_layouts_that_ran_are_no_longer_refused_for_their_logits() -> None:
    # llm-foundry ran every layout of its table (with its fused cross-entropy); counted with fp32
    # log-probabilities of the whole micro-batch, at least ten of them did not fit.
    sources = load_sources()
    runs = [r for r in load_runs() if r.source == "llm-foundry"]
    accepted = 0
    for run in runs:
        cfg = replace(run.parallel_config(), stack=sources[run.source].stack)
        cluster = run_cluster(run.cluster, run.device)
        model, gpus, batch, seq = model_spec(run), run.gpus, run.global_batch, run.seq_len
        fused = estimate_step(model, cluster, gpus, batch, seq, cfg)
        unfused = estimate_step(model, cluster, gpus, batch, seq, replace(cfg, stack="megatron-lm"))
        assert fused.memory_gib_per_gpu < unfused.memory_gib_per_gpu
        accepted += fused.fits and not unfused.fits
    assert accepted >= 10
