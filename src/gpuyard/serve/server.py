"""The model server's HTTP app (FastAPI): predict with dynamic batching, health, readiness, metrics, drift.

Routes:
  ``POST /v1/models/{name}/predict``  JSON (``{"inputs": [...]}``) or ``application/x-safetensors``
  ``GET  /v1/models``, ``/v1/models/{name}``  what is served (version, signature, batching)
  ``GET  /v1/models/{name}/stats``  p50/p95/p99 latency, throughput, batch sizes, errors (this process)
  ``GET  /v1/models/{name}/drift``  the latest drift report; ``/alerts`` the alerts in the store
  ``GET  /health`` (the process answers), ``/ready`` (the model thread is up), ``/metrics`` (Prometheus)

The predict route reads the raw body itself (no pydantic model on the hot path) and documents the
request schema through ``openapi_extra``, so fuzzers and clients still see it in ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gpuyard.errors import GpuyardError
from gpuyard.serve.access import read_body
from gpuyard.serve.batching import AnyBatcher, BatchConfig
from gpuyard.serve.codec import (
    JSON_MEDIA,
    TENSOR_MEDIA,
    RecordsHook,
    decode_json,
    decode_tensor,
    encode_json,
    encode_tensor,
)
from gpuyard.serve.drift import DriftMonitor, skew_rows
from gpuyard.serve.model import ServedModel
from gpuyard.serve.monitor import ServeMetrics

PROM_MEDIA = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class AppConfig:
    """HTTP-level limits.

    Attributes:
        max_body_bytes: larger bodies get 413 before they are read in full.
        deployment_id: the deployment record this server belongs to (alerts point at it).
    """

    max_body_bytes: int = 4 << 20
    deployment_id: int | None = None


class NotServed(GpuyardError):
    """The URL names a model this server does not serve."""

    http_status = 404


def _request_schema(model: ServedModel) -> dict[str, Any]:
    sample_shape = list(model.spec.shape)
    number = {"type": "number"}
    sample: dict[str, Any] = number
    for dim in reversed(sample_shape):
        sample = {"type": "array", "items": sample, "minItems": dim, "maxItems": dim}
    batch = {"type": "array", "items": sample, "minItems": 1, "maxItems": model.spec.max_rows}
    body: dict[str, Any] = {
        "type": "object",
        "required": ["inputs"],
        "properties": {"inputs": {"oneOf": [batch, sample]}},
    }
    record = _record_schema(model)
    if record is not None:
        many = {"type": "array", "items": record, "minItems": 1, "maxItems": model.spec.max_rows}
        body = {
            "type": "object",
            "properties": {**body["properties"], "records": {"oneOf": [many, record]}},
            "oneOf": [{"required": ["inputs"]}, {"required": ["records"]}],
        }
    return {
        "required": True,
        "content": {
            JSON_MEDIA: {"schema": body},
            TENSOR_MEDIA: {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "safetensors file with a float tensor named 'inputs'",
                }
            },
        },
    }


def _record_schema(model: ServedModel) -> dict[str, Any] | None:
    """The JSON schema of one raw record (None when the model takes none)."""
    spec = model.spec
    recipe = spec.recipe
    if recipe is None:
        if len(spec.names) != spec.n_features or len(spec.shape) != 1:
            return None
        return {
            "type": "object",
            "required": list(spec.names),
            "properties": {n: {"type": "number"} for n in spec.names},
            "additionalProperties": False,
        }
    kinds: dict[str, dict[str, Any]] = {
        "int": {"type": "integer"},
        "float": {"type": "number"},
        "bool": {"type": "boolean"},
    }
    props: dict[str, Any] = {}
    for col in recipe.columns:
        if col["kind"] == "tensor":
            item: dict[str, Any] = {"type": "number"}
            for dim in reversed(col["tensor"]["shape"]):
                item = {"type": "array", "items": item, "minItems": dim, "maxItems": dim}
            props[str(col["name"])] = item
        else:
            props[str(col["name"])] = kinds.get(col["kind"], {"type": ["string", "null"]})
    props.update({name: {} for name in recipe.contract.get("ignored") or ()})
    return {
        "type": "object",
        "required": recipe.raw_columns(),
        "properties": props,
        "additionalProperties": False,
    }


_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "unreadable body"},
    404: {"description": "no such model on this server"},
    413: {"description": "body too large"},
    422: {"description": "input does not match the model's signature"},
    503: {"description": "overloaded or not ready"},
}


def _error(exc: GpuyardError) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=exc.http_status)


_REASONS = {400: "bad_body", 404: "unknown_model", 413: "too_large", 422: "signature", 503: "overloaded"}


def create_app(
    model: ServedModel,
    batcher: AnyBatcher,
    metrics: ServeMetrics,
    drift: DriftMonitor | None = None,
    drift_note: str = "",
    config: AppConfig = AppConfig(),
    skew: DriftMonitor | None = None,
) -> FastAPI:
    """Build the app for one model; the caller starts/stops ``batcher``, ``drift`` and ``skew`` (the raw
    records' monitor, see :mod:`gpuyard.serve.drift`) (see :mod:`runner`)."""
    app = FastAPI(title=f"gpuyard model server: {model.name}:{model.version}", version="1")

    def info() -> dict[str, Any]:
        cfg: BatchConfig = batcher.config
        return {
            "name": model.name,
            "version": model.version,
            "task": model.task,
            "device": model.device,
            "signature": model.signature,
            "max_batch": cfg.max_batch,
            "max_wait_ms": cfg.max_wait_ms,
            "batching": cfg.mode,
            "max_rows_per_request": model.spec.max_rows,
            "max_body_bytes": config.max_body_bytes,
        }

    handler = PredictHandler(model, batcher, metrics, skew_hook(skew))
    base = f"/v1/models/{model.name}"

    @app.post(f"{base}/predict", openapi_extra={"requestBody": _request_schema(model)}, responses=_RESPONSES)
    async def predict(request: Request) -> Response:
        """Predict a batch (or one sample); answers in the request's format (JSON or safetensors)."""
        t0 = time.perf_counter()
        try:
            with batcher.arriving():
                body = await read_body(request, config.max_body_bytes)
        except GpuyardError as exc:
            metrics.observe_error(exc.http_status, _REASONS.get(exc.http_status, "error"))
            return _error(exc)
        source = tuple(request.client) if request.client else None
        status, media, payload = await handler(body, request.headers.get("content-type", ""), t0, source)
        return Response(payload, status_code=status, media_type=media)

    @app.get("/v1/models")
    async def models() -> list[dict[str, Any]]:
        """The model this server answers for."""
        return [info()]

    @app.get(base)
    async def model_info() -> dict[str, Any]:
        """Version, signature and batching settings."""
        return info()

    @app.get(f"{base}/stats")
    async def stats() -> dict[str, Any]:
        """This replica: latency percentiles, throughput, batch sizes (last minute), error totals."""
        return {**metrics.stats(), "queue_depth": batcher.depth, "replica_pid": os.getpid()}

    @app.get(f"{base}/drift")
    async def drift_report() -> dict[str, Any]:
        """The latest drift report over the sliding window (``enabled: false`` with the reason if off)."""
        if drift is None:
            return {"enabled": False, "reason": drift_note}
        report = await asyncio.to_thread(drift.evaluate)
        doc = await asyncio.to_thread(skew_doc, skew)
        if report is None:
            rows = len(drift.snapshot()[0])
            # Each replica keeps its own window: say whose, or another replica's traffic looks lost.
            reason = f"{rows} samples in this replica's window; tests start at {drift.config.min_rows}"
            return {
                "enabled": True,
                "reference": drift_note,
                "report": None,
                "reason": reason,
                "replica_pid": os.getpid(),
                **doc,
            }
        return {"enabled": True, "reference": drift_note, "report": report, "replica_pid": os.getpid(), **doc}

    @app.get(f"{base}/alerts")
    async def alerts() -> list[dict[str, Any]]:
        """Drift alerts of this model recorded in the state store, newest first."""
        from gpuyard.serve.alerts import list_alerts

        return await asyncio.to_thread(list_alerts, model.name)

    @app.api_route("/v1/models/{name}/{rest:path}", methods=["GET", "POST"], include_in_schema=False)
    @app.api_route("/v1/models/{name}", methods=["GET", "POST"], include_in_schema=False)
    async def not_served(name: str, request: Request) -> Response:
        if name == model.name:
            return _error(NotServed(f"no route {request.method} {request.url.path}; see /docs"))
        return _error(NotServed(f"model {name!r} is not served here (this server: {model.name})"))

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/ready", responses=_RESPONSES)
    async def ready() -> Response:
        """200 when the batcher is running (its model thread, in thread mode) and takes requests, else 503."""
        if batcher.alive:
            return JSONResponse({"status": "ready", "model": model.name, "version": model.version})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics")
    async def prom() -> Response:
        """Prometheus text format."""
        return Response(metrics.exposition(), media_type=PROM_MEDIA)

    app.state.predict_handler = handler
    return app


def skew_hook(skew: DriftMonitor | None) -> RecordsHook | None:
    """What copies a raw-records request's columns into the skew window (None without a monitor)."""
    if skew is None:
        return None
    monitor = skew

    def observe(table: Any) -> None:
        monitor.observe(skew_rows(monitor.reference, table))

    return observe


def skew_doc(skew: DriftMonitor | None) -> dict[str, Any]:
    """The skew part of ``/drift``: raw records' columns against the training rows."""
    if skew is None:
        return {"skew": None, "skew_reason": "no serving recipe, or no training rows to compare with"}
    report = skew.evaluate()
    if report is None:
        rows, start = len(skew.snapshot()[0]), skew.config.min_rows
        return {
            "skew": None,
            "skew_reason": f"{rows} raw records in this replica's window; tests start at {start}",
        }
    return {"skew": report, "skew_reference": skew.reference.get("source")}


class PredictHandler:
    """Body in, answer out: decode, check, batch, encode, count. Shared by the route and the fast path."""

    def __init__(
        self,
        model: ServedModel,
        batcher: AnyBatcher,
        metrics: ServeMetrics,
        on_records: RecordsHook | None = None,
    ) -> None:
        self.model, self.batcher, self.metrics = model, batcher, metrics
        self.on_records = on_records

    async def __call__(
        self, body: bytes, content_type: str, t0: float, source: Any = None
    ) -> tuple[int, str, bytes]:
        """Return (status, media type, body) for one predict request whose body was read at ``t0``
        from connection ``source`` (the client's address)."""
        tensor = content_type.startswith(TENSOR_MEDIA)
        try:
            if tensor:
                batch = decode_tensor(body, self.model.spec)
            else:
                batch = decode_json(body, self.model.spec, self.on_records)
            outputs = await self.batcher.submit(batch, source)
        except GpuyardError as exc:
            self.metrics.observe_error(exc.http_status, _REASONS.get(exc.http_status, "error"))
            return exc.http_status, JSON_MEDIA, json.dumps({"detail": str(exc)}).encode()
        if tensor:
            out = (200, TENSOR_MEDIA, encode_tensor(outputs))
        else:
            out = (200, JSON_MEDIA, encode_json(outputs, self.model.name, self.model.version))
        self.metrics.observe_ok(time.perf_counter() - t0)
        return out


class FastPredict:
    """ASGI wrapper answering ``POST /v1/models/<name>/predict`` without FastAPI's per-request machinery.

    Routing, dependency resolution and the Request object cost more than a tiny model's forward pass;
    this path reads the body straight from ``receive`` (413 past the limit) and calls the same
    :class:`PredictHandler` as the documented route. Every other request goes to the FastAPI app.
    """

    def __init__(self, app: FastAPI, model_name: str, max_body_bytes: int) -> None:
        self.app, self.limit = app, max_body_bytes
        self.path = f"/v1/models/{model_name}/predict"
        self.handler: PredictHandler = app.state.predict_handler

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """ASGI entry."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        content_type, length = "", None
        for key, value in scope["headers"]:
            if key == b"content-type":
                content_type = value.decode("latin-1")
            elif key == b"content-length":
                length = value
        status, media, payload = 413, JSON_MEDIA, b""
        if length is not None and length.isdigit() and int(length) > self.limit:
            payload = _too_large(self.limit)
        else:
            with self.handler.batcher.arriving():
                body = await _receive_body(receive, self.limit)
            if body is None:
                payload = _too_large(self.limit)
            else:
                status, media, payload = await self.handler(body, content_type, t0, scope.get("client"))
        if status == 413:
            self.handler.metrics.observe_error(413, "too_large")
        headers = [(b"content-type", media.encode()), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def _receive_body(receive: Any, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> bytes:
    return json.dumps({"detail": f"body exceeds the limit of {limit} bytes"}).encode()
