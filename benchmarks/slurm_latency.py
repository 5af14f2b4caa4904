"""Submission-to-start latency on Slurm: a 1-node job through `gpuyard server --slurm` vs `sbatch` directly.

Both sides run on the same private Slurm cluster (munged, slurmctld, two slurmd on this host, started
here; needs root and Debian's slurmctld, slurmd, slurm-client and munge), alternating job by job so the
machine's load hits both alike. The job is the same on both sides: a batch job whose first command
writes the wall-clock time; latency is that time minus the moment the submission began.

- baseline: ``sbatch --parsable --wrap`` with the same node, CPUs and output options gpuyard passes.
  That is the fastest way to start a job on Slurm from a client (``srun`` would also hold an
  interactive step open; slurmrestd adds an HTTP hop and a JWT daemon). The cluster's scheduler runs
  with ``sched_min_interval=0`` so a submission is scheduled at once on both sides.
- gpuyard: ``POST /jobs`` to `gpuyard server --slurm` over loopback; the server's loop wakes on the
  submission, places the job, writes its state, and calls sbatch (the same Slurm path as above).

Last line: ``slurm_latency: overhead_ratio=<gpuyard/sbatch median> gpuyard_ms=<median>
sbatch_ms=<median> gpuyard_p90_ms=<x> sbatch_p90_ms=<x> rounds=<n>``. Goal: overhead_ratio <= 1.2.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gpuyard.scheduler.executors.slurm_local import LocalSlurm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_file(path: Path, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text:
                return float(text)
        except OSError:
            pass
        time.sleep(0.002)
    raise TimeoutError(f"{path} not written within {timeout:g} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="6 rounds")
    parser.add_argument("--smoke", action="store_true", help="CI: 2 rounds (no figure)")
    args = parser.parse_args()
    rounds = 2 if args.smoke else 6 if args.quick else args.rounds
    if os.geteuid() != 0:
        print("slurm_latency: needs root (a private Slurm cluster is started here)", file=sys.stderr)
        sys.exit(2)
    work = Path(tempfile.mkdtemp(prefix="gpuyard-slurm-bench-"))
    os.chmod(work, 0o755)
    with LocalSlurm(work / "cluster", nodes={"n1": 1, "n2": 1}) as cluster:
        env = {
            **os.environ,
            **cluster.env,
            "GPUYARD_HOME": str(work / "home"),
            "GPUYARD_TOKEN": "bench-token",
        }
        port = _free_port()
        log = open(work / "server.log", "wb")  # noqa: SIM115 - open for the server's whole life
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuyard.cli.main",
                "server",
                "--slurm",
                "--port",
                str(port),
                "--job-user",
                "root",
                "--job-dir",
                str(work / "jobs"),
                "--cpus",
                "2",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=url, timeout=30)
        try:
            deadline = time.monotonic() + 90
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"server did not start: {(work / 'server.log').read_text()[-2000:]}")
                time.sleep(0.05)
            # The admin token the server wrote at its first start (as `gpuyard jobs` reads it).
            token = (work / "home" / "token").read_text().strip()
            client.headers["Authorization"] = f"Bearer {token}"
            gy: list[float] = []
            sb: list[float] = []
            stages: list[tuple[float, float, float]] = []  # POST answered, sbatch script written, started
            for i in range(rounds):
                for side in ("gpuyard", "sbatch") if i % 2 == 0 else ("sbatch", "gpuyard"):
                    mark = work / f"{side}-{i}.start"
                    cmd = f"date +%s.%N > {mark}"
                    t0 = time.time()
                    if side == "sbatch":
                        subprocess.run(
                            [
                                "sbatch",
                                "--parsable",
                                "--nodes=1",
                                "--ntasks-per-node=1",
                                "--cpus-per-task=1",
                                "--gpus-per-node=1",
                                f"--output={work / 'sbatch.out'}",
                                "--open-mode=append",
                                "--no-requeue",
                                f"--wrap={cmd}",
                            ],
                            env=env,
                            check=True,
                            capture_output=True,
                        )
                        sb.append((_wait_file(mark) - t0) * 1000)
                    else:
                        body = {"name": f"lat{i}", "command": ["bash", "-c", cmd], "resources": {"gpus": 1}}
                        resp = client.post("/jobs", json=body)
                        resp.raise_for_status()
                        t_resp = time.time()
                        started = _wait_file(mark)
                        gy.append((started - t0) * 1000)
                        script = work / "home" / "jobs" / str(resp.json()["id"]) / "attempt-1.sbatch"
                        t_script = script.stat().st_mtime
                        stages.append(
                            (1000 * (t_resp - t0), 1000 * (t_script - t_resp), 1000 * (started - t_script))
                        )
                    # The next job starts on an idle cluster on both sides.
                    while cluster.run("squeue", "-h", "-o", "%i", check=False).strip():
                        time.sleep(0.01)
        finally:
            client.close()
            server.terminate()
            server.wait(timeout=30)
            log.close()
    load = os.getloadavg()
    g, s = statistics.median(gy), statistics.median(sb)

    def p90(xs: list[float]) -> float:
        return sorted(xs)[max(0, round(0.9 * len(xs)) - 1)]

    print(f"gpuyard: {' '.join(f'{x:.0f}' for x in gy)} ms")
    print(f"sbatch:  {' '.join(f'{x:.0f}' for x in sb)} ms")
    post, place, slurm = (statistics.median(x) for x in zip(*stages, strict=True))
    print(
        f"gpuyard stages (median ms): POST answered {post:.0f}, batch script written {place:.0f} later, "
        f"job started {slurm:.0f} after that"
    )
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(
        f"slurm_latency: overhead_ratio={g / s:.2f} gpuyard_ms={g:.0f} sbatch_ms={s:.0f} "
        f"gpuyard_p90_ms={p90(gy):.0f} sbatch_p90_ms={p90(sb):.0f} rounds={rounds}"
    )


if __name__ == "__main__":
    main()
