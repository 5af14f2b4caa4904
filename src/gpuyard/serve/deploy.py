"""Deployments: model servers started in the background and recorded in the state store.

``deploy`` writes a ``starting`` record, launches ``gpuyard serve ... --deployment-id N`` in its own
session (so it outlives the CLI), and waits until that server marks itself ``running`` (its
``/ready`` answered) or dies. ``undeploy`` sends SIGTERM to the server's process group (replicas
included) and marks it ``stopped``. ``list_deployments`` notices servers whose process vanished and
marks them ``dead``.

Devices: with ``--device auto`` a replica gets ``cuda:<i mod GPUs>`` where CUDA is present and
``cpu`` otherwise; on this GPU-less machine every replica is a CPU process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

from sqlalchemy import select

from gpuyard.errors import ConfigError, ConflictError, NotFoundError
from gpuyard.serve.runner import ServeOptions
from gpuyard.settings import load_settings
from gpuyard.store import get_store
from gpuyard.store.base import utcnow
from gpuyard.store.tables.serve import DeploymentRow

ACTIVE = ("starting", "running")


def _doc(r: DeploymentRow) -> dict[str, Any]:
    return {
        "id": r.id,
        "model": r.model_name,
        "version": r.model_version,
        "ref": r.model_ref,
        "replicas": r.replicas,
        "device": r.device,
        "status": r.status,
        "url": r.url,
        "pids": r.pids,
        "log": r.log_path,
        "error": r.error,
        "config": r.config,
        "created_at": r.created_at.isoformat(),
        "stopped_at": r.stopped_at.isoformat() if r.stopped_at else None,
    }


def create_record(ref: str, opts: ServeOptions) -> dict[str, Any]:
    """Resolve ``ref`` in the registry and write a ``starting`` deployment record."""
    from gpuyard.models.registry import get_version

    mv = get_version(ref)
    with get_store().session() as s:
        row = DeploymentRow(
            model_name=mv.name,
            model_version=mv.version,
            model_ref=ref,
            replicas=opts.replicas,
            device=opts.device,
            status="starting",
            pids={},
            config=opts.to_json(),
        )
        s.add(row)
        s.flush()
        return _doc(row)


def mark(deployment_id: int, status: str, **fields: Any) -> None:
    """Set a deployment's status (and url, pids, error, log_path when given)."""
    with get_store().session() as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is None:
            raise NotFoundError(f"deployment {deployment_id} not found")
        row.status = status
        for key, value in fields.items():
            setattr(row, key, value)
        if status in ("stopped", "failed", "dead"):
            row.stopped_at = utcnow()


def get_deployment(deployment_id: int) -> dict[str, Any]:
    """One deployment record.

    Raises:
        NotFoundError: no such deployment.
    """
    with get_store().read() as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is None:
            raise NotFoundError(f"deployment {deployment_id} not found (see `gpuyard deployments ls`)")
        return _doc(row)


def _alive(pid: int | None) -> bool:
    import psutil

    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def list_deployments(all_: bool = False) -> list[dict[str, Any]]:
    """Deployments, newest first (only active ones unless ``all_``); vanished servers become ``dead``."""
    with get_store().read() as s:
        rows = [_doc(r) for r in s.scalars(select(DeploymentRow).order_by(DeploymentRow.id.desc()))]
    for d in rows:
        if d["status"] in ACTIVE and d["pids"].get("server") and not _alive(d["pids"]["server"]):
            mark(d["id"], "dead", error="the server process is gone")
            d["status"] = "dead"
    return rows if all_ else [d for d in rows if d["status"] in ACTIVE]


def deploy(ref: str, opts: ServeOptions, timeout_s: float = 180.0) -> dict[str, Any]:
    """Start a server for ``ref`` in the background and wait until it is ready.

    Raises:
        NotFoundError: unknown model. ConfigError: the server exited before it was ready (the message
        ends with its log).
    """
    if opts.deployment_id is not None:
        raise ConfigError("deploy() assigns the deployment id itself")
    doc = create_record(ref, opts)
    dep_id = doc["id"]
    logs = load_settings().ensure_home() / "logs"
    logs.mkdir(exist_ok=True)
    log_path = logs / f"deployment-{dep_id}.log"
    cmd = [
        sys.executable,
        "-m",
        "gpuyard.cli.main",
        "serve",
        ref,
        "--host",
        opts.host,
        "--port",
        str(opts.port),
        "--replicas",
        str(opts.replicas),
        "--device",
        opts.device,
        "--max-batch",
        str(opts.batch.max_batch),
        "--max-wait-ms",
        str(opts.batch.max_wait_ms),
        "--threads",
        str(opts.batch.threads),
        "--max-body-bytes",
        str(opts.max_body_bytes),
        "--drift-window",
        str(opts.drift_config.window),
        "--drift-interval",
        str(opts.drift_config.interval_s),
        "--deployment-id",
        str(dep_id),
    ] + ([] if opts.drift else ["--no-drift"])
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=os.getcwd(),
        )
    mark(dep_id, "starting", pids={"server": proc.pid}, log_path=str(log_path))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        current = get_deployment(dep_id)
        if current["status"] == "running":
            return current
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-800:]
            mark(dep_id, "failed", error=f"exited with code {proc.returncode}")
            raise ConfigError(f"deployment {dep_id}: the server exited with code {proc.returncode}:\n{tail}")
        time.sleep(0.2)
    _terminate(proc.pid)
    mark(dep_id, "failed", error=f"not ready after {timeout_s:.0f} s")
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
        pid = d["pids"].get("server")
        if pid:
            _terminate(int(pid))
        mark(d["id"], "stopped")
        out.append(get_deployment(d["id"]))
    return out
