"""The training stage: ``gpuyard train`` (torchrun, DDP over ``nproc`` processes) on a dataset version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuyard.errors import ConfigError
from gpuyard.pipelines.stages import need


def train_spec(inputs: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The ``gpuyard.train`` spec for an image classifier on ``inputs['dataset']`` with ``params``."""
    ref = str(inputs["dataset"])
    p = dict(inputs.get("params") or {})
    batch = int(p.get("batch_size", 64))
    loader = {"dataset": ref, "batch_size": batch, "column": inputs.get("column", "image")}
    loader["label"] = inputs.get("label", "label")
    return {
        "name": "pipeline-train",
        "run_dir": str(run_dir),
        "seed": int(inputs.get("seed", 0)),
        "model": {
            "entrypoint": "gpuyard.pipelines.torchglue:image_mlp",
            "kwargs": {
                "dataset": ref,
                "out_features": int(inputs.get("classes", 10)),
                "hidden": int(p.get("hidden", 64)),
                "activation": str(p.get("activation", "relu")),
            },
        },
        "data": {
            "train": {
                "entrypoint": "gpuyard.pipelines.torchglue:shard_batches",
                "kwargs": {**loader, "split": "train"},
            },
            "val": {
                "entrypoint": "gpuyard.pipelines.torchglue:shard_batches",
                "kwargs": {**loader, "split": "val", "augment": False},
            },
            "batch_size": batch,
        },
        "optimizer": {
            "name": "adamw",
            "lr": float(p.get("lr", 0.01)),
            "weight_decay": float(p.get("weight_decay", 0.0)),
        },
        "schedule": {"kind": "warmup_cosine", "warmup_steps": int(inputs.get("warmup_steps", 10))},
        "epochs": int(inputs.get("epochs") or p.get("epochs") or 10),
        "checkpoint": {"keep": 1},
        "max_restarts": 0,
        "log_every_steps": 10,
        "callbacks": ["gpuyard.pipelines.torchglue:save_at_end"],
        # Rank 0 records the run in the state store as it trains (beside the search trials in
        # `gpuyard runs` and the dashboard), with the dataset version it read.
        "tracking": {
            "backend": "db",
            "experiment": str(inputs.get("experiment", "default")),
            "run_name": str(inputs.get("run_name", "pipeline-train")),
            "dataset": ref,
            "tags": {"parallel": "ddp"},
        },
    }


def train_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Train with DDP on ``nproc`` processes (torchrun via gpuyard.train); outputs the saved model folder.

    Raises:
        ConfigError: the training job did not complete (names its status and run folder).
    """
    from gpuyard.train.launch import LaunchConfig, launch
    from gpuyard.train.tracking import tracked_run_id

    need(inputs, "dataset", ctx["stage"])
    work = Path(ctx["workdir"])
    run_dir = work / "run"
    spec_path = work / "train.yaml"
    spec_path.write_text(yaml.safe_dump(train_spec(inputs, run_dir), sort_keys=False))
    nproc = int(inputs.get("nproc", 2))
    res = launch(LaunchConfig(spec_path=spec_path, nproc=nproc))
    status = res.status
    if res.exit_code != 0 or not (run_dir / "model" / "model.safetensors").is_file():
        raise ConfigError(
            f"training did not complete: exit {res.exit_code}, status {status} (run folder {run_dir})"
        )
    run_id = tracked_run_id(run_dir)
    if run_id is None:  # the trainer could not reach the state store; metrics.jsonl has the curves
        raise ConfigError(f"training completed but its run is not in the state store (see {run_dir})")
    metrics = status.get("metrics") or {}
    shown = ", ".join(
        f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float) and k in ("loss", "val_loss")
    )
    return {
        "model_dir": str(run_dir / "model"),
        "run": run_id,
        "run_dir": str(run_dir),
        "steps": int(status.get("step") or 0),
        "nproc": nproc,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        "report": [
            f"DDP on {nproc} processes (torchrun, gloo): {status.get('step')} steps, {shown};"
            f" tracked as run {run_id[:8]}",
            f"spec {spec_path}; checkpoints in {run_dir / 'checkpoints'}",
        ],
    }
