"""The pipelines' loader wrapper passes what the trainer asks of gpuyard's loader through."""

from __future__ import annotations

from typing import Any

import pytest

from gpuyard.pipelines.torchglue import _Flatten
from gpuyard.train.data import LoaderSource, make_source

pytestmark = pytest.mark.unit


class _Loader:
    """A resumable loader that records what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple[int, int, int]] = []

    def __iter__(self) -> Any:
        return iter(())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def set_global_batch(self, global_batch: int, rank: int, world_size: int) -> None:
        self.told.append((global_batch, rank, world_size))


def test_a_pipeline_loader_takes_global_batches_so_it_resumes_at_another_world_size() -> None:
    inner = _Loader()
    source = make_source(_Flatten(inner, "image", "label"), "data.train", 8, 1, 2, True, 0, False, 0, 16)
    assert isinstance(source, LoaderSource) and inner.told == [(16, 1, 2)]
