"""Fabric-aware placement: start a job spread out now or wait for a consolidated placement, by step time.

Topology-aware placement (:func:`gpuyard.scheduler.placement.place`) takes the best placement free *now*.
When that is worse than the job's consolidated placement (one node, one NVLink domain, one leaf: what
it would get on an empty cluster), :func:`choose` asks the fabric model
(:func:`gpuyard.fabric.placement_cost.placement_cost`) how much slower each training step would be,
turns that into seconds lost over the job's expected run time (the history estimator's), and compares
it with the expected wait until the consolidated placement frees up (running jobs ending as estimated).
It waits only when waiting is expected to cost less, and never longer than ``max_wait_s`` after the job
entered the queue. The decision is a plain :class:`FabricChoice`; policies call it through
:class:`FabricPass`, so the server, the simulator and the tests share it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from gpuyard.errors import CapacityError, ConfigError, NotFoundError
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.placement_cost import PlacementShape, Workload, placement_cost
from gpuyard.scheduler.placement import ClusterState, Placement, PredictedStep, place
from gpuyard.scheduler.queue import QueuedJob, RunningJob
from gpuyard.scheduler.spec import WorkloadSpec

DEFAULT_MAX_WAIT_S = 600.0  # a job never waits longer than this for consolidation
TOLERANCE = 0.02  # slowdowns below 2% are inside the step model's error: start at once


def workload_of(spec: WorkloadSpec) -> Workload:
    """The fabric model's workload from a job spec's ``workload`` section.

    Raises:
        NotFoundError: the model is not a preset (the message lists them).
        ConfigError: an invalid knob.
    """
    from gpuyard.fabric.hf_config import load_any_model as load_model
    from gpuyard.fabric.models import ModelSpec
    from gpuyard.fabric.planner import Knobs

    if isinstance(spec.model, str):
        if "/" in spec.model or spec.model.endswith((".yaml", ".yml", ".json")):
            # A path would be read on the server's disk, not the submitter's: ask for the dimensions.
            raise ConfigError(f"workload.model: {spec.model!r}: give a preset name or the model's dimensions")
        model = load_model(spec.model)
    else:
        d = spec.model
        model = ModelSpec(
            d.name,
            d.layers,
            d.hidden,
            d.heads,
            d.kv_heads or d.heads,
            d.ffn_hidden,
            d.vocab,
            d.seq_len,
            d.gated_mlp,
            d.tied_embeddings,
            d.experts,
            d.top_k,
        )
    knobs = Knobs()
    if spec.layout is not None:
        knobs = Knobs(**spec.layout.model_dump(exclude={"dp"}))
    return Workload(model, spec.global_batch, spec.seq_len or model.seq_len, knobs)


def check_workload(
    spec: WorkloadSpec, gpus: int, gpu_type: str | None, state: ClusterState, placer: FabricPlacer | None
) -> Workload:
    """A job's workload, refused at submit when it could never be costed.

    Under fabric placement (``placer`` given) the workload is costed on the job's consolidated placement,
    so a model that fits no layout on its GPUs is refused with why, not discovered at every tick.

    Raises:
        ConfigError: unknown model, knobs that do not apply, or no layout that fits (the field named).
    """
    try:
        workload = workload_of(spec)
    except NotFoundError as exc:
        raise ConfigError(f"workload.model: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"workload: {exc}") from None
    if placer is None or gpus == 0 or gpus > state.max_gpus(gpu_type):
        return workload
    ideal = placer.ideal(state, gpus, gpu_type)
    if ideal is not None:
        try:
            placement_cost(placer.cluster, workload, shape_of(state, ideal))
        except (ConfigError, CapacityError) as exc:
            raise ConfigError(f"workload: on {gpus} GPUs: {exc}") from None
    return workload


def shape_of(state: ClusterState, placement: Placement) -> PlacementShape:
    """How a placement's GPUs sit in NVLink domains and leaf switches."""
    per_domain: Counter[int] = Counter()
    leaves = set()
    for node, n in placement.nodes:
        if n:
            per_domain[int(state.domain[node])] += n
            leaves.add(int(state.leaf[node]))
    counts = tuple(sorted(per_domain.values(), reverse=True)) or (0,)
    nodes = sum(1 for _, n in placement.nodes if n)
    return PlacementShape(counts, leaves=max(1, len(leaves)), nodes=max(1, nodes))


