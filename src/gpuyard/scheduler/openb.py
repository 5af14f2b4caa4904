"""Alibaba's openb GPU-sharing traces (cluster-trace-gpu-v2023): the node list and the pod lists.

The files are the data behind FGD (Weng et al., USENIX ATC'23). A node list has
``sn,cpu_milli,memory_mib,gpu,model``; a pod list ``name,cpu_milli,memory_mib,num_gpu,gpu_milli``
and, in some files, ``gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time``.
``gpu_milli`` < 1000 with ``num_gpu`` = 1 is a share of one GPU; ``gpu_spec`` lists the GPU models
a pod may run on (``|``-separated; empty: any). Times are seconds.

The traces are not part of the repository: :func:`traces_dir` finds them (``GPUYARD_TRACES``, else
``../shared/traces`` beside the repository root or the working directory).

MIG, an addition of gpuyard's (not in the openb files): a node list may have a ``mig`` column, the
MIG layout of the node's GPUs (:func:`parse_mig_layout`), and a pod list a ``mig`` column, the MIG
profile a pod asks for (``num_gpu`` of its slices, on one node; ``gpu_milli`` is then ignored).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.hardware.mig import COMPUTE_SLICES, MIG_GPUS, PROFILE_NAMES, arrange, mig_model

MILLI = 1000  # a whole GPU, in the traces' unit
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
NODE_LIST = "openb_node_list_gpu_node.csv"
POD_LISTS = ("openb_pod_list_gpushare40.csv", "openb_pod_list_multigpu50.csv")


MigLayout = tuple[tuple[tuple[str, int], ...], ...]  # per GPU: its instances (profile, first memory slice)


@dataclass(frozen=True)
class GpuNode:
    """One node of the openb cluster: CPU (millicores), memory (MiB), whole GPUs of one model.

    ``mig``: empty, or one entry per GPU: the MIG instances of that GPU as ``(profile, start)``
    (empty: the GPU is not in MIG mode). A GPU in MIG mode serves only its instances.
    ``gpu_memory_mib``: memory of each GPU (0: not known, never checked; the openb lists have none).
    """

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str
    mig: MigLayout = ()
    gpu_memory_mib: int = 0


@dataclass(frozen=True)
class GpuTask:
    """One pod: ``num_gpu`` GPUs of ``gpu_milli`` thousandths each (a share when < 1000, then one GPU).

    ``gpu_spec`` is the allowed GPU models (empty: any). ``creation`` and ``duration`` are seconds,
    None when the file has no times. ``mig``: a MIG profile (``3g.40gb``): the task asks for
    ``num_gpu`` instances of it on one node (``gpu_milli`` 0), nothing else of a GPU.
    ``gpu_memory_mib``: GPU memory it holds on each of its GPUs (0: none asked; the server's shares).
    """

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()
    creation: float | None = None
    duration: float | None = None
    mig: str = ""
    gpu_memory_mib: int = 0

    @property
    def gpu(self) -> float:
        """GPUs asked for, shares counted as fractions (0.25 for gpu_milli 250), a MIG instance as
        its compute slices over 7 (3/7 for 3g.40gb)."""
        if self.mig:
            return self.num_gpu * mig_compute(self.mig) / COMPUTE_SLICES
        return self.num_gpu * self.gpu_milli / MILLI

    @property
    def shape(self) -> tuple[Any, ...]:
        """What placement looks at: (cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec), and the
        MIG profile after them for a MIG task, or ``""`` and its GPU memory for a task that asks some."""
        base = (self.cpu_milli, self.memory_mib, self.num_gpu, self.gpu_milli, self.gpu_spec)
        if self.mig:
            return (*base, self.mig)
        return (*base, "", self.gpu_memory_mib) if self.gpu_memory_mib else base


def mig_compute(profile: str) -> int:
    """Compute slices (of 7) of a MIG profile name (``3g.40gb`` -> 3)."""
    return int(profile.split("g.", 1)[0])


def check_profile(profile: str, where: str) -> str:
    """``profile`` (lower case, stripped) when it is a MIG profile of the table, else a one-line error.

    Raises:
        ConfigError: not a profile of :mod:`gpuyard.hardware.mig`.
    """
    name = profile.strip().lower()
    if name not in PROFILE_NAMES:
        raise ConfigError(f"{where}: mig {profile!r} is not a MIG profile; known: {', '.join(PROFILE_NAMES)}")
    return name


def parse_mig_layout(text: str, model: str, gpus: int, where: str) -> MigLayout:
    """The MIG layout of one node's ``gpus`` GPUs of ``model`` from ``text``.

    GPU layouts are separated by ``|``, GPU 0 first; GPUs past the last are not in MIG mode, nor is
    one written ``-``. ``N*LAYOUT`` stands for N GPUs alike, ``*LAYOUT`` for every GPU left. A GPU's
    layout is its instances joined by ``+``: a profile (``3g.40gb``), ``Nx`` before it for N alike
    (``2x1g.10gb``), ``@S`` after it for its first memory slice (``3g.40gb@4``; else the first
    arrangement the hardware allows, :func:`gpuyard.hardware.mig.arrange`). Example, 8 GPUs:
    ``4*3g.40gb+2g.20gb+2x1g.10gb|2*7g.80gb`` (6 in MIG mode, 2 whole).

    Raises:
        ConfigError: a model without MIG, an unknown profile, a layout the GPU cannot hold, more GPU
            layouts than GPUs (one line, naming ``where``).
    """
    text = text.strip()
    if not text:
        return ()
    canon = mig_model(model) or (model if model in MIG_GPUS else None)
    if canon is None:
        raise ConfigError(
            f"{where}: mig layout {text!r} on GPU model {model!r}, which has no MIG; MIG GPUs: "
            f"{', '.join(MIG_GPUS)}"
        )
    layout: list[tuple[tuple[str, int], ...]] = []
    for part in text.split("|"):
        part = part.strip()
        count: int | None = 1
        if "*" in part:
            head, part = part.split("*", 1)
            count = None if not head.strip() else _count(head, where, text)
        if count is None:
            count = gpus - len(layout)
        layout.extend([_gpu_layout(part.strip(), canon, where)] * count)
    if len(layout) > gpus:
        raise ConfigError(f"{where}: mig layout {text!r} names {len(layout)} GPUs, the node has {gpus}")
    layout += [()] * (gpus - len(layout))
    return tuple(layout) if any(layout) else ()


def _count(text: str, where: str, layout: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{where}: mig layout {layout!r}: {text!r} before '*' or 'x' is not a count >= 1")
    return n


def _gpu_layout(text: str, model: str, where: str) -> tuple[tuple[str, int], ...]:
    if text in ("", "-"):
        return ()
    instances: list[tuple[str, int | None]] = []
    for item in text.split("+"):
        item = item.strip().lower()
        n = 1
        if "x" in item:  # no profile name has an x
            head, item = item.split("x", 1)
            n = _count(head, where, text)
        name, _, at = item.partition("@")
        start: int | None = None
        if at:
            try:
                start = int(at)
            except ValueError:
                raise ConfigError(f"{where}: mig {item!r}: the start after '@' is not a number") from None
        instances.extend([(check_profile(name, where), start)] * n)
    try:
        starts = arrange(model, instances)
    except ValueError as exc:
        raise ConfigError(f"{where}: mig layout {text!r}: {exc}") from None
    return tuple(
        sorted(((name, s) for (name, _), s in zip(instances, starts, strict=True)), key=lambda x: x[1])
    )


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
    """Read an openb node list (with a ``mig`` column: each node's MIG layout, :func:`parse_mig_layout`).

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
            if row.get("mig"):
                mig = parse_mig_layout(row["mig"], node.model, node.gpus, where)
                node = GpuNode(node.name, node.cpu_milli, node.memory_mib, node.gpus, node.model, mig)
            nodes.append(node)
    if not nodes:
        raise ConfigError(f"node list {path}: no nodes")
    return nodes


def load_openb_tasks(path: str | Path, limit: int | None = None) -> list[GpuTask]:
    """Read an openb pod list (all pods, in file order; ``limit``: the first ones only).

    A pod with ``deletion_time`` before its ``creation_time`` is refused; ``duration`` is their
    difference when both are there. With a ``mig`` column, a pod naming a MIG profile there asks for
    ``num_gpu`` (>= 1) instances of it.

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
            mig = check_profile(row["mig"], where) if row.get("mig") else ""
            if mig and num_gpu < 1:
                raise ConfigError(
                    f"{where}: mig {mig} with num_gpu {num_gpu}: num_gpu counts its instances, >= 1"
                )
            milli = _int(row, "gpu_milli", where) if num_gpu and not mig else 0
            if num_gpu and not mig and not 0 < milli <= MILLI:
                raise ConfigError(f"{where}: gpu_milli {milli} with num_gpu {num_gpu}; must be 1..{MILLI}")
            if num_gpu > 1 and not mig and milli < MILLI:
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
                    mig=mig,
                )
            )
    if not tasks:
        raise ConfigError(f"pod list {path}: no pods")
    return tasks
