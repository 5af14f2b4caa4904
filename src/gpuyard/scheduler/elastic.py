"""Elastic jobs in the live scheduler: the sizes a job may run at, and when to grow or shrink it.

A job with ``resources.gpus: {min: 2, max: 8}`` runs on any *allowed* size in that range: every size
for a command job (it finds its GPUs in ``CUDA_VISIBLE_DEVICES``); for a training job (``train:``) the
sizes at which its train spec splits ``data.global_batch_size`` evenly over the data-parallel ranks and
the accumulation steps, with its ``parallel`` layout (the trainer's own checks, so the global batch,
the sample order and the steps are the same at every size; see docs/training.md).

A resize is a restart: the scheduler stops the job as for a preemption (SIGTERM: it checkpoints and
exits 75), requeues it and starts it again at the new size, where it resumes from its checkpoint. The
rules (the simulator's elastic passes, ``gpuyard sim --elastic-share``, follow the same order with a
simpler test for a grow: work left above ten restarts):

* **start**: the policy places an elastic job at its minimum, like any job of that size; when no other
  queued job is left waiting after the decision it starts at the largest allowed size, up to its
  maximum, that fits. A job requeued by a resize starts at the size it was resized to when that fits
  (else at the largest allowed size below it that does).
* **grow**: when no job waits and GPUs are idle, a running elastic job below its maximum is restarted
  at the largest allowed size that fits in its own GPUs and the idle ones, when the time that saves on
  its predicted work left is more than twice a restart's cost (its speed taken as ``size ** alpha``;
  the work left is the run-time estimate from history less what it ran, and once it ran past that,
  as long again as it ran).
* **shrink**: when the first job in the queue cannot start and the policy neither started it nor
  preempted for it, running elastic jobs above their minimum shrink, largest first, each as little as
  needed, when that lets it start; when shrinking every one of them would not be enough, none shrinks.
* a job is resized at most once per ``interval_s`` (counted from its last start), and nothing is
  resized while an earlier resize is still stopping a job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuyard.scheduler.placement import ClusterState, Placement, place
from gpuyard.scheduler.spec import JobSpec


@dataclass(frozen=True)
class ElasticConfig:
    """How the live scheduler resizes elastic jobs.

    Attributes:
        enabled: grow and shrink running jobs (elastic jobs still start at their best size without).
        interval_s: the least time between a job's start and its next resize.
        restart_cost_s: what one restart is taken to cost (stop, requeue, start, restore): a grow
            must save more than twice that on the job's predicted work left.
        alpha: speed scales as ``size ** alpha`` (sublinear: an assumption, as in the simulator).
    """

    enabled: bool = True
    interval_s: float = 300.0
    restart_cost_s: float = 60.0
    alpha: float = 0.8


@dataclass(frozen=True)
class ElasticJob:
    """A running elastic job as the resize rules see it."""

    id: int
    gpus: int  # it holds now
    sizes: tuple[int, ...]  # allowed sizes, ascending
    placement: Placement
    started_at: float
    remaining_s: float  # predicted work left, at its current size
    gpu_type: str | None = None


# The sizes of a training spec's range it can run at: (path of the train spec, low, high, its text) ->
# sizes. Given by the front end (``gpuyard.train.resize.allowed_world_sizes``): the scheduler does not
# import the training package, and reads the file itself (see ``read`` of allowed_sizes).
TrainSizes = Callable[[Path, int, int, str], tuple[int, ...]]
# Reads a file a job names (bounded, as the job's user): its bytes, or None when there is none.
SpecReader = Callable[[Path], "bytes | None"]
TRAIN_SPEC_CAP = 1 << 20  # bytes of a training spec read to learn an elastic job's sizes


def allowed_sizes(
    spec: JobSpec, train_sizes: TrainSizes | None = None, read: SpecReader | None = None
) -> tuple[int, ...]:
    """The GPU counts an elastic job may run at, ascending (a rigid job: its own count).

    For a training job, ``train_sizes`` parses its train spec (a path relative to the job's
    ``workdir``) as ``read`` gives it: by the server, as the job's Unix user and at most
    :data:`TRAIN_SPEC_CAP` bytes (default: read here under the same bounds). Without ``train_sizes``,
    or when there is no such file, every size in the range is allowed and the trainer refuses a bad
    one when it starts.

    Raises:
        ConfigError: the train spec cannot be read (not a regular file, too large, not readable by the
            job's user: one line naming the path, nothing of its content), is invalid, has no
            ``data.global_batch_size``, or no size in the range splits it.
    """
    res = spec.resources
    low, high = res.gpus, res.gpus_max or res.gpus
    sizes = tuple(range(low, high + 1))
    if not res.elastic or spec.train is None or train_sizes is None:
        return sizes
    path = Path(spec.train)
    if not path.is_absolute() and spec.workdir:
        path = Path(spec.workdir) / path
    if read is None:
        from gpuyard.privileged import read_as

        def read(p: Path) -> bytes | None:
            return read_as(None, None, p, TRAIN_SPEC_CAP)

    data = read(path)
    if data is None:
        return sizes  # not here (another machine's path, or not there yet): the trainer checks at start
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        from gpuyard.errors import ConfigError

        raise ConfigError(f"train: {path} is not UTF-8 text, not a training spec") from None
    return train_sizes(path, low, high, text)  # a spec that is there but does not fit is refused now


def largest_fit(
    state: ClusterState,
    sizes: Iterable[int],
    gpu_type: str | None,
    multi_node: bool,
) -> Placement | None:
    """A placement for the largest of ``sizes`` that fits ``state`` now, or None."""
    free = state.free_gpus  # more than that never fits: not tried
    for size in sorted((s for s in sizes if s <= free), reverse=True):
        p = place(state, size, gpu_type, multi_node=multi_node)
        if p is not None:
            return p
    return None


def plan_grows(
    state: ClusterState,
    jobs: Sequence[ElasticJob],
    now: float,
    config: ElasticConfig,
    multi_node: bool,
) -> list[tuple[int, int]]:
    """(job id, new size) for the running elastic jobs to grow into idle GPUs, most work left first.

    Call only when no job waits. Each job's new size fits its own GPUs plus those still idle after
    the jobs grown before it; a grow must save more than two restarts on the job's work left.
    """
    work, out = state.copy(), []
    for job in sorted(jobs, key=lambda j: (-j.remaining_s, j.id)):
        idle = work.free_gpus
        if idle <= 0:
            break  # no idle GPU left to grow into
        bigger = [s for s in job.sizes if job.gpus < s <= job.gpus + idle]
        if not bigger or now - job.started_at < config.interval_s:
            continue
        trial = work.copy()
        trial.release(job.placement)
        p = largest_fit(trial, bigger, job.gpu_type, multi_node)
        if p is None:
            continue
        saved = job.remaining_s * (1.0 - (job.gpus / p.gpus) ** config.alpha)
        if saved <= 2.0 * config.restart_cost_s:
            continue
        trial.take(p)
        work = trial
        out.append((job.id, p.gpus))
    return out


def plan_shrinks(
    state: ClusterState,
    need: int,
    gpu_type: str | None,
    jobs: Sequence[ElasticJob],
    now: float,
    config: ElasticConfig,
    multi_node: bool,
) -> list[tuple[int, int]]:
    """(job id, new size) for the running elastic jobs to shrink so that a waiting job of ``need`` GPUs
    starts; [] when it fits already or shrinking them all would not be enough.

    What is checked is the restart order: the shrunk jobs release their GPUs, the waiting job is
    placed, then each shrunk job must fit again at its new size. Jobs shrink largest first, to their
    minimum until the waiting job fits; then each is given back as much as still lets everyone fit.
    """
    if need <= 0 or place(state, need, gpu_type, multi_node=multi_node) is not None:
        return []
    eligible = sorted(
        (j for j in jobs if j.sizes[0] < j.gpus and now - j.started_at >= config.interval_s),
        key=lambda j: (-j.gpus, j.id),
    )
    if state.free_gpus + sum(j.gpus - j.sizes[0] for j in eligible) < need:
        return []  # even shrinking every one of them to its minimum would not be enough
    chosen: dict[int, int] = {}
    by_id = {j.id: j for j in eligible}
    for job in eligible:
        chosen[job.id] = job.sizes[0]
        if _restart_fits(state, need, gpu_type, [(by_id[i], s) for i, s in chosen.items()], multi_node):
            break
    else:
        return []
    # Shrink each as little as needed: raise its size while the restart still fits.
    for jid in list(chosen):
        job = by_id[jid]
        for size in sorted((s for s in job.sizes if chosen[jid] < s < job.gpus), reverse=True):
            trial = {**chosen, jid: size}
            if _restart_fits(state, need, gpu_type, [(by_id[i], s) for i, s in trial.items()], multi_node):
                chosen[jid] = size
                break
    return list(chosen.items())


def _restart_fits(
    state: ClusterState,
    need: int,
    gpu_type: str | None,
    resized: list[tuple[ElasticJob, int]],
    multi_node: bool,
) -> bool:
    work = state.copy()
    for job, _ in resized:
        work.release(job.placement)
    first = place(work, need, gpu_type, multi_node=multi_node)
    if first is None:
        return False
    work.take(first)
    for job, size in sorted(resized, key=lambda js: js[0].id):
        p = place(work, size, job.gpu_type, multi_node=multi_node)
        if p is None:
            return False
        work.take(p)
    return True
