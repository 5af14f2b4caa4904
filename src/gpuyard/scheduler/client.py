"""HTTP client of the job API (what `gpuyard jobs ...` uses)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx

from gpuyard.auth import TokenAuth
from gpuyard.errors import (
    AuthenticationError,
    ConfigError,
    ConflictError,
    GpuyardError,
    NotFoundError,
    PermissionDenied,
)
from gpuyard.scheduler.spec import JobSpec


class ServerUnreachable(GpuyardError):
    """No gpuyard server answers at the URL."""

    http_status = 503


_BY_STATUS: dict[int, type[GpuyardError]] = {
    401: AuthenticationError,
    403: PermissionDenied,
    404: NotFoundError,
    409: ConflictError,
}


class JobClient:
    """Talks to a gpuyard server at ``url`` (default: ``GPUYARD_SERVER`` or the local one)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        # The token: GPUYARD_TOKEN, else GPUYARD_HOME/token (written by the embedded server's first start).
        self._http = httpx.Client(base_url=self.url, timeout=timeout, auth=TokenAuth())

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServerUnreachable(
                f"no gpuyard server at {self.url} ({exc}); start one with `gpuyard server`"
            ) from None
        if resp.status_code >= 400:
            raise _BY_STATUS.get(resp.status_code, ConfigError)(_detail(resp))
        return resp.json()

    def submit(self, spec: JobSpec, idempotency_key: str | None = None, attempts: int = 3) -> dict[str, Any]:
        """Queue a job; returns its document.

        The submission carries an ``Idempotency-Key`` (a new UUID unless given) and is sent again, up
        to ``attempts`` times, when the connection fails: the server queues the job once however many
        of the tries reached it.
        """
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        body = spec.model_dump(mode="json")
        for _ in range(attempts - 1):
            try:
                return dict(self._call("POST", "/jobs", json=body, headers=headers))
            except ServerUnreachable:
                continue  # the connection failed, before or after the server got it: same key again
        return dict(self._call("POST", "/jobs", json=body, headers=headers))

    def dry_run(self, spec: JobSpec) -> dict[str, Any]:
        """What the server would launch for ``spec`` now."""
        return dict(self._call("POST", "/jobs/dry-run", json=spec.model_dump(mode="json")))

    def whatif(self, spec: JobSpec) -> dict[str, Any]:
        """When ``spec`` would start and end if submitted now, per GPU count (nothing is submitted)."""
        return dict(self._call("POST", "/jobs/whatif", json=spec.model_dump(mode="json")))

    def list_jobs(self, state: str | None = None, team: str | None = None) -> list[dict[str, Any]]:
        """Jobs, newest first."""
        params = {k: v for k, v in (("state", state), ("team", team)) if v}
        return list(self._call("GET", "/jobs", params=params))

    def get(self, job_id: int) -> dict[str, Any]:
        """One job."""
        return dict(self._call("GET", f"/jobs/{job_id}"))

    def events(self, job_id: int) -> list[dict[str, Any]]:
        """A job's state changes."""
        return list(self._call("GET", f"/jobs/{job_id}/events"))

    def scheduler_view(self) -> dict[str, Any]:
        """The scheduler's nodes (GPU slots, GPU type, excluded GPUs), policy and the jobs holding GPUs."""
        return dict(self._call("GET", "/cluster/scheduler"))

    def cancel(self, job_id: int) -> dict[str, Any]:
        """Cancel a job."""
        return dict(self._call("POST", f"/jobs/{job_id}/cancel"))

    def logs(self, job_id: int, follow: bool = False, poll_s: float = 0.5) -> Iterator[str]:
        """Chunks of a job's log; with ``follow``, keeps reading until the job is over."""
        import time

        offset = 0
        while True:
            chunk = self._call("GET", f"/jobs/{job_id}/logs", params={"offset": offset})
            if chunk["text"]:
                yield chunk["text"]
            offset = chunk["offset"]
            if not follow or chunk["done"]:
                return
            if not chunk["text"]:
                time.sleep(poll_s)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()


def _detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail")
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    if isinstance(detail, list):  # FastAPI's validation errors: name each field
        return "; ".join(
            ".".join(str(p) for p in d.get("loc", []) if p != "body") + f": {d.get('msg')}" for d in detail
        )
    return str(detail)
