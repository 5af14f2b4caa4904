"""`gpuyard serve MODEL` for a language model: a registered causal LM (or adapter) or a local folder."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpuyard.errors import NotFoundError
from gpuyard.serve.access import Access


def language_model(ref: str) -> Path | None:
    """The local folder of ``ref`` when it is a language model (a Hugging Face folder, or a registered
    causal-lm/lora-adapter version), else None (another kind of model, or not registered)."""
    p = Path(ref).expanduser()
    tokenizer = (p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file()
    if p.is_dir() and (p / "config.json").is_file() and tokenizer:
        return p
    from gpuyard.models.llm import ADAPTER_FLAVOR, FLAVOR, fetch_lm
    from gpuyard.models.registry import get_version

    try:
        mv = get_version(ref)
    except (NotFoundError, Exception):  # a malformed reference: the ordinary server reports it
        return None
    if mv.flavor not in (FLAVOR, ADAPTER_FLAVOR):
        return None
    return fetch_lm(ref)


def serve_language_model(ref: str, folder: Path, opts: Any, access: Access) -> None:
    """``gpuyard serve`` of a language model by hand: vLLM behind the gateway, or gpuyard's own engine
    (``opts.engine``; :func:`~gpuyard.serve.llm.vllm_engine.choose_engine`)."""
    from gpuyard.serve.llm.vllm_engine import choose_engine, placement

    if choose_engine(opts.engine, folder, placement(opts.device)[0], opts.adapters) == "vllm":
        from gpuyard.serve.llm.gateway import serve_vllm

        serve_vllm(ref, folder, opts, access)
        return
    serve_lm(ref, folder, opts, access=access)


def serve_lm(
    ref: str,
    folder: Path,
    opts: Any,
    max_queue: int | None = None,
    sock: Any = None,
    *,
    access: Access,
) -> None:
    """Serve the language model in ``folder`` as ``ref`` until stopped: on opts.host:opts.port, or on
    the listening socket ``sock`` (a replica of a deployment, which bound it), to callers with a key
    ``access`` accepts. On SIGTERM it waits at most ``opts.drain_s`` for requests in flight."""
    import uvicorn

    from gpuyard.connections import guarded_uvicorn, model_server_guard
    from gpuyard.serve.access import KeyGate, draining_server, openai_body
    from gpuyard.serve.llm.app import Limits, Metrics, build_app
    from gpuyard.serve.llm.engine import load_engine

    metrics = Metrics()
    max_batch = opts.batch.max_batch
    engine, info = load_engine(folder, opts.device, max_batch, max_queue or 8 * max_batch, metrics)
    limits = Limits(opts.max_body_bytes, opts.max_prompt_tokens, opts.special_tokens)
    app = build_app(engine, ref, info, limits)
    # The connection limits of every model server: a request head within the header timeout, caps.
    config = uvicorn.Config(
        **guarded_uvicorn(KeyGate(app, access, openai_body), model_server_guard()),
        host=opts.host,
        port=opts.port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=opts.drain_s,  # type: ignore[arg-type]  # a float works (wait_for)
    )
    server = draining_server(config, engine.inflight)
    if sock is None:
        print(f"gpuyard serve: {ref} (language model, context {engine.context_length}) at "
              f"http://{opts.host}:{opts.port}/v1 (OpenAI API)", file=sys.stderr, flush=True)  # fmt: skip
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        app.state.close()
        engine.close()
