"""Exact resume in one process: stopped + resumed == never stopped; atomic checkpoints; keep last K."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from gpuyard.errors import ConfigError
from gpuyard.tracking.files import read_metrics
from gpuyard.train import examples as ex
from gpuyard.train.checkpoint import MARKER, latest_checkpoint, list_checkpoints
from gpuyard.train.trainer import Trainer

from .conftest import run, weights

pytestmark = pytest.mark.unit


def stop_at(step: int) -> Any:
    """A callback that asks the trainer to stop (as SIGTERM does) once `step` is reached.

    Ranks agree on a stop at the next step's all-reduce, so the run stops after step + 1.
    """

    def callback(trainer: Trainer, event: str) -> None:
        if event == "step" and trainer.step == step:
            trainer.request_stop()

    return callback


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=key)


# Stops after step 5 (mid-epoch, between checkpoints) and step 8 (the last step of epoch 0).
@pytest.mark.parametrize("stop_step", [4, 7])
def test_stopped_and_resumed_equals_never_stopped(spec_factory, stop_step: int) -> None:
    whole_t, whole = run(spec_factory("whole"))
    whole_w = weights(whole_t)
    stopped_spec = spec_factory("stopped")
    _, first = run(stopped_spec, callbacks=[stop_at(stop_step)])
    assert first.status == "preempted" and first.step == stop_step + 1
    resumed, second = run(stopped_spec)
    assert resumed.resumed_from is not None and resumed.resumed_from.name.endswith(f"{stop_step + 1:09d}")
    assert second.status == "completed" and second.step == whole.step
    _assert_same(weights(resumed), whole_w)
    # The resumed run continued the schedule: same final learning rate as the whole run.
    assert second.metrics["lr"] == pytest.approx(whole.metrics["lr"], abs=1e-12)


def test_exact_resume_with_a_protocol_loader(spec_factory) -> None:
    data = lambda: ex.classification_loader(256, batch_size=16, seed=4)  # noqa: E731
    whole_t, whole = run(spec_factory("whole"), data=data)
    stopped_spec = spec_factory("stopped")
    _, first = run(stopped_spec, data=data, callbacks=[stop_at(5)])
    assert first.status == "preempted"
    resumed, second = run(stopped_spec, data=data)
    assert second.step == whole.step
    _assert_same(weights(resumed), weights(whole_t))


def test_half_written_checkpoint_is_never_loaded(spec_factory) -> None:
    spec = spec_factory("run")
    _, _first = run(spec, callbacks=[stop_at(5)])
    ckpts = list_checkpoints(spec.resolved_run_dir() / "checkpoints")
    assert [p.name for p in ckpts][-1].endswith("000000006")
    # Simulate a crash during the next save: a newer folder without the completeness marker,
    # and a newer folder whose marker was never written (torn).
    torn = ckpts[-1].parent / "step-000000009"
    shutil.copytree(ckpts[-1], torn)
    (torn / MARKER).unlink()
    assert latest_checkpoint(ckpts[-1].parent) == ckpts[-1]
    resumed, _ = run(spec, callbacks=[stop_at(7)])
    assert resumed.resumed_from == ckpts[-1]


def test_keeps_only_the_last_k_checkpoints(spec_factory) -> None:
    spec = spec_factory("run", checkpoint={"every_steps": 1, "keep": 2})
    _, result = run(spec)
    names = [p.name for p in list_checkpoints(spec.resolved_run_dir() / "checkpoints")]
    assert names == [f"step-{result.step - 1:09d}", f"step-{result.step:09d}"]
    assert not list((spec.resolved_run_dir() / "checkpoints").glob(".tmp-*"))


def test_async_save_produces_loadable_checkpoints(spec_factory) -> None:
    whole_t, whole = run(spec_factory("whole"))
    spec = spec_factory("async", checkpoint={"async_save": True})
    _, first = run(spec, callbacks=[stop_at(4)])
    assert first.status == "preempted"
    resumed, second = run(spec)
    assert second.step == whole.step
    _assert_same(weights(resumed), weights(whole_t))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(spec_factory) -> None:
    def poison(trainer: Trainer, event: str) -> None:
        if event == "step" and trainer.step == 4:
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))

    spec = spec_factory("run")
    _trainer, result = run(spec, callbacks=[poison])
    assert result.status == "diverged" and result.step == 5
    assert result.checkpoint is not None and result.checkpoint.name == "step-000000003"
    events = read_metrics(spec.resolved_run_dir())
    assert events[-1] == {**events[-1], "event": "finish", "status": "diverged"}
    assert any(e["event"] == "diverged" and e["checkpoint"].endswith("step-000000003") for e in events)


def test_early_stopping_stops_when_validation_stops_improving(spec_factory) -> None:
    # lr=0: the validation loss can never improve after the first validation.
    spec = spec_factory(
        "run",
        epochs=10,
        optimizer={"lr": 1e-12},
        val_every_steps=2,
        early_stopping={"patience": 2, "min_delta": 0.1},
    )
    _, result = run(spec)
    assert result.status == "early_stopped"
    assert result.step == 6  # validations at steps 2 (best), 4 and 6 (no improvement x2)
    vals = [e for e in read_metrics(spec.resolved_run_dir()) if "val_loss" in e]
    assert [e["step"] for e in vals] == [2, 4, 6]


def test_gradient_accumulation_matches_a_larger_batch(spec_factory) -> None:
    no_shuffle = {"shuffle": False}
    common = dict(epochs=1, schedule={"kind": "constant", "warmup_steps": 0}, clip_grad_norm=None)
    a_t, a = run(
        spec_factory("accum", grad_accum=4, data={"batch_size": 8, **no_shuffle}, **common),
        model=lambda: ex.mlp(),
    )
    b_t, b = run(
        spec_factory("big", grad_accum=1, data={"batch_size": 32, **no_shuffle}, **common),
        model=lambda: ex.mlp(),
    )
    assert a.step == b.step == 8
    for key, value in weights(a_t).items():
        torch.testing.assert_close(value, weights(b_t)[key], atol=1e-5, rtol=1e-5)


def test_training_learns_and_logs_each_step(spec_factory) -> None:
    spec = spec_factory("run", epochs=4, grad_accum=1)
    _, result = run(spec, model=lambda: ex.mlp())
    events = read_metrics(spec.resolved_run_dir())
    steps = [e for e in events if e["event"] == "metrics" and "loss" in e]
    assert [e["step"] for e in steps] == list(range(1, result.step + 1))
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"]
    assert {"lr", "samples_per_s", "step_time", "tokens_per_s"} <= steps[0].keys()
    lrs = [e["lr"] for e in steps]
    assert lrs[0] < lrs[3] and lrs[-1] < lrs[4]  # warm-up rises, cosine decays
    assert events[0]["event"] == "params" and events[0]["params"]["grad_accum"] == 1


def test_bf16_autocast_and_mfu_with_a_given_peak(spec_factory) -> None:
    seen: list[torch.dtype] = []

    def record_dtype(trainer: Trainer, event: str) -> None:
        if event == "step" and not seen:
            handle = trainer.model.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
            trainer._hook = handle  # keep it alive for one more step

    spec = spec_factory(
        "run",
        epochs=1,
        grad_accum=1,
        precision="bf16",
        peak_tflops=0.5,
        data={"batch_size": 8},
        clip_grad_norm=None,
    )
    trainer = Trainer(
        spec,
        model=lambda: ex.TinyTransformer(vocab=16, dim=16, heads=2, layers=1, seq_len=8),
        train_data=ex.token_data(64, seq_len=8, vocab=16),
        callbacks=[record_dtype],
    )
    result = trainer.fit()
    assert torch.bfloat16 in seen  # the forward ran under bf16 autocast on CPU
    assert next(trainer.model.parameters()).dtype == torch.float32  # master weights stay fp32
    m = result.metrics
    expected = 6 * sum(p.numel() for p in trainer.model.parameters()) * m["tokens_per_s"] / 0.5e12
    assert m["tokens_per_s"] > 0 and m["mfu"] == pytest.approx(expected)


def test_non_finite_gradients_with_finite_loss_stop_before_the_update(spec_factory) -> None:
    def nan_grad_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Forward: finite (0 * sqrt(0)); backward: 0 * inf = NaN in every output gradient.
        return torch.nn.functional.cross_entropy(outputs, targets) + 0 * torch.sqrt((outputs * 0).sum())

    spec = spec_factory("run", grad_accum=1)
    trainer = Trainer(spec, model=lambda: ex.mlp(), train_data=ex.classification_data(64), loss=nan_grad_loss)
    result = trainer.fit()
    assert result.status == "diverged" and result.step == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())  # the update was skipped


def test_a_checkpoint_with_two_optimizer_groups_resumes_into_one(spec_factory, monkeypatch) -> None:
    """Without weight decay the optimizer has one group; a checkpoint written when it had two groups
    (decay, no decay) with the same settings resumes exactly into it."""
    from gpuyard.train import components as comp

    optimizer = {"weight_decay": 0.0}
    whole_t, whole = run(spec_factory("whole", optimizer=optimizer))
    stopped_spec = spec_factory("stopped", optimizer=optimizer)

    def two_groups(params: Any, spec: Any) -> torch.optim.Optimizer:
        params = [p for p in params if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.0},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, fused=True)

    with monkeypatch.context() as patched:
        patched.setattr(comp, "build_optimizer", two_groups)
        old, first = run(stopped_spec, callbacks=[stop_at(4)])
    assert len(old.optimizer.param_groups) == 2 and first.status == "preempted"
    resumed, second = run(stopped_spec)
    assert len(resumed.optimizer.param_groups) == 1 and resumed.resumed_from is not None
    assert second.status == "completed" and second.step == whole.step
    _assert_same(weights(resumed), weights(whole_t))
    assert second.metrics["lr"] == pytest.approx(whole.metrics["lr"], abs=1e-12)


def test_a_one_group_checkpoint_is_refused_in_one_line_when_weight_decay_is_turned_on(spec_factory) -> None:
    """A checkpoint written without weight decay (one optimizer group) cannot fill an optimizer with
    weight decay (decay and no-decay groups): a configuration error naming both counts, not DCP's
    missing-key traceback."""
    stopped = spec_factory("stopped", optimizer={"weight_decay": 0.0})
    old, first = run(stopped, callbacks=[stop_at(4)])
    assert len(old.optimizer.param_groups) == 1 and first.status == "preempted"
    on = spec_factory("stopped", optimizer={"weight_decay": 0.1})
    with pytest.raises(
        ConfigError, match=r"written with 1 optimizer parameter group\(s\) and this run's optimizer has 2"
    ):
        run(on)
