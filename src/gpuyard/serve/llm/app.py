"""The OpenAI-compatible HTTP API over the engine: /v1/models, /v1/completions, /v1/chat/completions.

Streaming answers are server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``), as the
OpenAI clients expect. A stream the client closes frees its batch slot before the next decoding step.
Errors are OpenAI-shaped: ``{"error": {"message", "type", "code"}}`` with 400 (a prompt plus
max_tokens over the context, a value out of range or a field this server does not implement, named),
404 (another model name), 413 (a body over the server's limit), 429 (queue full).

A request is bounded before it reaches the engine: its body (``Limits.max_body_bytes``, refused
while it is read), parsed in a worker thread, tokenized on the tokenizer thread (never on the event
loop, so /health answers while a large body is parsed), its prompt (``max_prompt_tokens``; a text
longer than that many of the longest token is refused untokenized), and its chat template's render
(:mod:`gpuyard.serve.llm.templates`). Special-token strings typed in chat messages stay text.
Prometheus metrics at /metrics: time to first token, inter-token latency, generated tokens (and a
tokens/s gauge over the last seconds), queue depth, running batch size.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuyard.errors import ConfigError, GpuyardError
from gpuyard.serve.access import read_body
from gpuyard.serve.llm.engine import Engine, collect
from gpuyard.serve.llm.scheduler import Failed, Finished, QueueFull, SamplingParams, TextEmitted
from gpuyard.serve.llm.scheduler import Request as GenRequest

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


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server.

    Attributes:
        max_body_bytes: larger bodies get 413 (a declared length before anything is read).
        max_prompt_tokens: the longest prompt (0: the context length less one).
        special_tokens: special-token strings in chat messages act as control tokens (off: text).
        template_timeout_s: the longest chat-template render (then the request fails, alone).
    """

    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int = 0
    special_tokens: bool = False
    template_timeout_s: float = 2.0


MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_N = 16  # choices per request
MAX_STOP_IDS = 64
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (chat; completions: 5)
# The optional fields each engine implements; the others are refused by name unless at their no-op
# value. One decision for both: gpuyard's own server and the gateway in front of vLLM call it.
ENGINE_FIELDS: dict[str, frozenset[str]] = {
    "gpuyard": frozenset({"stop_token_ids"}),
    "vllm": frozenset({"stop_token_ids", "n", "logprobs", "top_logprobs", "echo"}),
}
# Absent, or at the value that changes nothing: accepted whatever the engine.
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=300)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=10_000_000)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_IDS)
    user: str | None = Field(None, max_length=256)
    parallel_tool_calls: bool | None = None
    # Not implemented: refused unless absent or at their no-op value (_NOOP_VALUES).
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


class CompletionBody(_Body):
    prompt: str | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = Field(None, max_length=256)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)


def _error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": code, "param": None}}, status_code=status
    )


