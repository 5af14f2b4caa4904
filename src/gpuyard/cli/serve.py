"""`gpuyard serve MODEL`: an HTTP model server with dynamic batching, in the foreground."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from gpuyard.serve.runner import ServeOptions

_REF_HELP = "Model to serve: NAME (latest), NAME:VERSION or NAME@ALIAS (e.g. digits@production)."
BATCHING_HELP = "inline: the event loop runs each batch (no thread hand-off); thread: a model thread does."
MAX_BODY_HELP = "Larger request bodies get 413."


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
    deployment_id: int | None = None,
) -> ServeOptions:
    """The server's options from the flags `gpuyard serve` and `gpuyard deploy` share (one place, so
    neither command can drop one on the way)."""
    from gpuyard.serve.batching import BatchConfig
    from gpuyard.serve.drift import DriftConfig
    from gpuyard.serve.runner import ServeOptions

    return ServeOptions(
        host=host,
        port=port,
        replicas=replicas,
        device=device,
        batch=BatchConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, threads=threads, mode=batching),
        max_body_bytes=max_body,
        drift=not no_drift,
        drift_config=DriftConfig(
            window=drift_window, min_rows=min(200, drift_window), interval_s=drift_interval
        ),
        deployment_id=deployment_id,
    )


def serve(
    model: str = typer.Argument(..., help=_REF_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port (0: any free port; the URL is printed)."),
    replicas: int = typer.Option(1, "--replicas", help="Server processes sharing the port (one per GPU)."),
    max_batch: int = typer.Option(32, "--max-batch", help="Most samples in one forward pass."),
    max_wait_ms: float = typer.Option(2.0, "--max-wait-ms", help="Longest wait for a batch to fill (ms)."),
    batching: str = typer.Option("inline", "--batching", help=BATCHING_HELP),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    threads: int = typer.Option(
        0, "--threads", help="Torch threads per replica (0: (cores-1)/replicas, min 1)."
    ),
    max_body: int = typer.Option(4 << 20, "--max-body-bytes", help=MAX_BODY_HELP),
    no_drift: bool = typer.Option(False, "--no-drift", help="Do not monitor input/prediction drift."),
    drift_window: int = typer.Option(1000, "--drift-window", help="Samples in the drift window."),
    drift_interval: float = typer.Option(5.0, "--drift-interval", help="Seconds between drift checks."),
    deployment_id: int = typer.Option(None, "--deployment-id", hidden=True),
) -> None:
    """Serve MODEL over HTTP: POST /v1/models/NAME/predict, /health, /ready, /metrics, /docs."""
    from gpuyard.serve.runner import serve_with_record

    opts = serve_options(
        host=host,
        port=port,
        replicas=replicas,
        device=device,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        batching=batching,
        threads=threads,
        max_body=max_body,
        no_drift=no_drift,
        drift_window=drift_window,
        drift_interval=drift_interval,
        deployment_id=deployment_id,
    )
    serve_with_record(model, opts)


def register(app: typer.Typer) -> None:
    """Add `gpuyard serve` to the CLI."""
    app.command("serve")(serve)
