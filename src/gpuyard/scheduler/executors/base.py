"""The executor seam: a dry run builds an inspectable LaunchPlan; launch carries it out.

:class:`Executor` is the one base of what runs a job's processes (local, ray). Calls handed out as
futures (trials, folds, pipeline stages) go through :mod:`gpuyard.scheduler.executors.tasks`, whose
``jobs`` kind submits each call as a job that one of these executors runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuyard import exitcodes
from gpuyard.errors import StoreError
from gpuyard.scheduler.spec import JobSpec
from gpuyard.settings import NODE_ENV, TEAM_ENV


@dataclass(frozen=True)
class NodeSlots:
    """The part of a job on one node: its host name, GPU indices and CPU slots.

    A share of one GPU has that GPU in ``gpus`` and its ``share`` (fraction of compute) and
    ``memory_gb``; ``uuid`` is the GPU's UUID when known (MPS clients should name GPUs by UUID). A MIG
    job has its slices' GPUs in ``gpus`` and their ``MIG-...`` UUIDs in ``mig``.
    """

    node: str
    gpus: tuple[int, ...]
    cpus: int = 0
    share: float | None = None
    memory_gb: float = 0.0
    uuid: str = ""
    mig: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch will do, computed without doing it (the dry run).

    Attributes:
        job_id: the job.
        attempt: 1 for the first run, +1 per restart or resume.
        argv: the command each worker runs.
        env: variables added to the server's environment (CUDA_VISIBLE_DEVICES, GPUYARD_*).
        cwd: working directory.
        log_path: file that gets stdout and stderr (appended across attempts).
        nodes: where it runs.
        executor: name of the executor that made the plan.
        extra: executor-specific details (Ray bundles, rendezvous).
    """

    job_id: int
    attempt: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_path: str
    nodes: list[NodeSlots]
    executor: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class ExitStatus:
    """How a job's process ended: an exit code, or killed by a signal, or lost (no trace left)."""

    code: int | None
    killed: bool = False
    lost: bool = False
    # When it ended, where the executor knows (the exit file's time): a job that ended while no server
    # ran keeps its real end time instead of the moment a later server noticed.
    ended_at: datetime | None = None
    # Why, when the executor knows better than the code: "out of memory: limit 1.0 GiB", "cannot
    # start 'x': ...". Shown instead of the code (in the job's reason, `jobs ls` and `jobs show`).
    reason: str = ""
    # What else happened to the attempt, one event each ("log cut at 100 MiB: ...").
    notes: tuple[str, ...] = ()
    # Ended by someone outside gpuyard (an admin's ``scancel``): cancelled, not failed; it runs again
    # only as its spec's max_restarts allows.
    cancelled: bool = False
    # The executor has no trace of how the attempt ended (a cluster controller that lost its state):
    # it may have finished, so it is not run again.
    untraced: bool = False

    def describe(self) -> str:
        """Short why for events: "exit code 3", "killed by SIGTERM", "killed (SIGKILL)", or ``reason``."""
        if self.reason:
            return self.reason
        if self.code is None:
            return "lost (never started)" if self.lost else "killed (SIGKILL)"
        if self.code < 0:
            try:
                return f"killed by {signal.Signals(-self.code).name}"
            except ValueError:
                return f"killed by signal {-self.code}"
        return f"exit code {self.code}"

    @property
    def preempted(self) -> bool:
        """The job checkpointed after SIGTERM and asked to be resumed."""
        return self.code == exitcodes.PREEMPTED


class ExecutorUnreachable(StoreError):
    """The executor's controller (Slurm's slurmctld, Ray's head) did not answer: what it would have
    said is unknown, which is neither "running" nor "gone". A job keeps its state, resources and place
    until the controller answers again.

    Attributes:
        submitted: for a submission, whether it may have reached the controller (None: cannot tell,
            the call timed out) or surely did not (False: refused before it was sent).
    """

    def __init__(self, message: str, submitted: bool | None = False) -> None:
        super().__init__(message)
        self.submitted = submitted


