"""Failure model and expected effective training time ratio (ETTR) of a training job.

A synchronous training job stops when any of its GPUs or nodes fails, so its failure rate is the sum of
its parts' rates: ``N * gpu_rate + nodes * node_rate`` (failures per hour). Between failures it computes
``interval_s`` of training, then stalls ``checkpoint_s`` to save; after a failure it spends ``restart_s``
(detection, rescheduling, loading the checkpoint) and recomputes what it had done since the last
checkpoint.

With failures as a Poisson process of mean time between failures ``M`` (which may also strike during a
checkpoint or a restart), the expected wall time per unit of work is exactly (Daly 2006, eq. 13)::

    T_wall / T_work = M * exp(R / M) * (exp((tau + C) / M) - 1) / tau

so ``ETTR(tau) = tau / (M * exp(R/M) * (exp((tau + C)/M) - 1))``. Its maximum is found numerically
(:func:`best_interval`) and checked against the closed forms: Young's first-order ``sqrt(2 C M)``
(Young 1974) and Daly's higher-order estimate (Daly 2006, eq. 20).

Default rates (:data:`LLAMA3_405B`) come from the Llama 3 405B pre-training run: 419 unexpected
interruptions in a 54-day snapshot on 16,384 H100 80GB GPUs in 2,048 servers of 8 ("The Llama 3
Herd of Models", Meta, 2024, section 3.3.4 and table 5). The GPU's own causes (faulty GPU 148, HBM3
72, SRAM 19, GPU system processor 17, silent data corruption 6, thermal interface and sensor 6: 268,
the paper's 58.7%) make the per-GPU rate; everything else, counted per server (network switch or
cable 35, host maintenance 32, NIC 7, SSD 3, power supply 3, chassis 2, I/O board 2, CPU 2, system
memory 2: 88) plus software (software bug 54, NCCL watchdog 7, dependency 2: 63), makes the per-node
rate. At 16,384 GPUs that gives back the run's 419 in 54 days: one interruption every 3.09 hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpuyard.errors import ConfigError

HOURS_PER_DAY = 24.0


@dataclass(frozen=True)
class FailureModel:
    """Failure rates of one GPU and one node (host, network, software), per hour.

    Attributes:
        name: where the rates come from, in a few words.
        gpu_per_hour: failures per GPU-hour caused by the GPU itself.
        node_per_hour: failures per node-hour from the rest of the node, the network and software.
        source: the publication the rates are derived from.
    """

    name: str
    gpu_per_hour: float
    node_per_hour: float
    source: str = ""

    def __post_init__(self) -> None:
        if self.gpu_per_hour < 0 or self.node_per_hour < 0:
            raise ConfigError("failure rates must be >= 0")

    @classmethod
    def from_counts(
        cls,
        name: str,
        gpu_failures: int,
        node_failures: int,
        gpus: int,
        gpus_per_node: int,
        days: float,
        source: str = "",
    ) -> FailureModel:
        """Rates from a run's failure counts, its size and its length."""
        hours = days * HOURS_PER_DAY
        nodes = math.ceil(gpus / gpus_per_node)
        return cls(name, gpu_failures / (gpus * hours), node_failures / (nodes * hours), source)

    def rate_per_hour(self, gpus: int, gpus_per_node: int = 8) -> float:
        """Failures per hour of a job on ``gpus`` GPUs (whole nodes of ``gpus_per_node``)."""
        if gpus < 1 or gpus_per_node < 1:
            raise ConfigError(f"gpus and gpus_per_node must be >= 1, got {gpus} and {gpus_per_node}")
        return gpus * self.gpu_per_hour + math.ceil(gpus / gpus_per_node) * self.node_per_hour

    def mtbf_s(self, gpus: int, gpus_per_node: int = 8) -> float:
        """Mean time between failures of the job, seconds (inf when nothing fails)."""
        rate = self.rate_per_hour(gpus, gpus_per_node)
        return math.inf if rate == 0 else 3600.0 / rate

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (rates per 1,000 GPU-days and node-days, as papers give them, too)."""
        return {
            "name": self.name,
            "gpu_per_hour": self.gpu_per_hour,
            "node_per_hour": self.node_per_hour,
            "gpu_per_1000_gpu_days": self.gpu_per_hour * HOURS_PER_DAY * 1000,
            "node_per_1000_node_days": self.node_per_hour * HOURS_PER_DAY * 1000,
            "source": self.source,
        }


LLAMA3_405B = FailureModel.from_counts(
    "llama3-405b (16,384 H100, 54 days)",
    gpu_failures=148 + 72 + 19 + 17 + 6 + 6,
    node_failures=(35 + 32 + 7 + 3 + 3 + 2 + 2 + 2 + 2) + (54 + 7 + 2),
    gpus=16384,
    gpus_per_node=8,
    days=54,
    source="The Llama 3 Herd of Models (Meta, 2024), section 3.3.4, table 5: 419 unexpected "
    "interruptions in 54 days on 16,384 H100 GPUs",
)


def ettr(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected ETTR with a checkpoint every ``interval_s`` of training (Daly's exact model, above).

    Raises:
        ConfigError: a non-positive interval or a negative cost.
    """
    if interval_s <= 0 or checkpoint_s < 0 or restart_s < 0 or mtbf_s <= 0:
        raise ConfigError("interval must be > 0, checkpoint and restart >= 0, MTBF > 0")
    if math.isinf(mtbf_s):
        return interval_s / (interval_s + checkpoint_s)
    m = mtbf_s
    wall = m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m)
    return interval_s / wall


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006, eq. 20): ``sqrt(2CM) [1 + sqrt(C/2M)/3 + C/(18M)] - C`` for
    ``C < 2M``, else ``M``."""
    c, m = checkpoint_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def best_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that maximises :func:`ettr` (it does not depend on the restart cost).

    ``d/dtau`` of ``tau / (exp((tau + C)/M) - 1)`` is zero where ``(1 - tau/M) exp((tau + C)/M) = 1``;
    the left side falls from ``exp(C/M) > 1`` at 0 to 0 at ``M``, so the root is found by bisection.
    """
    if math.isinf(mtbf_s):
        return math.inf  # nothing fails: never checkpoint
    if checkpoint_s <= 0:
        return 0.0  # free checkpoints: as often as possible
    m, c = mtbf_s, checkpoint_s
    lo, hi = 0.0, m
    for _ in range(200):
        mid = (lo + hi) / 2
        if (1 - mid / m) * math.exp((mid + c) / m) > 1:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * m:
            break
    return (lo + hi) / 2


