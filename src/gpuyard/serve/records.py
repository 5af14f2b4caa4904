"""Deployment records in the state store: read them, mark their state, and the undeploy request.

``gpuyard deploy`` (:mod:`gpuyard.serve.deploy`) writes a record; the replica set it starts
(:mod:`gpuyard.serve.runner`) reads its options from it and keeps its state up to date.
"""

from __future__ import annotations

from typing import Any

from gpuyard.errors import NotFoundError
from gpuyard.serve.access import Access
from gpuyard.serve.options import ServeOptions
from gpuyard.states import DeploymentState
from gpuyard.store import get_store
from gpuyard.store.base import utcnow
from gpuyard.store.tables.serve import DeploymentRow

ACTIVE = frozenset(s for s in DeploymentState if s.active)
# Set in a deployment's config by `undeploy` before it stops the processes: a scheduled replica set
# that gets SIGTERM reads it to tell the cancel from a preemption.
UNDEPLOY = "undeploy_requested"
# The SHA-256 of the deployment's key, in its config: never shown (deployment_doc leaves it out).
KEY_SHA256 = "key_sha256"


def deployment_doc(r: DeploymentRow) -> dict[str, Any]:
    """A deployment record as the JSON document the CLI and the API show."""
    return {
        "id": r.id,
        "model": r.model_name,
        "version": r.model_version,
        "team": r.team,
        "ref": r.model_ref,
        "replicas": r.replicas,
        "device": r.device,
        "status": r.status,
        "url": r.url,
        "pids": r.pids,
        "log": r.log_path,
        "error": r.error,
        "job": r.job_id,
        # LoRA adapters served by name beside the model (`--adapter`), as NAME:VERSION.
        "adapters": list((r.config or {}).get("adapters") or ()),
        "config": {k: v for k, v in (r.config or {}).items() if k != KEY_SHA256},
        "created_at": r.created_at.isoformat(),
        "stopped_at": r.stopped_at.isoformat() if r.stopped_at else None,
    }


def recorded_options(deployment_id: int) -> ServeOptions:
    """The serve options recorded for a deployment (what `gpuyard serve --deployment-id N` runs with)."""
    config = dict(get_deployment(deployment_id)["config"])
    config.pop("scheduling", None)
    config.pop(UNDEPLOY, None)
    config.pop(KEY_SHA256, None)
    return ServeOptions.from_json({**config, "deployment_id": deployment_id})


def recorded_access(deployment_id: int) -> Access:
    """What the deployment's server accepts: its key (the hash kept in the record) and its team's tokens.

    Raises:
        NotFoundError: no such deployment.
    """
    with get_store().read() as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is None:
            raise NotFoundError(f"deployment {deployment_id} not found (see `gpuyard deployments ls`)")
        return Access((row.config or {}).get(KEY_SHA256), row.team)


def mark(deployment_id: int, status: DeploymentState, **fields: Any) -> None:
    """Set a deployment's status (and url, pids, error, log_path when given)."""
    with get_store().session() as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is None:
            raise NotFoundError(f"deployment {deployment_id} not found")
        row.status = status
        for key, value in fields.items():
            setattr(row, key, value)
        if not status.active:
            row.stopped_at = utcnow()
        else:
            row.stopped_at = None  # a replica set restarted by the scheduler is live again


def request_undeploy(deployment_id: int) -> None:
    """Record that the deployment is being undeployed (committed before any process is signalled)."""
    with get_store().session() as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is not None:
            row.config = {**(row.config or {}), UNDEPLOY: True}


def undeploy_requested(deployment_id: int) -> bool:
    """Whether ``undeploy`` asked this deployment to stop (False for a preemption's SIGTERM)."""
    return bool((get_deployment(deployment_id)["config"] or {}).get(UNDEPLOY))


def get_deployment(deployment_id: int) -> dict[str, Any]:
    """One deployment record.

    Raises:
        NotFoundError: no such deployment.
    """
    with get_store().read() as s:
        row = s.get(DeploymentRow, deployment_id)
        if row is None:
            raise NotFoundError(f"deployment {deployment_id} not found (see `gpuyard deployments ls`)")
        return deployment_doc(row)
