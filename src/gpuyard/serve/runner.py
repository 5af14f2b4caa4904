"""Running a model server: one process per replica, all accepting on one listening socket.

The parent binds the socket (so ``--port 0`` works and the URL is known before any replica is up),
then either serves in-process (one replica) or starts R replica processes that inherit the socket's
file descriptor; the kernel hands each new connection to one of them. Each replica loads the model,
warms it up, runs ``gc.collect(); gc.freeze()`` (a full collection of a big heap stalls every request
in flight for ~100 ms on this kind of machine) and serves with uvicorn on uvloop + httptools.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, replace
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.serve.access import Access, KeyGate, draining_server
from gpuyard.serve.listen import bind, url_of, watch_ready
from gpuyard.serve.options import BatchConfig, ServeOptions
from gpuyard.states import DeploymentState

log = logging.getLogger("gpuyard.serve")


def serve_replica(ref: str, opts: ServeOptions, sock: socket.socket, index: int, access: Access) -> None:
    """Load ``ref`` and serve it on ``sock`` until SIGTERM/SIGINT (runs in the replica's process), to
    callers with a key ``access`` accepts (:mod:`gpuyard.serve.access`)."""
    import uvicorn

    from gpuyard.serve.alerts import reference_for
    from gpuyard.serve.batching import make_batcher
    from gpuyard.serve.drift import DriftMonitor
    from gpuyard.serve.llm.run import language_model, serve_lm
    from gpuyard.serve.model import load_served, resolve_device, warm_up
    from gpuyard.serve.monitor import ServeMetrics
    from gpuyard.serve.server import AppConfig, FastPredict, create_app

    folder = language_model(ref)
    if folder is not None:  # a language model: the OpenAI-compatible server (docs/llm.md)
        opts = replace(opts, device=resolve_device(opts.device, index))
        serve_lm(ref, folder, opts, sock=sock, access=access)
        return
    # Default: leave one core to the HTTP loops. Intra-op threads that outnumber the free cores stall
    # at their barriers whenever one is descheduled, which shows up as p99 spikes.
    threads = opts.batch.threads or max(1, ((os.cpu_count() or 1) - 1) // opts.replicas)
    model = load_served(ref, resolve_device(opts.device, index), opts.max_rows)
    warm_up(model)
    metrics = ServeMetrics(model.name, model.version)
    monitor, skew, note = None, None, "disabled (--no-drift)"
    if opts.drift:
        reference, note = reference_for(model)
        if reference is not None:
            monitor = DriftMonitor(
                reference,
                opts.drift_config,
                on_alert=lambda alerts: _record(model, alerts, opts.deployment_id),
                on_report=lambda rep: _publish(metrics, rep),
            )
            if reference.get("skew"):
                skew = DriftMonitor(
                    reference["skew"],
                    opts.drift_config,
                    on_alert=lambda alerts: _record(model, alerts, opts.deployment_id),
                    on_report=lambda rep: _publish(metrics, rep, "skew_"),
                    kind="input_skew",
                )

    def on_batch(inputs: Any, outputs: dict[str, Any], _requests: int, seconds: float) -> None:
        metrics.observe_batch(len(inputs), seconds)
        if monitor is not None:
            monitor.observe(inputs, outputs["predictions"])

    def setup() -> None:
        import torch

        # Per thread: setup runs in the thread that runs the model (the model thread in thread mode,
        # this one, which runs the event loop, in inline mode).
        torch.set_num_threads(threads)

    batcher = make_batcher(
        model.forward, BatchConfig(**{**asdict(opts.batch), "threads": threads}), on_batch, setup
    )
    app = create_app(
        model, batcher, metrics, monitor, note, AppConfig(opts.max_body_bytes, opts.deployment_id), skew
    )
    batcher.start()
    for m in (monitor, skew):
        if m is not None:
            m.start()
    gc.collect()
    gc.freeze()  # everything loaded so far is never scanned again by the collector
    config = uvicorn.Config(
        KeyGate(FastPredict(app, model.name, opts.max_body_bytes), access),
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=opts.drain_s,  # type: ignore[arg-type]  # a float works (wait_for)
        backlog=2048,
    )
    try:
        draining_server(config, lambda: f"{batcher.depth} queued" if batcher.depth else "").run(
            sockets=[sock]
        )
    finally:
        batcher.stop()
        for m in (monitor, skew):
            if m is not None:
                m.stop()


def _record(model: Any, alerts: list[dict[str, Any]], deployment_id: int | None) -> None:
    from gpuyard.serve.alerts import record_alerts

    record_alerts(model, alerts, deployment_id)


def _publish(metrics: Any, report: dict[str, Any], prefix: str = "") -> None:
    """Drift gauges (``psi``, ``ks``); a skew report's are ``skew_psi``, ``skew_ks`` (raw columns)."""
    for f in report["features"]:
        metrics.set_drift(f["feature"], f"{prefix}psi", f["psi"])
        if f["ks"] is not None:
            metrics.set_drift(f["feature"], f"{prefix}ks", f["ks"])
    if report["predictions"] is not None:
        metrics.set_drift("__predictions__", "psi", report["predictions"]["psi"])


def serve(
    ref: str, opts: ServeOptions, access: Access, on_ready: Any = None, on_replaced: Any = None
) -> None:
    """Serve ``ref`` with ``opts.replicas`` processes until SIGTERM/SIGINT.

    A language model whose engine is vLLM (``opts.engine``) is served by the gateway in front of
    ``opts.replicas`` vLLM processes (:func:`gpuyard.serve.llm.gateway.serve_vllm`).

    Args:
        ref: ``NAME``, ``NAME:V`` or ``NAME@ALIAS``.
        opts: server options.
        access: the keys the server accepts.
        on_ready: called with (url, pids) once ``/ready`` answers 200.
        on_replaced: called with (replica pids, a one-line note) when a vLLM replica was replaced.
    """
    from gpuyard.models.registry import get_version
    from gpuyard.serve.llm.run import language_model
    from gpuyard.serve.model import resolve_device

    get_version(ref)  # an unknown model or version is said before anything is bound or printed
    if opts.adapters:  # LoRA adapters by name (vLLM): refused in one line before anything starts
        from gpuyard.serve.llm.vllm_engine import check_lora

        check_lora(ref, opts)
    folder = language_model(ref)
    if folder is not None:
        from gpuyard.serve.llm.vllm_engine import choose_engine, placement

        if choose_engine(opts.engine, folder, placement(opts.device)[0], opts.adapters) == "vllm":
            from gpuyard.serve.llm.gateway import serve_vllm

            serve_vllm(ref, folder, opts, access, on_ready, on_replaced)
            return
    devices = [resolve_device(opts.device, i) for i in range(opts.replicas)]  # fail before binding
    sock = bind(opts.host, opts.port)
    url = url_of(sock)
    pids: dict[str, Any] = {"server": os.getpid(), "replicas": [os.getpid()], "devices": devices}
    if opts.replicas == 1:
        watch_ready(url, lambda: on_ready(url, pids) if on_ready else None)
        print(f"serving {ref} at {url} (1 replica)", flush=True)
        serve_replica(ref, opts, sock, 0, access)
        return
    _serve_many(ref, opts, sock, url, devices, on_ready, access)


def _serve_many(
    ref: str,
    opts: ServeOptions,
    sock: socket.socket,
    url: str,
    devices: list[str],
    on_ready: Any,
    access: Access,
) -> None:
    prom_dir = tempfile.mkdtemp(prefix="gpuyard-prom-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": prom_dir, **access.replica_env()}
    env.pop("GPUYARD_SERVE_KEY", None)  # the replicas get the key's hash, never the key
    payload = json.dumps(opts.to_json())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gpuyard.serve.replica", ref, str(sock.fileno()), str(i), payload],
            pass_fds=(sock.fileno(),),
            env=env,
        )
        for i in range(opts.replicas)
    ]
    pids = {"server": os.getpid(), "replicas": [p.pid for p in procs], "devices": devices}
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    watch_ready(url, lambda: on_ready(url, pids) if on_ready else None, expect=opts.replicas)
    print(f"serving {ref} at {url} ({opts.replicas} replicas: pids {pids['replicas']})", flush=True)
    try:
        while not stop.wait(0.5):
            if any(p.poll() is not None for p in procs):
                dead = [p.pid for p in procs if p.poll() is not None]
                raise ConfigError(f"replica process(es) {dead} exited; see the log above")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        sock.close()


