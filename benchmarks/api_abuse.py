"""Benchmark: /health latency of `gpuyard server` while other clients abuse the API (goal: p99 < 100 ms).

Starts `gpuyard server` in a temporary GPUYARD_HOME and probes ``GET /health`` one request after
another, first on a quiet server, then while abusive clients (separate processes, a member's token)
send, as fast as the server answers them:

- job specs just under the body cap (a 4 MiB command list), parsed off the event loop;
- bodies over the cap (413), 100,000-deep JSON, specs with 5,000-digit integers;
- slow bodies (headers, then a byte now and then: the body timeout ends them);
- dry runs of valid specs and listings with out-of-range parameters.

Then the idle-connection flood: ``--flood`` connections (default 22,000) opened by 4 processes (each
raises its own open-file limit to the hard limit) and held without sending a byte, while /health is
probed from the start of the flood (``opening``: the kernel's accept queue is full, and a probe whose
SYN is dropped waits for its retransmission, 1 s or more) and then while it is held for the phase's
length (``idle_flood_health_p99_ms``).

Printed: /health p50/p99/max quiet, under abuse and under the idle flood, the abusive requests by
status, and the last line ``api_abuse: health_p99_ms=<x> quiet_p99_ms=<y> ...
idle_flood_health_p99_ms=<z> idle_connections=<n> idle_flood_opening_p99_ms=<w>``. Any 5xx is
counted in ``server_errors``.

    python benchmarks/api_abuse.py [--quick] [--abusers N] [--flood N]
"""

from __future__ import annotations

import argparse
import getpass
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

