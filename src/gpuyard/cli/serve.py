"""`gpuyard serve MODEL`: an HTTP model server with dynamic batching, in the foreground."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import typer

# Plain dataclasses (no numpy): cheap enough for every `gpuyard` run, and the one place defaults live.
from gpuyard.serve.access import KEY_ENV
from gpuyard.serve.options import BatchConfig, DriftConfig, ServeOptions

_REF_HELP = "Model to serve: NAME (latest), NAME:VERSION or NAME@ALIAS (e.g. digits@production)."
_BATCHING_HELP = "inline: the event loop runs each batch (no thread hand-off); thread: a model thread does."
_SERVE, _BATCH, _DRIFT = ServeOptions(), BatchConfig(), DriftConfig()
# The drift tests start once the window holds this many rows (or the whole window, when smaller).
_DRIFT_MIN_ROWS = _DRIFT.min_rows


# The flags `gpuyard serve` and `gpuyard deploy` share: (parameter, type, flag, help).
_FLAGS = (
    ("host", str, "--host", "Address to listen on."),
    ("port", int, "--port", ""),  # default and help per command
    ("replicas", int, "--replicas", "Server processes sharing the port (one per GPU)."),
    ("max_batch", int, "--max-batch", "Most samples in one forward pass."),
    ("max_wait_ms", float, "--max-wait-ms", "Longest wait for a batch to fill (ms)."),
    ("batching", str, "--batching", _BATCHING_HELP),
    ("device", str, "--device", "auto, cpu, cuda or cuda:N."),
    ("threads", int, "--threads", "Torch threads per replica (0: (cores-1)/replicas, min 1)."),
    ("max_body", int, "--max-body-bytes", "Larger request bodies get 413."),
    ("no_drift", bool, "--no-drift", "Do not monitor input/prediction drift."),
    ("drift_window", int, "--drift-window", "Samples in the drift window."),
    ("drift_interval", float, "--drift-interval", "Seconds between drift checks."),
    ("drain_s", float, "--drain-timeout", "On SIGTERM, longest wait (s) for requests in flight; then cut."),
    ("max_prompt_tokens", int, "--max-prompt-tokens", "Language models: longest prompt (0: the context)."),
    (
        "engine",
        str,
        "--engine",
        "Language models: vllm, gpuyard (its own engine) or auto (vLLM when `make vllm` installed it).",
    ),
    (
        "special_tokens",
        bool,
        "--special-tokens-in-chat",
        "Language models: special-token strings in chat messages act as control tokens (off: text).",
    ),
    (
        "adapters",
        list[str],
        "--adapter",
        "Language models, vLLM: a registered LoRA adapter (NAME:VERSION) of MODEL's base, served by name "
        "beside it (a request's model picks it); repeat for several.",
    ),
)


def _flags(port: int, port_help: str) -> dict[str, tuple[type, Any]]:
    """The shared flags as name -> (type, typer option), their defaults taken from the config classes."""
    defaults = {
        "host": _SERVE.host,
        "port": port,
        "replicas": _SERVE.replicas,
        "max_batch": _BATCH.max_batch,
        "max_wait_ms": _BATCH.max_wait_ms,
        "batching": _BATCH.mode,
        "device": _SERVE.device,
        "threads": _BATCH.threads,
        "max_body": _SERVE.max_body_bytes,
        "no_drift": not _SERVE.drift,
        "drift_window": _DRIFT.window,
        "drift_interval": _DRIFT.interval_s,
        "drain_s": _SERVE.drain_s,
        "max_prompt_tokens": _SERVE.max_prompt_tokens,
        "special_tokens": _SERVE.special_tokens,
        "engine": _SERVE.engine,
        "adapters": list(_SERVE.adapters),
    }
    metavars = {"adapters": "NAME:VERSION"}
    return {
        name: (
            kind,
            typer.Option(
                defaults[name], flag, help=port_help if name == "port" else text, metavar=metavars.get(name)
            ),
        )
        for name, kind, flag, text in _FLAGS
    }


def serve_options(
    *,
    host: str,
    port: int,
    replicas: int,
    device: str,
    max_batch: int,
    max_wait_ms: float,
    batching: str,
    threads: int,
    max_body: int,
    no_drift: bool,
    drift_window: int,
    drift_interval: float,
    drain_s: float = _SERVE.drain_s,
    max_prompt_tokens: int = _SERVE.max_prompt_tokens,
    special_tokens: bool = _SERVE.special_tokens,
    engine: str = _SERVE.engine,
    adapters: list[str] | tuple[str, ...] | None = _SERVE.adapters,
) -> ServeOptions:
    """The server's options from the shared flags (one place, so neither command can drop one)."""
    return ServeOptions(
        host=host,
        port=port,
        replicas=replicas,
        device=device,
        batch=BatchConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, threads=threads, mode=batching),
        max_body_bytes=max_body,
        drift=not no_drift,
        drift_config=DriftConfig(
            window=drift_window, min_rows=min(_DRIFT_MIN_ROWS, drift_window), interval_s=drift_interval
        ),
        drain_s=drain_s,
        max_prompt_tokens=max_prompt_tokens,
        special_tokens=special_tokens,
        engine=engine,
        adapters=tuple(adapters or ()),
    )


