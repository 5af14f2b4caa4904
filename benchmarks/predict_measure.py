"""Predict-then-measure: calibrate this machine, predict `gpuyard train` step times, run them, compare.

For each bundled transformer configuration the step model (gpuyard.fabric.step, with the calibration
applied to the ``local`` cluster) predicts the step time *before* the run; then ``gpuyard train`` runs
it under torchrun and the measured step time is the median of the steps after warm-up, as the trainer
logs them in metrics.jsonl. Nothing is fitted to the runs: the only inputs are the calibration and the
configuration.

CPU (2 ranks, gloo, fp32): DDP and FSDP of a 4-layer transformer at widths 256 and 512, and a 2-stage
pipeline (GPipe). CUDA (one GPU, bf16): a ~1B-parameter transformer and a ~350M one.

A loaded machine cannot fool it: a calibration taken while other work ran predicts every run too slow
(or too fast when the load came after). So the benchmark measures the machine's compute rate with a
short probe (one GEMM loop per rank, all ranks at once, as the runs use the cores) right after the
calibration and before and after every run. A run whose rate before or after differs from the
calibration's by more than ``RATE_TOLERANCE`` is reported as "machine changed" (with both rates and
the load average) instead of an error figure, and tried again up to ``--retries`` times. A
calibration whose own rate moved while it ran is retaken (when the benchmark calibrates). A run that
fails (exit status, no step times) is reported with its output's last lines and does not stop the
others; the benchmark exits 1 only when no configuration gave a figure for a reason other than load.

    python benchmarks/predict_measure.py [--calibration FILE] [--quick] [--keep DIR] [--retries N]

Last line: ``predict_measure: median_error=<fraction|na> max_error=<fraction|na> configs=<n>
steady=<k> changed=<c> failed=<f> rate_tolerance=<x> calibration=<steady|unsteady|file>
device=<cpu|cuda>``: errors over the ``steady`` configurations only (na when none was; with an unsteady
calibration no run is made).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from gpuyard.fabric.calibrate import (
    CalibrateConfig,
    Calibration,
    apply_calibration,
    load_calibration,
    run_calibration,
)
from gpuyard.fabric.loadprobe import RATE_TOLERANCE, RateProbe, changed
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, estimate_step

# The first steps pay for allocator growth, autograd graph caching and (on CUDA) kernel selection.
WARMUP_STEPS = 3


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


@dataclass(frozen=True)
class Config:
    """One training configuration: model shape, layout and batch."""

    name: str
    dim: int
    layers: int
    heads: int
    seq_len: int
    vocab: int
    batch: int  # per data-parallel rank, per step
    nproc: int
    data_parallel: str = "ddp"  # ddp | fsdp
    pp: int = 1
    microbatches: int = 1
    steps: int = 12

    def model_spec(self) -> ModelSpec:
        """The shape the step model sees: gpuyard.train.examples.TinyTransformer's blocks (GELU FFN of 4x)."""
        return ModelSpec(
            self.name, self.layers, self.dim, self.heads, self.heads, 4 * self.dim, self.vocab, self.seq_len
        )

    def parallel(self, precision: str) -> ParallelConfig:
        """The layout the trainer builds for this configuration."""
        dp = self.nproc // self.pp
        micro = self.batch // self.microbatches if self.pp > 1 else self.batch
        zero = 3 if self.data_parallel == "fsdp" else 0
        return ParallelConfig(
            tp=1, pp=self.pp, dp=dp, micro_batch=micro, zero=zero, precision=precision, stack="gpuyard"
        )

    def global_batch(self) -> int:
        """Sequences per step over all data-parallel ranks."""
        return self.batch * (self.nproc // self.pp)


def cpu_configs(quick: bool) -> list[Config]:
    """2 ranks on the CPU: DDP, FSDP and a 2-stage pipeline."""
    steps = 8 if quick else 14
    base = {"layers": 4, "heads": 4, "seq_len": 128, "vocab": 256, "nproc": 2, "steps": steps}
    configs = [
        Config("ddp-d256", dim=256, batch=16, **base),  # type: ignore[arg-type]
        Config("fsdp-d256", dim=256, batch=16, data_parallel="fsdp", **base),  # type: ignore[arg-type]
        Config("pipeline2-d256", dim=256, batch=16, pp=2, microbatches=4, **base),  # type: ignore[arg-type]
    ]
    if not quick:
        configs += [
            Config("ddp-d512", dim=512, batch=8, **base),  # type: ignore[arg-type]
            Config("fsdp-d512", dim=512, batch=8, data_parallel="fsdp", **base),  # type: ignore[arg-type]
        ]
    return configs


def cuda_configs(quick: bool) -> list[Config]:
    """One GPU: a ~1B-parameter transformer and a ~350M one (bf16)."""
    steps = 10 if quick else 20
    return [
        Config(
            "gpt-1.2b",
            dim=2048,
            layers=22,
            heads=16,
            seq_len=2048,
            vocab=32768,
            batch=4,
            nproc=1,
            steps=steps,
        ),
        Config(
            "gpt-350m",
            dim=1024,
            layers=24,
            heads=16,
            seq_len=1024,
            vocab=32768,
            batch=8,
            nproc=1,
            steps=steps,
        ),
    ]


def spec_yaml(cfg: Config, run_dir: Path) -> dict[str, object]:
    """The `gpuyard train` spec of one configuration."""
    model = "SequentialTransformer" if cfg.pp > 1 else "TinyTransformer"
    samples = cfg.global_batch() * (cfg.steps + 2)
    return {
        "name": cfg.name,
        "run_dir": str(run_dir),
        "model": {
            "entrypoint": f"gpuyard.train.examples:{model}",
            "kwargs": {
                "vocab": cfg.vocab,
                "dim": cfg.dim,
                "heads": cfg.heads,
                "layers": cfg.layers,
                "seq_len": cfg.seq_len,
            },
        },
        "data": {
            "train": {
                "entrypoint": "gpuyard.train.examples:token_data",
                "kwargs": {"n": samples, "seq_len": cfg.seq_len, "vocab": cfg.vocab},
            },
            "batch_size": cfg.batch,
            "shuffle": False,
        },
        "max_steps": cfg.steps,
        "parallel": {
            "pp": cfg.pp,
            "data_parallel": cfg.data_parallel,
            "microbatches": cfg.microbatches,
        },
        "checkpoint": {"every_steps": 0, "at_epoch_end": False, "final": False, "resume": False},
        "tracking": "jsonl",
        "max_restarts": 0,
    }


def measure(cfg: Config, workdir: Path, attempt: int = 0) -> float:
    """Run `gpuyard train` and return the median step time after warm-up (seconds).

    Raises:
        RuntimeError: the run failed (its output's last lines say why).
    """
    run_dir = workdir / f"{cfg.name}-{attempt}"  # a fresh folder per attempt: no resume, no stale metrics
    spec_path = workdir / f"{cfg.name}-{attempt}.yaml"
    spec_path.write_text(yaml.safe_dump(spec_yaml(cfg, run_dir)))
    cmd = [
        sys.executable,
        "-m",
        "gpuyard.cli.main",
        "train",
        str(spec_path),
        "--nproc",
        str(cfg.nproc),
        "--tracking",
        "jsonl",
    ]
    env = {**os.environ, "GPUYARD_HOME": str(workdir / "home")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"{cfg.name}: gpuyard train exited {proc.returncode}: {' | '.join(tail)}")
    events = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    times = [e["step_time"] for e in events if "step_time" in e and e.get("step", 0) > WARMUP_STEPS]
    if not times:
        raise RuntimeError(f"{cfg.name}: no step_time after step {WARMUP_STEPS} in metrics.jsonl")
    return statistics.median(times)


def calibrate(
    configs: list[Config], probe: RateProbe, attempts: int, quick: bool = False
) -> tuple[Calibration, float, str, bool]:
    """Calibrate with the compute rate probed before and after; retake it when the rate moved.

    Returns the calibration, the reference rate (after it), a note, and whether it was steady.
    """
    note = ""
    for attempt in range(1, attempts + 1):
        before = probe.rate()
        cal = run_calibration(CalibrateConfig(nproc=max(c.nproc for c in configs), quick=quick))
        after = probe.rate()
        if not changed(before, after):
            note = f"steady (rate {before / 1e9:.1f} -> {after / 1e9:.1f} GFLOP/s, {_load()})"
            return cal, after, note, True
        if attempt == attempts:
            break
        note = (
            f"the machine changed during calibration attempt {attempt}: rate {before / 1e9:.1f} -> "
            f"{after / 1e9:.1f} GFLOP/s ({_load()})"
        )
        print(note, flush=True)
    note = (
        f"the machine changed during every calibration ({attempts}): rate {before / 1e9:.1f} -> "
        f"{after / 1e9:.1f} GFLOP/s in the last ({_load()}): no run can be judged against it"
    )
    return cal, after, note, False


def main() -> int:
    """Calibrate, predict, measure with the rate checked around each run; print the table and summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, help="Use this calibration instead of measuring now.")
    parser.add_argument("--quick", action="store_true", help="Fewer configurations and steps.")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI: calibrate's quick mode, one configuration, 5 steps (no figure)",
    )
    parser.add_argument("--keep", type=Path, help="Keep run folders and the calibration here.")
    parser.add_argument(
        "--retries", type=int, default=1, help="Runs again a configuration the machine changed under."
    )
    args = parser.parse_args()

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = (
        cuda_configs(args.quick or args.smoke) if device == "cuda" else cpu_configs(args.quick or args.smoke)
    )
    if args.smoke:
        configs = [replace(configs[0], steps=WARMUP_STEPS + 2)]
    precision = "bf16" if device == "cuda" else "fp32"
    workdir = Path(tempfile.mkdtemp(prefix="gpuyard-pm-")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    how = "none"
    probe = RateProbe(device, max(c.nproc for c in configs))
    errors: list[float] = []
    n_changed = n_failed = 0
    try:
        started = time.perf_counter()
        if args.calibration:
            cal = load_calibration(args.calibration)
            reference, steady, how = probe.rate(), True, "file"
            note = (
                f"from {args.calibration}: the load it was taken under is unknown; runs are judged "
                f"against the rate now ({reference / 1e9:.1f} GFLOP/s, {_load()})"
            )
        else:
            cal, reference, note, steady = calibrate(
                configs, probe, attempts=1 if args.smoke else 2, quick=args.smoke
            )
            how = "steady" if steady else "unsteady"
            (workdir / "calibration.json").write_text(cal.model_dump_json(indent=2))
        print(
            f"calibration: {cal.ranks} rank(s) of {cal.device_name} in "
            f"{time.perf_counter() - started:.0f} s; {note}"
        )
        cluster = apply_calibration(load_cluster("local"), cal)
        print(
            f"{'config':<16} {'params':>8} {'predicted':>10} {'measured':>10} {'error':>7}  "
            "rate before/after (of calibration's); breakdown (predicted)"
        )
        for cfg in configs if steady else []:
            spec = cfg.model_spec()
            est = estimate_step(
                spec, cluster, cfg.nproc, cfg.global_batch(), cfg.seq_len, cfg.parallel(precision)
            )
            b = est.breakdown
            parts = (
                f"compute {b.compute_s * 1e3:.1f} bubble {b.bubble_s * 1e3:.1f} "
                f"exposed {b.exposed_comm_s * 1e3:.1f} ms"
            )
            for attempt in range(args.retries + 1):
                before = probe.rate()
                try:
                    measured = measure(cfg, workdir, attempt)
                except RuntimeError as exc:
                    n_failed += 1
                    print(f"{cfg.name:<16} FAILED ({_load()}): {exc}", flush=True)
                    break
                after = probe.rate()
                rates = f"{before / reference:4.0%}/{after / reference:4.0%}"
                if changed(reference, before, after):
                    print(
                        f"{cfg.name:<16} {spec.params / 1e6:7.1f}M {est.step_time_s * 1e3:8.1f}ms "
                        f"{measured * 1e3:8.1f}ms  machine changed: rate {rates} of the calibration's "
                        f"({_load()}){'; again' if attempt < args.retries else '; no figure'}",
                        flush=True,
                    )
                    if attempt == args.retries:
                        n_changed += 1
                    continue
                err = abs(est.step_time_s - measured) / measured
                errors.append(err)
                print(
                    f"{cfg.name:<16} {spec.params / 1e6:7.1f}M {est.step_time_s * 1e3:8.1f}ms "
                    f"{measured * 1e3:8.1f}ms {err:6.1%}  {rates}; {parts}",
                    flush=True,
                )
                break
    finally:
        probe.close()
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    med = f"{statistics.median(errors):.3f}" if errors else "na"
    worst = f"{max(errors):.3f}" if errors else "na"
    print(
        f"predict_measure: median_error={med} max_error={worst} configs={len(configs)} "
        f"steady={len(errors)} changed={n_changed} failed={n_failed} rate_tolerance={RATE_TOLERANCE} "
        f"calibration={how} device={device}"
    )
    return 1 if n_failed and not errors and not n_changed else 0


if __name__ == "__main__":
    sys.exit(main())
