"""Workloads for trace jobs that carry none (Philly): a reproducible model per job, chosen by its GPU count.

Traces record sizes and durations, not what was trained. To replay them with fabric-aware placement each
job gets a transformer the way a research cluster's mix plausibly looks: small jobs small models, big
jobs big ones, drawn with a seeded generator so two runs (and the two placements compared) see the same
jobs. Weak scaling: every GPU processes ``SEQS_PER_GPU`` sequences per step, the way data-parallel jobs
grow with their GPU count.

| GPUs     | models (equally likely)               | sequence length |
| -------- | ------------------------------------- | --------------- |
| 1-2      | gpt-350m, gpt-1.3b                    | 2048            |
| 3-8      | gpt-1.3b, gpt-2.7b                    | 2048            |
| 9-32     | gpt-2.7b, gpt-6.7b, llama3-8b         | 2048 / 4096     |
| 33+      | llama3-8b, llama3-70b                 | 4096            |
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from gpuyard.fabric.models import PRESETS, ModelSpec
from gpuyard.fabric.placement_cost import Workload
from gpuyard.fabric.planner import Knobs
from gpuyard.scheduler.trace import TraceJob

SEQS_PER_GPU = 4  # sequences each GPU processes per step (weak scaling)
# GPT-3 family shapes: layers and width from Brown et al. 2020, Table 2.1; heads of 64-128 dimensions.
SMALL_MODELS = {
    "gpt-350m": ModelSpec("gpt-350m", 24, 1024, 16, 16, 4096, 51200, 2048, tied_embeddings=True),
    "gpt-1.3b": ModelSpec("gpt-1.3b", 24, 2048, 16, 16, 8192, 51200, 2048, tied_embeddings=True),
    "gpt-2.7b": ModelSpec("gpt-2.7b", 32, 2560, 32, 32, 10240, 51200, 2048, tied_embeddings=True),
    "gpt-6.7b": ModelSpec("gpt-6.7b", 32, 4096, 32, 32, 16384, 51200, 2048, tied_embeddings=True),
}
# (largest GPU count of the class, models, sequence length)
MIX: tuple[tuple[int, tuple[str, ...], int], ...] = (
    (2, ("gpt-350m", "gpt-1.3b"), 2048),
    (8, ("gpt-1.3b", "gpt-2.7b"), 2048),
    (32, ("gpt-2.7b", "gpt-6.7b", "llama3-8b"), 2048),
    (1 << 30, ("llama3-8b", "llama3-70b"), 4096),
)
# Held knobs: the planner searches tensor/pipeline sizes (and sequence parallelism) per placement only,
# which keeps a search to a few milliseconds; the rest is a common Megatron set-up.
KNOBS = Knobs(cp=1, micro_batch=1, virtual_stages=1, recompute="selective", zero=1)


def model_named(name: str) -> ModelSpec:
    """A model of the mix: the GPT-3 shapes here or a fabric preset."""
    return SMALL_MODELS.get(name) or PRESETS[name]


def workload_for(gpus: int, rng: random.Random) -> Workload:
    """A workload for a job of ``gpus`` GPUs (see the module's table)."""
    for most, names, seq in MIX:
        if gpus <= most:
            model = model_named(rng.choice(names))
            return Workload(model, SEQS_PER_GPU * max(1, gpus), seq, KNOBS)
    raise AssertionError("unreachable: the last class has no upper bound")  # pragma: no cover


def trace_workloads(trace: Iterable[TraceJob], seed: int = 0) -> dict[int, Workload]:
    """Job id -> workload for every GPU job of ``trace``, reproducible for a given ``seed``."""
    rng = random.Random(seed)
    return {j.id: workload_for(j.gpus, rng) for j in sorted(trace, key=lambda j: j.id) if j.gpus > 0}
