"""GPU deployments run as scheduler jobs: the scheduler chooses the GPUs, the replicas take one each.

A deployment that wants GPUs becomes a job of ``gpus = replicas`` on the running ``gpuyard server``.
The scheduler places it like any other job (queue, policy, gang and topology-aware placement, fair
share) and starts ``gpuyard serve REF --deployment-id N`` with ``CUDA_VISIBLE_DEVICES`` set to the GPUs
it chose; replica *i* takes the *i*-th of them, so each replica owns one placed GPU and no other job
can be given it while the deployment lives. Cancelling the job (``undeploy``) frees them.

All replicas of one deployment share one listening socket, so they go on one node: the job asks for
its GPUs on a single node (larger fleets are several deployments behind a load balancer).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuyard.errors import CapacityError, ConfigError, ConflictError, NotFoundError
from gpuyard.scheduler.nodes import FAKE_GPU_TYPE
from gpuyard.scheduler.spec import JobState
from gpuyard.serve.options import ServeOptions


@dataclass(frozen=True)
class Scheduling:
    """How a GPU deployment asks the scheduler for its GPUs.

    Attributes:
        server: URL of the gpuyard server whose scheduler places the job (default: ``GPUYARD_SERVER``).
        team: the team the job is charged to (fair share, quotas).
        priority: job priority (-1000..1000).
        max_restarts: times the scheduler starts a replica set again after it exits with an error.
    """

    server: str | None = None
    team: str = "default"
    priority: int = 0
    max_restarts: int = 2


@dataclass(frozen=True)
class Route:
    """Where a deployment's replicas go.

    Attributes:
        scheduled: True when a scheduler job holds the replicas' GPUs.
        serve_device: the ``--device`` the replicas get (``auto`` on fake GPUs: no device behind them).
        server: the gpuyard server placing the job.
        gpu_type: the GPU type of the scheduler's nodes (``fake-gpu`` on a pretend cluster).
    """

    scheduled: bool
    serve_device: str
    server: str | None = None
    gpu_type: str | None = None


def _client(scheduling: Scheduling, timeout: float = 30.0) -> Any:
    from gpuyard.scheduler.client import JobClient
    from gpuyard.settings import load_settings

    return JobClient(scheduling.server or load_settings().server_url, timeout=timeout)


def route(opts: ServeOptions, scheduling: Scheduling) -> Route:
    """Decide how ``opts.device`` is met: a scheduler job (GPUs) or processes started here (CPU).

    ``cpu``: started here. ``cuda``: a scheduler job; a gpuyard server must answer. ``auto``: a
    scheduler job when a gpuyard server answers and its nodes have GPUs, else started here (on this
    machine's CUDA devices when it has some, else on CPU). ``cuda:N`` is refused: the scheduler picks.

    Raises:
        ConfigError: ``cuda:N``. ServerUnreachable: ``cuda`` and no server. CapacityError: no node of
            the scheduler has ``replicas`` GPUs.
    """
    from gpuyard.scheduler.client import ServerUnreachable

    if opts.device == "cpu":
        return Route(False, "cpu")
    if opts.device.startswith("cuda:"):
        raise ConfigError(
            f"--device {opts.device}: a deployment's GPUs are chosen by the scheduler; use --device cuda "
            "(or pin a GPU by hand with `gpuyard serve --device cuda:N`)"
        )
    client = _client(scheduling, timeout=10.0)  # `auto` asks on every deploy: do not hang on a dead host
    try:
        view = client.scheduler_view()
    except ServerUnreachable as exc:
        if opts.device == "auto":
            return Route(False, "auto")
        raise ServerUnreachable(
            f"--device cuda: GPU deployments are placed by the scheduler, and {exc}"
        ) from None
    finally:
        client.close()
    nodes = view.get("nodes") or []
    usable = [(n["gpus"] - len(n.get("excluded") or []), n.get("gpu_type") or "") for n in nodes]
    if not any(g for g, _ in usable):
        if opts.device == "auto":
            return Route(False, "auto")
        raise CapacityError(f"--device cuda: the scheduler at {client.url} has no GPUs")
    fits = [t for g, t in usable if g >= opts.replicas]
    if not fits:
        biggest = max(g for g, _ in usable)
        raise CapacityError(
            f"--replicas {opts.replicas}: the replicas of one deployment share a node's port and the "
            f"largest node of the scheduler at {client.url} has {biggest} usable GPUs"
        )
    fake = all(t == FAKE_GPU_TYPE for t in fits)
    return Route(True, "auto" if fake else "cuda", client.url, fits[0])


def serve_argv(ref: str, deployment_id: int) -> list[str]:
    """The replica set's command: its options come from the deployment record (nothing is dropped)."""
    exe = shutil.which("gpuyard", path=str(Path(sys.executable).parent))
    base = [exe] if exe else [sys.executable, "-m", "gpuyard.cli.main"]
    return [*base, "serve", ref, "--deployment-id", str(deployment_id)]


def submit(doc: dict[str, Any], opts: ServeOptions, scheduling: Scheduling) -> int:
    """Submit deployment ``doc`` as a job of ``opts.replicas`` GPUs; returns the job id.

    Raises:
        ConfigError: the server keeps its state in another store than this command (its job would
            not find this deployment record, or would find another one).
    """
    from gpuyard.scheduler.spec import parse_spec

    name = re.sub(r"[^A-Za-z0-9._-]", "-", f"deploy-{doc['id']}-{doc['model']}")[:100]
    spec = parse_spec(
        {
            "name": name,
            "command": serve_argv(doc["ref"], doc["id"]),
            "resources": {"gpus": opts.replicas, "cpus": 1},
            "team": scheduling.team,
            "priority": scheduling.priority,
            "max_restarts": scheduling.max_restarts,
        },
        where="deployment job",
    )
    client = _client(scheduling)
    try:
        if not _same_record(client.url, doc):
            raise ConfigError(
                f"the gpuyard server at {client.url} keeps its state in another store than this command: "
                "run `gpuyard deploy` with the server's GPUYARD_HOME / GPUYARD_DATABASE_URL"
            )
        job = client.submit(spec)
    finally:
        client.close()
    return int(job["id"])


def _same_record(url: str, doc: dict[str, Any]) -> bool:
    """Whether the server at ``url`` reads deployment ``doc`` as this command wrote it (one store)."""
    import httpx

    from gpuyard.auth import TokenAuth

    try:
        resp = httpx.get(f"{url}/deployments/{doc['id']}", auth=TokenAuth(), timeout=30.0)
    except httpx.TransportError:
        return True  # gone since route() reached it: submit() reports that with its own message
    if resp.status_code == 404:
        return False
    if resp.is_error:
        return True  # not an answer about the store (a token, a limit): submit() reports it as it should
    theirs = resp.json()
    return bool(theirs["created_at"] == doc["created_at"] and theirs["model"] == doc["model"])


def job_state(job_id: int, scheduling: Scheduling) -> JobState | None:
    """The job's state on the scheduler's server (None: the server has no such job).

    Raises:
        ServerUnreachable: no server answers at ``scheduling.server``.
    """
    client = _client(scheduling)
    try:
        return _state(client, job_id)
    finally:
        client.close()


def _state(client: Any, job_id: int) -> JobState | None:
    try:
        return JobState(client.get(job_id)["state"])
    except NotFoundError:
        return None


def job_log_tail(job_id: int, scheduling: Scheduling, chars: int = 800) -> str:
    """The end of the job's log (through the server), or a pointer to it when the server is gone."""
    from gpuyard.scheduler.client import ServerUnreachable

    client = _client(scheduling)
    try:
        text = "".join(client.logs(job_id))
    except (ServerUnreachable, NotFoundError):
        return f"(see `gpuyard jobs logs {job_id}`)"
    finally:
        client.close()
    return text[-chars:]


def cancel(job_id: int, scheduling: Scheduling, wait_s: float = 60.0) -> None:
    """Cancel the job and wait until the scheduler has seen its processes go.

    Raises:
        ServerUnreachable: no server to cancel it (the replicas keep running: the message says so).
        ConfigError: the job did not end within ``wait_s``.
    """
    from gpuyard.scheduler.client import ServerUnreachable

    client = _client(scheduling)
    try:
        with contextlib.suppress(ConflictError):  # already over
            client.cancel(job_id)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            state = _state(client, job_id)
            if state is None or state.terminal:
                return
            time.sleep(0.2)  # the server has no completion callback: poll the job's record
    except ServerUnreachable as exc:
        raise ServerUnreachable(
            f"cannot cancel job {job_id}, which holds the deployment's GPUs: {exc}"
        ) from None
    finally:
        client.close()
    raise ConfigError(f"job {job_id} did not stop within {wait_s:.0f} s; see `gpuyard jobs show {job_id}`")
