"""Alibaba's openb GPU-sharing traces (cluster-trace-gpu-v2023): the node list and the pod lists.

The files are the data behind FGD (Weng et al., USENIX ATC'23). A node list has
``sn,cpu_milli,memory_mib,gpu,model``; a pod list ``name,cpu_milli,memory_mib,num_gpu,gpu_milli``
and, in some files, ``gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time``.
``gpu_milli`` < 1000 with ``num_gpu`` = 1 is a share of one GPU; ``gpu_spec`` lists the GPU models
a pod may run on (``|``-separated; empty: any). Times are seconds.

The traces are not part of the repository: :func:`traces_dir` finds them (``GPUYARD_TRACES``, else
``../shared/traces`` beside the repository root or the working directory).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from gpuyard.errors import ConfigError, NotFoundError

MILLI = 1000  # a whole GPU, in the traces' unit
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
NODE_LIST = "openb_node_list_gpu_node.csv"
POD_LISTS = ("openb_pod_list_gpushare40.csv", "openb_pod_list_multigpu50.csv")


@dataclass(frozen=True)
class GpuNode:
    """One node of the openb cluster: CPU (millicores), memory (MiB), whole GPUs of one model."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class GpuTask:
    """One pod: ``num_gpu`` GPUs of ``gpu_milli`` thousandths each (a share when < 1000, then one GPU).

    ``gpu_spec`` is the allowed GPU models (empty: any). ``creation`` and ``duration`` are seconds,
    None when the file has no times.
    """

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()
    creation: float | None = None
    duration: float | None = None

    @property
    def gpu(self) -> float:
        """GPUs asked for, shares counted as fractions (0.25 for gpu_milli 250)."""
        return self.num_gpu * self.gpu_milli / MILLI

    @property
    def shape(self) -> tuple[int, int, int, int, tuple[str, ...]]:
        """What placement looks at: (cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec)."""
        return (self.cpu_milli, self.memory_mib, self.num_gpu, self.gpu_milli, self.gpu_spec)


def traces_dir() -> Path:
    """Where the shared traces are: ``$GPUYARD_TRACES``, else ``../shared/traces`` of the repository.

    Falls back to ``../shared/traces`` of the working directory (a clone run from its root); the
    returned path may not exist (callers say so or skip).
    """
    env = os.environ.get("GPUYARD_TRACES")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3]
    for base in (repo, Path.cwd()):
        candidate = base.parent / "shared" / "traces"
        if candidate.is_dir():
            return candidate
    return repo.parent / "shared" / "traces"


def _header(path: Path) -> list[str]:
    if not path.is_file():
        raise NotFoundError(f"trace {path}: no such file")
    with path.open(newline="") as fh:
        return next(csv.reader(fh), [])


def is_openb_pods(path: str | Path) -> bool:
    """True when ``path`` is an openb pod list (told by its header)."""
    return set(POD_COLUMNS) <= set(_header(Path(path)))


def is_openb_nodes(path: str | Path) -> bool:
    """True when ``path`` is an openb node list (told by its header)."""
    return set(NODE_COLUMNS) <= set(_header(Path(path)))


def _int(row: dict[str, str], column: str, where: str) -> int:
    try:
        value = int(row[column])
    except (TypeError, ValueError, KeyError):
        raise ConfigError(f"{where}: column {column!r} is {row.get(column)!r}, not an integer") from None
    if value < 0:
        raise ConfigError(f"{where}: column {column!r} is {value}, must be >= 0")
    return value


def load_openb_nodes(path: str | Path) -> list[GpuNode]:
    """Read an openb node list.

    Raises:
        NotFoundError: no such file.
        ConfigError: not a node list, or a bad value (the message names line and column).
    """
    path = Path(path)
    header = _header(path)
    if not set(NODE_COLUMNS) <= set(header):
        raise ConfigError(
            f"node list {path}: header {header} lacks the openb columns {','.join(NODE_COLUMNS)}"
        )
    nodes: list[GpuNode] = []
    with path.open(newline="") as fh:
        for i, row in enumerate(csv.DictReader(fh), start=2):
            where = f"node list {path} line {i}"
            node = GpuNode(
                name=row["sn"],
                cpu_milli=_int(row, "cpu_milli", where),
                memory_mib=_int(row, "memory_mib", where),
                gpus=_int(row, "gpu", where),
                model=row["model"] or "",
            )
            if node.gpus > 64:
                raise ConfigError(f"{where}: {node.gpus} GPUs on one node; at most 64")
            nodes.append(node)
    if not nodes:
        raise ConfigError(f"node list {path}: no nodes")
    return nodes


def load_openb_tasks(path: str | Path, limit: int | None = None) -> list[GpuTask]:
    """Read an openb pod list (all pods, in file order; ``limit``: the first ones only).

    A pod with ``deletion_time`` before its ``creation_time`` is refused; ``duration`` is their
    difference when both are there.

    Raises:
        NotFoundError: no such file.
        ConfigError: not a pod list, or a bad value (the message names line and column).
    """
    path = Path(path)
    header = _header(path)
    if not set(POD_COLUMNS) <= set(header):
        raise ConfigError(
            f"pod list {path}: header {header} lacks the openb columns {', '.join(POD_COLUMNS)}"
        )
    timed = {"creation_time", "deletion_time"} <= set(header)
    tasks: list[GpuTask] = []
    with path.open(newline="") as fh:
        for i, row in enumerate(csv.DictReader(fh), start=2):
            if limit is not None and len(tasks) >= limit:
                break
            where = f"pod list {path} line {i}"
            num_gpu = _int(row, "num_gpu", where)
            milli = _int(row, "gpu_milli", where) if num_gpu else 0
            if num_gpu and not 0 < milli <= MILLI:
                raise ConfigError(f"{where}: gpu_milli {milli} with num_gpu {num_gpu}; must be 1..{MILLI}")
            if num_gpu > 1 and milli < MILLI:
                raise ConfigError(f"{where}: a share of a GPU (gpu_milli {milli}) with num_gpu {num_gpu}")
            spec = tuple(sorted(s for s in (row.get("gpu_spec") or "").split("|") if s and s != "nan"))
            creation = duration = None
            if timed and row.get("creation_time") and row.get("deletion_time"):
                creation = float(_int(row, "creation_time", where))
                end = float(_int(row, "deletion_time", where))
                if end < creation:
                    raise ConfigError(f"{where}: deletion_time {end:.0f} before creation_time {creation:.0f}")
                duration = end - creation
            tasks.append(
                GpuTask(
                    name=row["name"],
                    cpu_milli=_int(row, "cpu_milli", where),
                    memory_mib=_int(row, "memory_mib", where),
                    num_gpu=num_gpu,
                    gpu_milli=milli,
                    gpu_spec=spec,
                    creation=creation,
                    duration=duration,
                )
            )
    if not tasks:
        raise ConfigError(f"pod list {path}: no pods")
    return tasks