def with_serve_flags(
    port: int = _SERVE.port, port_help: str = "Port (0: any free port; the URL is printed)."
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the shared serve flags; it receives them as one ``opts: ServeOptions``.

    Typer reads a command's parameters from its signature, so the wrapper's signature is the
    command's own parameters (less ``opts``) followed by the shared flags.

    Args:
        port: the ``--port`` default (`deploy` picks a free port by default, `serve` listens on 8000).
        port_help: the ``--port`` help.
    """

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        flags = _flags(port, port_help)
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "opts"]
        shared = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
            for name, (kind, option) in flags.items()
        ]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> None:
            opts = serve_options(**{name: kwargs.pop(name) for name in flags})
            command(opts=opts, **kwargs)

        wrapper.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in (*own, *shared)} | {"return": None}
        return wrapper

    return decorate


@with_serve_flags()
def serve(
    opts: ServeOptions,
    model: str = typer.Argument(..., help=_REF_HELP),
    deployment_id: int = typer.Option(None, "--deployment-id", hidden=True),
    api_key: str = typer.Option(
        None,
        "--api-key",
        help=f"Key clients send (Authorization: Bearer). Default: ${KEY_ENV}, else a new one, printed once.",
    ),
) -> None:
    """Serve MODEL over HTTP: POST /v1/models/NAME/predict, /health, /ready, /metrics, /docs.

    Raw records: {"records": [{"column": value, ...}]}, made features by the model's training recipe.

    Features: {"inputs": [[...], ...]} or a safetensors body. See docs/serving.md.

    A language model (a registered causal LM or adapter, or a Hugging Face folder) is served with
    the OpenAI API instead: /v1/completions, /v1/chat/completions, /v1/models. See docs/llm.md.
    With vLLM, --adapter A:1 --adapter B:2 serves registered LoRA adapters of MODEL's base by name
    beside it, on one base: /v1/models lists each, a request's model picks one.

    Every request but /health and /ready needs 'Authorization: Bearer KEY': the server's key, or a
    gpuyard API token of the model's team (or an admin's).
    """
    from gpuyard.serve.runner import serve_with_record

    if deployment_id is not None:  # started by `gpuyard deploy`: options and key come from the record
        serve_with_record(model, replace(opts, deployment_id=deployment_id))
        return
    from pathlib import Path

    from gpuyard.models.registry import get_version
    from gpuyard.serve.access import Access, announce_key, hand_key, key_hash
    from gpuyard.serve.llm.run import language_model, serve_language_model

    if opts.adapters:  # LoRA adapters by name: refused in one line before anything starts
        from gpuyard.serve.llm.vllm_engine import check_lora

        check_lora(model, opts)
    folder = language_model(model)
    # A registered model's team may call it with their tokens; a plain folder belongs to no team.
    team = None if folder is not None and Path(model).expanduser().is_dir() else get_version(model).team
    key, generated = hand_key(api_key)
    if folder is None:  # a registered model's files are checked as data first: a refusal is one line
        from gpuyard.serve.deploy import check_files

        check_files(model)
    if generated:
        announce_key(key)
    access = Access(key_hash(key), team)
    if folder is not None:  # a language model: the OpenAI-compatible server (docs/llm.md)
        serve_language_model(model, folder, opts, access)
        return
    serve_with_record(model, opts, access)


def register(app: typer.Typer) -> None:
    """Add `gpuyard serve` to the CLI."""
    app.command("serve")(serve)
