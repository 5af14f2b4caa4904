"""Stack-aware overlap: TP communication hidden behind GEMMs where the stack's recipes turn it on,
and the per-collective exposed/overlapped breakdown that `gpuyard plan --json` carries."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from gpuyard.cli.main import app
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.stacks import STACKS
from gpuyard.fabric.step import ParallelConfig, StepEstimate, estimate_step

pytestmark = pytest.mark.unit

TP8 = ParallelConfig(tp=8, pp=1, dp=8, micro_batch=1, zero=1, sequence_parallel=True)


def _est(cfg: ParallelConfig) -> StepEstimate:
    return estimate_step(PRESETS["llama3-70b"], load_cluster("dgx-h100"), 64, 64, 8192, cfg)


def test_only_the_stacks_whose_recipes_overlap_tp_hide_it() -> None:
    assert STACKS["nemo"].tp_comm_overlap and not STACKS["megatron-lm"].tp_comm_overlap
    assert not STACKS["torchtitan"].tp_comm_overlap
    plain = _est(replace(TP8, stack="megatron-lm")).breakdown.collectives["tp"]
    assert plain["exposed_s"] == pytest.approx(plain["total_s"]) and plain["overlapped_s"] == 0
    nemo = _est(replace(TP8, stack="nemo")).breakdown.collectives["tp"]
    assert nemo["total_s"] == pytest.approx(plain["total_s"])  # same bytes on the same links
    assert 0 < nemo["exposed_s"] < 0.5 * nemo["total_s"]
    assert nemo["overlapped_s"] == pytest.approx(nemo["total_s"] - nemo["exposed_s"])


def test_a_run_can_override_its_stacks_default() -> None:
    nemo_on = _est(replace(TP8, stack="nemo"))
    nemo_off = _est(replace(TP8, stack="nemo", tp_overlap=False))
    titan_on = _est(replace(TP8, stack="torchtitan", tp_overlap=True))
    titan_off = _est(replace(TP8, stack="torchtitan"))
    assert nemo_off.breakdown.collectives["tp"]["overlapped_s"] == 0
    assert titan_on.breakdown.collectives["tp"]["overlapped_s"] > 0
    # Hidden communication still costs (the GPU is shared), but less than showing it.
    saved = nemo_off.step_time_s - nemo_on.step_time_s
    tp = nemo_on.breakdown.collectives["tp"]
    assert 0 < saved < tp["overlapped_s"]
    assert titan_on.step_time_s < titan_off.step_time_s
    assert nemo_on.breakdown.overlap_cost_s > nemo_off.breakdown.overlap_cost_s


def test_without_tensor_parallelism_nothing_changes() -> None:
    cfg = ParallelConfig(tp=1, pp=1, dp=64, micro_batch=1, zero=3, stack="nemo")
    on = estimate_step(PRESETS["llama3-8b"], load_cluster("dgx-h100"), 64, 64, 8192, cfg)
    off = estimate_step(
        PRESETS["llama3-8b"], load_cluster("dgx-h100"), 64, 64, 8192, replace(cfg, tp_overlap=False)
    )
    assert on.step_time_s == off.step_time_s and "tp" not in on.breakdown.collectives
    dp = on.breakdown.collectives["dp"]
    assert dp["exposed_s"] + dp["overlapped_s"] == pytest.approx(dp["total_s"])


def test_plan_json_shows_exposed_and_overlapped_time_per_collective() -> None:
    args = ["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64"]
    args += ["--global-batch", "64", "--tp", "8", "--pp", "1", "--cp", "1", "--top", "1", "--json"]
    result = CliRunner().invoke(app, [*args, "--stack", "nemo"])
    assert result.exit_code == 0, result.output
    top = json.loads(result.output)["plans"][0]
    coll = top["breakdown"]["collectives"]
    assert {"tp", "dp"} <= set(coll) and coll["tp"]["overlapped_s"] > 0
    assert top["tp_overlap"] is None  # the stack's default


def test_asynchronous_pipeline_sends_hide_all_but_the_fill_and_drain_hops() -> None:
    """Llama 3's asynchronous P2P (arXiv:2407.21783, 3.3.2): a hop overlaps the next micro-batch's compute,
    except the pp - 1 hops each way that fill and drain the pipeline; hidden sends still cost."""
    assert not any(s.pp_async for s in STACKS.values())  # no profiled stack does it by default
    cfg = ParallelConfig(tp=8, pp=4, dp=2, micro_batch=1, virtual_stages=2, zero=1, sequence_parallel=True)
    model, cluster = PRESETS["llama3-70b"], load_cluster("dgx-h100")
    sync = estimate_step(model, cluster, 64, 32, 8192, cfg, stack=STACKS["other"])
    asyn = estimate_step(model, cluster, 64, 32, 8192, cfg, stack=replace(STACKS["other"], pp_async=True))
    pp_sync, pp_async = sync.breakdown.collectives["pp"], asyn.breakdown.collectives["pp"]
    assert pp_sync["overlapped_s"] == 0 and pp_async["total_s"] == pytest.approx(pp_sync["total_s"])
    m = 32 // 2  # micro-batches per pipeline: global batch over data parallelism, micro-batch 1
    hops = 2 * (m * cfg.virtual_stages + cfg.pp - 1)  # every send, forward and backward
    assert pp_async["exposed_s"] == pytest.approx(pp_sync["total_s"] * 2 * (cfg.pp - 1) / hops)
    saved = sync.step_time_s - asyn.step_time_s
    assert 0 < saved < pp_async["overlapped_s"]  # hidden, it still slows the compute it shares the GPU with
    assert asyn.breakdown.overlap_cost_s > sync.breakdown.overlap_cost_s
    no_pp = replace(cfg, pp=1, dp=8, virtual_stages=1)
    assert estimate_step(model, cluster, 64, 32, 8192, no_pp, stack=STACKS["other"]).step_time_s == (
        estimate_step(
            model, cluster, 64, 32, 8192, no_pp, stack=replace(STACKS["other"], pp_async=True)
        ).step_time_s
    )
