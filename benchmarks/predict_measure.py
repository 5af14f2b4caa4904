"""Predict-then-measure: calibrate this machine, predict `gpuyard train` step times, run them, compare.

For each bundled transformer configuration the step model (gpuyard.fabric.step, with the calibration
applied to the ``local`` cluster) predicts the step time *before* the run; then ``gpuyard train`` runs
it under torchrun and the measured step time is the median of the steps after warm-up, as the trainer
logs them in metrics.jsonl. Nothing is fitted to the runs: the only inputs are the calibration and the
configuration.

CPU (2 ranks, gloo, fp32): DDP and FSDP of a 4-layer transformer at widths 256 and 512, and a 2-stage
pipeline (GPipe). CUDA (one GPU, bf16): a ~1B-parameter transformer and a ~350M one.

    python benchmarks/predict_measure.py [--calibration FILE] [--quick] [--keep DIR]

Last line: ``predict_measure: median_error=<fraction> max_error=<fraction> configs=<n> device=<cpu|cuda>``.
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
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpuyard.fabric.calibrate import CalibrateConfig, apply_calibration, load_calibration, run_calibration
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, estimate_step

# The first steps pay for allocator growth, autograd graph caching and (on CUDA) kernel selection.
WARMUP_STEPS = 3


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


def measure(cfg: Config, workdir: Path) -> float:
    """Run `gpuyard train` and return the median step time after warm-up (seconds).

    Raises:
        RuntimeError: the run failed (its output's last lines say why).
    """
    run_dir = workdir / cfg.name
    spec_path = workdir / f"{cfg.name}.yaml"
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


def main() -> int:
    """Calibrate, predict, measure, compare; print the table and the summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, help="Use this calibration instead of measuring now.")
    parser.add_argument("--quick", action="store_true", help="Fewer configurations and steps.")
    parser.add_argument("--keep", type=Path, help="Keep run folders and the calibration here.")
    args = parser.parse_args()

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = cuda_configs(args.quick) if device == "cuda" else cpu_configs(args.quick)
    precision = "bf16" if device == "cuda" else "fp32"
    workdir = Path(tempfile.mkdtemp(prefix="gpuyard-pm-")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        if args.calibration:
            cal = load_calibration(args.calibration)
        else:
            cal = run_calibration(CalibrateConfig(nproc=max(c.nproc for c in configs)))
            (workdir / "calibration.json").write_text(cal.model_dump_json(indent=2))
        print(
            f"calibration: {cal.ranks} rank(s) of {cal.device_name} in {time.perf_counter() - started:.0f} s"
        )
        cluster = apply_calibration(load_cluster("local"), cal)
        print(
            f"{'config':<16} {'params':>8} {'predicted':>10} {'measured':>10} {'error':>7}  "
            "breakdown (predicted)"
        )
        errors = []
        for cfg in configs:
            spec = cfg.model_spec()
            est = estimate_step(
                spec, cluster, cfg.nproc, cfg.global_batch(), cfg.seq_len, cfg.parallel(precision)
            )
            measured = measure(cfg, workdir)
            err = abs(est.step_time_s - measured) / measured
            errors.append(err)
            b = est.breakdown
            print(
                f"{cfg.name:<16} {spec.params / 1e6:7.1f}M {est.step_time_s * 1e3:8.1f}ms "
                f"{measured * 1e3:8.1f}ms "
                f"{err:6.1%}  compute {b.compute_s * 1e3:.1f} bubble {b.bubble_s * 1e3:.1f} "
                f"exposed {b.exposed_comm_s * 1e3:.1f} ms",
                flush=True,
            )
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"predict_measure: median_error={statistics.median(errors):.3f} max_error={max(errors):.3f} "
        f"configs={len(errors)} device={device}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
