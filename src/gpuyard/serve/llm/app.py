"""The OpenAI-compatible HTTP API over the engine: /v1/models, /v1/completions, /v1/chat/completions.

Streaming answers are server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``), as the
OpenAI clients expect. A stream the client closes frees its batch slot before the next decoding step.
Errors are OpenAI-shaped: ``{"error": {"message", "type", "code"}}`` with 400 (a prompt plus
max_tokens over the context, bad parameters), 404 (another model name), 429 (queue full).
Prometheus metrics at /metrics: time to first token, inter-token latency, generated tokens (and a
tokens/s gauge over the last seconds), queue depth, running batch size.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuyard.errors import ConfigError
from gpuyard.serve.llm.engine import Engine, QueueFull, SamplingParams, collect
from gpuyard.serve.llm.engine import Request as GenRequest

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class Metrics:
    """The server's Prometheus metrics (a registry of its own)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram(
            "gpuyard_llm_time_to_first_token_seconds",
            "Time to first token",
            buckets=buckets,
            registry=self.registry,
        )
        self.itl = Histogram(
            "gpuyard_llm_inter_token_latency_seconds",
            "Time between tokens of a request",
            buckets=buckets,
            registry=self.registry,
        )
        self.generated = Counter("gpuyard_llm_generated_tokens", "Tokens generated", registry=self.registry)
        self.tps = Gauge(
            "gpuyard_llm_tokens_per_second",
            "Tokens generated per second over the last 5 s",
            registry=self.registry,
        )
        self.queue = Gauge(
            "gpuyard_llm_queue_depth", "Requests waiting to join the batch", registry=self.registry
        )
        self.batch = Gauge("gpuyard_llm_batch_size", "Requests in the running batch", registry=self.registry)
        self.requests = Counter(
            "gpuyard_llm_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_sum = 0  # tokens in _recent

    def observe_ttft(self, s: float) -> None:
        self.ttft.observe(s)

    def observe_itl(self, s: float) -> None:
        self.itl.observe(s)

    def tokens(self, n: int) -> None:
        """``n`` tokens generated now (the engine calls it once per step)."""
        if n <= 0:
            return
        self.generated.inc(n)
        now = time.monotonic()
        self._recent.append((now, n))
        self._recent_sum += n
        while self._recent and self._recent[0][0] < now - 5:
            self._recent_sum -= self._recent.popleft()[1]
        span = max(now - self._recent[0][0], 1e-3) if len(self._recent) > 1 else 5.0
        self.tps.set(self._recent_sum / span)

    def set_queue(self, n: int) -> None:
        self.queue.set(n)

    def set_batch(self, n: int) -> None:
        self.batch.set(n)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)


class CompletionBody(_Body):
    prompt: str | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)


def _error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": code, "param": None}}, status_code=status
    )