@dataclass
class FabricPlacer:
    """Fabric-aware placement's settings, and memos of consolidated placements and costs.

    Attributes:
        cluster: the fabric description of the scheduler's nodes (accelerator, NVLink, NICs, spine).
        max_wait_s: the longest a job waits for consolidation after it entered the queue.
        tolerance: relative slowdown below which a placement counts as consolidated.
        hold: a waiting job holds the GPUs it declined for the rest of a policy pass (later jobs in the
            policy's order cannot take them), so it can still start there when its cap is reached.
    """

    cluster: Cluster
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    tolerance: float = TOLERANCE
    hold: bool = True
    _ideal: dict[tuple[int, str | None], Placement | None] = field(default_factory=dict, repr=False)

    def ideal(self, state: ClusterState, gpus: int, gpu_type: str | None) -> Placement | None:
        """The job's placement on the empty cluster (its consolidated placement)."""
        key = (gpus, gpu_type)
        if key not in self._ideal:
            empty = state.copy()
            empty.free = empty.capacity.copy()
            self._ideal[key] = place(empty, gpus, gpu_type)
        return self._ideal[key]

    def step(self, workload: Workload, shape: PlacementShape) -> float | None:
        """Predicted step seconds, or None when the model cannot cost it (no layout fits, bad knobs)."""
        try:
            return placement_cost(self.cluster, workload, shape).step_time_s
        except (ConfigError, CapacityError):
            return None