# Checkpoint intervals shown for comparison (seconds): 5 minutes to 4 hours.
INTERVALS_S: tuple[float, ...] = (300, 600, 900, 1800, 3600, 7200, 14400)


@dataclass(frozen=True)
class EttrPlan:
    """Expected ETTR of a job at one scale: per checkpoint interval, and at the best interval.

    Attributes:
        gpus / nodes: the job's size.
        mtbf_s: its mean time between failures.
        checkpoint_s: the training stall per checkpoint.
        restart_s: time from a failure to training again (detection, rescheduling, loading).
        best_interval_s: the interval that maximises ETTR (numerically), and best_ettr its ETTR.
        young_interval_s / daly_interval_s: the closed-form optima, for comparison.
        by_interval: ``(interval_s, ettr)`` for :data:`INTERVALS_S`.
        model: the failure model used.
    """

    gpus: int
    nodes: int
    mtbf_s: float
    checkpoint_s: float
    restart_s: float
    best_interval_s: float
    best_ettr: float
    young_interval_s: float
    daly_interval_s: float
    by_interval: tuple[tuple[float, float], ...]
    model: FailureModel
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "gpus": self.gpus,
            "nodes": self.nodes,
            "mtbf_h": self.mtbf_s / 3600,
            "checkpoint_s": self.checkpoint_s,
            "restart_s": self.restart_s,
            "best_interval_s": self.best_interval_s,
            "expected_ettr": self.best_ettr,
            "young_interval_s": self.young_interval_s,
            "daly_interval_s": self.daly_interval_s,
            "by_interval": [{"interval_s": t, "ettr": e} for t, e in self.by_interval],
            "failure_model": self.model.to_dict(),
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """One line: the expected ETTR at the best interval, MTBF and costs, and Young/Daly."""
        return (
            f"expected ETTR {self.best_ettr:.1%} at {self.gpus:,} GPUs with a checkpoint every "
            f"{_duration(self.best_interval_s)} (MTBF {self.mtbf_s / 3600:.2f} h, checkpoint stall "
            f"{self.checkpoint_s:.1f} s, restart {self.restart_s:.0f} s; "
            f"Young {_duration(self.young_interval_s)}, Daly {_duration(self.daly_interval_s)})"
        )


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def plan_ettr(
    gpus: int,
    gpus_per_node: int,
    checkpoint_s: float,
    restart_s: float,
    model: FailureModel = LLAMA3_405B,
    intervals: tuple[float, ...] = INTERVALS_S,
    notes: tuple[str, ...] = (),
) -> EttrPlan:
    """Expected ETTR of a job of ``gpus`` GPUs for each interval in ``intervals`` and at the best one.

    Raises:
        ConfigError: a bad size or cost.
    """
    if checkpoint_s < 0 or restart_s < 0:
        raise ConfigError(f"checkpoint and restart must be >= 0 s, got {checkpoint_s} and {restart_s}")
    mtbf = model.mtbf_s(gpus, gpus_per_node)
    best = best_interval(checkpoint_s, mtbf)
    if math.isinf(best):
        best_e = 1.0
    elif best == 0:
        best_e = math.exp(-restart_s / mtbf)  # the limit of ettr() as the interval goes to 0
    else:
        best_e = ettr(best, checkpoint_s, restart_s, mtbf)
    return EttrPlan(
        gpus=gpus,
        nodes=math.ceil(gpus / gpus_per_node),
        mtbf_s=mtbf,
        checkpoint_s=checkpoint_s,
        restart_s=restart_s,
        best_interval_s=best,
        best_ettr=best_e,
        young_interval_s=young_interval(checkpoint_s, mtbf),
        daly_interval_s=daly_interval(checkpoint_s, mtbf) if math.isfinite(mtbf) else math.inf,
        by_interval=tuple((t, ettr(t, checkpoint_s, restart_s, mtbf)) for t in intervals),
        model=model,
        notes=notes,
    )
