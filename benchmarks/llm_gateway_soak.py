"""The vLLM gateway's memory and descriptors over many requests: does anything grow?

Usage: ``python benchmarks/llm_gateway_soak.py [--requests 20000] [--clients 16] [--quick] [--smoke]``

The gateway runs as a process of its own, served as ``gpuyard serve --engine vllm`` serves it
(:func:`gpuyard.serve.llm.gateway.serve_gateway`: key gate, connection guard, relay), in front of the
fake replica of the gateway tests (``tests/integration/serve/fake_replica.py``: a real HTTP/1.1 server
on 127.0.0.1 that answers like vLLM, its failures chosen by the prompt). Closed-loop clients send the
requests, a mix of:

- streamed answers (most) and whole ones, over kept-alive connections;
- replica errors: an answer refused (400), a replica that ends the stream half way (one error event),
  one that answers something that is not HTTP (503);
- clients that hang up after the first event (the replica's request aborted);
- clients that never read a flood of events (cut after the write-stall limit, 1 s here);
- clients that send half a request head and idle (408 after the header timeout, 2 s here);
- requests refused before any replica: no key (401), a body over the limit (413).

Every tenth of the run it samples the gateway process: resident memory (``VmRSS`` in
``/proc/PID/status``), open descriptors (``/proc/PID/fd``), the idle connections it keeps to the replica
and the requests it has outstanding (its ``/metrics``). The baseline is taken after a warm-up tenth
(the allocator's arenas and the interpreter's caches fill on the first requests); the last sample
after every client is done and the gateway's outstanding count is back to 0.

Last line: ``llm_gateway_soak: requests=N rss_warm_mib=... rss_end_mib=... rss_growth_mib=...
fds_warm=... fds_end=... pooled_end=... outstanding_end=... unexpected=...`` (unexpected: answers
whose status is not the one its kind must get).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' fake replica

from tests.integration.serve.fake_replica import AUTH, KEY, FakeReplica, GatewayProcess

HEADER_TIMEOUT_S = 2.0
WRITE_STALL_S = 1.0

# One request in every CYCLE, by its index in the cycle: kinds other than "stream".
CYCLE = 200
KINDS = {
    **{i: "json" for i in range(0, 20)},
    **{i: "refuse" for i in range(20, 26)},
    **{i: "die" for i in range(26, 32)},
    **{i: "badhead" for i in range(32, 36)},
    **{i: "hangup" for i in range(36, 46)},
    **{i: "nokey" for i in range(46, 50)},
    **{i: "toolarge" for i in range(50, 52)},
    52: "slowhead",
    53: "noread",
}
# The status each kind's answer must have.
EXPECT = {
    "stream": 200,
    "json": 200,
    "refuse": 400,
    "die": 200,
    "badhead": 503,
    "nokey": 401,
    "toolarge": 413,
    "hangup": 200,
    "slowhead": 408,
}


def sample(pid: int, url: str) -> dict[str, float]:
    """The gateway's resident MiB, open descriptors, pooled connections and requests outstanding."""
    import httpx

    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=60).text
    pooled = outstanding = 0.0
    for line in text.splitlines():
        if line.startswith("gpuyard_gateway_pooled_connections{"):
            pooled += float(line.rsplit(" ", 1)[1])
        elif line.startswith("gpuyard_gateway_outstanding{"):
            outstanding += float(line.rsplit(" ", 1)[1])
    return {"rss_mib": rss_kib / 1024, "fds": fds, "pooled": pooled, "outstanding": outstanding}


def _head(path: str, body: bytes, key: bool = True) -> bytes:
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n" if key else b""
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
        % (path.encode(), auth, len(body), body)
    )


def _body(prompt: str, stream: bool = True) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, "stream": stream}).encode()


