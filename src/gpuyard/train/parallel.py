"""Process group, device mesh (pp x dp x tp) and the parallel strategies applied to a model.

Strategies: a single device; DDP or FSDP2 ``fully_shard`` on the ``dp`` dimension; tensor parallel
(``parallelize_module``) on the ``tp`` dimension with the plan the model gives through
``model.tp_plan()``; pipeline parallel (``torch.distributed.pipelining``, GPipe or 1F1B) on the
``pp`` dimension, splitting an ``nn.Sequential`` into contiguous stages, each stage replicated (DDP)
or sharded (FSDP2) over its ``dp`` sub-mesh. NCCL on GPUs, gloo on CPU.

Mesh order is ``("pp", "dp", "tp")``, outermost first: tp (a collective in every layer) takes
neighbouring ranks, which share a node's fastest links; pp (point-to-point activations, once per
stage boundary) takes the farthest ranks, which tolerates the slowest links.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gpuyard.errors import ConfigError
from gpuyard.train.spec import ParallelSpec


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the mesh dimensions; pp * dp * tp == world size."""

    pp: int
    dp: int
    tp: int

    @property
    def world_size(self) -> int:
        """Ranks the layout needs."""
        return self.pp * self.dp * self.tp


def resolve_layout(spec: ParallelSpec, world_size: int) -> MeshLayout:
    """Fill dp when omitted and check the layout against the world size.

    Raises:
        ConfigError: naming the parallel field that does not fit.
    """
    if world_size % (spec.tp * spec.pp):
        raise ConfigError(
            f"parallel: tp={spec.tp} x pp={spec.pp} does not divide the world size {world_size}"
        )
    dp = spec.dp if spec.dp is not None else world_size // (spec.tp * spec.pp)
    layout = MeshLayout(pp=spec.pp, dp=dp, tp=spec.tp)
    if layout.world_size != world_size:
        raise ConfigError(
            f"parallel: pp={layout.pp} x dp={layout.dp} x tp={layout.tp} = {layout.world_size} ranks, "
            f"but the job has {world_size} (set parallel.dp or --nproc to match)"
        )
    if layout.tp > 1 and layout.dp > 1 and spec.data_parallel == "ddp":
        # DDP's reducer does not handle the DTensor parameters tensor parallel leaves behind.
        raise ConfigError(
            f"parallel.data_parallel: use 'fsdp' to combine dp={layout.dp} with tp={layout.tp} "
            f"(with or without pp); 'ddp' works for dp alone and for pp x dp"
        )
    return layout


@dataclass
class DistContext:
    """Where this process sits: rank, device, mesh and its coordinates."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    layout: MeshLayout
    mesh: Any = None  # DeviceMesh with dims ("pp", "dp", "tp"), None for a single process

    def coord(self, dim: str) -> int:
        """This rank's index along a mesh dimension (0 without a mesh)."""
        return 0 if self.mesh is None else int(self.mesh.get_local_rank(dim))

    def group(self, dim: str) -> Any:
        """The process group of a mesh dimension (None without a mesh)."""
        return None if self.mesh is None else self.mesh.get_group(dim)

    @property
    def dp_rank(self) -> int:
        """Index along dp: which shard of the data this rank reads."""
        return self.coord("dp")

    @property
    def is_loss_owner(self) -> bool:
        """True on the ranks whose loss counts once: the last pipeline stage, tp index 0."""
        return self.coord("tp") == 0 and self.coord("pp") == self.layout.pp - 1


def _attempt_store(world: int) -> Any:
    """The rendezvous store, under a prefix of its own for each torchrun restart attempt.

    torchrun (agent store) hands restarted workers the same TCPStore; gloo would then find the
    addresses the killed attempt published there and wait forever to connect to dead ranks.
    """
    from datetime import timedelta

    base = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ.get("MASTER_PORT", "29500")),
        world_size=world,
        is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        and int(os.environ.get("RANK", "0")) == 0,
        timeout=timedelta(minutes=10),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"gpuyard/attempt{attempt}/", base)


