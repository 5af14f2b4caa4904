"""Model serving throughput within a p99 budget: gpuyard vs Ray Serve (@serve.batch) vs plain FastAPI.

Usage: ``python benchmarks/serve.py [--quick] [--soak SECONDS] [--noise N] [--also-batching thread]``

Two models by default, registered with gpuyard's registry and loaded the same way by all three
servers: ``mlp`` (16 -> 32 -> 4: HTTP handling dominates) and ``transformer`` (4 encoder layers,
d=384, 4 heads, on 4 tokens x 16 features). The transformer is the compute-bound model the issue asks
for: with 4 tokens each matrix product of a single sample has 4 rows, so its forward pass is bound by
reading ~28 MB of weights (about 3 ms on this CPU), while a batch of 32 shares those reads (about
0.8 ms per sample). The earlier choice (16 tokens, d=128) took 0.65 ms alone and 0.32 ms per sample
in a batch: 2x, too little for batching to decide anything. The benchmark measures and prints both
figures for each model before the servers start. ``--models mlp,cnn`` adds or swaps in a small CNN
(three 3x3 conv blocks on 1x28x28). Each server runs in its own process tree on 127.0.0.1; one load
generator (``gpuyard.serve.loadgen``, a separate process: closed loop, keep-alive, one request = one
sample as JSON, the same bodies for all three servers) drives each at several concurrency levels
(1, 2, 4, 8, 16, 32, 64 clients x 10 s; ``--quick``: 1, 4, 16 x 4 s). gpuyard and the plain endpoint
run at the same time and are loaded in turn, level by level, so a change in the machine's load (other
people's work on these shared cores) hits both alike; Ray Serve runs alone afterwards (its idle
processes would take CPU from the others). The headline per server is the best throughput among the
levels whose p99 latency stays within 50 ms; peak memory is the server's whole process tree (RSS,
sampled every 0.2 s).

``--noise N`` keeps N busy-loop processes (``while 1: pass``) running for the whole measurement: a
loaded machine on purpose, reported in the last line as ``noise_procs``, with the load average at the
start as ``load1_at_start``. ``--also-batching thread`` also measures gpuyard with its model-thread
batching (``gpuyard_thread``), side by side with the default inline batching.

Every server's forward pass runs with the same torch intra-op threads, ``THREADS`` = cores - 1 (1 on
this 2-core machine: with 2 threads a forward pass measured several times slower here, the cores
being shared with the HTTP loop, the load generator and other processes).

Baselines, each in its best documented configuration:
- Ray Serve: one replica with ``@serve.batch(max_batch_size=32, batch_wait_timeout_s=WAIT_MS[model])``,
  ``max_ongoing_requests=128`` (>= the batch size: its default of 5 starves batching), access logs off
  via ``serve.start(logging_config=LoggingConfig(enable_access_log=False))``, the replica's torch
  threads set like the others', ``RAY_AUTH_MODE=disabled``, HTTP proxy bound to 127.0.0.1.
- Plain FastAPI: one ``async def`` endpoint with a pydantic body (``{"inputs": [...]}``), one
  ``torch.inference_mode`` forward pass per request in the event loop's thread (``torch.set_num_threads
  (THREADS)`` there), the outputs as a dict (FastAPI's JSON response); one uvicorn worker with uvloop,
  httptools, access log off, log level warning.
- gpuyard: ``gpuyard serve REF --max-batch 32 --max-wait-ms WAIT_MS[model] --threads THREADS`` (one
  replica, default ``--batching inline``, drift monitoring and Prometheus metrics on, as deployed).

The last line is ``serve: key=value ...`` (ratios first). ``--soak 60`` also runs the 60-second
64-client load on gpuyard's MLP server and reports errors and RSS growth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

BUDGET_MS = 50.0
# Torch threads for every server's forward pass: one core stays free for HTTP and the load generator.
THREADS = max(1, (os.cpu_count() or 1) - 1)
MAX_BATCH = 32
# Longest wait for a batch to fill, per model, for gpuyard and Ray Serve alike; chosen by measurement
# (gpuyard, transformer, 4 s per point, req/s at p99 <= 50 ms): 2 ms fires batches of ~6 while the
# rest of the closed-loop clients are still in HTTP handling (489 req/s at c=16, p99 68 ms); 10 ms lets
# them join (1,131 req/s at c=32, p99 47 ms). For the MLP a batch fills long before 2 ms. Rechecked
# with inline batching under two busy loops (5 s per point, interleaved): 10 ms 390 req/s at c=8 (p99
# 44 ms), 5 ms 365 (c=8, p99 44), 2 ms 290 (c=4; p99 59 ms at c=8).
WAIT_MS = {"mlp": 2.0, "transformer": 10.0, "cnn": 10.0}
# The compute-bound transformer: 4 tokens, d=384, 4 layers (see the module docstring for why).
MODEL_KWARGS: dict[str, dict[str, int]] = {"transformer": {"tokens": 4, "d_model": 384, "layers": 4}}


def forward_regime(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[float, float]]:
    """Per model: (single-sample forward ms, per-sample ms in a batch of MAX_BATCH), best of several
    passes with THREADS threads (the best, not the mean: other processes share these cores)."""
    import torch

    from gpuyard.serve.model import load_served

    torch.set_num_threads(THREADS)
    out = {}
    for ref, shape in shapes.items():
        fwd = load_served(ref).forward
        times = {}
        for n, reps in ((1, 200), (MAX_BATCH, 20)):
            x = np.random.default_rng(0).normal(size=(n, *shape)).astype(np.float32)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                fwd(x)
                best = min(best, time.perf_counter() - t0)
            times[n] = best * 1000
        out[ref] = (times[1], times[MAX_BATCH] / MAX_BATCH)
        print(
            f"  forward {ref}: batch 1 {times[1]:.2f} ms; batch {MAX_BATCH} {times[MAX_BATCH]:.1f} ms = "
            f"{out[ref][1]:.3f} ms/sample ({out[ref][0] / out[ref][1]:.1f}x less)",
            flush=True,
        )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Body(BaseModel):
    """The plain endpoint's request body (module level: FastAPI resolves annotations by name)."""

    inputs: list[Any]