CAP = 4 * 1024 * 1024  # the server's default --max-body-mb


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bodies() -> list[tuple[str, str, bytes]]:
    # (method, path, body): each an abuse the API must refuse or absorb without slowing /health.
    arg = b'"' + b"a" * 30 + b'", '
    near_cap = b'{"name": "big", "command": [' + arg * ((CAP - 200) // len(arg)) + b'"z"]}'
    return [
        ("POST", "/jobs", near_cap),
        ("POST", "/jobs/dry-run", near_cap),
        ("POST", "/jobs", b'{"name": "over", "command": ["' + b"a" * (CAP + 1024) + b'"]}'),
        ("POST", "/jobs", b"[" * 100_000 + b"]" * 100_000),
        ("POST", "/jobs", b'{"name": "x", "command": ["true"], "priority": ' + b"9" * 5000 + b"}"),
        ("POST", "/jobs/dry-run", b'{"name": "ok", "command": ["true"], "resources": {"gpus": 0}}'),
        ("GET", "/jobs?limit=" + "9" * 400, b""),
        ("GET", "/jobs/" + "9" * 400 + "/logs?offset=-1", b""),
    ]


def _slow_body(port: int, token: str, stop: mp.synchronize.Event) -> None:
    """Headers for a 1 MB body, then one byte a second until the server hangs up (its body timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        head = (
            f"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
        )
        sock.sendall(head.encode())
        try:
            while not stop.is_set():
                sock.sendall(b" ")
                if stop.wait(1.0):
                    break
        except OSError:
            pass  # the server ended it


def _abuser(
    url: str, port: int, token: str, stop: mp.synchronize.Event, out: mp.Queue, ready: mp.Queue, slow: bool
) -> None:
    counts: Counter[str] = Counter()
    ready.put(None)  # started (spawn takes seconds on a loaded machine): the probe waits for all
    if slow:
        while not stop.is_set():
            _slow_body(port, token, stop)
            counts["slow body ended"] += 1
        out.put(dict(counts))
        return
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    bodies = _bodies()
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        i = 0
        while not stop.is_set():
            method, path, body = bodies[i % len(bodies)]
            i += 1
            try:
                status = client.request(method, path, content=body).status_code
                counts[str(status)] += 1
            except httpx.HTTPError as exc:
                counts[type(exc).__name__] += 1
    out.put(dict(counts))


FLOOD_HOLDERS = 4


def _hold(port: int, count: int, out: mp.Queue, stop: mp.synchronize.Event) -> None:
    """Open ``count`` idle connections (non-blocking connects: the kernel retries what the server's
    backlog drops), report how many were established, hold them until ``stop``."""
    import errno
    import resource
    import selectors

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(min(count, hard - 64)):
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            sock.close()
            continue
        socks.append(sock)
        sel.register(sock, selectors.EVENT_WRITE)
    established = 0
    deadline = time.monotonic() + 120
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            sel.unregister(key.fileobj)
            established += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0  # type: ignore[union-attr]
    out.put(established)
    stop.wait(600)
    for sock in socks:
        sock.close()


def _idle_flood(url: str, port: int, flood: int, seconds: float) -> tuple[list[float], list[float], int]:
    """/health latencies while the flood opens and while it is held ``seconds``; connections held."""
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_hold, args=(port, flood // FLOOD_HOLDERS, out, stop))
        for _ in range(FLOOD_HOLDERS)
    ]
    for p in procs:
        p.start()
    opening: list[float] = []
    held: list[int] = []
    try:
        while len(held) < FLOOD_HOLDERS:
            opening += _probe(url, 0.5)
            while not out.empty():
                held.append(out.get())
        holding = _probe(url, seconds)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=60)
    return opening, holding, sum(held)


def _probe(url: str, seconds: float) -> list[float]:
    """Sequential GET /health for ``seconds``; each latency in ms (a failed request counts as 10 s)."""
    lat: list[float] = []
    with httpx.Client(base_url=url, timeout=10) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            lat.append((time.perf_counter() - t0) * 1000 if ok else 10_000.0)
            time.sleep(0.01)
    return lat


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    """Run the quiet and the abused phase; print the figures and the last line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 s per phase instead of 20 s")
    ap.add_argument(
        "--smoke", action="store_true", help="CI: 0.5 s phases, 1+1 abusers, 500 idle (no figure)"
    )
    ap.add_argument(
        "--abusers", type=int, default=4, help="abusive client processes (one more sends slow bodies)"
    )
    ap.add_argument(
        "--flood", type=int, default=22_000, help="idle connections held at once in the flood phase"
    )
    args = ap.parse_args()
    seconds = 3.0 if args.quick else 20.0
    if args.smoke:
        seconds, args.abusers, args.flood = 0.5, 1, 500
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        os.environ["GPUYARD_HOME"] = str(home)
        from gpuyard.auth import add_user, create_token

        add_user("mallory", team="default")
        token, _ = create_token("mallory")
        port = _port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [
                *(sys.executable, "-m", "gpuyard.cli.main", "server", "--port", str(port)),
                *("--body-timeout", "5", "--job-user", getpass.getuser()),  # no job runs here
            ],
            env={**os.environ, "GPUYARD_HOME": str(home)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("api_abuse: the server did not start")
                time.sleep(0.1)
            quiet = _probe(url, seconds)
            ctx = mp.get_context("spawn")
            stop, out, ready = ctx.Event(), ctx.Queue(), ctx.Queue()
            procs = [
                ctx.Process(target=_abuser, args=(url, port, token, stop, out, ready, i == args.abusers))
                for i in range(args.abusers + 1)
            ]
            for p in procs:
                p.start()
            for _ in procs:
                ready.get(timeout=120)
            time.sleep(1.0)  # the abuse is under way before the probe starts
            abused = _probe(url, seconds)
            stop.set()
            counts: Counter[str] = Counter()
            for _ in procs:
                counts.update(out.get(timeout=120))
            for p in procs:
                p.join(timeout=30)
            opening, flooded, held = _idle_flood(url, port, args.flood, seconds)
            alive = server.poll() is None
        finally:
            server.terminate()
            server.wait(timeout=30)
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load average {load:.2f}")
    phases = (("quiet", quiet), ("abused", abused), ("flood opening", opening), ("flood held", flooded))
    for name, lat in phases:
        print(
            f"/health {name:>13}: n={len(lat)} p50={_pct(lat, 0.5):.1f} ms p99={_pct(lat, 0.99):.1f} ms "
            f"max={max(lat):.1f} ms"
        )
    print("abusive requests by answer:", dict(sorted(counts.items())))
    errors = sum(n for status, n in counts.items() if status.isdigit() and int(status) >= 500)
    sent = sum(counts.values())
    print(
        f"api_abuse: health_p99_ms={_pct(abused, 0.99):.1f} quiet_p99_ms={_pct(quiet, 0.99):.1f} "
        f"health_p50_ms={_pct(abused, 0.5):.1f} abusive_requests={sent} server_errors={errors} "
        f"server_alive={str(alive).lower()} abusers={args.abusers + 1} "
        f"idle_flood_health_p99_ms={_pct(flooded, 0.99):.1f} idle_connections={held} "
        f"idle_flood_opening_p99_ms={_pct(opening, 0.99):.1f}"
    )


if __name__ == "__main__":
    main()