def node_nproc(spec: JobSpec, gpus: int = 0) -> int:
    """Training ranks on a node where the job has ``gpus`` GPUs: one per GPU; without GPUs
    spec.nproc, else the job's GPUs, else 1."""
    return gpus or spec.nproc or max(1, spec.resources.gpus)


def gang_world_size(spec: JobSpec, nodes: list[NodeSlots]) -> int:
    """Training ranks of a job over all its nodes: the sum of each node's, which may differ (a gang
    placed 8 + 4 is a world of 12, not 2 x 8)."""
    return sum(node_nproc(spec, len(n.gpus)) for n in nodes)


def job_argv(
    spec: JobSpec,
    nproc: int | None = None,
    nnodes: int = 1,
    rdzv: str | None = None,
    python: str | None = None,
    world_size: int | None = None,
) -> list[str]:
    """The command of a job: its own argv, or ``gpuyard train SPEC --nproc N`` for a training spec.

    Args:
        spec: the job.
        nproc: processes on this node (default: spec.nproc, else the job's GPUs, else 1).
        nnodes: nodes taking part; above 1 the training runtime meets its peers at ``rdzv``.
        rdzv: HOST:PORT of the rendezvous (multi-node jobs).
        python: the interpreter whose ``gpuyard`` runs a training spec (default: this one).
        world_size: the job's ranks over all nodes (:func:`gang_world_size`); required with
            ``nnodes`` above 1, since nodes may run different numbers of ranks.

    Raises:
        ValueError: a multi-node training job without its world size, or one smaller than its nodes.
    """
    if spec.command is not None:
        return list(spec.command)
    n = node_nproc(spec, nproc or 0)
    python = python or sys.executable
    exe = shutil.which("gpuyard", path=str(Path(python).parent))
    argv = [*([exe] if exe else [python, "-m", "gpuyard.cli.main"]), "train", str(spec.train)]
    argv += ["--nproc", str(n)]
    if nnodes > 1 and rdzv:
        if world_size is None or world_size < n + nnodes - 1:
            raise ValueError(f"job_argv: world size {world_size} for {nnodes} nodes, {n} ranks on this one")
        argv += ["--nnodes", str(nnodes), "--rdzv", rdzv, "--world-size", str(world_size)]
    if spec.checkpoint_dir:
        argv += ["--run-dir", spec.checkpoint_dir]  # checkpoints live there: a resumed job finds them
    return argv


@dataclass(frozen=True)
class MpsConfig:
    """An NVIDIA MPS control daemon that share jobs join (``nvidia-cuda-mps-control -d``, started by
    the administrator with the same pipe directory). gpuyard never starts or stops it.

    Attributes:
        pipe_dir: its ``CUDA_MPS_PIPE_DIRECTORY``.
        log_dir: its ``CUDA_MPS_LOG_DIRECTORY`` ("" : the default).
    """

    pipe_dir: str
    log_dir: str = ""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> MpsConfig | None:
        """The daemon named by ``GPUYARD_MPS_PIPE_DIRECTORY`` (and ``GPUYARD_MPS_LOG_DIRECTORY``) in the
        server's environment; None when unset (shares are then time-sliced)."""
        import os

        env = os.environ if environ is None else environ
        pipe = env.get("GPUYARD_MPS_PIPE_DIRECTORY", "")
        return cls(pipe, env.get("GPUYARD_MPS_LOG_DIRECTORY", "")) if pipe else None