# -- the two baseline servers (run as `python benchmarks/serve.py --run-server KIND REF PORT`) --------


def run_plain(ref: str, port: int) -> None:
    """FastAPI without batching: parse, one forward pass, answer."""
    import torch
    import uvicorn
    from fastapi import FastAPI

    from gpuyard.serve.model import load_served

    torch.set_num_threads(THREADS)  # this (main) thread runs the event loop and the forward pass
    model = load_served(ref, "cpu")
    app = FastAPI()

    @app.post("/v1/models/{name}/predict")
    async def predict(name: str, body: Body) -> dict[str, Any]:
        out = model.forward(np.asarray(body.inputs, dtype=np.float32))
        return {k: v.tolist() for k, v in out.items()}

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


def run_ray(ref: str, port: int) -> None:
    """Ray Serve with @serve.batch, in its documented best configuration (see the module docstring)."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import LoggingConfig
    from starlette.requests import Request

    cores = os.cpu_count() or 1
    ray.init(
        num_cpus=cores,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"GPUYARD_HOME": os.environ["GPUYARD_HOME"]}},
    )
    serve.start(
        http_options=HTTPOptions(host="127.0.0.1", port=port),
        logging_config=LoggingConfig(enable_access_log=False, log_level="WARNING"),
    )

    @serve.deployment(num_replicas=1, max_ongoing_requests=128, logging_config={"enable_access_log": False})
    class Model:
        def __init__(self) -> None:
            from gpuyard.serve.model import load_served

            self.model = load_served(ref, "cpu")
            self.threads_set = False

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=WAIT_MS[ref] / 1000)
        async def batched(self, xs: list[np.ndarray]) -> list[dict[str, Any]]:
            if not self.threads_set:  # torch threads are per thread: set them where the model runs
                import torch

                torch.set_num_threads(THREADS)
                self.threads_set = True
            sizes = [len(x) for x in xs]
            out = self.model.forward(np.concatenate(xs))
            starts = np.cumsum([0, *sizes])
            return [{k: v[a:b].tolist() for k, v in out.items()} for a, b in itertools.pairwise(starts)]

        async def __call__(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            x = np.asarray(body["inputs"], dtype=np.float32)
            return await self.batched(x if x.ndim > len(self.model.spec.shape) else x[None])

    name = ref.split(":")[0]
    serve.run(Model.bind(), name=name, route_prefix=f"/v1/models/{name}/predict")
    while True:
        time.sleep(3600)


# -- the harness ------------------------------------------------------------------------------------


class TreeMemory:
    """Peak RSS of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    continue
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


