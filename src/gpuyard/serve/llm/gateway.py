"""The gateway: gpuyard's process in front of a language model's vLLM replicas.

It is what ``gpuyard serve --engine vllm`` and a deployment of a language model listen with; the
replicas (:mod:`gpuyard.serve.llm.vllm_engine`) listen on loopback ports behind it, each with a key only
the gateway holds. For every request it:

- authenticates the caller exactly as every gpuyard model server does (:class:`~gpuyard.serve.access.KeyGate`:
  the deployment's key, or a gpuyard token of the model's team or an admin's; 401/403 before any body
  is read);
- bounds the body (``--max-body-bytes``, 413 while it is read) and checks the request with the same
  validation as gpuyard's own engine (:func:`gpuyard.serve.llm.app.sampling`): a field vLLM does not
  implement here (``tools``, ``response_format``, ...) or an unknown one is refused with 400 naming it,
  ``max_tokens`` may not exceed the context;
- sends it to the ready replica with the fewest requests outstanding and streams the answer back as it
  comes (server-sent events pass through chunk by chunk; a client that hangs up closes the upstream
  request, which vLLM aborts).

Connections are those of every gpuyard model server (:func:`gpuyard.connections.model_server_guard`):
a request's headers must be complete within the header timeout of the connection opening or of its
previous answer (else 408 and closed: a client that sends half a request head and idles holds nothing),
and the open connections are capped in total and per client address, fitted to the open-file limit.

A replica whose process exits is reported in one line, its requests in flight answered 503 (or, in a
stream already begun, one error event), and a replacement is started; ``on_replaced`` records it (a
deployment's record). ``/metrics`` serves the gateway's own series and every replica's (vLLM's, with a
``replica`` label). ``/health`` and ``/ready`` stay open, as on every gpuyard model server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gpuyard.errors import ConfigError, GpuyardError
from gpuyard.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S
from gpuyard.serve.access import read_body
from gpuyard.serve.llm import vllm_engine
from gpuyard.serve.llm.relay import READ_CHUNK, Dechunker, Head, Upstream, UpstreamError, abort, request_bytes
from gpuyard.serve.llm.vllm_engine import Replica, VllmConfig

log = logging.getLogger("gpuyard.serve")

# A replica that is being replaced gets this long to become ready again.
REPLACE_TIMEOUT_S = 900.0
# A streamed answer whose client takes no bytes for this long is cut (its slot and the replica's
# request freed): a client that never reads holds nothing for longer.
WRITE_STALL_S = 60.0


@dataclass(frozen=True)
class GatewayLimits:
    """What one request may carry.

    Attributes:
        max_body_bytes: larger bodies get 413.
        vocab: the tokenizer's size (token ids in a request are checked against it).
        specials: the tokenizer's special-token strings.
        special_tokens: chat messages may contain them (``--special-tokens-in-chat``); else a message
            holding one is refused (vLLM would read it as the control token, not as text).
    """

    max_body_bytes: int
    vocab: int
    specials: tuple[str, ...] = ()
    special_tokens: bool = False


class Gateway:
    """The replicas and the routing over them (module docstring).

    Args:
        cfg: how replicas start.
        replicas: the replicas, already ready.
        limits: body and parameter limits.
        on_replaced: called with (replica pids, one-line note) after a replica was replaced.
    """

    def __init__(
        self,
        cfg: VllmConfig,
        replicas: list[Replica],
        limits: GatewayLimits,
        on_replaced: Callable[[list[int | None], str], None] | None = None,
    ) -> None:
        import httpx
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.cfg, self.replicas, self.limits, self.on_replaced = cfg, replicas, limits, on_replaced
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gpuyard_gateway_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        self.outstanding = Gauge(
            "gpuyard_gateway_outstanding",
            "Requests in flight per replica",
            ["replica"],
            registry=self.registry,
        )
        self.restarts = Counter(
            "gpuyard_gateway_replica_restarts", "Replicas replaced", registry=self.registry
        )
        self.pooled = Gauge(
            "gpuyard_gateway_pooled_connections",
            "Idle kept-alive connections to each replica",
            ["replica"],
            registry=self.registry,
        )
        self.stopping = False
        self.write_stall_s = WRITE_STALL_S
        self.body_timeout_s = DEFAULT_BODY_TIMEOUT_S
        self._pools: dict[int, Upstream] = {}
        self._relays: set[_Relayed] = set()
        self._replacing: set[int] = set()
        self._tasks: set[asyncio.Future[None]] = set()

    # ----- routing ---------------------------------------------------------------------------------
    def pick(self) -> Replica:
        """The ready replica with the fewest requests outstanding.

        Raises:
            Unavailable: none is ready.
        """
        ready = [r for r in self.replicas if r.ready and r.exited() is None]
        if not ready:
            starting = sum(1 for r in self.replicas if not r.ready)
            raise Unavailable(f"no replica of this model is ready ({starting} starting again); retry shortly")
        return min(ready, key=lambda r: r.outstanding)

    def _gone(self, replica: Replica) -> str:
        code = replica.exited()
        if code is not None:
            return (
                f"vLLM replica {replica.index} (pid {replica.pid}) exited with code {code} while answering; "
                "it is being replaced: retry"
            )
        return f"vLLM replica {replica.index} (pid {replica.pid}) did not answer; retry"

    def _upstream(self, replica: Replica) -> Upstream:
        up = self._pools.get(replica.index)
        if up is None or up.port != replica.port:
            up = self._pools[replica.index] = Upstream("127.0.0.1", replica.port)
        return up

    async def forward(self, path: str, raw: bytes, stream: bool) -> Response:
        """Send ``raw`` to a replica's ``path`` and relay the answer (streamed when ``stream``)."""
        replica = self.pick()
        replica.outstanding += 1
        self.outstanding.labels(str(replica.index)).set(replica.outstanding)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                replica.outstanding -= 1
                self.outstanding.labels(str(replica.index)).set(replica.outstanding)

        up = self._upstream(replica)
        try:
            head, reader, writer = await up.open(request_bytes(path, replica.port, replica.key, raw))
        except UpstreamError as exc:
            release()
            self.requests.labels("replica_failed").inc()
            log.warning("vLLM replica %s: %s", replica.index, exc)
            raise Unavailable(self._gone(replica)) from None
        except BaseException:
            release()
            raise
        if not stream or head.status != 200:
            try:
                body = await up.read_body(head, reader, writer)
            except UpstreamError as exc:
                self.requests.labels("replica_failed").inc()
                log.warning("vLLM replica %s: %s", replica.index, exc)
                raise Unavailable(self._gone(replica)) from None
            finally:
                release()
            self.requests.labels("ok" if head.status == 200 else f"status_{head.status}").inc()
            return Response(body, status_code=head.status, media_type=head.content_type)
        return _Relayed(self, replica, up, head, reader, writer, release)

    # ----- replicas --------------------------------------------------------------------------------
    async def watch(self) -> None:
        """Replace each replica whose process exits, cut streams whose client stopped reading, and
        close pooled connections too old to reuse, until the gateway stops."""
        loop = asyncio.get_running_loop()
        while not self.stopping:
            now = loop.time()
            for relayed in list(self._relays):
                if relayed.sending_since and now - relayed.sending_since > self.write_stall_s:
                    relayed.cut()
            for pool in self._pools.values():
                pool.reap()
            for replica in self.replicas:
                code = replica.exited()
                if code is not None and replica.index not in self._replacing and not self.stopping:
                    self._replacing.add(replica.index)
                    task = asyncio.ensure_future(self._replace(replica, code))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(0.5)  # a child's exit has no event on this loop: poll, as init would

    async def _replace(self, replica: Replica, code: int) -> None:
        old = replica.pid
        replica.ready = False
        tail = replica.log_tail(3)
        print(
            f"gpuyard serve: vLLM replica {replica.index} (pid {old}) exited with code {code}; starting a "
            f"replacement{': ' + tail if tail else ''}",
            file=sys.stderr,
            flush=True,
        )
        pool = self._pools.pop(replica.index, None)
        if pool is not None:
            pool.close()
        try:
            # What is left of it (its engine-core and worker processes outlive a killed server) goes first.
            await asyncio.to_thread(replica.stop, 5.0)
            # Started from this (the event loop's) thread: the replica's parent-death signal is tied to it.
            vllm_engine.start(self.cfg, replica)
            await asyncio.to_thread(vllm_engine.wait_ready, replica, self.cfg.name, REPLACE_TIMEOUT_S)
        except ConfigError as exc:
            print(f"gpuyard serve: could not replace vLLM replica {replica.index}: {exc}", file=sys.stderr)
            note = f"replica {replica.index} (pid {old}) exited with code {code}; its replacement failed"
        else:
            self.restarts.inc()
            note = (
                f"replica {replica.index} (pid {old}) exited with code {code}; replaced by pid {replica.pid}"
            )
            print(f"gpuyard serve: {note}", file=sys.stderr, flush=True)
        finally:
            self._replacing.discard(replica.index)
        if self.on_replaced is not None:
            try:
                self.on_replaced([r.pid for r in self.replicas], note)
            except Exception as exc:  # a store hiccup must not stop the gateway
                log.warning("could not record the replacement: %s", exc)

    async def metrics_text(self) -> bytes:
        """The gateway's series and each replica's (a ``replica`` label added), one exposition."""
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families
        from prometheus_client.samples import Sample

        async def scrape(r: Replica) -> str:
            try:
                resp = await self.client.get(f"{r.url}/metrics", timeout=5.0)
                return resp.text if resp.status_code == 200 else ""
            except Exception:  # a replica being replaced has no metrics for now
                return ""

        for index, pool in list(self._pools.items()):
            self.pooled.labels(str(index)).set(len(pool.idle))
        texts = await asyncio.gather(*(scrape(r) for r in self.replicas))
        merged: dict[str, Any] = {}
        for r, text in zip(self.replicas, texts, strict=True):
            try:
                families = list(text_string_to_metric_families(text))
            except ValueError:
                continue
            for fam in families:
                into = merged.setdefault(fam.name, fam)
                if into is not fam:
                    into.samples.extend(fam.samples)
                    fam.samples = []
                into.samples[:] = [
                    s if "replica" in s.labels else Sample(s.name, {**s.labels, "replica": str(r.index)},
                                                           s.value, s.timestamp, s.exemplar)
                    for s in into.samples
                ]  # fmt: skip

        class _Replicas:
            def collect(self) -> Any:
                return list(merged.values())

        from prometheus_client import CollectorRegistry

        theirs = CollectorRegistry(auto_describe=False)
        theirs.register(_Replicas())  # type: ignore[arg-type]
        return generate_latest(self.registry) + generate_latest(theirs)

    async def close(self) -> None:
        self.stopping = True
        for pool in self._pools.values():
            pool.close()
        await self.client.aclose()