def build_app(engine: Engine, model_name: str, info: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name``."""
    app = FastAPI(title="gpuyard LLM server")
    created = int(time.time())
    metrics: Metrics = engine.metrics

    def _params(body: _Body, default_max: int) -> SamplingParams:
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ConfigError("stop: at most 4 non-empty strings")
        mt = body.max_completion_tokens or body.max_tokens or default_max
        return SamplingParams(
            max_tokens=mt, temperature=body.temperature, top_p=body.top_p, stop=stops, seed=body.seed
        )

    async def _parse(request: Request, cls: type[_Body]) -> Any:
        try:
            return cls.model_validate(json.loads(await request.body()))
        except (ValueError, ValidationError) as exc:
            errs = exc.errors() if isinstance(exc, ValidationError) else None
            msg = (
                "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errs)
                if errs
                else f"body is not JSON: {exc}"
            )
            raise ConfigError(msg) from None

    async def _run(kind: str, body: _Body, prompt_ids: list[int]) -> Response:
        if body.model != model_name:
            return _error(
                404,
                f"model {body.model!r} is not served here (serving {model_name!r})",
                code="model_not_found",
            )
        default_max = (
            DEFAULT_COMPLETION_TOKENS
            if kind == "text_completion"
            else engine.context_length - len(prompt_ids)
        )
        params = _params(body, max(1, default_max))
        rid = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        try:
            req, queue = await collect(engine, lambda emit: GenRequest(prompt_ids, params, emit))
        except QueueFull as exc:
            metrics.requests.labels("queue_full").inc()
            return _error(429, str(exc), "rate_limit_exceeded", "queue_full")
        obj = "text_completion" if kind == "text_completion" else "chat.completion"

        def choice(text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
            if kind == "text_completion":
                return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            if delta:
                d = {"role": "assistant", "content": text} if text is not None else {}
                return {"index": 0, "delta": d, "finish_reason": finish}
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}

        if body.stream:

            async def events() -> AsyncIterator[bytes]:
                done = False
                try:
                    while True:
                        ev = await queue.get()
                        if "error" in ev:
                            err = {"error": {"message": ev["error"], "type": "server_error"}}
                            yield f"data: {json.dumps(err)}\n\n".encode()
                            break
                        chunk = {
                            "id": rid,
                            "object": obj + ("" if kind == "text_completion" else ".chunk"),
                            "created": int(time.time()),
                            "model": model_name,
                        }
                        if "text" in ev:
                            chunk["choices"] = [choice(ev["text"], None, True)]
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                        if "done" in ev:
                            chunk["choices"] = [
                                choice(None if kind != "text_completion" else "", ev["done"], True)
                            ]
                            chunk["usage"] = _usage(ev)
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                            yield b"data: [DONE]\n\n"
                            done = True
                            metrics.requests.labels("ok").inc()
                            break
                finally:
                    if not done:  # the client went away: free the slot
                        engine.cancel(req)
                        metrics.requests.labels("cancelled").inc()

            return StreamingResponse(
                events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        parts: list[str] = []
        try:
            while True:
                ev = await queue.get()
                if "error" in ev:
                    return _error(500, ev["error"], "server_error")
                if "text" in ev:
                    parts.append(ev["text"])
                if "done" in ev:
                    break
        finally:
            if req.finish_reason is None:
                engine.cancel(req)
        metrics.requests.labels("ok").inc()
        return JSONResponse(
            {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
             "choices": [choice("".join(parts), ev["done"], False)], "usage": _usage(ev)}
        )  # fmt: skip

    @app.exception_handler(ConfigError)
    async def _bad(request: Request, exc: ConfigError) -> JSONResponse:
        metrics.requests.labels("bad_request").inc()
        return _error(400, str(exc))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "gpuyard",
                      "context_length": engine.context_length}],
        }  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionBody)
        if isinstance(body.prompt, str):
            ids = engine.tok.encode_batch([body.prompt])[0]
        else:
            vocab = engine.tok.vocab_size
            if any(t < 0 or t >= vocab for t in body.prompt):
                raise ConfigError(f"prompt: token ids must be in [0, {vocab})")
            ids = list(body.prompt)
        engine.check(len(ids), _params(body, DEFAULT_COMPLETION_TOKENS).max_tokens)
        return await _run("text_completion", body, ids)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatBody)
        text = engine.tok.render_chat([m.model_dump() for m in body.messages], add_generation_prompt=True)
        ids = engine.tok.encode_batch([text], specials=True)[0]
        if body.max_tokens or body.max_completion_tokens:
            engine.check(len(ids), _params(body, 1).max_tokens)
        elif len(ids) >= engine.context_length:
            engine.check(len(ids), 1)
        return await _run("chat", body, ids)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_name,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
        }

    @app.get("/ready")
    async def ready() -> Response:
        # The model is loaded before the app exists; ready while the engine's decoding thread runs.
        up = engine.alive()
        return JSONResponse({"ready": up}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.info = info or {}
    return app


def _usage(ev: dict[str, Any]) -> dict[str, int]:
    p, c = int(ev.get("prompt_tokens", 0)), int(ev.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
