"""The training stage: ``gpuyard train`` (torchrun, DDP over ``nproc`` processes) on a dataset version.

The stage resolves the dataset once (``digits`` / ``digits@latest`` -> ``digits@<version id>``) and
every rank reads that version: the ``train`` split for gradient steps, the ``val`` split for the
validation loss. The run records the rows it trained on, ``NAME@<version id>#split=train``, as its
dataset version (the validation rows as the tag ``validation``), so its lineage names rows that exist
forever, not whatever ``latest`` is later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuyard.errors import ConfigError
from gpuyard.pipelines.inputs import TrainInputs, parse_inputs
from gpuyard.refs import DatasetRef


def _version(ref: str, stage: str) -> tuple[str, str, str]:
    """(``NAME@<version id>``, its train selection, its val selection) of the stage's dataset.

    Raises:
        ConfigError: the reference selects splits (this stage reads train and val itself), or the
            version lacks a train or val split. NotFoundError: no such dataset or version.
    """
    from gpuyard.data.arrays import pin, with_splits

    if DatasetRef.has_selection(ref):
        raise ConfigError(
            f"stage {stage!r}: dataset {ref!r} selects splits, but the train stage reads the version's"
            f" 'train' and 'val' splits itself: give NAME[@VERSION] without #split="
        )
    train = pin(with_splits(ref, ["train"]))
    return str(DatasetRef.parse(train).base), train, pin(with_splits(train, ["val"]))


def train_spec(inputs: TrainInputs | dict[str, Any], run_dir: Path, stage: str = "train") -> dict[str, Any]:
    """The ``gpuyard.train`` spec for an image classifier on ``inputs.dataset`` with ``params``.

    The dataset is resolved here (see the module docstring); the spec names only the resolved version.

    Raises:
        ConfigError: a bad input (naming it), or a dataset that selects splits or lacks train or val.
    """
    i = inputs if isinstance(inputs, TrainInputs) else parse_inputs(TrainInputs, inputs, stage)
    ref, trained, validated = _version(i.dataset, stage)
    p = dict(i.params or {})
    batch = int(p.get("batch_size", 64))
    loader = {"dataset": ref, "batch_size": batch, "column": i.column, "label": i.label}
    return {
        "name": "pipeline-train",
        "run_dir": str(run_dir),
        "seed": i.seed,
        "model": {
            "entrypoint": "gpuyard.pipelines.torchglue:image_mlp",
            "kwargs": {
                "dataset": ref,
                "out_features": i.classes,
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
        "schedule": {"kind": "warmup_cosine", "warmup_steps": i.warmup_steps},
        "epochs": int(i.epochs or p.get("epochs") or 10),
        "checkpoint": {"keep": 1},
        "max_restarts": 0,
        "log_every_steps": 10,
        "callbacks": ["gpuyard.pipelines.torchglue:save_at_end"],
        # Rank 0 records the run in the state store as it trains (beside the search trials in
        # `gpuyard runs` and the dashboard), with the version and split it trained on.
        "tracking": {
            "backend": "db",
            "experiment": i.experiment,
            "run_name": i.run_name,
            "dataset": trained,
            "tags": {"parallel": "ddp", "validation": validated},
        },
    }


def train_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Train with DDP on ``nproc`` processes (torchrun via gpuyard.train); outputs the saved model folder.

    Raises:
        ConfigError: the training job did not complete (names its status and run folder).
    """
    from gpuyard.tracking.training import tracked_run_id
    from gpuyard.train.launch import LaunchConfig, launch

    i = parse_inputs(TrainInputs, inputs, ctx["stage"])
    work = Path(ctx["workdir"])
    run_dir = work / "run"
    spec_path = work / "train.yaml"
    spec = train_spec(i, run_dir, ctx["stage"])
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    nproc = i.nproc
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
        "dataset": spec["tracking"]["dataset"],
        "run": run_id,
        "run_dir": str(run_dir),
        "steps": int(status.get("step") or 0),
        "nproc": nproc,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        "report": [
            f"DDP on {nproc} processes (torchrun, gloo): {status.get('step')} steps, {shown};"
            f" tracked as run {run_id[:8]} on {spec['tracking']['dataset']}",
            f"spec {spec_path}; checkpoints in {run_dir / 'checkpoints'}",
        ],
    }