async def _raw(port: int, kind: str) -> int:
    """One request of a hostile kind on a connection of its own; the status it got (0: none)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        if kind == "slowhead":
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            got = await asyncio.wait_for(r.read(), 120)  # the 408, then the close
        elif kind == "hangup":
            w.write(_head("/v1/completions", _body("hold")))
            got = await asyncio.wait_for(r.readuntil(b"data: "), 120)  # the first event: hang up
        else:  # noread: the request, then nothing read until the gateway has cut it
            w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            w.write(_head("/v1/completions", _body("flood")))
            await w.drain()
            await asyncio.sleep(WRITE_STALL_S * 3)  # a client that never reads, for longer than the limit
            return 200
        return int(got[9:12]) if got.startswith(b"HTTP/1.1 ") else 0
    finally:
        w.transport.abort()


async def run(port: int, url: str, pid: int, requests: int, clients: int) -> dict[str, Any]:
    import httpx

    tenth = max(1, requests // 10)
    samples: list[tuple[int, dict[str, float]]] = []
    counts: dict[str, int] = {}
    unexpected: dict[str, int] = {}
    done = 0
    it = iter(range(requests))
    sampling = asyncio.Lock()

    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients)
    ) as http:

        async def one(i: int) -> None:
            kind = KINDS.get(i % CYCLE, "stream")
            if kind in ("slowhead", "hangup", "noread"):
                status = await _raw(port, kind)
            elif kind == "nokey":
                status = (await http.post("/v1/completions", content=_body("stream"))).status_code
            elif kind == "toolarge":
                status = (
                    await http.post("/v1/completions", content=_body("x" * 5000), headers=AUTH)
                ).status_code
            else:
                async with http.stream(
                    "POST", "/v1/completions", content=_body(kind, kind != "json"), headers=AUTH
                ) as resp:
                    await resp.aread()
                    status = resp.status_code
            counts[kind] = counts.get(kind, 0) + 1
            if status != EXPECT.get(kind, status):
                unexpected[f"{kind}:{status}"] = unexpected.get(f"{kind}:{status}", 0) + 1

        async def client() -> None:
            nonlocal done
            for i in it:
                await one(i)
                done += 1
                if done % tenth == 0:
                    async with sampling:
                        samples.append((done, await asyncio.to_thread(sample, pid, url)))

        await asyncio.gather(*(client() for _ in range(clients)))
    # Settled: every relay ended (the never-reading clients' cuts included), then the last sample.
    deadline = time.monotonic() + 120
    last = await asyncio.to_thread(sample, pid, url)
    while last["outstanding"] and time.monotonic() < deadline:
        await asyncio.sleep(0.5)  # the gateway is a process: its state can only be polled
        last = await asyncio.to_thread(sample, pid, url)
    samples.append((done, last))
    return {"samples": samples, "counts": counts, "unexpected": unexpected}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="5,000 requests")
    ap.add_argument("--smoke", action="store_true", help="CI: 400 requests (no figure)")
    args = ap.parse_args()
    requests = 400 if args.smoke else 5_000 if args.quick else args.requests
    replica = FakeReplica()
    replica.keep_keys = False  # it would keep one string per request
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        gw = GatewayProcess(replica.port, Path(tmp), HEADER_TIMEOUT_S, WRITE_STALL_S)
        try:
            start = sample(gw.pid, gw.url)
            t0 = time.monotonic()
            res = asyncio.run(run(gw.port, gw.url, gw.pid, requests, args.clients))
            wall = time.monotonic() - t0
            alive = gw.proc.poll() is None
        finally:
            gw.stop()
    samples = res["samples"]
    print(f"start: rss {start['rss_mib']:.1f} MiB, {start['fds']:.0f} fds")
    for n, s in samples:
        print(
            f"after {n:>6} requests: rss {s['rss_mib']:7.1f} MiB  fds {s['fds']:4.0f}  "
            f"pooled {s['pooled']:3.0f}  outstanding {s['outstanding']:.0f}"
        )
    print("kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(res["counts"].items())))
    if res["unexpected"]:
        print("unexpected answers: " + ", ".join(f"{k} x{v}" for k, v in res["unexpected"].items()))
    warm = samples[0][1]
    end = samples[-1][1]
    print(
        f"llm_gateway_soak: requests={samples[-1][0]} wall_s={wall:.1f} rss_start_mib={start['rss_mib']:.1f} "
        f"rss_warm_mib={warm['rss_mib']:.1f} rss_end_mib={end['rss_mib']:.1f} "
        f"rss_growth_mib={end['rss_mib'] - warm['rss_mib']:.1f} fds_start={start['fds']:.0f} "
        f"fds_warm={warm['fds']:.0f} fds_end={end['fds']:.0f} pooled_end={end['pooled']:.0f} "
        f"outstanding_end={end['outstanding']:.0f} unexpected={sum(res['unexpected'].values())} "
        f"gateway_alive={int(alive)} load1_at_start={load:.2f} load1_at_end={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
