"""Resuming a checkpoint at another world size (elastic jobs): what carries over and what cannot.

Model and optimizer state need nothing here: the trainer builds the new world's state dict
(``get_state_dict``: replicated under DDP, this rank's shards under FSDP2) and ``dcp.load`` fills it
from whatever shards the checkpoint holds, so DCP reshards. The per-rank state needs care:

* the data position must mean the same samples: a map-style dataset with ``data.global_batch_size``
  counts global batches of a world-size independent order (:class:`GlobalBatchSampler`), checked
  by :func:`gpuyard.train.data.check_position`; a loader in global-batch mode (gpuyard.data's
  ``ShardLoader``, told ``data.global_batch_size`` through ``set_global_batch``) saves its global
  position and checks it itself when loading; a loader with its own per-rank position cannot be
  carried to another world size and is refused here;
* RNG states belong to ranks that may no longer exist: each rank is seeded afresh from
  (seed, step, data-parallel rank, pipeline stage) rather than all ranks copying rank 0's stream
  (which would give every rank the same dropout masks);
* only the data-parallel size may change: pipeline stages key their optimizer state by stage, and
  tensor-parallel resharding is not tested.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuyard.errors import ConfigError
from gpuyard.train import components as comp
from gpuyard.train.data import LoaderSource, check_loader_position, check_position, rank_batch_size

if TYPE_CHECKING:
    from gpuyard.train.parallel import MeshLayout
    from gpuyard.train.spec import TrainSpec


def saved_world(meta: dict[str, Any]) -> tuple[int, list[int] | None]:
    """(world size, [pp, dp, tp]) a checkpoint was written at, from its marker."""
    layout = meta.get("layout")
    return int(meta.get("world_size", 1)), (list(layout) if layout is not None else None)


def resized(meta: dict[str, Any], world_size: int, layout: list[int]) -> bool:
    """True when the checkpoint was written at another world size or layout."""
    saved_size, saved_layout = saved_world(meta)
    return saved_size != world_size or (saved_layout is not None and saved_layout != layout)


def fresh_rng(seed: int, step: int, dp_rank: int, stage: int) -> dict[str, Any]:
    """RNG states for a rank of a resized world: seeded by (seed, step, dp rank, stage), so a resumed
    run is reproducible and ranks draw different dropout masks."""
    comp.seed_everything(seed + 1_000_003 * (step + 1) + 1000 * dp_rank + stage)
    return comp.rng_state()


def check_resizable(meta: dict[str, Any], world_size: int, layout: list[int], source: Any) -> None:
    """Refuse what cannot change between the checkpoint's world (`meta`) and this one.

    Raises:
        ConfigError: pipeline or tensor-parallel size changed, or the data position is a loader's
            own per-rank one (a loader in global-batch mode is accepted).
    """
    saved_size, saved_layout = saved_world(meta)
    if saved_layout is not None:
        pairs = (("pp", saved_layout[0], layout[0]), ("tp", saved_layout[2], layout[2]))
        for name, old, new in pairs:
            if old != new:
                raise ConfigError(
                    f"parallel.{name}: the checkpoint was written with {name}={old}, this run has "
                    f"{name}={new}; a resume at another world size may change only dp"
                )
    if isinstance(source, LoaderSource) and source.global_batch is None:
        raise ConfigError(
            f"data.train: the checkpoint was written at world size {saved_size}, this run has "
            f"{world_size}, and a loader keeps its own per-rank position; use data.global_batch_size "
            "(a map-style Dataset, or gpuyard.data's ShardLoader) to resume at another world size"
        )


def adapt_rank_state(
    state: dict[str, Any],
    meta: dict[str, Any],
    *,
    world_size: int,
    layout: list[int],
    seed: int,
    dp_rank: int,
    stage: int,
    source: Any,
) -> dict[str, Any]:
    """This rank's small state from a checkpoint, made fit for the current world.

    At the world size and layout it was written at, `state` is returned as it is. Otherwise its RNG
    states are replaced (see :func:`fresh_rng`); counters, LR schedule, early-stopping state and the
    data position are the same on every rank, so any old rank's copy serves.

    Raises:
        ConfigError: pipeline or tensor-parallel size changed, or the data position is a loader's
            own (per-rank) one.
    """
    if not resized(meta, world_size, layout):
        return state
    check_resizable(meta, world_size, layout, source)
    step = int(state["step"])
    return {**state, "rng": fresh_rng(seed, step, dp_rank, stage)}


def check_resume(spec: TrainSpec, layout: MeshLayout) -> None:
    """Before any process starts (the launcher): refuse a resume the workers would refuse, in one line
    and without torchrun restarting workers that fail the same way each time.

    Raises:
        ConfigError: the newest checkpoint was written at another world size and cannot be resumed
            at this one (pp/tp changed, a per-rank batch, a loader's own per-rank position, another
            global batch).
    """
    import torch

    from gpuyard.train.checkpoint import latest_checkpoint, read_marker

    if not spec.checkpoint.resume:
        return
    path = latest_checkpoint(Path(spec.resolved_run_dir()) / "checkpoints")
    new = [layout.pp, layout.dp, layout.tp]
    if path is None:
        return
    try:
        meta = read_marker(path)
    except (OSError, ValueError):
        return  # a damaged marker: the workers' check sets that checkpoint aside, in one line
    if not resized(meta, layout.world_size, new):
        return
    rank0 = path / "rank0.pt"
    state = torch.load(rank0, weights_only=True) if rank0.is_file() else {}
    data = state.get("data", {})
    d = spec.data
    loader_global = data.get("global_batch_size") if "batches_done" not in data else None
    source = None if "batches_done" in data or not data else LoaderSource(None, loader_global)
    check_resizable(meta, layout.world_size, new, source)
    batch, global_batch = rank_batch_size(d.batch_size, d.global_batch_size, layout.dp, spec.grad_accum)
    if "batches_done" in data:
        check_position(data, layout.dp, batch, global_batch)
    elif loader_global is not None:
        check_loader_position(data, global_batch)