def _parse_body(raw: bytes, cls: type[_Body]) -> Any:
    """Parse and validate a body (runs in a worker thread: a large body never stalls the loop)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ConfigError(f"body is not JSON: {reason}") from None
    try:
        return cls.model_validate(doc)
    except ValidationError as exc:
        errs = exc.errors()[:5]
        raise ConfigError(
            "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errs)
        ) from None


def refuse_unsupported(body: _Body, engine: str) -> None:
    """Refuse, naming every one, the fields of ``body`` that ``engine`` does not implement (one 400
    rather than a 200 that ignored them), and range-check the optional ones it does.

    Raises:
        ConfigError: the fields named, and whether another engine implements them.
    """
    supported = ENGINE_FIELDS[engine]
    named = ["n"] if body.n != 1 and "n" not in supported else []
    named += ["stop_token_ids"] if body.stop_token_ids and "stop_token_ids" not in supported else []
    named += [k for k, noop in _NOOP_VALUES.items() if k not in supported and getattr(body, k) not in noop]
    if named:
        if all(k in ENGINE_FIELDS["vllm"] for k in named):
            why = "gpuyard's own engine does not implement them; vLLM does: serve with --engine vllm"
        else:
            why = "this server does not implement them: leave them out"
        raise ConfigError(f"{', '.join(named)}: not supported ({why})")
    chat = isinstance(body, ChatBody)
    lp, top = body.logprobs, body.top_logprobs
    if chat and lp is not None and not isinstance(lp, bool):
        raise ConfigError("logprobs: true or false (the number of alternatives is top_logprobs)")
    if not chat and lp is not None and not _int_in(lp, 5):
        raise ConfigError("logprobs: an integer from 0 to 5 (alternatives per token)")
    if top is not None and not _int_in(top, MAX_TOP_LOGPROBS):
        raise ConfigError(f"top_logprobs: an integer from 0 to {MAX_TOP_LOGPROBS}")
    if chat and top and lp is not True:
        raise ConfigError("top_logprobs: needs logprobs: true")
    if body.echo is not None and not isinstance(body.echo, bool):
        raise ConfigError("echo: true or false")


def _int_in(value: Any, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most


def sampling(body: _Body, default_max: int, vocab: int, engine: str = "gpuyard") -> SamplingParams:
    """The request's sampling values, each range-checked (ConfigError naming the field); fields
    ``engine`` does not implement are refused by name (:func:`refuse_unsupported`)."""
    refuse_unsupported(body, engine)
    if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
        raise ConfigError(f"stop_token_ids: token ids must be in [0, {vocab})")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ConfigError(
            f"stop: at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters"
        )
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise ConfigError(f"logit_bias: {key[:20]!r} is not a token id in [0, {vocab})")
        if not -100 <= value <= 100:
            raise ConfigError(f"logit_bias: the bias of token {key} must be between -100 and 100")
        bias[int(key)] = float(value)
    given = body.max_completion_tokens or body.max_tokens
    return SamplingParams(
        max_tokens=given or default_max,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=stops,
        seed=body.seed,
        top_k=max(body.top_k, 0),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=bias,
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        max_tokens_given=given is not None,
    )


class ChatPrompt:
    """Chat messages to prompt tokens: the template rendered in its worker (deadline and size limit),
    and special-token strings a message contains kept as text unless the server allows them."""

    def __init__(self, engine: Engine, renderer: Any, special_tokens: bool) -> None:
        self.tok, self.renderer, self.allow = engine.tok, renderer, special_tokens
        added = engine.tok.tokenizer.get_added_tokens_decoder().values()
        self.specials = sorted({t.content for t in added if getattr(t, "special", False) and t.content})

    def ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids (runs on the tokenizer thread).

        Raises:
            ConfigError: the template failed, or changed a message holding a special-token string
                so that it cannot be found to keep as text.
        """
        hostile = [
            i for i, m in enumerate(messages)
            if not self.allow and any(sp in m["content"] for sp in self.specials)
        ]  # fmt: skip
        if not hostile:
            return self.tok.encode_batch([self.renderer.render(messages)], specials=True)[0]
        # Those messages go through the template as markers; their text is tokenized on its own,
        # with special-token strings as plain text, and put back where each marker was.
        marks = {f"\ue000{i}\ue001": messages[i]["content"] for i in hostile}
        shown = [dict(m, content=f"\ue000{i}\ue001") if i in hostile else m for i, m in enumerate(messages)]
        text = self.renderer.render(shown)
        if any(text.count(mark) != 1 for mark in marks):
            named = next(sp for sp in self.specials if any(sp in c for c in marks.values()))
            raise ConfigError(
                f"messages: a message contains the special token {named!r}, which this server keeps as "
                "text, and the model's chat template transforms message content, so it cannot be kept "
                "apart: leave the token out"
            )
        ids: list[int] = []
        rest = text
        while rest:
            at, mark = min(((rest.find(m), m) for m in marks if m in rest), default=(-1, ""))
            head = rest if at < 0 else rest[:at]
            if head:
                ids += self.tok.encode_batch([head], specials=True)[0]
            if at < 0:
                break
            ids += self.tok.encode_batch([marks[mark]], specials=False)[0]
            rest = rest[at + len(mark) :]
        return ids


