"""`gpuyard server`: the API (uvicorn) and the scheduling loop (a thread) in one process."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any

from gpuyard.connections import (
    ADMINS,
    ConnectionGuard,
    guarded_protocol,
    keep_alive_s,
    raise_nofile_limit,
    team_holder,
)
from gpuyard.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PER_ADDRESS,
    DEFAULT_MAX_PER_TEAM,
    DEFAULT_MAX_REQUESTS_PER_TEAM,
)
from gpuyard.scheduler.service import JobService


@dataclass(frozen=True)
class ServerOptions:
    """Where the API listens, how large and how slow a request may be, and how many connections."""

    host: str = "127.0.0.1"
    port: int = 8765
    log_level: str = "warning"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_address: int = DEFAULT_MAX_PER_ADDRESS
    max_connections_per_team: int = DEFAULT_MAX_PER_TEAM
    max_requests_per_team: int = DEFAULT_MAX_REQUESTS_PER_TEAM


def run_server(service: JobService, options: ServerOptions) -> None:
    """Recover the jobs of a previous run, start the scheduling thread, serve the API until stopped.

    Jobs keep running when the server stops (each is its own process group); the next server adopts
    them.
    """
    from gpuyard.api.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    guard = connection_guard(options)
    counts = service.recover()
    placer = service.placer
    placement = (
        f"fabric on {placer.cluster.name} (waits at most {placer.max_wait_s:g} s)"
        if placer is not None
        else "topology"
    )
    health = (
        service.health.describe()
        if service.health is not None
        else "no node health checks (no real GPUs here)"
    )
    isolation = getattr(service.executor, "isolation", None)
    jobs_as = isolation.describe() if isolation is not None else "jobs run as the executor's user"
    # Jobs that are not isolated from the server are said once, in this line, as a warning.
    level = logging.WARNING if isolation is not None and not isolation.switch else logging.INFO
    logging.getLogger("gpuyard.server").log(
        level,
        "recovered: %d adopted, %d requeued; policy %s, placement %s, executor %s, %d nodes; %s; %s",
        counts["adopted"],
        counts["requeued"],
        service.policy.name,
        placement,
        service.executor.name,
        len(service.nodes),
        jobs_as,
        health,
    )
    shown_host = "127.0.0.1" if options.host in ("0.0.0.0", "::") else options.host
    disk = (
        service.disk.describe()
        if service.disk is not None
        else "no disk shares per team (logs are written by the executor's nodes)"
    )
    logging.getLogger("gpuyard.server").info(
        "dashboard and API at http://%s:%d/ (OpenAPI at /docs); %s; %s",
        shown_host,
        options.port,
        guard.describe(),
        disk,
    )
    service.api_url = f"http://{_url_host(shown_host)}:{options.port}"  # for the jobs' own tokens
    stop = threading.Event()
    # uvicorn stops gracefully on SIGTERM as on SIGINT, then re-raises the signal with the handler it
    # found: with the default one the process dies there, before the `finally` below gives the
    # scheduler lease back (the next server then waits for its expiry). This handler ends it cleanly.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    loop = threading.Thread(target=service.run, args=(stop,), name="gpuyard-scheduler", daemon=True)
    loop.start()
    try:
        app = create_app(
            jobs=service, max_body_bytes=options.max_body_bytes, body_timeout_s=options.body_timeout_s
        )
        serve(app, options, guard)
    finally:
        stop.set()
        service.wake.set()
        loop.join(timeout=5)
        service.executor.close()
        if service.health is not None:
            service.health.close()
        signal.signal(signal.SIGTERM, previous)


def connection_guard(options: ServerOptions) -> ConnectionGuard:
    """The connection limits of ``options``, fitted to the open-file limit (raised to its hard limit)."""
    from gpuyard.auth import authenticate

    def identify(token: str) -> str:
        principal = authenticate(token)  # a job's token: its submitter's team
        return ADMINS if principal.is_admin else team_holder(principal.team)

    guard, note = ConnectionGuard.fitted(
        raise_nofile_limit(),
        max_connections=options.max_connections,
        per_address=options.max_connections_per_address,
        header_timeout_s=options.header_timeout_s,
        identify=identify,
        per_team=options.max_connections_per_team,
        per_team_requests=options.max_requests_per_team,
    )
    if note is not None:
        logging.getLogger("gpuyard.server").warning("%s", note)
    return guard


def serve(app: Any, options: ServerOptions, guard: ConnectionGuard) -> None:
    """Run ``app`` on uvicorn with ``guard``'s limits until stopped.

    The client address is the TCP peer's: ``X-Forwarded-For`` is not trusted (``proxy_headers`` off),
    so a local client cannot pose as another address. No WebSocket upgrades (the API has none).
    """
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    uvicorn.run(
        guard.wrap(app),
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        http=guarded_protocol(AutoHTTPProtocol, guard),
        timeout_keep_alive=keep_alive_s(guard),  # idle connections: the guard's 408, not a silent close
        ws="none",
        proxy_headers=False,
        backlog=4096,  # handshakes the kernel completes before accept (capped by net.core.somaxconn)
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)  # asked to stop (systemd, docker stop, kill): a clean stop, as SIGINT is


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
