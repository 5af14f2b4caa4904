"""A closed-loop HTTP/1.1 load generator: N keep-alive connections, each sending its next request as
soon as the previous answer arrives, for a fixed time. One asyncio loop (uvloop when installed) on raw
streams: an HTTP client library would cost more CPU per request than the servers being measured.

``python -m gpuyard.serve.loadgen URL BODY_FILE --concurrency 64 --duration 20`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np


@dataclass(frozen=True)
class LoadSpec:
    """One load run.

    Attributes:
        url: full URL of the POST endpoint (``http://127.0.0.1:PORT/path``).
        bodies: request bodies, used in turn (each client starts at a different one).
        content_type: the bodies' media type.
        concurrency: simultaneous connections (each with one request in flight).
        duration_s: measured time.
        warmup_s: time before measuring (connections open, caches warm).
        timeout_s: one request's limit; a late answer counts as an error.
        api_key: sent as ``Authorization: Bearer`` (gpuyard's model servers need a key).
    """

    url: str
    bodies: tuple[bytes, ...]
    content_type: str = "application/json"
    concurrency: int = 64
    duration_s: float = 10.0
    warmup_s: float = 1.0
    timeout_s: float = 10.0
    api_key: str | None = None


def _requests(spec: LoadSpec) -> tuple[str, int, list[bytes]]:
    parts = urlsplit(spec.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {spec.content_type}\r\n"
    if spec.api_key:
        head += f"Authorization: Bearer {spec.api_key}\r\n"
    return host, port, [f"{head}Content-Length: {len(b)}\r\n\r\n".encode() + b for b in spec.bodies]


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length, chunked = 0, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"content-length":
            length = int(value)
        elif key == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status


async def _client(
    i: int,
    spec: LoadSpec,
    reqs: list[bytes],
    host: str,
    port: int,
    t: dict[str, float],
    lat: list[float],
    codes: dict[int, int],
) -> None:
    k, reader, writer = i, None, None
    while time.perf_counter() < t["end"]:
        try:
            if reader is None or writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            t0 = time.perf_counter()
            writer.write(reqs[k % len(reqs)])
            k += 1
            status = await asyncio.wait_for(_read_response(reader), spec.timeout_s)
            t1 = time.perf_counter()
        except (
            OSError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            asyncio.TimeoutError,
            ValueError,
        ):
            if time.perf_counter() >= t["start"]:
                codes[-1] = codes.get(-1, 0) + 1
            if writer is not None:
                writer.close()
            reader = writer = None
            continue
        if t0 >= t["start"] and t1 <= t["end"]:
            lat.append(t1 - t0)
            codes[status] = codes.get(status, 0) + 1
    if writer is not None:
        writer.close()


async def run_async(spec: LoadSpec) -> dict[str, Any]:
    """Run ``spec`` on the current event loop; see :func:`run`."""
    host, port, reqs = _requests(spec)
    now = time.perf_counter()
    t = {"start": now + spec.warmup_s, "end": now + spec.warmup_s + spec.duration_s}
    lat: list[float] = []
    codes: dict[int, int] = {}
    await asyncio.gather(
        *(_client(i, spec, reqs, host, port, t, lat, codes) for i in range(spec.concurrency))
    )
    arr = np.asarray(lat) * 1000
    ok = codes.get(200, 0)
    pct = {f"p{q}_ms": round(float(np.percentile(arr, q)), 3) if arr.size else None for q in (50, 95, 99)}
    return {
        "concurrency": spec.concurrency,
        "duration_s": spec.duration_s,
        "requests": int(arr.size),
        "ok": ok,
        "errors": sum(n for c, n in codes.items() if c != 200),
        "codes": {str(c): n for c, n in sorted(codes.items())},
        "throughput_rps": round(ok / spec.duration_s, 1),
        **pct,
        "max_ms": round(float(arr.max()), 3) if arr.size else None,
    }


def run(spec: LoadSpec) -> dict[str, Any]:
    """Run ``spec`` in a fresh event loop and return throughput (successful answers per second), the
    latency percentiles of answers completed in the measured period, and the status-code counts
    (``-1``: connection errors and timeouts)."""
    try:
        import uvloop

        return uvloop.run(run_async(spec))  # type: ignore[no-any-return]
    except ImportError:
        return asyncio.run(run_async(spec))


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: one JSON line on stdout."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url")
    p.add_argument("body_file", help="a file holding the request body, or a JSON list of bodies (--many)")
    p.add_argument("--many", action="store_true", help="body_file is a JSON list of string bodies")
    p.add_argument("--content-type", default="application/json")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument(
        "--api-key-env",
        default="GPUYARD_SERVE_KEY",
        help="environment variable holding the key sent as 'Authorization: Bearer' (none when unset)",
    )
    a = p.parse_args(argv)
    raw = Path(a.body_file).read_bytes()
    bodies = tuple(s.encode() for s in json.loads(raw)) if a.many else (raw,)
    key = os.environ.get(a.api_key_env) or None
    spec = LoadSpec(a.url, bodies, a.content_type, a.concurrency, a.duration, a.warmup, api_key=key)
    print(json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    main()
