"""Sampler position, LR schedules, RNG round trip, losses and the metrics file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from gpuyard.errors import ConfigError
from gpuyard.tracking.files import JsonlTracker, read_metrics
from gpuyard.train import components as comp
from gpuyard.train import examples as ex
from gpuyard.train.data import MapSource, ResumableSampler, make_source, split_batch
from gpuyard.train.spec import ScheduleSpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_resumable_sampler_is_a_distributed_sampler_that_can_start_late(rank: int) -> None:
    data = list(range(50))
    ours = ResumableSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=7, drop_last=False)
    theirs = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=7, drop_last=False)
    for epoch in (0, 1):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)
    ours.set_start(5)
    assert list(ours) == list(theirs)[5:] and len(list(theirs)) == 17
    assert list(ours) == list(theirs)  # the start applies to one iteration only


def test_map_source_resumes_mid_epoch() -> None:
    ds = ex.classification_data(64)
    a = MapSource(ds, 8, dp_rank=0, dp_size=1, shuffle=True, seed=1, drop_last=True)
    a.set_epoch(2)
    it = iter(a)
    seen = [next(it)[1] for _ in range(3)]
    b = MapSource(ds, 8, dp_rank=0, dp_size=1, shuffle=True, seed=1, drop_last=True)
    b.load_state_dict(a.state_dict())
    rest_b = [y for _, y in b]
    rest_a = [y for _, y in it]
    assert len(rest_b) == 5 and all(torch.equal(x, y) for x, y in zip(rest_a, rest_b, strict=True))
    assert not any(torch.equal(seen[0], y) for y in rest_b[:1])


def test_make_source_accepts_datasets_and_protocol_loaders_only() -> None:
    assert isinstance(
        make_source(ex.classification_data(16), "data.train", 4, 0, 1, True, 0, True), MapSource
    )
    loader = ex.classification_loader(32, batch_size=4)
    assert make_source(loader, "data.train", 4, 0, 1, True, 0, True).loader is loader
    with pytest.raises(ConfigError, match=r"data\.train: a generator has no resumable position"):
        make_source((i for i in range(3)), "data.train", 4, 0, 1, True, 0, True)
    with pytest.raises(ConfigError, match="fewer than the 4 data-parallel ranks"):
        make_source(ex.classification_data(3), "data.train", 1, 0, 4, True, 0, True)


def test_split_batch_handles_tuples_and_mappings() -> None:
    assert split_batch((1, 2), "inputs", "targets") == (1, 2)
    assert split_batch({"x": 1, "y": 2}, "x", "y") == (1, 2)
    with pytest.raises(ConfigError, match=r"data\.input_key/target_key"):
        split_batch({"x": 1}, "inputs", "targets")


def test_warmup_cosine_and_step_schedules() -> None:
    f = comp.lr_factor(ScheduleSpec(kind="warmup_cosine", warmup_steps=4, min_lr_ratio=0.1), total_steps=14)
    assert [round(f(s), 3) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    g = comp.lr_factor(ScheduleSpec(kind="step", step_size=3, gamma=0.5), total_steps=10)
    assert [g(s) for s in (0, 2, 3, 6)] == [1.0, 1.0, 0.5, 0.25]


def test_rng_state_round_trip_through_a_safe_load(tmp_path: Path) -> None:
    comp.seed_everything(3)
    state = comp.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    comp.seed_everything(99)
    comp.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_weight_decay_skips_biases() -> None:
    from gpuyard.train.spec import OptimizerSpec

    opt = comp.build_optimizer(ex.mlp().parameters(), OptimizerSpec(weight_decay=0.1))
    decays = sorted((g["weight_decay"], all(p.dim() >= 2 for p in g["params"])) for g in opt.param_groups)
    assert decays == [(0.0, False), (0.1, True)]


def test_without_weight_decay_one_group_holds_every_parameter() -> None:
    from gpuyard.train.spec import OptimizerSpec

    model = ex.mlp()
    opt = comp.build_optimizer(model.parameters(), OptimizerSpec(weight_decay=0.0))
    assert len(opt.param_groups) == 1
    assert opt.param_groups[0]["weight_decay"] == 0.0
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_a_two_group_optimizer_state_resumes_into_one_group() -> None:
    """A checkpoint written when weight decay 0 still made two groups loads into the one group."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from gpuyard.train.spec import OptimizerSpec

    torch.manual_seed(0)
    model = ex.mlp()
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.0},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    old = torch.optim.AdamW(groups, lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 16)).sum().backward()
        old.step()
        old.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, old)
    new = comp.build_optimizer(model.parameters(), OptimizerSpec(lr=1e-3, weight_decay=0.0))
    set_state_dict(model, new, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert len(new.param_groups) == 1
    for p in params:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(new.state[p][key], old.state[p][key]), key


def test_accuracy_counts_of_scores_that_need_gradients() -> None:
    from gpuyard.train.validation import accuracy_counts

    scores = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0]], requires_grad=True)
    counts = accuracy_counts(scores * 1.0, torch.tensor([1, 2, 2]))  # predicts 1, 0, 2
    assert counts.tolist() == [2, 3] and counts.dtype == torch.int64 and not counts.requires_grad


def test_cross_entropy_flattens_sequences() -> None:
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(10, 7), targets.reshape(10))
    torch.testing.assert_close(comp.build_loss("cross_entropy")(logits, targets), expected)


def test_jsonl_tracker_writes_parseable_lines_even_for_nan(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    tracker.log_params({"lr": 0.1})
    tracker.log_metrics(1, {"loss": float("nan"), "lr": 0.1})
    tracker.finish("diverged")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["params", "metrics", "finish"]
    (tmp_path / "metrics.jsonl").open("a").write('{"event": "torn')  # a killed writer's last line
    events = read_metrics(tmp_path)
    assert len(events) == 3 and events[1]["loss"] == "nan"
