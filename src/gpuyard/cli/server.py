"""`gpuyard server`: the API and the scheduling loop on this machine (SQLite, local executor), on Ray or
on a Slurm cluster."""

from __future__ import annotations

import typer

from gpuyard.fabric.presets import list_presets
from gpuyard.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PER_ADDRESS,
    DEFAULT_MAX_PER_TEAM,
    DEFAULT_MAX_REQUESTS_PER_TEAM,
)
from gpuyard.scheduler.executors.limits import DEFAULT_LOG_MB, DEFAULT_NOFILE, DEFAULT_PIDS
from gpuyard.scheduler.fabric_placement import DEFAULT_MAX_WAIT_S
from gpuyard.scheduler.policies import POLICIES

_SERVER_POLICIES = ", ".join(name for name, cls in POLICIES.items() if not cls.needs_oracle)


def server(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8765, "--port", min=1, max=65535, help="Port to listen on."),
    policy: str = typer.Option("fifo", "--policy", help=f"Scheduling policy: {_SERVER_POLICIES}."),
    team: list[str] = typer.Option(
        [], "--team", help="TEAM[=WEIGHT]: a team that may submit, and its quota."
    ),
    gpus: int = typer.Option(
        None, "--gpus", help="Pretend this machine has N GPUs (testing placement; fake)."
    ),
    cpus: int = typer.Option(None, "--cpus", help="CPU slots for CPU-only jobs (default: the cores)."),
    grace: float = typer.Option(
        10.0, "--grace", help="Seconds from SIGTERM to SIGKILL on cancel/preemption."
    ),
    min_run: float = typer.Option(300.0, "--min-run", help="Seconds a job runs before it may be preempted."),
    resize_interval: float = typer.Option(
        300.0,
        "--resize-interval",
        min=0,
        max=86400,
        help="Seconds an elastic job (gpus: {min, max}) runs before it may grow or shrink again.",
    ),
    restart_cost: float = typer.Option(
        60.0,
        "--restart-cost",
        min=0,
        max=86400,
        help="Seconds one restart of an elastic job is taken to cost: a grow must save twice that.",
    ),
    no_resize: bool = typer.Option(
        False,
        "--no-resize",
        help="Never grow or shrink running elastic jobs (they still start at their best size).",
    ),
    ray: str = typer.Option(None, "--ray", help="Run jobs on the Ray cluster at ADDRESS instead of here."),
    slurm: bool = typer.Option(
        False,
        "--slurm",
        help="Run each job as a Slurm batch job on the cluster the Slurm tools reach (SLURM_CONF); "
        "gpuyard places, Slurm runs and confines (docs/scheduler.md, On a Slurm cluster).",
    ),
    slurm_config: str = typer.Option(
        None,
        "--slurm-config",
        help="With --slurm: YAML of partition, account, qos, and teams: {TEAM: {...}}.",
    ),
    slurm_partition: str = typer.Option(None, "--slurm-partition", help="With --slurm: the jobs' partition."),
    slurm_account: str = typer.Option(None, "--slurm-account", help="With --slurm: the jobs' account."),
    placement: str = typer.Option(
        "topology",
        "--placement",
        help="topology, or fabric: jobs with a workload are placed by predicted step time (needs --cluster).",
    ),
    packing: str = typer.Option(
        "fgd-online",
        "--packing",
        help="How GPU shares and MIG slices are placed: fgd-online (FGD, its task mix the jobs known now), "
        "fgd, fgd-exact, fgd-bf, bestfit, firstfit, randomfit or dotprod (docs/scheduler.md, sharing).",
    ),
    cluster: str = typer.Option(
        None,
        "--cluster",
        help=f"The nodes' fabric for --placement fabric: a preset ({', '.join(list_presets())}) or a file.",
    ),
    calibration: str = typer.Option(
        None, "--calibration", help="Fabric placement: a `gpuyard fabric calibrate` file of the nodes' GPUs."
    ),
    max_wait: float = typer.Option(
        DEFAULT_MAX_WAIT_S,
        "--max-wait",
        help="Fabric placement: the longest a job waits for a consolidated placement, seconds.",
    ),
    max_body_mb: float = typer.Option(
        DEFAULT_MAX_BODY_BYTES / 2**20,
        "--max-body-mb",
        min=0.001,
        max=1024,
        help="The largest request body, MiB (413 above it).",
    ),
    job_user: str = typer.Option(
        None,
        "--job-user",
        help="Unix user the jobs run as (default: gpuyard-job when the server is root, else the server's"
        " own user, not isolated); a template such as gpuyard-{team} or gpuyard-{user} runs each team's"
        " (or submitter's) jobs as its own user, so jobs of different teams cannot touch each other.",
    ),
    job_dir: str = typer.Option(
        None, "--job-dir", help="Folder of the jobs' working directories (default: in the temp folder)."
    ),
    health_config: str = typer.Option(
        None,
        "--health-config",
        help="YAML of node health checks (interval, checks, limits, drain on failure; docs/scheduler.md).",
    ),
    job_memory_gb: float = typer.Option(
        0.0,
        "--job-memory-gb",
        min=0,
        max=1_048_576,
        help="Memory (GiB) of a job that declares no resources.memory_gb (0: not limited).",
    ),
    job_pids: int = typer.Option(
        DEFAULT_PIDS,
        "--job-pids",
        min=0,
        max=4_194_304,
        help="Processes and threads of a job (0: not limited).",
    ),
    job_nofile: int = typer.Option(
        DEFAULT_NOFILE,
        "--job-nofile",
        min=0,
        max=1_048_576,
        help="Open files of each of a job's processes (0: not limited).",
    ),
    job_log_mb: float = typer.Option(
        DEFAULT_LOG_MB,
        "--job-log-mb",
        min=0,
        max=1_048_576,
        help="MiB of output each attempt of a job may write to its log; the rest is cut (0: not capped).",
    ),
    team_disk_gb: float = typer.Option(
        None,
        "--team-disk-gb",
        min=0,
        max=1_048_576,
        help="GiB one team's job folders (logs) may hold under GPUYARD_HOME; a log past its team's share"
        " is cut (default: a quarter of the disk; 0: no team quota).",
    ),
    disk_reserve_mb: float = typer.Option(
        None,
        "--disk-reserve-mb",
        min=0,
        max=1_048_576,
        help="MiB the server keeps free on GPUYARD_HOME's disk: no job's log takes it (default: 5% of"
        " the disk, 24 MiB to 1 GiB; at least 24).",
    ),
    max_queued_per_team: int = typer.Option(
        None,
        "--max-queued-per-team",
        min=1,
        max=10_000_000,
        help="Jobs one team may have waiting (queued or preempted) at once; past it a submission is 429"
        " (default: 10000).",
    ),
    job_python: str = typer.Option(
        None,
        "--job-python",
        help="The Python jobs are given (gpuyard train of a training spec; default: the server's). The job"
        " user must be able to run it, or the server refuses to start.",
    ),
    body_timeout: float = typer.Option(
        DEFAULT_BODY_TIMEOUT_S,
        "--body-timeout",
        min=0.1,
        max=3600,
        help="Seconds a request body may take to arrive (408 after that).",
    ),
    header_timeout: float = typer.Option(
        DEFAULT_HEADER_TIMEOUT_S,
        "--header-timeout",
        min=0.1,
        max=3600,
        help="Seconds a connection may take to send a request's headers (then 408 and closed).",
    ),
    max_connections: int = typer.Option(
        DEFAULT_MAX_CONNECTIONS,
        "--max-connections",
        min=1,
        help="Open connections served without a token; past it only /health, /ready, admins and teams"
        " under their share get in.",
    ),
    max_connections_per_address: int = typer.Option(
        DEFAULT_MAX_PER_ADDRESS,
        "--max-connections-per-address",
        min=1,
        help="Open connections of one client address (IPv6: a /64) served until a token charges them to"
        " a team; past it, 429.",
    ),
    max_connections_per_team: int = typer.Option(
        DEFAULT_MAX_PER_TEAM,
        "--max-connections-per-team",
        min=1,
        help="Open connections charged to one team (by its members' and jobs' tokens) served; past it, 429.",
    ),
    max_requests_per_team: int = typer.Option(
        DEFAULT_MAX_REQUESTS_PER_TEAM,
        "--max-requests-per-team",
        min=1,
        max=100_000,
        help="Requests of one team (or of one address without a token) in flight at once; past it, 429.",
    ),
) -> None:
    """Serve the job API and run the scheduler (state in GPUYARD_HOME or GPUYARD_DATABASE_URL)."""
    from gpuyard.api.server import ServerOptions, run_server
    from gpuyard.scheduler.diskshare import enable as enable_disk_shares
    from gpuyard.scheduler.executors.limits import LimitDefaults
    from gpuyard.scheduler.setup import build_service
    from gpuyard.scheduler.spec import parse_team_weights
    from gpuyard.train.resize import allowed_world_sizes

    service = build_service(
        policy=policy,
        teams=parse_team_weights(team),
        fake_gpus=gpus,
        cpus=cpus,
        grace_s=grace,
        min_run_s=min_run,
        resize_interval_s=None if no_resize else resize_interval,
        restart_cost_s=restart_cost,
        train_sizes=allowed_world_sizes,
        ray_address=ray,
        slurm=slurm,
        slurm_config=slurm_config,
        slurm_partition=slurm_partition,
        slurm_account=slurm_account,
        role="server",
        placement=placement,
        packing=packing,
        cluster=cluster,
        max_wait_s=max_wait,
        calibration=calibration,
        job_user=job_user,
        job_dir=job_dir,
        health_config=health_config,
        limits=LimitDefaults(
            memory_gb=job_memory_gb or None,
            pids=job_pids or None,
            nofile=job_nofile or None,
            log_mb=job_log_mb or None,
        ),
        job_python=job_python,
    )
    enable_disk_shares(service, team_disk_gb, disk_reserve_mb)
    if max_queued_per_team is not None:
        service.max_queued_per_team = max_queued_per_team
    options = ServerOptions(
        host=host,
        port=port,
        max_body_bytes=int(max_body_mb * 2**20),
        body_timeout_s=body_timeout,
        header_timeout_s=header_timeout,
        max_connections=max_connections,
        max_connections_per_address=max_connections_per_address,
        max_connections_per_team=max_connections_per_team,
        max_requests_per_team=max_requests_per_team,
    )
    run_server(service, options)


def register(app: typer.Typer) -> None:
    """Add `gpuyard server` to the CLI."""
    app.command("server")(server)