def init_distributed(spec: ParallelSpec) -> DistContext:
    """Join the process group torchrun prepared (if any) and build the named device mesh."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    layout = resolve_layout(spec, world)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world == 1:
        return DistContext(rank, world, local_rank, device, layout)
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=_attempt_store(world), rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    return DistContext(rank, world, local_rank, device, layout, mesh)


def tp_plan_of(model: nn.Module, tp: int = 1) -> dict[str, Any]:
    """The model's tensor-parallel plan, `model.tp_plan()` (`model.tp_plan(tp=tp)` where the method
    takes the tp size, to check that its layers split over that many ranks).

    Raises:
        ConfigError: when the model gives no plan (or its own check refuses tp).
    """
    import inspect

    plan_fn = getattr(model, "tp_plan", None)
    if not callable(plan_fn):
        raise ConfigError(
            f"parallel.tp: {type(model).__name__} has no tp_plan() method returning "
            "{module_path: ColwiseParallel()/RowwiseParallel()}"
        )
    try:
        takes_tp = "tp" in inspect.signature(plan_fn).parameters
    except (TypeError, ValueError):  # a callable without a readable signature
        takes_tp = False
    return dict(plan_fn(tp=tp) if takes_tp else plan_fn())


def apply_tensor_parallel(
    model: nn.Module, ctx: DistContext, plan: dict[str, Any] | None = None
) -> nn.Module:
    """Shard the model's layers over the tp dimension with `plan` (default: `model.tp_plan()`).

    Raises:
        ConfigError: when no plan is given and the model has none.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan_of(model, ctx.layout.tp) if plan is None else plan
    return parallelize_module(model, ctx.mesh["tp"], plan)


def stage_tp_plan(plan: dict[str, Any], stage: nn.Module) -> dict[str, Any]:
    """The entries of a whole-model plan that fall inside a pipeline stage.

    Stages keep the whole model's child names ("1", "2", ...), so a path such as "1.attn.q" means
    the same module in the stage as in the whole model. A stage without planned layers (say,
    embedding and head only) runs replicated on its tp ranks.
    """
    names = {name for name, _ in stage.named_children()}
    return {path: style for path, style in plan.items() if path.split(".", 1)[0] in names}


def apply_data_parallel(model: nn.Module, ctx: DistContext, kind: str) -> nn.Module:
    """Wrap for data parallelism on the dp dimension: DDP, or FSDP2 fully_shard per block then root."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, process_group=ctx.group("dp"))
    from torch.distributed.fsdp import fully_shard

    units = (
        model.fsdp_units()  # type: ignore[operator]
        if callable(getattr(model, "fsdp_units", None))
        else [child for child in model.children() if any(True for _ in child.parameters())]
    )
    # One FSDP unit per block: only one block's full parameters exist at a time.
    for unit in units:
        fully_shard(unit, mesh=ctx.mesh["dp"])
    fully_shard(model, mesh=ctx.mesh["dp"])
    return model


def parallelize(model: nn.Module, ctx: DistContext, spec: ParallelSpec) -> nn.Module:
    """Apply tp then dp as the layout asks (pipeline stages are built by build_pipeline instead)."""
    model.to(ctx.device)
    if ctx.layout.tp > 1:
        model = apply_tensor_parallel(model, ctx)
    if ctx.layout.dp > 1:
        model = apply_data_parallel(model, ctx, spec.data_parallel)
    return model


@contextlib.contextmanager
def gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce for micro-batches before the last of an accumulation step."""
    if enabled:
        yield
        return
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def stage_module(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """The `stage`-th of `num_stages` contiguous slices of an nn.Sequential, keeping child names.

    Keeping the names keeps parameter names unique across stages, so checkpoints of different
    stages merge into one.

    Raises:
        ConfigError: when the model is not an nn.Sequential with at least `num_stages` children.
    """
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"parallel.pp: pipeline parallel needs an nn.Sequential, got {type(model).__name__}"
        )
    children = list(model.named_children())
    if len(children) < num_stages:
        raise ConfigError(f"parallel.pp: {len(children)} layers cannot fill {num_stages} pipeline stages")
    per = math.ceil(len(children) / num_stages)
    bounds = [min(i * per, len(children)) for i in range(num_stages + 1)]
    bounds[-1] = len(children)
    part = children[bounds[stage] : bounds[stage + 1]]
    if not part:
        raise ConfigError(f"parallel.pp: stage {stage} would be empty; use fewer stages")
    return nn.Sequential(OrderedDict(part))