def share_env(slot: NodeSlots, mps: MpsConfig | None) -> dict[str, str]:
    """The GPU variables of a share or MIG job on one node.

    MIG: ``CUDA_VISIBLE_DEVICES`` lists the slices' ``MIG-...`` UUIDs (hardware isolation). A share
    with an MPS daemon: the GPU (by UUID when known), ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its
    fraction of the SMs) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its memory, on the one device it
    sees, ordinal 0). Without MPS: the GPU's index only, shared by time-slicing (no limit enforced);
    ``GPUYARD_GPU_SHARE`` and ``GPUYARD_GPU_MEMORY_GB`` tell the job its share either way.
    """
    if slot.mig:
        return {"CUDA_VISIBLE_DEVICES": ",".join(slot.mig), "GPUYARD_MIG": "1"}
    share = slot.share if slot.share is not None else 1.0
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in slot.gpus),
        "GPUYARD_GPU_SHARE": f"{share:.4g}",
        "GPUYARD_GPU_MEMORY_GB": f"{slot.memory_gb:.4g}",
        "GPUYARD_GPU_SHARING": "time-slicing",
    }
    if mps is not None:
        env.update(
            CUDA_VISIBLE_DEVICES=slot.uuid or env["CUDA_VISIBLE_DEVICES"],
            CUDA_MPS_PIPE_DIRECTORY=mps.pipe_dir,
            CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(max(1, min(100, round(share * 100)))),
            GPUYARD_GPU_SHARING="mps",
        )
        if mps.log_dir:
            env["CUDA_MPS_LOG_DIRECTORY"] = mps.log_dir
        if slot.memory_gb > 0:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, int(slot.memory_gb * 1024))}MB"
    return env


def job_env(
    job_id: int,
    spec: JobSpec,
    attempt: int,
    gpus: tuple[int, ...],
    slot: NodeSlots | None = None,
    mps: MpsConfig | None = None,
) -> dict[str, str]:
    """Variables a job gets: its GPUs (none visible for a CPU-only job), identity and checkpoint folder.

    ``slot``: the job's part of the node; for a share or MIG job its variables come from
    :func:`share_env` (with ``mps``, the MPS daemon shares join).
    """
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
        "GPUYARD_JOB_ID": str(job_id),
        "GPUYARD_JOB_NAME": spec.name,
        TEAM_ENV: spec.team,  # the runs the job tracks belong to its team
        "GPUYARD_ATTEMPT": str(attempt),
    }
    if slot is not None:
        env[NODE_ENV] = slot.node  # the scheduler's name of the node (straggler reports name it)
    if slot is not None and (slot.mig or slot.share is not None):
        env.update(share_env(slot, mps))
    if spec.checkpoint_dir:
        env["GPUYARD_CHECKPOINT_DIR"] = spec.checkpoint_dir
    env.update(spec.env)
    if spec.workdir:
        # The job's own modules import from its working directory, as `python -m` would find them
        # (before a PYTHONPATH the spec sets itself).
        extra = spec.env.get("PYTHONPATH")
        env["PYTHONPATH"] = spec.workdir + (os.pathsep + extra if extra else "")
    return env


class Executor(ABC):
    """Runs jobs. ``plan`` is pure (the dry run); the other methods act on processes."""

    name = "base"
    multi_node = False  # can one job span several nodes

    @abstractmethod
    def plan(self, job_id: int, spec: JobSpec, nodes: list[NodeSlots], attempt: int) -> LaunchPlan:
        """Build the launch plan for a placed job, without launching anything."""

    @abstractmethod
    def launch(self, plan: LaunchPlan) -> dict[str, Any]:
        """Start the plan; return a JSON-able handle that finds the job again after a server restart."""

    @abstractmethod
    def poll(self, handle: dict[str, Any]) -> ExitStatus | None:
        """None while the job runs; its ExitStatus once it has ended."""

    @abstractmethod
    def stop(self, handle: dict[str, Any], kill: bool) -> None:
        """Ask the job to stop (SIGTERM: checkpoint and exit) or, with ``kill``, end it (SIGKILL)."""

    def recover(self, job_id: int, plan_hint: dict[str, Any] | None) -> dict[str, Any] | None:
        """After a crash between placing and recording a launch: the handle of a job that did start."""
        return None

    def unavailable(self) -> str | None:
        """Why no job can be started or stopped now (a cluster controller that does not answer), or
        None. The service starts nothing while it is not None."""
        return None

    def close(self) -> None:  # noqa: B027 - most executors hold nothing to release
        """Release resources held by the executor (connections)."""
