"""A causal-LM step is the mean over the step's counted labels, however the global batch is split
(micro-batches here; data-parallel ranks take the same path), and a loader factory takes the
trainer's batch size instead of its own default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.llm_fixtures import token_dataset
from torch import nn

from gpuyard.errors import ConfigError
from gpuyard.tracking.files import read_metrics
from gpuyard.train.spec import TrainSpec
from gpuyard.train.trainer import Trainer

pytestmark = pytest.mark.unit

IGNORE = -100


class TinyLM(nn.Module):
    """Embedding -> linear: logits for every position (enough for the loss's arithmetic)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.emb(inputs["input_ids"]))


@pytest.fixture
def tokens(gpuyard_home: Path, tmp_path: Path) -> tuple[str, int]:
    from gpuyard.data.tokens import load_tokenizer

    ref, folder = token_dataset(tmp_path, 60, val_fraction=0.0)
    return ref, load_tokenizer(folder).vocab_size


def _losses(run_dir: Path, ref: str, vocab: int, **fields: Any) -> list[float]:
    """Per-step losses of 3 steps of :class:`TinyLM` over global batches of 8 packed sequences."""
    train = {"entrypoint": "gpuyard.data.tokens:packed_batches", "kwargs": {"dataset": ref}}
    spec = TrainSpec.model_validate(
        {
            "run_dir": str(run_dir),
            "data": {"train": train, "global_batch_size": 8},
            "loss": "gpuyard.train.hf:lm_loss",
            "optimizer": {"lr": 0.05},
            "epochs": 3,
            "max_steps": 3,
            "log_every_steps": 1,
            "tracking": "jsonl",
            "checkpoint": {"at_epoch_end": False, "final": False},
            **fields,
        }
    )
    result = Trainer(spec, model=lambda: TinyLM(vocab)).fit()
    assert result.status == "completed"
    return [
        float(ev["loss"]) for ev in read_metrics(run_dir) if ev.get("event") == "metrics" and "loss" in ev
    ]


def test_a_step_is_the_mean_over_its_labels_however_the_batch_is_split(
    tmp_path: Path, tokens: tuple[str, int]
) -> None:
    from gpuyard.data.tokens import packed_batches

    ref, vocab = tokens
    # The halves of the first global batch count different numbers of labels (packing leaves padding
    # and each document's last token unlabelled): a mean of the halves' means is not the step's mean.
    loader = packed_batches(ref, batch_size=8)
    loader.loader.set_global_batch(8, 0, 1)
    labels = next(iter(loader))["targets"]
    halves = [int((h != IGNORE).sum()) for h in (labels[:4], labels[4:])]
    assert halves[0] != halves[1]
    whole = _losses(tmp_path / "whole", ref, vocab)
    split = _losses(tmp_path / "split", ref, vocab, grad_accum=2)
    assert len(whole) == 3 and whole[-1] < whole[0]
    assert split == pytest.approx(whole, rel=1e-6)


def test_a_loader_factory_takes_the_trainers_batch_size(tokens: tuple[str, int]) -> None:
    from gpuyard.data.tokens import packed_batches
    from gpuyard.train.data import call_factory

    ref, _ = tokens
    kwargs = {"dataset": ref}
    got = call_factory(packed_batches, kwargs, 0, 1, batch_size=3)
    assert next(iter(got))["inputs"]["input_ids"].shape == (3, 32)
    same = call_factory(packed_batches, {**kwargs, "batch_size": 3}, 0, 1, batch_size=3)
    assert next(iter(same))["inputs"]["input_ids"].shape[0] == 3
    with pytest.raises(ConfigError, match=r"data.train.kwargs.batch_size=8 but each rank's batch is 3"):
        call_factory(packed_batches, {**kwargs, "batch_size": 8}, 0, 1, batch_size=3)
