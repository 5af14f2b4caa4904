"""A dataset (and a gpuyard.data loader) that records which samples each rank fetched per step, and a
stop at a given step.

Named by the elastic-resume specs (torchrun workers import it via PYTHONPATH; the in-process runs of
the tests put this folder on sys.path). Files go to $GPUYARD_TEST_HOOK_DIR/samples/.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from gpuyard.data.loader import LoaderConfig, ShardLoader
from gpuyard.train import examples as ex

HOOK_DIR = "GPUYARD_TEST_HOOK_DIR"
STOP_AT = "GPUYARD_TEST_STOP_AT"


class LoggedData(Dataset):  # type: ignore[type-arg]
    """classification_data whose fetched indices are kept until the step callback writes them."""

    def __init__(self, n: int) -> None:
        self.data = ex.classification_data(n)
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched.append(int(i))
        return self.data[i]


def logged_data(n: int = 196) -> LoggedData:
    """Entry point of the specs."""
    return LoggedData(n)


def record(trainer: Any, event: str) -> None:
    """After each step: append `step idx idx ...` (this rank's samples of the step) to this process's
    file. num_workers=0 fetches a batch only when the loop asks for it, so these are exactly the
    samples the step trained on."""
    if event != "step":
        return
    source = trainer.train_source.loader
    ds = source if isinstance(source, LoggedShardLoader) else source.dataset
    folder = Path(os.environ[HOOK_DIR]) / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"w{trainer.ctx.world_size}-r{trainer.ctx.rank}-p{os.getpid()}.txt"
    with open(folder / name, "a") as f:
        f.write(" ".join(map(str, [trainer.step, *ds.fetched])) + "\n")
    ds.fetched.clear()


def stop_at(trainer: Any, event: str) -> None:
    """Ask the run to stop (as SIGTERM does) after step $GPUYARD_TEST_STOP_AT."""
    if event == "step" and trainer.step == int(os.environ.get(STOP_AT, "-1")):
        trainer.request_stop()


class LoggedShardLoader(ShardLoader):
    """gpuyard.data's loader whose yielded sample ids are kept until the step callback writes them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetched: list[int] = []

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in super().__iter__():
            self.fetched.extend(batch["id"].tolist())
            yield {**batch, "x": batch["x"].flatten(1)}  # stored as 4x4 (a 2-D array ingests as columns)


def logged_loader(dataset: str, dp_rank: int = 0, dp_size: int = 1) -> LoggedShardLoader:
    """Entry point of the loader specs: `dataset` (id, x, y) streamed in blocks of 64 rows; the
    trainer tells it data.global_batch_size (set_global_batch)."""
    cfg = LoaderConfig(shuffle_buffer=64, seed=5, columns=("id", "x", "y"))
    return LoggedShardLoader(dataset, cfg, rank=dp_rank, world_size=dp_size, pin_memory=False)
