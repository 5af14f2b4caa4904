"""A view of a shard loader that reshapes its batches and keeps everything else the loader's.

Kept apart from :mod:`gpuyard.data.loader` so that modules defining views import no torch.
"""

from __future__ import annotations

from typing import Any


class LoaderView:
    """A view of a :class:`ShardLoader` whose batches a subclass turns into another form (``__iter__``);
    its length, epochs, global-batch mode and position (``state_dict``) are the wrapped loader's, so
    resume is exact as for the loader itself."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``."""
        self.loader.set_epoch(epoch)

    def set_global_batch(self, global_batch: int, rank: int, world_size: int) -> None:
        """Global-batch mode (``data.global_batch_size``: resumable at another world size)."""
        self.loader.set_global_batch(global_batch, rank, world_size)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's position."""
        return dict(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        self.loader.load_state_dict(state)
