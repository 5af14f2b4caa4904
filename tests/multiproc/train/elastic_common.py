"""Helpers for the resume-at-another-world-size tests: the spec, runs in this process or under
torchrun, and what is compared (samples per step, loss per step, final weights)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from gpuyard.tracking.files import read_metrics

from .conftest import HERE, env_for, final_weights, finish

STEPS = 24  # 188 samples (+4 wrapped), global batch 16 over grad_accum 2: 12 steps an epoch, 2 epochs
STOP = 7  # the first part stops after step 7 is asked, so it checkpoints at step 8 (mid-epoch 0)


def write_elastic_spec(folder: Path, **fields: Any) -> Path:
    """DDP (or `parallel` in fields) over a dropout-free MLP with a global batch of 16 per step."""
    doc: dict[str, Any] = {
        "name": "elastic",
        "run_dir": str(folder / "run"),
        "seed": 5,
        "model": {"entrypoint": "gpuyard.train.examples:mlp", "kwargs": {"hidden": 64}},
        "data": {
            "train": {"entrypoint": "elastic_hooks:logged_data", "kwargs": {"n": 188}},
            "global_batch_size": 16,
            "drop_last": False,
        },
        "grad_accum": 2,
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01},
        "schedule": {"kind": "warmup_cosine", "warmup_steps": 3},
        "epochs": 2,
        "clip_grad_norm": 1.0,
        "checkpoint": {"every_steps": 4, "keep": 2},
        "max_restarts": 0,
        "tracking": "jsonl",
        "callbacks": ["elastic_hooks:record", "elastic_hooks:stop_at"],
    }
    doc.update(fields)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_here(spec_path: Path, folder: Path, stop: int | None) -> Any:
    """One process, in this one (world size 1): cheaper than a torchrun start."""
    from gpuyard.train.spec import load_spec
    from gpuyard.train.trainer import Trainer

    with pytest.MonkeyPatch.context() as m:
        m.syspath_prepend(str(HERE))
        m.setenv("GPUYARD_TEST_HOOK_DIR", str(folder))
        for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            m.delenv(var, raising=False)
        if stop is not None:
            m.setenv("GPUYARD_TEST_STOP_AT", str(stop))
        trainer = Trainer(load_spec(spec_path))
        try:
            return trainer.fit()
        finally:
            trainer.close()


def run_torchrun(spec_path: Path, folder: Path, nproc: int, stop: int | None) -> dict[str, Any]:
    """`gpuyard train SPEC --nproc N --json`; returns its outcome (exit 0 or 75 expected)."""
    import subprocess

    env = env_for(folder)
    if stop is not None:
        env["GPUYARD_TEST_STOP_AT"] = str(stop)
    cmd = [sys.executable, "-m", "gpuyard.cli.main", "train", str(spec_path), "--nproc", str(nproc), "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, out, err = finish(proc)
    assert code in (0, 75), err[-3000:]
    return dict(json.loads(out))


def rank_slices(folder: Path) -> dict[int, set[int]]:
    """World size -> the sizes of the per-rank slices of a step its ranks fetched (one size expected)."""
    sizes: dict[int, set[int]] = {}
    for path in (folder / "samples").glob("*.txt"):
        world = int(path.name.split("-")[0][1:])
        sizes.setdefault(world, set()).update(len(line.split()) - 1 for line in path.read_text().splitlines())
    return sizes


def samples_by_step(folder: Path) -> dict[int, Counter[int]]:
    """Every sample fetched, per optimizer step, over all ranks and all parts of the run."""
    steps: dict[int, Counter[int]] = {}
    for path in sorted((folder / "samples").glob("*.txt")):
        for line in path.read_text().splitlines():
            step, *ids = map(int, line.split())
            steps.setdefault(step, Counter()).update(ids)
    return steps


def losses(run_dir: Path) -> dict[int, float]:
    """The logged loss of each step (a step logged twice would be a replay: refused)."""
    out: dict[int, float] = {}
    for e in read_metrics(run_dir):
        if e.get("event") == "metrics":
            assert e["step"] not in out, f"step {e['step']} logged twice"
            out[e["step"]] = float(e["loss"])
    return out


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over all model tensors (same names and shapes required)."""
    assert a.keys() == b.keys() and a
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def compare(resized: Path, reference: Path, label: str, worlds: tuple[int, ...]) -> dict[str, Any]:
    """The closest honest notion of exact across world sizes, asserted; returns the figures.

    Equal: the multiset of samples of every step and the step count. Close: the loss of every step and
    the final weights (the gradient all-reduce sums in another order at another world size, so
    bit-equality does not hold).
    """
    got, want = samples_by_step(resized), samples_by_step(reference)
    assert sorted(got) == list(range(1, STEPS + 1)) and sorted(want) == sorted(got)
    for step in want:
        assert got[step] == want[step], f"step {step}: other samples"
        assert sum(got[step].values()) == 16
    # Each world size really split the step: 16 samples over its ranks.
    assert {w: sorted(s) for w, s in rank_slices(resized).items()} == {w: [16 // w] for w in worlds}
    l_got, l_want = losses(resized / "run"), losses(reference / "run")
    assert sorted(l_got) == sorted(l_want) == list(range(1, STEPS + 1))
    loss_diff = max(abs(l_got[s] - l_want[s]) for s in l_want)
    weight_diff = max_weight_difference(final_weights(resized / "run"), final_weights(reference / "run"))
    figures = {
        "case": label,
        "samples_equal": True,
        "max_loss_diff": loss_diff,
        "max_weight_diff": weight_diff,
    }
    print(f"elastic-resume: {json.dumps(figures)}")
    assert loss_diff < 1e-5, figures
    assert weight_diff < 1e-6, figures
    return figures


def resume_events(run_dir: Path) -> list[dict[str, Any]]:
    """The resume events of a run."""
    return [e for e in read_metrics(run_dir) if e.get("event") == "resume"]
