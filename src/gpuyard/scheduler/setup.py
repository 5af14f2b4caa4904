"""Assemble a JobService from options: the store, this machine or a Ray cluster, a policy, teams."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.scheduler.elastic import ElasticConfig, TrainSizes
from gpuyard.scheduler.executors.base import Executor
from gpuyard.scheduler.executors.limits import LimitDefaults, setup_confinement
from gpuyard.scheduler.fabric_placement import DEFAULT_MAX_WAIT_S
from gpuyard.scheduler.lease import SchedulerLease, lease_conflict
from gpuyard.scheduler.nodes import check_fabric_nodes
from gpuyard.scheduler.packing import LivePacking
from gpuyard.scheduler.placement import DEFAULT_PACKING
from gpuyard.scheduler.service import JobService, ServiceConfig
from gpuyard.settings import load_settings
from gpuyard.store.db import get_store


def build_service(
    policy: str = "fifo",
    teams: dict[str, float] | None = None,
    fake_gpus: int | None = None,
    cpus: int | None = None,
    grace_s: float = 10.0,
    min_run_s: float = 300.0,
    ray_address: str | None = None,
    role: str = "in-process",
    placement: str = "topology",
    cluster: str | None = None,
    max_wait_s: float = DEFAULT_MAX_WAIT_S,
    calibration: str | None = None,
    job_user: str | None = None,
    job_dir: str | None = None,
    health_config: str | None = None,
    resize_interval_s: float | None = 300.0,
    restart_cost_s: float = 60.0,
    train_sizes: TrainSizes | None = None,
    slurm: bool = False,
    slurm_config: str | None = None,
    slurm_partition: str | None = None,
    slurm_account: str | None = None,
    limits: LimitDefaults | None = None,
    job_python: str | None = None,
    packing: str = DEFAULT_PACKING,
) -> JobService:
    """The job service of `gpuyard server`.

    Args:
        policy: scheduling policy name.
        teams: team -> fair-share weight; "default" (weight 1) is always known.
        fake_gpus: pretend this machine has N GPUs (placement tests on a GPU-less machine).
        cpus: CPU slots for CPU-only jobs (default: the machine's cores).
        grace_s: seconds between SIGTERM and SIGKILL on cancel and preemption.
        min_run_s: how long a job runs before a preemptive policy may take its GPUs.
        ray_address: run jobs on this Ray cluster instead of this machine.
        role: ``server`` for `gpuyard server`, ``in-process`` for a service inside another command.
        placement: ``topology`` or ``fabric`` (jobs with a workload placed by predicted step time).
        cluster: fabric preset or file describing the nodes' fabric (needed by ``fabric`` placement).
        calibration: a ``gpuyard fabric calibrate`` file applied to ``cluster`` (fabric placement).
        max_wait_s: under fabric placement, the longest a job waits for a consolidated placement.
        packing: how GPU shares and MIG slices are placed (``gpuyard.scheduler.packing.PACKING_POLICIES``).
        job_user: ``server`` role on this machine: the Unix user jobs run as (None: ``gpuyard-job`` when
            root, else the server's own); see :mod:`gpuyard.scheduler.executors.isolation`.
        job_dir: ``server`` role on this machine: the folder of the jobs' working directories.
        health_config: ``server`` role: a YAML file of node health check settings
            (:class:`gpuyard.hardware.health.NodeCheckConfig`); None: the defaults. On this machine its
            node is checked periodically when it has real GPUs (not with ``fake_gpus``); on Ray every
            node is, each on its node (:class:`gpuyard.scheduler.nodes.RayHealthMonitor`).
        resize_interval_s: the least time between an elastic job's start and its next grow or shrink;
            None: running elastic jobs are never resized (they still start at their best size).
        restart_cost_s: what one restart of an elastic job is taken to cost; a grow must save twice it.
        train_sizes: the sizes an elastic training job's spec can run at
            (``gpuyard.train.resize.allowed_world_sizes``; None: every size of its range).
        limits: ``server`` role: the jobs' default limits (memory, processes, open files, log cap;
            :mod:`gpuyard.scheduler.executors.limits`); None: the defaults of LimitDefaults.
        job_python: ``server`` role on this machine: the interpreter jobs are given (default: the
            server's); a job user that cannot run it makes the server refuse to start.
        slurm: run each job as a Slurm batch job on the cluster the Slurm tools reach
            (:mod:`gpuyard.scheduler.executors.slurm`); its nodes come from Slurm.
        slurm_config: YAML of the Slurm partition, account and QoS (per team too).
        slurm_partition, slurm_account: the defaults of every job (override the file's).

    Raises:
        ConfigError: an unknown placement, fabric placement without a cluster (or a cluster without
            it), a negative ``max_wait_s``, or a cluster whose nodes are not the scheduler's (see
            :func:`gpuyard.scheduler.nodes.check_fabric_nodes`).
        NotFoundError: ``cluster`` is neither a preset nor a file (the message lists the presets).
        ConfigError: (server role) the job user cannot be used (see
            :func:`gpuyard.scheduler.executors.isolation.resolve_isolation`), or --job-user with Ray.
        ConflictError: another live job service is the store's scheduler (the message names it);
            checked before any executor or Ray connection is set up. The lease itself is taken by
            ``recover()`` or the first ``tick()``.
    """
    # Options are checked before the store, the lease, Ray or the hardware probe are touched.
    fabric = _fabric_cluster(placement, cluster, max_wait_s, calibration)
    LivePacking(packing)  # an unknown name is refused before anything is touched
    settings = load_settings()
    store = get_store(settings)
    config = ServiceConfig(
        policy=policy,
        teams={"default": 1.0, **(teams or {})},
        grace_s=grace_s,
        min_run_s=min_run_s,
        placement=placement,
        max_wait_s=max_wait_s,
        packing=packing,
        elastic=ElasticConfig(
            enabled=resize_interval_s is not None,
            interval_s=resize_interval_s or 0.0,
            restart_cost_s=restart_cost_s,
        ),
    )
    # Refuse before building the executor: a refused server must not touch Ray or the GPUs. This only
    # looks (a service built to list jobs must not hold the store); recover() or the first tick takes it.
    holder = SchedulerLease(store, role=role).live_holder()
    if holder is not None:
        raise lease_conflict(store, role, holder)
    executor: Executor
    ray_health = None  # the health config of a Ray server's node checks
    if ray_address and slurm:
        raise ConfigError("--ray and --slurm: a server runs its jobs on one of them; choose one")
    if not slurm and (slurm_config or slurm_partition or slurm_account):
        raise ConfigError("--slurm-config/--slurm-partition/--slurm-account apply with --slurm")
    if slurm:
        from gpuyard.scheduler.executors.slurm import SlurmConfig, SlurmExecutor

        slurm_cfg = SlurmConfig.load(slurm_config, slurm_partition or "", slurm_account or "")
        slurm_isolation = None
        if role == "server":  # jobs run as the team's Unix user (sbatch --uid), as on this machine
            from gpuyard.scheduler.executors.isolation import resolve_isolation

            slurm_isolation = resolve_isolation(settings, job_user, job_dir)
        slurm_executor = SlurmExecutor(
            settings.ensure_home() / "jobs", slurm_cfg, slurm_isolation, instance=store.url
        )
        nodes, executor = slurm_executor.nodes(), slurm_executor
    elif ray_address:
        from gpuyard.scheduler.executors.ray import RayExecutor

        if job_user is not None or job_dir is not None or job_python is not None:
            raise ConfigError(
                "--job-user/--job-dir/--job-python apply to the local executor; Ray runs jobs as its "
                "workers' user"
            )

        if role == "server":  # checked before Ray is reached
            from gpuyard.scheduler.nodes import load_health_config

            ray_health = load_health_config(health_config)
        ray_executor = RayExecutor(
            ray_address, settings.ensure_home() / "jobs", limits=limits or LimitDefaults()
        )
        nodes, executor = ray_executor.nodes(), ray_executor
    else:
        from gpuyard.scheduler.executors.local import LocalExecutor
        from gpuyard.scheduler.nodes import local_node

        isolation = None
        if role == "server":  # a service inside a user's own command runs that user's jobs as they are
            from gpuyard.scheduler.executors.isolation import resolve_isolation

            isolation = resolve_isolation(settings, job_user, job_dir, job_python)
            isolation = replace(isolation, confinement=setup_confinement(limits or LimitDefaults()))
        elif job_python is not None:
            raise ConfigError("--job-python applies to `gpuyard server`")
        executor = LocalExecutor(settings.ensure_home() / "jobs", isolation)
        nodes = [local_node(fake_gpus=fake_gpus, cpus=cpus, record=True)]
    if fabric is not None:
        check_fabric_nodes(fabric, nodes)
    service = JobService(store, nodes, executor, config, role=role, fabric=fabric)
    service.train_sizes = train_sizes
    if role == "server" and slurm:
        from gpuyard.scheduler.executors.slurm_monitor import SlurmNodeMonitor

        service.health = SlurmNodeMonitor(service, slurm_executor)
    elif role == "server" and ray_address:
        from gpuyard.scheduler.nodes import ray_health_monitor

        service.health = ray_health_monitor(service, ray_health)
    elif role == "server":
        from gpuyard.scheduler.nodes import local_health_monitor

        service.health = local_health_monitor(service, health_config)
    elif health_config is not None:
        raise ConfigError("--health-config applies to `gpuyard server`")
    return service


def _fabric_cluster(
    placement: str, cluster: str | None, max_wait_s: float, calibration: str | None = None
) -> Any:
    """The fabric cluster that fabric placement needs (None under topology placement), options checked."""
    if placement not in ("topology", "fabric"):
        raise ConfigError(f"--placement {placement!r} is unknown; choose topology or fabric")
    if max_wait_s < 0:
        raise ConfigError(f"--max-wait {max_wait_s:g}: must be >= 0 seconds")
    if placement == "topology":
        if calibration:
            raise ConfigError(
                f"--calibration {calibration}: it applies to fabric placement; add --placement fabric"
            )
        if cluster:
            raise ConfigError(
                f"--cluster {cluster}: the fabric is used by fabric placement only; add --placement fabric"
            )
        return None
    from gpuyard.fabric.presets import list_presets, load_cluster

    if not cluster:
        raise ConfigError(
            "--placement fabric needs the fabric of the nodes: --cluster PRESET|FILE "
            f"(presets: {', '.join(list_presets())})"
        )
    from pathlib import Path

    from gpuyard.fabric.calibrate import load_calibrated

    return load_calibrated(load_cluster(cluster), Path(calibration) if calibration else None)
