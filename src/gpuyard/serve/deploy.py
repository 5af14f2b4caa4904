"""Deployments: model servers started in the background and recorded in the state store.

``deploy`` writes a ``starting`` record and starts ``gpuyard serve REF --deployment-id N``, which reads
every option from that record (nothing is dropped on the way) and marks it ``running`` once its
``/ready`` answers. Where the replicas go (:func:`gpuyard.serve.scheduled.route`):

- GPUs: the server runs as a scheduler job of ``gpus = replicas`` on the running ``gpuyard server``;
  the scheduler places it (queue, policy, topology) and sets ``CUDA_VISIBLE_DEVICES``, replica *i*
  takes the *i*-th placed GPU. ``undeploy`` cancels the job, which frees the GPUs.
- CPU (or ``--device auto`` with no gpuyard server answering): started here in its own session, so it
  outlives the CLI; ``undeploy`` sends SIGTERM to its process group.

``list_deployments`` notices servers whose process or job has gone and marks them ``dead``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any

from sqlalchemy import select

from gpuyard.errors import ConfigError, ConflictError, NotFoundError
from gpuyard.scheduler.spec import JobState
from gpuyard.serve.access import key_hash, new_key
from gpuyard.serve.options import ServeOptions
from gpuyard.serve.records import (
    ACTIVE,
    KEY_SHA256,
    deployment_doc,
    get_deployment,
    mark,
    request_undeploy,
)
from gpuyard.serve.scheduled import Scheduling
from gpuyard.settings import load_settings
from gpuyard.states import DeploymentState
from gpuyard.store import get_store
from gpuyard.store.tables.serve import DeploymentRow

_ENDED: dict[str, str] = {
    JobState.FAILED: "failed",
    JobState.CANCELLED: "was cancelled",
    JobState.SUCCEEDED: "exited with code 0",
}


def create_record(ref: str, opts: ServeOptions, scheduling: Scheduling | None = None) -> dict[str, Any]:
    """Resolve ``ref`` in the registry and write a ``starting`` deployment record.

    ``config`` holds the serve options the replicas start with, the SHA-256 of the deployment's key
    and, for a scheduled deployment, how its job was asked for (``scheduling``: the server to cancel
    it on). The deployment belongs to its model's team. The returned document carries the key itself
    (``api_key``), which is stored nowhere: it is shown once.
    """
    from dataclasses import asdict

    from gpuyard.models.registry import get_version

    mv = get_version(ref)
    key = new_key()
    config = opts.to_json() | {KEY_SHA256: key_hash(key)}
    config |= {"scheduling": asdict(scheduling)} if scheduling else {}
    with get_store().session() as s:
        row = DeploymentRow(
            model_name=mv.name,
            model_version=mv.version,
            team=mv.team,
            model_ref=ref,
            replicas=opts.replicas,
            device=opts.device,
            status=DeploymentState.STARTING,
            pids={},
            config=config,
        )
        s.add(row)
        s.flush()
        return deployment_doc(row) | {"api_key": key}


def check_files(ref: str) -> None:
    """Refuse a version whose files gpuyard would not load, before any record or server exists.

    Only a check (the schema and headers are read as data): the model is loaded by the server
    process, which checks again (:func:`gpuyard.models.flavors.load_model`).

    Raises:
        UnsafeModelError: (a ConfigError) see :func:`gpuyard.models.safety.check_model_safety`.
    """
    from gpuyard.models.flavors import FILE_FOR_FLAVOR
    from gpuyard.models.registry import fetch, get_version
    from gpuyard.models.safety import check_model_safety

    mv = get_version(ref)
    check_model_safety(fetch(mv) / FILE_FOR_FLAVOR.get(mv.flavor, ""), mv.flavor, mv.config)


def _alive(pid: int | None) -> bool:
    import psutil

    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _scheduling(d: dict[str, Any]) -> Scheduling:
    """How a scheduled deployment's job was asked for (which server places it)."""
    return Scheduling(**((d["config"] or {}).get("scheduling") or {}))


def _gone(d: dict[str, Any]) -> str | None:
    """Why an active deployment is not live any more (None: it is, or may still become so)."""
    if d["job"] is not None:
        from gpuyard.scheduler.client import ServerUnreachable
        from gpuyard.serve.scheduled import job_state

        try:
            state = job_state(d["job"], _scheduling(d))
        except ServerUnreachable:
            return None  # the scheduler cannot say: an unreachable server does not end its jobs
        if state is None or state.terminal:
            return f"its scheduler job {d['job']} {_ENDED.get(state or '', 'is gone')}"
        return None
    if d["pids"].get("server") and not _alive(d["pids"]["server"]):
        return "the server process is gone"
    return None


def list_deployments(all_: bool = False, team: str | None = None) -> list[dict[str, Any]]:
    """Deployments, newest first (only active ones unless ``all_``); vanished servers become ``dead``.

    Args:
        team: only the deployments of this team (None: every team's).
    """
    q = select(DeploymentRow).order_by(DeploymentRow.id.desc())
    if team is not None:
        q = q.where(DeploymentRow.team == team)
    with get_store().read() as s:
        rows = [deployment_doc(r) for r in s.scalars(q)]
    for d in rows:
        why = _gone(d) if d["status"] in ACTIVE else None
        if why is not None:
            mark(d["id"], DeploymentState.DEAD, error=why)
            d["status"], d["error"] = DeploymentState.DEAD, why
    return rows if all_ else [d for d in rows if d["status"] in ACTIVE]