def build_app(
    engine: Engine,
    model_name: str,
    info: dict[str, Any] | None = None,
    limits: Limits = Limits(),
    renderer: Any = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name`` within ``limits``.

    ``renderer`` renders chat templates (:class:`~gpuyard.serve.llm.templates.TemplateRenderer`; one
    is made for the engine's tokenizer when None, and closed by ``app.state.close()``).
    """
    from gpuyard.serve.llm.templates import TemplateRenderer

    app = FastAPI(title="gpuyard LLM server")
    created = int(time.time())
    metrics: Metrics = engine.metrics
    tok = engine.tok
    vocab = tok.vocab_size
    max_prompt = min(limits.max_prompt_tokens or engine.context_length - 1, engine.context_length - 1)
    # No token is longer than this, so a text of more than max_prompt * longest characters cannot fit:
    # it is refused before it is tokenized.
    longest = max((len(t) for t in tok.tokenizer.get_vocab(with_added_tokens=True)), default=1)
    max_chars = max_prompt * max(longest, 1)
    if renderer is None:
        renderer = TemplateRenderer(tok.chat_template, tok.eos_token, max_chars, limits.template_timeout_s)
    chat_prompt = ChatPrompt(engine, renderer, limits.special_tokens)
    # One tokenizer thread: tokenizing (and rendering) never runs on the event loop, and the tokenizer's
    # special-token switch (LoadedTokenizer.encode_batch) is never flipped by two requests at once.
    tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuyard-llm-tokenize")

    async def on_tokenizer(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(tok_pool, fn, *args)

    async def _parse(request: Request, cls: type[_Body]) -> Any:
        raw = await read_body(request, limits.max_body_bytes)
        body = await asyncio.to_thread(_parse_body, raw, cls)
        if body.model != model_name:
            raise NotServed(f"model {body.model!r} is not served here (serving {model_name!r})")
        return body

    def _prompt_cap(n: int) -> None:
        if n > max_prompt:
            raise ConfigError(
                f"the prompt has {n} tokens; this server takes prompts of at most {max_prompt} tokens"
            )

    def _chars_cap(n: int, what: str) -> None:
        if n > max_chars:
            raise ConfigError(
                f"{what} has {n} characters: more than a prompt of at most {max_prompt} tokens can hold"
            )

    async def _run(
        kind: str, body: _Body, params: SamplingParams, prompt_ids: list[int], request: Request
    ) -> Response:
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
                        if isinstance(ev, Failed):
                            err = {"error": {"message": ev.message, "type": "server_error"}}
                            yield f"data: {json.dumps(err)}\n\n".encode()
                            break
                        chunk = {
                            "id": rid,
                            "object": obj + ("" if kind == "text_completion" else ".chunk"),
                            "created": int(time.time()),
                            "model": model_name,
                        }
                        if isinstance(ev, TextEmitted):
                            chunk["choices"] = [choice(ev.text, None, True)]
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                        if isinstance(ev, Finished):
                            chunk["choices"] = [
                                choice(None if kind != "text_completion" else "", ev.reason.value, True)
                            ]
                            chunk["usage"] = ev.usage
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                            yield b"data: [DONE]\n\n"
                            done = True
                            metrics.requests.labels("ok").inc()
                            break
                finally:
                    if not done:  # the client went away: free the slot (or its queue place)
                        engine.cancel(req)
                        metrics.requests.labels("cancelled").inc()

            return StreamingResponse(
                events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        parts: list[str] = []
        # A client that hangs up while its request waits or runs frees its place at once: its
        # disconnect is watched alongside the engine's events.
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                got = asyncio.ensure_future(queue.get())
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    metrics.requests.labels("cancelled").inc()
                    return Response(status_code=499)  # nobody reads it: the client is gone
                ev = got.result()
                if isinstance(ev, Failed):
                    return _error(500, ev.message, "server_error")
                if isinstance(ev, TextEmitted):
                    parts.append(ev.text)
                if isinstance(ev, Finished):
                    end = ev
                    break
        finally:
            gone.cancel()
            if req.finish_reason is None:
                engine.cancel(req)
        metrics.requests.labels("ok").inc()
        return JSONResponse(
            {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
             "choices": [choice("".join(parts), end.reason.value, False)], "usage": end.usage}
        )  # fmt: skip

    @app.exception_handler(GpuyardError)
    async def _bad(request: Request, exc: GpuyardError) -> JSONResponse:
        return error_response(exc, metrics.requests)

    card = model_card(model_name, created, engine.context_length)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        return model_lookup(card, model_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionBody)
        params = sampling(body, DEFAULT_COMPLETION_TOKENS, vocab)
        if isinstance(body.prompt, str):
            _chars_cap(len(body.prompt), "prompt")
            ids = (await on_tokenizer(tok.encode_batch, [body.prompt]))[0]
        else:
            _prompt_cap(len(body.prompt))
            if any(t < 0 or t >= vocab for t in body.prompt):
                raise ConfigError(f"prompt: token ids must be in [0, {vocab})")
            ids = list(body.prompt)
        _prompt_cap(len(ids))
        engine.check(len(ids), params.max_tokens, params.max_tokens_given)
        return await _run("text_completion", body, params, ids, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatBody)
        sampling(body, 1, vocab)  # its values are refused before any work is spent on the prompt
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        _chars_cap(sum(len(m["content"]) for m in messages), "the messages' content")
        ids = await on_tokenizer(chat_prompt.ids, messages)
        _prompt_cap(len(ids))
        params = sampling(body, engine.context_length - len(ids), vocab)
        engine.check(len(ids), params.max_tokens, params.max_tokens_given)
        return await _run("chat", body, params, ids, request)

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

    def close() -> None:
        renderer.close()
        tok_pool.shutdown(wait=False, cancel_futures=True)

    app.state.info = info or {}
    app.state.close = close
    app.state.limits = {"max_prompt_tokens": max_prompt, "max_prompt_chars": max_chars}
    return app


def error_response(exc: GpuyardError, requests: Any = None) -> JSONResponse:
    """A gpuyard error as the OpenAI API's error body: 400 for a bad value, else the error's status
    (404 another model, 413 too large, 429 full); ``requests`` (a labelled counter) counts it."""
    status = 400 if isinstance(exc, ConfigError) else exc.http_status  # OpenAI: 400 for bad values
    if requests is not None:
        requests.labels({413: "too_large", 404: "unknown_model"}.get(status, "bad_request")).inc()
    code = "model_not_found" if status == 404 else None
    return _error(status, str(exc), code=code)


def model_card(name: str, created: int, context: int, engine: str = "gpuyard") -> dict[str, Any]:
    """The model's entry in /v1/models (the same from both engines)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "gpuyard",
            "context_length": context, "engine": engine}  # fmt: skip


def model_lookup(card: dict[str, Any], model_id: str) -> dict[str, Any]:
    """``GET /v1/models/{model_id}``: the card, or NotServed (404) naming the model served."""
    if model_id != card["id"]:
        raise NotServed(f"model {model_id[:300]!r} is not served here (serving {card['id']!r})")
    return card


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (its body was read: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class NotServed(GpuyardError):
    """The body names another model than the one served."""

    http_status = 404