class _Relayed(Response):
    """A streamed answer relayed from a replica's connection to the client (:mod:`.relay`).

    Per read from the replica: undo its chunked framing, one ASGI message to the client. A client that
    hangs up aborts the replica's connection (vLLM aborts the request); a client that takes nothing for
    ``Gateway.write_stall_s`` is cut by :meth:`Gateway.watch`; a replica that fails mid-stream gets the
    client one error event. The replica's slot is released however it ends.
    """

    def __init__(
        self,
        gw: Gateway,
        replica: Replica,
        up: Upstream,
        head: Head,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        release: Callable[[], None],
    ) -> None:
        self.gw, self.replica, self.up, self.head = gw, replica, up, head
        self.reader, self.writer, self.release = reader, writer, release
        self.status_code = 200
        self.background = None
        self.sending_since = 0.0  # the loop's time when a send began that has not returned; 0: none
        self.hung_up = False
        self.stalled = False
        self._task: asyncio.Task[Any] | None = None

    def cut(self) -> None:
        """The client stopped reading: end this relay (the watchdog's call)."""
        if not self.stalled and self._task is not None:
            self.stalled = True
            self._task.cancel()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gw, head, reader, writer = self.gw, self.head, self.reader, self.writer
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()

        async def until_hang_up() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.hung_up = True
            abort(writer)

        watcher = asyncio.ensure_future(until_hang_up())
        gw._relays.add(self)
        outcome, complete = "cancelled", False
        dech = Dechunker() if head.chunked else None
        left = head.length
        try:
            kind = head.content_type.encode("latin-1")
            headers = [(b"content-type", kind), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            failure = ""
            while True:
                try:
                    data = await reader.read(READ_CHUNK)
                except OSError as exc:
                    data, failure = b"", str(exc)
                if not data:
                    complete = dech is None and left is None  # delimited by the connection's end
                    break
                try:
                    payload = dech.feed(data) if dech is not None else data
                except UpstreamError as exc:
                    failure = str(exc)
                    break
                if left is not None:
                    payload, left = payload[:left], left - len(payload)
                if payload:
                    self.sending_since = loop.time()
                    await send({"type": "http.response.body", "body": payload, "more_body": True})
                    self.sending_since = 0.0
                if (dech is not None and dech.done) or (left is not None and left <= 0):
                    complete = True
                    break
            if self.hung_up:
                outcome = "cancelled"
            elif complete:
                outcome = "ok"
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                # The watcher goes before the connection is pooled: a hang-up seen later must not
                # abort a connection that another request may be using by then.
                watcher.cancel()
                clean = head.keep_alive and (dech is None or not dech.buf) and not (left or 0) < 0
                if clean and not self.hung_up:
                    self.up.put_back(reader, writer)
                else:
                    abort(writer)
            else:
                outcome = "replica_failed"
                abort(writer)
                if failure:
                    log.warning("vLLM replica %s: %s", self.replica.index, failure)
                err = {"error": {"message": gw._gone(self.replica), "type": "server_error", "code": 503}}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\n".encode()})
        except asyncio.CancelledError:
            abort(writer)
            if not self.stalled or self._task is None:
                raise
            self._task.uncancel()  # the watchdog's cut: end here; the server closes the connection
            outcome = "client_stalled"
            print(
                f"gpuyard serve: cut a streamed answer whose client took nothing for {gw.write_stall_s:g} s",
                file=sys.stderr,
                flush=True,
            )
        except BaseException:
            abort(writer)
            raise
        finally:
            watcher.cancel()
            gw._relays.discard(self)
            gw.requests.labels(outcome).inc()
            self.release()


class Unavailable(GpuyardError):
    """No replica can answer now (503)."""

    http_status = 503


class BodyTimeout(GpuyardError):
    """The request's body did not arrive in time (408; the connection is closed)."""

    http_status = 408


def build_gateway_app(gw: Gateway, created: int | None = None) -> FastAPI:
    """The gateway's HTTP API (module docstring); the key check wraps it (KeyGate). Its lifespan runs
    :meth:`Gateway.watch` (serve it with ``lifespan="on"``)."""
    from gpuyard.serve.llm.app import (
        ChatBody,
        CompletionBody,
        NotServed,
        _Body,
        _parse_body,
        error_response,
        model_card,
        model_lookup,
        sampling,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        watcher = asyncio.ensure_future(gw.watch())
        yield
        await gw.close()
        watcher.cancel()

    app = FastAPI(title="gpuyard LLM gateway", lifespan=lifespan)
    made = created or int(time.time())
    cards = {gw.cfg.name: model_card(gw.cfg.name, made, gw.cfg.context, "vllm")}
    for a in gw.cfg.adapters:  # a LoRA adapter by name: its parent is the model it runs on
        cards[a.name] = model_card(a.name, made, gw.cfg.context, "vllm") | {"parent": gw.cfg.name}
    card = cards[gw.cfg.name]

    @app.exception_handler(GpuyardError)
    async def _bad(request: Request, exc: GpuyardError) -> JSONResponse:
        answer = error_response(exc, gw.requests)
        if isinstance(exc, BodyTimeout):
            answer.headers["connection"] = "close"  # the rest of the body would be read as a request
        return answer

    async def _checked(request: Request, cls: type[_Body]) -> tuple[bytes, Any]:
        try:  # a client sending its body slowly, or not at all, holds its connection this long at most
            async with asyncio.timeout(gw.body_timeout_s):  # inline: a refusal is sent at once
                raw = await read_body(request, gw.limits.max_body_bytes)
        except asyncio.TimeoutError:
            raise BodyTimeout(f"request body not received within {gw.body_timeout_s:g} s") from None
        body = await asyncio.to_thread(_parse_body, raw, cls)
        if body.model not in cards:
            serving = ", ".join(map(repr, cards))
            raise NotServed(f"model {body.model[:300]!r} is not served here (serving {serving})")
        sampling(body, 1, gw.limits.vocab, engine="vllm")
        if isinstance(body, ChatBody) and not gw.limits.special_tokens:
            for i, m in enumerate(body.messages):
                named = next((sp for sp in gw.limits.specials if sp in m.content), None)
                if named is not None:
                    raise ConfigError(
                        f"messages[{i}]: contains the special token {named!r}, which this server does not "
                        "take in chat text: leave it out"
                    )
        given = body.max_completion_tokens or body.max_tokens
        if given is not None and given >= gw.cfg.context:
            raise ConfigError(
                f"max_tokens: {given} does not fit the model's context of {gw.cfg.context} tokens "
                "with a prompt"
            )
        return raw, body

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw, body = await _checked(request, CompletionBody)
        return await gw.forward("/v1/completions", raw, body.stream)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        raw, body = await _checked(request, ChatBody)
        return await gw.forward("/v1/chat/completions", raw, body.stream)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        return cards[model_id] if model_id in cards else model_lookup(card, model_id)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": gw.cfg.name,
            "engine": "vllm",
            "replicas": [
                {"index": r.index, "ready": r.ready, "outstanding": r.outstanding} for r in gw.replicas
            ],
        }

    @app.get("/ready")
    async def ready() -> Response:
        up = any(r.ready and r.exited() is None for r in gw.replicas)
        return JSONResponse({"ready": up}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await gw.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_gateway(
    gw: Gateway,
    access: Any,
    sock: Any,
    drain_s: float,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
) -> None:
    """Serve ``gw`` on the listening socket ``sock`` to callers ``access`` accepts, under the model
    servers' connection limits (module docstring), until SIGTERM/SIGINT; then wait at most ``drain_s``
    for requests in flight."""
    import uvicorn

    from gpuyard.connections import guarded_uvicorn, model_server_guard
    from gpuyard.serve.access import KeyGate, draining_server, openai_body

    guard = model_server_guard(header_timeout_s)
    print(f"gpuyard serve: {guard.describe()}", file=sys.stderr, flush=True)
    config = uvicorn.Config(
        **guarded_uvicorn(KeyGate(build_gateway_app(gw), access, openai_body), guard),
        log_level="warning",
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=drain_s,  # type: ignore[arg-type]  # a float works (wait_for)
        backlog=2048,
    )

    def inflight() -> str:
        return ", ".join(f"{r.outstanding} on replica {r.index}" for r in gw.replicas if r.outstanding)

    draining_server(config, inflight).run(sockets=[sock])


def _loopback_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_vllm(
    ref: str,
    folder: Any,
    opts: Any,
    access: Any,
    on_ready: Callable[[str, dict[str, Any]], None] | None = None,
    on_replaced: Callable[[list[int | None], str], None] | None = None,
    startup_timeout_s: float = 900.0,
) -> None:
    """Serve language model ``folder`` as ``ref`` with ``opts.replicas`` vLLM replicas behind the
    gateway on opts.host:opts.port, until SIGTERM/SIGINT; the replicas stop with it.

    Raises:
        ConfigError: a replica exited before it was ready, or was not ready in time (one line with
            the tail of its log).
    """
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from gpuyard.models.llm import serving_tokenizer as load_tokenizer
    from gpuyard.serve.listen import bind, url_of, watch_ready
    from gpuyard.settings import load_settings

    folder = Path(folder)
    adapters: tuple[vllm_engine.Adapter, ...] = ()
    lora = vllm_engine.lora_set(ref, opts.adapters)
    if lora is not None:  # registered LoRA adapters: their base served, each adapter by name on it
        base_ref, folder, adapters = lora
        names = ", ".join(repr(a.name) for a in adapters)
        print(
            f"gpuyard serve: vLLM serves {base_ref} with LoRA adapter(s) by name (model {names}; "
            f"{base_ref!r} answers without them)",
            file=sys.stderr,
            flush=True,
        )
        ref = base_ref
    tok = load_tokenizer(folder)
    device, gpus = vllm_engine.placement(opts.device)
    work = Path(tempfile.mkdtemp(prefix="gpuyard-vllm-"))
    cfg = VllmConfig(
        folder=vllm_engine.served_folder(folder, work / "model"),
        name=ref,
        context=vllm_engine.context_length(folder),
        max_batch=opts.batch.max_batch,
        device=device,
        gpus=gpus,
        logs=load_settings().ensure_home() / "logs",
        adapters=adapters,
    )
    replicas = [Replica(i, _loopback_port()) for i in range(opts.replicas)]
    gw: Gateway | None = None
    sock = None
    try:
        sock = bind(opts.host, opts.port)  # before the replicas: a port in use fails at once
        for r in replicas:
            vllm_engine.start(cfg, r)
        print(
            f"gpuyard serve: starting {len(replicas)} vLLM replica(s) of {ref} ({device}; logs in "
            f"{cfg.logs}); vLLM takes minutes to start on a busy CPU",
            file=sys.stderr,
            flush=True,
        )
        for r in replicas:
            vllm_engine.wait_ready(r, ref, startup_timeout_s)
        added = tok.tokenizer.get_added_tokens_decoder().values()
        specials = tuple(sorted({t.content for t in added if getattr(t, "special", False) and t.content}))
        limits = GatewayLimits(opts.max_body_bytes, tok.vocab_size, specials, opts.special_tokens)
        gw = Gateway(cfg, replicas, limits, on_replaced)
        url = url_of(sock)
        pids: dict[str, Any] = {"server": os.getpid(), "replicas": [r.pid for r in replicas]}
        pids |= {"devices": [device] * len(replicas), "engine": "vllm"}
        if on_ready is not None:
            watch_ready(url, lambda: on_ready(url, pids))
        print(f"gpuyard serve: {ref} (language model, vLLM, {len(replicas)} replica(s), context "
              f"{cfg.context}) at {url}/v1 (OpenAI API)", file=sys.stderr, flush=True)  # fmt: skip

        serve_gateway(gw, access, sock, opts.drain_s)
    finally:
        if gw is not None:
            gw.stopping = True
        for r in replicas:
            r.stop()
        if sock is not None:
            sock.close()
        shutil.rmtree(work, ignore_errors=True)
