"""Building blocks the trainer assembles from a spec: loss, optimizer, LR schedule, RNG state."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpuyard.refs import import_ref
from gpuyard.train.spec import OptimizerSpec, ScheduleSpec


def _cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Sequence models give (batch, time, vocab): flatten so one function serves both shapes.
    if outputs.dim() > 2:
        return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))
    return F.cross_entropy(outputs, targets)


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.reshape(targets.shape), targets)


def _l1(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(outputs.reshape(targets.shape), targets)


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "mse": _mse,
    "l1": _l1,
}


def build_loss(name: str) -> Callable[[Any, Any], torch.Tensor]:
    """A named loss (cross_entropy, mse, l1) or a `module:function` taking (outputs, targets)."""
    if name in LOSSES:
        return LOSSES[name]
    return import_ref(name, field="loss")


def build_optimizer(params: Any, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """AdamW/Adam/SGD from the spec; biases and norm weights (1-D) get no weight decay.

    Without weight decay every parameter has the same settings: one group, so each step makes one
    optimizer call instead of two (measured 0.14 ms a step on the CPU MLP of
    ``benchmarks/train_overhead.py``); checkpoints name each parameter's state, so one written with
    the two groups (earlier versions) resumes into the one (its schedule: :func:`scheduler_state_for`).
    """
    params = [p for p in params if p.requires_grad]
    if spec.weight_decay:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
    else:
        groups = [{"params": params, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum)
    cls = torch.optim.AdamW if spec.name == "adamw" else torch.optim.Adam
    # The fused kernel reads each parameter, gradient and moment once per step (28 bytes a parameter);
    # the default foreach path makes one pass per operation (about 80): measured here 7.5x faster on
    # the CPU and a third of the optimizer's time on an H100 (BENCHMARKS.md). DTensor parameters (FSDP,
    # tensor parallel) keep the foreach path, which every torch version supports for them.
    fused = bool(params) and all(_fusable(p) for p in params)
    return cls(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, fused=fused or None)


def _fusable(param: torch.Tensor) -> bool:
    """A plain floating-point tensor on a device the fused Adam kernel supports."""
    from torch.distributed.tensor import DTensor

    return (
        not isinstance(param, DTensor)
        and param.device.type in ("cuda", "cpu")
        and param.dtype in (torch.float32, torch.float16, torch.bfloat16)
    )


def scheduler_state_for(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A schedule's saved ``state`` for an optimizer of ``groups`` parameter groups.

    Checkpoints written before weight decay 0 made one group have two groups of the same learning
    rate; their per-group lists are cut to the first ``groups`` (every value the same), so they resume
    into the one group. Any other state is returned as it is.
    """
    lrs = state.get("base_lrs")
    if not isinstance(lrs, list) or len(lrs) <= groups or len(set(lrs)) != 1:
        return state
    cut = dict(state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if isinstance(cut.get(key), list):
            cut[key] = cut[key][:groups]
    return cut


def lr_factor(spec: ScheduleSpec, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the base learning rate at each step, for LambdaLR."""

    def factor(step: int) -> float:
        if spec.warmup_steps and step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        if spec.kind == "warmup_cosine":
            span = max(1, total_steps - spec.warmup_steps)
            progress = min(1.0, (step - spec.warmup_steps) / span)
            cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
            return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine
        if spec.kind == "step":
            return float(spec.gamma ** ((step - spec.warmup_steps) // spec.step_size))
        return 1.0

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, spec: ScheduleSpec, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `lr_factor`; its state (the step) goes into checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(spec, total_steps))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG's state in types `torch.load(weights_only=True)` accepts."""
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np.asarray(np_state[1]).copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def count_parameters(model: nn.Module) -> int:
    """Parameters of the (local part of the) model."""
    return sum(p.numel() for p in model.parameters())