@dataclass(frozen=True)
class FabricChoice:
    """What fabric-aware placement decided for one job.

    Attributes:
        action: "start" (on ``placement``) or "wait" (for the consolidated placement).
        placement: the placement free now, with its prediction attached.
        note: one line for the job's events and the dry run.
        expected_wait_s: expected seconds until the consolidated placement is free (inf: not within the cap).
        slowdown_cost_s: seconds the job is expected to lose by running on ``placement``.
    """

    action: Literal["start", "wait"]
    placement: Placement
    note: str
    expected_wait_s: float = 0.0
    slowdown_cost_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form for the dry run (an infinite expected wait becomes null)."""
        doc: dict[str, object] = {
            "decision": self.action,
            "note": self.note,
            "expected_wait_s": None if math.isinf(self.expected_wait_s) else self.expected_wait_s,
            "slowdown_cost_s": self.slowdown_cost_s,
        }
        if self.placement.predicted is not None:
            doc.update(self.placement.predicted.to_dict())
        return doc


def choose(
    placer: FabricPlacer,
    state: ClusterState,
    job: QueuedJob,
    workload: Workload,
    placement: Placement,
    running: list[RunningJob],
    now: float,
) -> FabricChoice:
    """Start ``job`` on ``placement`` (the best free now) or wait for its consolidated placement.

    Pure: reads ``state`` and ``running`` (jobs holding GPUs, with their expected ends), changes nothing.
    """
    ideal = placer.ideal(state, job.gpus, job.gpu_type)
    shape = shape_of(state, placement)
    ideal_shape = shape_of(state, ideal) if ideal is not None else shape
    step, best = placer.step(workload, shape), placer.step(workload, ideal_shape)
    if step is None or best is None:
        return FabricChoice("start", placement, f"{placement.how} (the fabric model cannot cost this job)")
    where, target = shape.describe(), ideal_shape.describe()
    if step <= best * (1 + placer.tolerance):
        note = f"{where}: predicted step {step:.3g} s (consolidated)"
        predicted = PredictedStep(step, best, where, target, "consolidated")
        return FabricChoice(
            "start", replace(placement, how=f"{placement.how}; {note}", predicted=predicted), note
        )
    slower = f"{where}: predicted step {step:.3g} s vs {best:.3g} s on {target} (+{step / best - 1:.0%})"
    lost = (step / best - 1) * max(job.estimate - job.attained, 1.0)
    left = placer.max_wait_s - (now - job.enqueued_at)
    wait = math.inf
    if left <= 0:
        action, note = "start", f"{slower}; spreading now: waited {placer.max_wait_s:.0f} s, the cap"
    else:
        wait = expected_wait(placer, state, job, workload, running, now, min(left, lost), best)
        if wait < lost:
            action = "wait"
            # No clock-dependent figure in the note: the service records it again only when it changes.
            note = (
                f"{slower}; waiting up to {placer.max_wait_s:.0f} s for {target} "
                f"(expected sooner than the {lost:.0f} s spreading would lose)"
            )
        else:
            why = "not expected within the cap" if math.isinf(wait) else f"expected wait {wait:.0f} s"
            action, note = "start", f"{slower}; spreading now: {why}, spreading loses {lost:.0f} s"
    predicted = PredictedStep(step, best, where, target, "wait" if action == "wait" else "spread")
    placed = replace(placement, how=f"{placement.how}; {note}", predicted=predicted)
    return FabricChoice("wait" if action == "wait" else "start", placed, note, wait, lost)


def expected_wait(
    placer: FabricPlacer,
    state: ClusterState,
    job: QueuedJob,
    workload: Workload,
    running: list[RunningJob],
    now: float,
    horizon: float,
    target_s: float,
) -> float:
    """Seconds until a placement within tolerance of ``target_s`` frees up, as running jobs end as expected.

    Ignores queued jobs that may take the GPUs first (the cap bounds what that costs). Returns ``inf``
    when it is not expected within ``horizon`` seconds.
    """
    tentative = state.copy()
    mask = state.type_mask(job.gpu_type)
    ideal = placer.ideal(state, job.gpus, job.gpu_type)
    one_node = ideal is not None and len(ideal.nodes) == 1
    # The consolidated placement lies in one NVLink domain (NVL72) or under one leaf: the group to watch.
    in_domain = ideal is not None and len(shape_of(state, ideal).domain_gpus) == 1
    groups = tentative.domain if in_domain else tentative.leaf
    for r in sorted(running, key=lambda r: r.expected_end):
        end = max(r.expected_end, now + 1.0)  # a job past its estimate is expected to end soon
        if end - now > horizon:
            return math.inf
        tentative.release(r.placement)
        # Only the nodes and leaves this release touched can have become good enough: check those
        # cheaply before asking placement and the fabric model.
        touched = [node for node, n in r.placement.nodes if n and (mask is None or mask[node])]
        if one_node:
            if any(tentative.free[node] >= job.gpus for node in touched):
                return end - now
            continue
        free = tentative.free if mask is None else np.where(mask, tentative.free, 0)
        if not any(int(free[groups == g].sum()) >= job.gpus for g in {int(groups[n]) for n in touched}):
            continue
        p = place(tentative, job.gpus, job.gpu_type, job.cpus)
        step = placer.step(workload, shape_of(tentative, p)) if p is not None else None
        if step is not None and step <= target_s * (1 + placer.tolerance):
            return end - now
    return math.inf


@dataclass
class FabricPass:
    """One policy pass's fabric context: the placer, who holds GPUs (incl. this pass's starts), the clock."""

    placer: FabricPlacer
    running: list[RunningJob]
    now: float
    waits: dict[int, str] = field(default_factory=dict)

    def place(self, work: ClusterState, job: QueuedJob, multi_node: bool) -> Placement | None:
        """Topology placement, then the fabric choice for jobs with a workload; None: do not start now."""
        p = place(work, job.gpus, job.gpu_type, job.cpus, multi_node)
        if p is None or job.gpus == 0 or not isinstance(job.workload, Workload):
            return p
        choice = choose(self.placer, work, job, job.workload, p, self.running, self.now)
        if choice.action == "wait":
            self.waits[job.id] = choice.note
            # Hold the GPUs it declined for the rest of this pass: jobs later in the policy's order must
            # not erode its fallback while it waits, or the cap would not bound its wait.
            if self.placer.hold:
                work.take(p)
            return None
        return choice.placement

    def started(self, job: QueuedJob, placement: Placement) -> None:
        """Count a job started in this pass as running (it frees its GPUs when expected to end)."""
        slow = placement.predicted.slowdown if placement.predicted else 1.0
        end = self.now + max(job.estimate - job.attained, 1.0) * slow
        self.running.append(
            RunningJob(job.id, job.gpus, job.team, job.priority, self.now, end, placement, job.gpu_type)
        )
