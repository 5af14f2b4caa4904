"""Fixtures for training-runtime unit tests: a tiny spec builder and a run helper."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuyard.train import examples as ex
from gpuyard.train.spec import TrainSpec
from gpuyard.train.trainer import Trainer, TrainResult


def make_spec(run_dir: Path, **fields: Any) -> TrainSpec:
    """A small but fully-featured spec: shuffling, dropout-friendly, warm-up + cosine, clipping."""
    doc: dict[str, Any] = {
        "run_dir": str(run_dir),
        "epochs": 2,
        "seed": 3,
        "data": {"batch_size": 16},
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.05},
        "schedule": {"kind": "warmup_cosine", "warmup_steps": 4},
        "clip_grad_norm": 1.0,
        "grad_accum": 2,
        "checkpoint": {"every_steps": 3, "keep": 2},
    }
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return TrainSpec.model_validate(doc)


def run(spec: TrainSpec, data: Callable[[], Any] | None = None, **kwargs: Any) -> tuple[Trainer, TrainResult]:
    """Train a dropout MLP on seeded classification data; returns the trainer and its result."""
    trainer = Trainer(
        spec,
        model=kwargs.pop("model", lambda: ex.mlp(dropout=0.2)),
        train_data=(data or (lambda: ex.classification_data(256)))(),
        val_data=kwargs.pop("val_data", ex.classification_data(64, seed=9)),
        **kwargs,
    )
    return trainer, trainer.fit()


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """A detached copy of the trained model's parameters."""
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """Tiny models on a shared 2-core machine run faster (and steadier) on one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def spec_factory(tmp_path: Path) -> Callable[..., TrainSpec]:
    """make_spec bound to a fresh folder per call name."""

    def factory(name: str = "run", **fields: Any) -> TrainSpec:
        return make_spec(tmp_path / name, **fields)

    return factory