class _Stopped(BaseException):
    """SIGTERM or SIGINT reached a deployment's server process."""


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise _Stopped(signum)


def serve_with_record(ref: str, opts: ServeOptions, access: Access | None = None) -> None:
    """:func:`serve`, keeping the deployment record (when ``opts.deployment_id``) up to date.

    A deployment's server accepts the key recorded for it (its hash) and its team's tokens; without a
    deployment, ``access`` says what it accepts.
    """
    if opts.deployment_id is None:
        if access is None:
            raise ConfigError("a model server needs a key (gpuyard.serve.access.Access)")
        serve(ref, opts, access)
        return
    from gpuyard.serve.records import mark, recorded_access, recorded_options, undeploy_requested

    # The record holds every option `gpuyard deploy` was given (drift thresholds, batching, limits):
    # the command line only names the deployment.
    dep_id = opts.deployment_id
    opts = recorded_options(dep_id)
    access = recorded_access(dep_id)

    def ready(url: str, pids: dict[str, Any]) -> None:
        device = ",".join(sorted(set(pids["devices"])))
        # Where the scheduler put us (a GPU deployment runs as a job): its GPUs and node, for the record.
        placed = {"gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "node": socket.gethostname()}
        if os.environ.get("GPUYARD_JOB_ID"):
            placed["job"] = os.environ["GPUYARD_JOB_ID"]
        mark(dep_id, DeploymentState.RUNNING, url=url, pids={**pids, **placed}, device=device, error=None)
        started.update(pids | placed)

    started: dict[str, Any] = {}

    def replaced(replicas: list[int | None], note: str) -> None:
        # A vLLM replica exited and the gateway started another: the record says so (error keeps the note).
        started["replicas"] = replicas
        mark(dep_id, DeploymentState.RUNNING, pids=dict(started), error=note)

    # uvicorn re-raises the SIGTERM it shut down on, which would kill this process before the record
    # is updated; a handler of ours turns it into an exception instead (also while the model loads).
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve(ref, opts, access, on_ready=ready, on_replaced=replaced)
    except _Stopped:
        pass
    except BaseException as exc:
        mark(dep_id, DeploymentState.FAILED, error=str(exc)[:1000] or type(exc).__name__)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if os.environ.get("GPUYARD_JOB_ID") and not undeploy_requested(dep_id):
        # Under the scheduler, serving ends on its SIGTERM: a cancel (undeploy recorded it first) or a
        # preemption: the job is queued again and this record comes back to running once placed. Exit
        # 75 so a preempted replica set is requeued rather than recorded as finished.
        from gpuyard.exitcodes import PREEMPTED

        mark(dep_id, DeploymentState.STARTING, error="stopped by the scheduler: waiting to be placed again")
        raise SystemExit(PREEMPTED)
    mark(dep_id, DeploymentState.STOPPED)