def deploy(
    ref: str, opts: ServeOptions, timeout_s: float = 180.0, scheduling: Scheduling = Scheduling()
) -> dict[str, Any]:
    """Start a server for ``ref`` in the background and wait until it is ready; the document returned
    carries the deployment's key (``api_key``), shown only now.

    GPU replicas are placed by the scheduler (see the module docstring); ``scheduling`` says on which
    server, for which team, at which priority.

    Raises:
        NotFoundError: unknown model. ConfigError: the server exited before it was ready (the message
        ends with its log), or was not placed/ready within ``timeout_s``. CapacityError: no node of
        the scheduler has enough GPUs. ServerUnreachable: ``--device cuda`` and no gpuyard server.
    """
    from dataclasses import replace

    from gpuyard.serve import scheduled

    if opts.deployment_id is not None:
        raise ConfigError("deploy() assigns the deployment id itself")
    check_files(ref)
    rt = scheduled.route(opts, scheduling)
    if opts.adapters:  # LoRA adapters by name: checked now, recorded as NAME:VERSION
        from gpuyard.serve.llm.vllm_engine import check_lora

        opts = replace(opts, adapters=check_lora(ref, opts, rt.serve_device))
    if not rt.scheduled:
        doc = create_record(ref, opts)
        return _deploy_here(doc, timeout_s) | {"api_key": doc["api_key"]}
    server = Scheduling(rt.server, scheduling.team, scheduling.priority, scheduling.max_restarts)
    doc = create_record(ref, replace(opts, device=rt.serve_device), server)
    try:
        job_id = scheduled.submit(doc, opts, server)
    except BaseException as exc:
        mark(doc["id"], DeploymentState.FAILED, error=str(exc)[:1000] or type(exc).__name__)
        raise
    mark(doc["id"], DeploymentState.STARTING, job_id=job_id, device=opts.device)
    return _wait_for_job(doc["id"], job_id, server, timeout_s) | {"api_key": doc["api_key"]}


def _wait_for_job(dep_id: int, job_id: int, scheduling: Scheduling, timeout_s: float) -> dict[str, Any]:
    from gpuyard.serve import scheduled

    deadline = time.monotonic() + timeout_s
    state: JobState | None = JobState.QUEUED
    while time.monotonic() < deadline:
        current = get_deployment(dep_id)
        state = scheduled.job_state(job_id, scheduling)
        if current["status"] == DeploymentState.RUNNING and state == JobState.RUNNING:
            return current
        if state is None or state.terminal:
            why = f"its scheduler job {job_id} {_ENDED.get(state or '', 'is gone')}"
            mark(dep_id, DeploymentState.FAILED, error=why)
            raise ConfigError(f"deployment {dep_id}: {why}:\n{scheduled.job_log_tail(job_id, scheduling)}")
        time.sleep(0.2)
    scheduled.cancel(job_id, scheduling)
    if state == JobState.QUEUED:
        why = f"not placed within {timeout_s:.0f} s: job {job_id} waited in the queue for GPUs (cancelled)"
    else:
        why = (
            f"not ready within {timeout_s:.0f} s (job {job_id}, cancelled; see `gpuyard jobs logs {job_id}`)"
        )
    mark(dep_id, DeploymentState.FAILED, error=why)
    raise ConfigError(f"deployment {dep_id}: {why}")


def _deploy_here(doc: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Start the server as a process of this machine (in its own session) and wait until it is ready."""
    from gpuyard.serve.scheduled import serve_argv

    dep_id = doc["id"]
    logs = load_settings().ensure_home() / "logs"
    logs.mkdir(exist_ok=True)
    log_path = logs / f"deployment-{dep_id}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            serve_argv(doc["ref"], dep_id),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=os.getcwd(),
        )
    mark(dep_id, DeploymentState.STARTING, pids={"server": proc.pid}, log_path=str(log_path))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        current = get_deployment(dep_id)
        if current["status"] == DeploymentState.RUNNING:
            return current
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-800:]
            mark(dep_id, DeploymentState.FAILED, error=f"exited with code {proc.returncode}")
            raise ConfigError(f"deployment {dep_id}: the server exited with code {proc.returncode}:\n{tail}")
        time.sleep(0.2)
    _terminate(proc.pid)
    mark(dep_id, DeploymentState.FAILED, error=f"not ready after {timeout_s:.0f} s")
    raise ConfigError(f"deployment {dep_id}: not ready after {timeout_s:.0f} s (log: {log_path})")


def _terminate(pid: int, grace_s: float = 15.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    # Reap it when it is our own child (deploy and undeploy in one process: tests, scripts).
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def undeploy(target: str) -> list[dict[str, Any]]:
    """Stop deployment ``target`` (an id) or every active deployment of model ``target``.

    Raises:
        NotFoundError: nothing active matches. ConflictError: the deployment is not active.
    """
    if target.isdigit():
        docs = [get_deployment(int(target))]
        if docs[0]["status"] not in ACTIVE:
            raise ConflictError(f"deployment {target} is already {docs[0]['status']}")
    else:
        docs = [d for d in list_deployments() if d["model"] == target]
        if not docs:
            raise NotFoundError(f"no active deployment of model {target!r} (see `gpuyard deployments ls`)")
    out = []
    for d in docs:
        request_undeploy(d["id"])
        if d["job"] is not None:
            from gpuyard.serve.scheduled import cancel

            cancel(int(d["job"]), _scheduling(d))
        elif d["pids"].get("server"):
            _terminate(int(d["pids"]["server"]))
        mark(d["id"], DeploymentState.STOPPED, error=None)
        out.append(get_deployment(d["id"]))
    return out