@dataclass
class Pipeline:
    """A pipeline stage of this rank and the schedule that drives it."""

    module: nn.Module
    schedule: Any
    is_first: bool
    is_last: bool
    group: Any


def build_pipeline(model: nn.Module, ctx: DistContext, spec: ParallelSpec, loss_fn: Any) -> Pipeline:
    """Split `model` into stages over the pp dimension and build a GPipe or 1F1B schedule.

    With tp > 1 each stage's layers are sharded over the tp sub-mesh with the entries of
    `model.tp_plan()` that fall in the stage. With dp > 1 each stage is then wrapped for data
    parallelism over its dp sub-mesh (the ranks that hold the same stage): the pipeline stage
    all-reduces (DDP) or reduce-scatters (FSDP2) the stage's gradients once, after the last
    micro-batch's backward.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp_rank, pp = ctx.coord("pp"), ctx.layout.pp
    # The plan is read from the whole model: a stage is a plain nn.Sequential without tp_plan().
    plan = tp_plan_of(model, ctx.layout.tp) if ctx.layout.tp > 1 else {}
    module = stage_module(model, pp_rank, pp).to(ctx.device)
    if ctx.layout.tp > 1:
        module = apply_tensor_parallel(module, ctx, stage_tp_plan(plan, module))
    if ctx.layout.dp > 1 and spec.data_parallel == "fsdp":
        module = apply_data_parallel(module, ctx, "fsdp")
    elif ctx.layout.dp > 1:
        # Classic DDP's bucket rebuild breaks when the schedule runs several micro-batch backwards
        # per step (its reducer records each one); the composable replicate (DDP semantics on the
        # FSDP2 runtime) is the data-parallel wrapper torch.distributed.pipelining drives itself.
        from torch.distributed._composable.replicate_with_fsdp import replicate

        module = cast(nn.Module, replicate(module, mesh=ctx.mesh["dp"]))
    stage = PipelineStage(module, pp_rank, pp, ctx.device, group=ctx.group("pp"))
    cls = ScheduleGPipe if spec.pp_schedule == "gpipe" else Schedule1F1B
    schedule = cls(stage, n_microbatches=spec.microbatches, loss_fn=loss_fn)
    return Pipeline(module, schedule, pp_rank == 0, pp_rank == pp - 1, ctx.group("pp"))


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, ctx: DistContext) -> float:
    """Clip gradients to a global norm (DTensor shards and pipeline stages included); returns the norm.

    Gradients are grouped by kind: plain tensors (replicated parameters, the same on every rank of a
    tensor-parallel group: counted once), and DTensors by mesh and placements (FSDP shards, tensor
    parallel column/row shards: each group's norm is made whole across its mesh). torch's foreach
    kernels take one kind per call, so a tensor-parallel model (sharded projections beside replicated
    embeddings and norms) cannot be clipped in one call.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    parts = []
    for group in groups.values():
        part = torch.nn.utils.get_total_norm(group)
        parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
    if not parts:
        norm = torch.zeros((), device=ctx.device)
    elif len(parts) == 1:
        norm = parts[0]
    else:  # the norm of all: the root of the groups' summed squares
        norm = torch.stack([n.float().pow(2) for n in parts]).sum().sqrt()
    if ctx.layout.pp > 1:
        # Each stage holds different parameters: the global norm sums their squares.
        sq = norm.pow(2)
        dist.all_reduce(sq, group=ctx.group("pp"))
        norm = sq.sqrt()
    with_grads = [p for p in params if p.grad is not None]
    for kind in (True, False):  # DTensor parameters, then plain ones: one foreach kind per call
        same = [p for p in with_grads if isinstance(p.grad, DTensor) is kind]
        if same:
            torch.nn.utils.clip_grads_with_norm_(same, max_norm, norm)
    return float(norm)
