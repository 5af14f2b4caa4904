"""A loss and a data factory that make rank 1 slow, for the straggler tests (imported by the workers).

``GPUYARD_TEST_SLOW=compute`` adds 40 ms to each of rank 1's forward passes (in the loss);
``GPUYARD_TEST_SLOW=data`` adds 3 ms to each sample rank 1 reads. The injected slowness is the
subject of the test, not a wait for a condition.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from gpuyard.train.examples import classification_data

SLOW = "GPUYARD_TEST_SLOW"


def slow_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if os.environ.get(SLOW) == "compute" and os.environ.get("RANK") == "1":
        time.sleep(0.04)
    return F.cross_entropy(outputs, targets)


class _SlowSamples(Dataset):  # type: ignore[type-arg]
    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay)
        return self.inner[i]


def slow_data(n: int = 1024, dp_rank: int = 0, dp_size: int = 1) -> Any:
    data = classification_data(n)
    if os.environ.get(SLOW) == "data" and dp_rank == 1:
        return _SlowSamples(data, 0.003)
    return data
