"""Benchmark: submit-to-process-start latency on the local server (target: p50 at most 0.5 s).

Starts `gpuyard server` in a temporary GPUYARD_HOME, submits CPU-only jobs one after another over
HTTP, and measures from just before the POST to the moment the job's command runs (it writes the
time to a file). The baseline is a bare ``subprocess.Popen`` of the same command from Python: the
floor that no scheduler can beat.

    python benchmarks/submit_latency.py [--quick]
"""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CMD = "import sys, time; open(sys.argv[1], 'w').write(repr(time.time()))"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_file(path: Path, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
            if text:
                return float(text)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.002)
    raise TimeoutError(f"{path} never written")


def bench_server(n: int, tmp: Path) -> list[float]:
    port = _port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "GPUYARD_HOME": str(tmp / "home")}
    log = tmp / "server.log"
    # The jobs run as this user (no dedicated job user on a benchmark machine), as in api_abuse.py.
    cmd = [sys.executable, "-m", "gpuyard.cli.main", "server", "--port", str(port)]
    with log.open("wb") as sink:
        server = subprocess.Popen(
            [*cmd, "--job-user", getpass.getuser()], env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    tail = log.read_text(errors="replace").strip().splitlines()[-1:]
                    raise SystemExit(f"submit_latency: the server did not start: {' '.join(tail)}") from None
                time.sleep(0.1)
        from gpuyard.auth import bearer_headers, read_token
        from gpuyard.settings import load_settings

        # The embedded server writes its admin token into its GPUYARD_HOME on first start.
        headers = bearer_headers(read_token(load_settings(env)))
        out = []
        with httpx.Client(base_url=url, headers=headers) as client:
            for i in range(n):
                marker = tmp / f"server-{i}.txt"
                spec = {"name": f"lat{i}", "command": [sys.executable, "-S", "-c", CMD, str(marker)]}
                t0 = time.time()
                client.post("/jobs", json=spec).raise_for_status()
                out.append(_wait_file(marker) - t0)
        return out
    finally:
        server.terminate()
        server.wait(10)


def bench_popen(n: int, tmp: Path) -> list[float]:
    out = []
    for i in range(n):
        marker = tmp / f"popen-{i}.txt"
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-S", "-c", CMD, str(marker)])
        out.append(_wait_file(marker) - t0)
        proc.wait()
    return out


def main() -> None:
    """Measure both; print percentiles and the summary line."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="10 jobs instead of 40")
    ap.add_argument("--smoke", action="store_true", help="CI: 3 jobs (no figure)")
    args = ap.parse_args()
    n = 3 if args.smoke else 10 if args.quick else 40
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ours = bench_server(n, tmp)
        base = bench_popen(n, tmp)
    p50, p90 = statistics.median(ours), sorted(ours)[int(0.9 * (n - 1))]
    b50 = statistics.median(base)
    print(
        f"server: p50 {p50 * 1000:.0f} ms, p90 {p90 * 1000:.0f} ms, "
        f"max {max(ours) * 1000:.0f} ms over {n} jobs"
    )
    print(f"popen:  p50 {b50 * 1000:.0f} ms")
    print(
        f"submit_latency: vs_popen={p50 / b50:.1f} p50_s={p50:.3f} p90_s={p90:.3f} "
        f"popen_p50_s={b50:.3f} jobs={n}"
    )


if __name__ == "__main__":
    main()