def start(kind: str, ref: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """Start server ``kind`` (gpuyard, gpuyard_MODE, plain, ray) on a free port; (process, predict URL)."""
    port = free_port()
    if kind.startswith("gpuyard"):
        cmd = [
            sys.executable,
            "-m",
            "gpuyard.cli.main",
            "serve",
            ref,
            "--port",
            str(port),
            "--max-batch",
            str(MAX_BATCH),
            "--max-wait-ms",
            str(WAIT_MS[ref]),
            "--threads",
            str(THREADS),
        ]
        if "_" in kind:  # gpuyard_thread / gpuyard_inline: that batching mode; plain gpuyard: the default
            cmd += ["--batching", kind.split("_", 1)[1]]
    else:
        cmd = [sys.executable, __file__, "--run-server", kind, ref, str(port)]
    log = open(Path(env["GPUYARD_HOME"]).parent / f"{kind}-{ref}.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/v1/models/{ref}/predict"


def wait_ready(url: str, body: bytes, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready ({url})")
        try:
            if (
                httpx.post(
                    url,
                    content=body,
                    headers={
                        "content-type": "application/json",
                        "authorization": f"Bearer {os.environ.get('GPUYARD_SERVE_KEY', '')}",
                    },
                    timeout=5,
                ).status_code
                == 200
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def load(
    url: str, bodies_file: Path, concurrency: int, duration: float, env: dict[str, str]
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "gpuyard.serve.loadgen",
        url,
        str(bodies_file),
        "--many",
        "--concurrency",
        str(concurrency),
        "--duration",
        str(duration),
        "--warmup",
        "1",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=duration + 120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(
    kinds: list[str], ref: str, bodies_file: Path, levels: list[int], duration: float, env: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Start the servers ``kinds`` together and load them in turn, level by level (c=1 on each, then
    c=4 on each...), so that a change in the machine's load between minutes hits them all alike."""
    procs: dict[str, tuple[subprocess.Popen[bytes], str, TreeMemory]] = {}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    peaks: dict[str, float] = {}
    try:
        for kind in kinds:
            proc, url = start(kind, ref, env)
            procs[kind] = (proc, url, TreeMemory(proc.pid))
        for proc, url, _ in procs.values():
            wait_ready(url, json.loads(bodies_file.read_text())[0].encode(), proc)
        for c in levels:
            for kind in kinds:
                r = load(procs[kind][1], bodies_file, c, duration, env)
                runs[kind].append(r)
                print(
                    f"  {kind:14s} {ref:11s} c={c:3d}  {r['throughput_rps']:8.1f} req/s  "
                    f"p50 {r['p50_ms']} ms  p99 {r['p99_ms']} ms  errors {r['errors']}",
                    flush=True,
                )
    finally:
        for kind, (proc, _, mem) in procs.items():
            stop(proc)
            peaks[kind] = mem.stop()
    out = {}
    for kind in kinds:
        ok = [r for r in runs[kind] if r["errors"] == 0 and r["p99_ms"] is not None]
        within = [r for r in ok if r["p99_ms"] <= BUDGET_MS]
        best = max(within, key=lambda r: r["throughput_rps"]) if within else None
        out[kind] = {
            "rps": best["throughput_rps"] if best else 0.0,
            "at": best["concurrency"] if best else None,
            "peak_mb": round(peaks[kind]),
            "runs": runs[kind],
        }
    return out


def soak(bodies_file: Path, seconds: float, env: dict[str, str]) -> dict[str, Any]:
    import psutil

    proc, url = start("gpuyard", "mlp", env)
    try:
        wait_ready(url, json.loads(bodies_file.read_text())[0].encode(), proc)
        p = psutil.Process(proc.pid)
        rss: list[int] = []
        done = threading.Event()
        sampler = threading.Thread(
            target=lambda: [rss.append(p.memory_info().rss) for _ in iter(lambda: done.wait(1), True)]
        )
        sampler.start()
        result = load(url, bodies_file, 64, seconds, env)
        done.set()
        sampler.join()
    finally:
        stop(proc)
    q = max(len(rss) // 4, 1)
    return {
        **result,
        "rss_start_mb": round(max(rss[:q]) / 2**20, 1),
        "rss_end_mb": round(max(rss[-q:]) / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="3 concurrency levels x 4 s (about 3-4 minutes with Ray Serve on this machine)",
    )
    ap.add_argument(
        "--soak",
        type=float,
        default=None,
        help="64 clients on gpuyard's MLP for this long (default: 60 s, 0 with --quick)",
    )
    ap.add_argument("--skip-ray", action="store_true", help="leave Ray Serve out")
    ap.add_argument("--smoke", action="store_true", help="CI: 1 and 4 clients x 1 s, no Ray (no figure)")
    ap.add_argument(
        "--also-batching",
        default="",
        help="also measure gpuyard with these batching modes (comma list of inline, thread)",
    )
    ap.add_argument(
        "--noise",
        type=int,
        default=0,
        help="busy-loop processes kept running during the whole measurement (a loaded machine)",
    )
    ap.add_argument("--models", default="mlp,transformer", help="comma list of mlp, transformer, cnn")
    ap.add_argument("--run-server", nargs=3, metavar=("KIND", "REF", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_server:
        kind, ref, port = args.run_server
        (run_plain if kind == "plain" else run_ray)(ref, int(port))
        return
    levels, duration = ([1, 4, 16], 4.0) if args.quick else ([1, 2, 4, 8, 16, 32, 64], 10.0)
    soak_s = args.soak if args.soak is not None else (0.0 if args.quick else 60.0)
    if args.smoke:
        levels, duration, soak_s, args.skip_ray = [1, 4], 1.0, 0.0, True
    tmp = Path(tempfile.mkdtemp(prefix="gpuyard-bench-serve-"))
    env = {
        **os.environ,
        "GPUYARD_HOME": str(tmp / "home"),
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(sys.path),
        # gpuyard's server needs a key; the load generator sends it to every server (the baselines
        # ignore the header, so each request carries the same bytes everywhere).
        "GPUYARD_SERVE_KEY": "gyk_" + secrets.token_urlsafe(32),
    }
    os.environ.update(env)
    from gpuyard.serve.examples import register_example

    all_shapes = {"mlp": (16,), "transformer": (4, 16), "cnn": (1, 28, 28)}
    shapes = {m: all_shapes[m] for m in args.models.split(",")}
    for name in shapes:
        register_example(name, name, **MODEL_KWARGS.get(name, {}))
    args.load1 = os.getloadavg()[0]
    noise = [
        subprocess.Popen([sys.executable, "-c", "while 1: pass"], start_new_session=True)
        for _ in range(args.noise)
    ]
    try:
        regime, results, soaked = run_all(args, shapes, levels, duration, soak_s, tmp, env)
    finally:
        for p in noise:
            p.kill()
            p.wait()
    report(args, shapes, regime, results, soaked, soak_s, tmp)


def run_all(
    args: argparse.Namespace,
    shapes: dict[str, tuple[int, ...]],
    levels: list[int],
    duration: float,
    soak_s: float,
    tmp: Path,
    env: dict[str, str],
) -> tuple[dict[str, tuple[float, float]], dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Measure every server on every model (and the soak), with the same bodies for all."""
    rng = np.random.default_rng(0)
    regime = forward_regime(shapes)
    results: dict[str, dict[str, Any]] = {}
    for ref, shape in shapes.items():
        bodies = tmp / f"{ref}.json"
        bodies.write_text(
            json.dumps(
                [json.dumps({"inputs": [rng.normal(size=shape).round(4).tolist()]}) for _ in range(16)]
            )
        )
        # gpuyard and the plain endpoint side by side (interleaved); Ray Serve alone (its idle
        # processes would take CPU from the others).
        groups = [[k for k in servers(args) if k != "ray"]] + ([["ray"]] if not args.skip_ray else [])
        for group in groups:
            for kind, res in measure(group, ref, bodies, levels, duration, env).items():
                results[f"{ref}_{kind}"] = res
    soaked = soak(tmp / "mlp.json", soak_s, env) if soak_s else None
    return regime, results, soaked


def servers(args: argparse.Namespace) -> list[str]:
    """The servers measured: gpuyard (default batching), gpuyard_MODE for ``--also-batching``, baselines."""
    extra = [f"gpuyard_{m}" for m in args.also_batching.split(",") if m]
    return ["gpuyard", *extra, "plain", *([] if args.skip_ray else ["ray"])]


def report(
    args: argparse.Namespace,
    shapes: dict[str, tuple[int, ...]],
    regime: dict[str, tuple[float, float]],
    results: dict[str, dict[str, Any]],
    soaked: dict[str, Any] | None,
    soak_s: float,
    tmp: Path,
) -> None:
    """Print the details file, the soak line and the last ``serve: key=value`` line."""
    (tmp / "results.json").write_text(json.dumps({"results": results, "soak": soaked}, indent=1))
    print(f"details: {tmp / 'results.json'}")
    if soaked:
        print(
            f"soak: 64 clients x {soak_s:.0f} s: {soaked['ok']} ok, {soaked['errors']} errors, "
            f"p99 {soaked['p99_ms']} ms, RSS {soaked['rss_start_mb']} -> {soaked['rss_end_mb']} MB"
        )
    figures = {}
    ours = [k for k in servers(args) if k.startswith("gpuyard")]
    for ref, mine in itertools.product(shapes, ours):
        g = results[f"{ref}_{mine}"]["rps"]
        for kind in ("ray", "plain"):
            if f"{ref}_{kind}" in results:
                base = results[f"{ref}_{kind}"]["rps"]
                # inf: the baseline never kept p99 within the budget at any concurrency tried.
                figures[f"{ref}{mine[7:]}_vs_{kind}"] = f"{g / base:.1f}x" if base else "inf"
    for ref, mine in itertools.product(shapes, ours):  # best at any latency: the ratio without the budget
        top = {k: max(r["throughput_rps"] for r in v["runs"]) for k, v in results.items()}
        for kind in ("ray", "plain"):
            if top.get(f"{ref}_{kind}"):
                ratio = top[f"{ref}_{mine}"] / top[f"{ref}_{kind}"]
                figures[f"{ref}{mine[7:]}_vs_{kind}_unbounded"] = f"{ratio:.1f}x"
    for ref in shapes:
        for kind in servers(args):
            if f"{ref}_{kind}" in results:
                r = results[f"{ref}_{kind}"]
                figures[f"{ref}_{kind}_rps"] = f"{r['rps']:.0f}"
                best_p99 = min(x["p99_ms"] for x in r["runs"] if x["p99_ms"] is not None)
                figures[f"{ref}_{kind}_best_p99_ms"] = f"{best_p99:.1f}"
    for ref, (one, per) in regime.items():
        figures[f"{ref}_fwd1_ms"] = f"{one:.2f}"
        figures[f"{ref}_fwd{MAX_BATCH}_per_sample_ms"] = f"{per:.3f}"
    for kind in servers(args):
        if all(f"{ref}_{kind}" in results for ref in shapes):
            peak = max(results[f"{ref}_{kind}"]["peak_mb"] for ref in shapes)
            figures[f"{kind}_peak_mb"] = str(peak)
    if soaked:
        figures["soak_errors"] = str(soaked["errors"])
        figures["soak_rss_growth_mb"] = f"{soaked['rss_end_mb'] - soaked['rss_start_mb']:.1f}"
    figures["noise_procs"] = str(args.noise)  # busy loops started by this run (a loaded machine on purpose)
    figures["load1_at_start"] = f"{args.load1:.1f}"  # the machine's load before this run started
    print("serve: " + " ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
