"""Run under torchrun with 2 ranks: each parallel strategy vs a single-process reference, and exact resume.

For each strategy (DDP, FSDP2, tensor parallel, pipeline GPipe, pipeline 1F1B) this trains with the
gpuyard Trainer on a 2-rank gloo mesh, gathers the full weights, and compares them with the same
model trained by a plain single-process loop on the same global batches; then it trains again, stops
after step 3 (a stop requested on rank 0 only, agreed by all ranks), resumes from the sharded
checkpoint in a fresh Trainer, and compares the final weights with the uninterrupted run. The
validation loss at the epoch end (pipeline: forward-only schedule) is compared with the reference too.
SGD with momentum: linear, so the comparison is not blurred by Adam's normalisation of tiny
gradients. Writes `<out>/rank<r>.json`; the pytest side asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from gpuyard.train import components as comp
from gpuyard.train import examples as ex
from gpuyard.train.spec import TrainSpec
from gpuyard.train.trainer import Trainer

SEED, LR, MOMENTUM, GLOBAL_BATCH = 5, 0.05, 0.9, 32

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"parallel": {"dp": 2}, "model": "mlp", "loss": "cross_entropy"},
    "fsdp": {"parallel": {"dp": 2, "data_parallel": "fsdp"}, "model": "mlp", "loss": "cross_entropy"},
    "tp": {"parallel": {"tp": 2}, "model": "transformer", "loss": "cross_entropy"},
    "pp_gpipe": {
        "parallel": {"pp": 2, "pp_schedule": "gpipe", "microbatches": 4},
        "model": "mlp",
        "loss": "cross_entropy",
    },
    "pp_1f1b": {
        "parallel": {"pp": 2, "pp_schedule": "1f1b", "microbatches": 4},
        "model": "mlp",
        "loss": "cross_entropy",
    },
    # 2-D: tensor parallel inside FSDP2 data parallel; needs 4 ranks (run by a separate launch).
    "fsdp_tp": {
        "parallel": {"dp": 2, "tp": 2, "data_parallel": "fsdp"},
        "model": "transformer",
        "loss": "cross_entropy",
        "world": 4,
    },
    # 2-D: pipeline stages, each replicated (DDP) or sharded (FSDP2) over its dp group; 4 ranks.
    "pp_ddp": {
        "parallel": {"pp": 2, "dp": 2, "pp_schedule": "gpipe", "microbatches": 4},
        "model": "mlp",
        "loss": "cross_entropy",
        "world": 4,
    },
    # Tensor parallel inside pipeline stages: the stage's blocks sharded over its tp group.
    "pp_tp": {
        "parallel": {"pp": 2, "tp": 2, "pp_schedule": "1f1b", "microbatches": 4},
        "model": "seq_transformer",
        "loss": "cross_entropy",
        "world": 4,
    },
    # 3-D: pp x dp x tp, FSDP2 over tensor-parallel stages; 8 ranks (about 40 s on 2 cores).
    "pp_dp_tp": {
        "parallel": {"pp": 2, "dp": 2, "tp": 2, "data_parallel": "fsdp", "microbatches": 4},
        "model": "seq_transformer",
        "loss": "cross_entropy",
        "world": 8,
    },
    "pp_fsdp": {
        "parallel": {"pp": 2, "dp": 2, "data_parallel": "fsdp", "pp_schedule": "1f1b", "microbatches": 4},
        "model": "mlp",
        "loss": "cross_entropy",
        "world": 4,
    },
}


def model_factory(kind: str) -> Any:
    if kind == "seq_transformer":  # [Embed, Block, Block, Head]: 2 stages of 2 layers
        return lambda: ex.SequentialTransformer(vocab=16, dim=16, heads=4, layers=2, seq_len=8)
    if kind == "transformer":
        return lambda: ex.TinyTransformer(vocab=16, dim=16, heads=4, layers=1, seq_len=8)
    return lambda: ex.mlp(in_features=16, hidden=32, out_features=4, layers=3)


def dataset(kind: str) -> Any:
    if kind in ("transformer", "seq_transformer"):
        return ex.token_data(n=192, seq_len=8, vocab=16, seed=1)
    return ex.classification_data(n=192, seed=1)


def spec_for(name: str, cfg: dict[str, Any], run_dir: Path) -> TrainSpec:
    dp = cfg["parallel"].get("dp", 1)
    return TrainSpec.model_validate(
        {
            "run_dir": str(run_dir),
            "seed": SEED,
            "epochs": 1,
            "loss": cfg["loss"],
            "data": {"batch_size": GLOBAL_BATCH // dp, "shuffle": False},
            "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
            "parallel": cfg["parallel"],
            "checkpoint": {"every_steps": 2, "at_epoch_end": False},
        }
    )


def reference(cfg: dict[str, Any], steps: int) -> tuple[dict[str, torch.Tensor], float]:
    """The same training, written by hand in one process over the same global batches."""
    torch.manual_seed(SEED)
    model = model_factory(cfg["model"])()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = dataset(cfg["model"]).tensors
    for step in range(steps):
        sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        comp.build_loss(cfg["loss"])(model(x[sl]), y[sl]).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        val_loss = float(comp.build_loss(cfg["loss"])(model(x), y))  # validation data = training data
    return {k: v.detach() for k, v in model.state_dict().items()}, val_loss


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}


def tp_sharded(trainer: Trainer) -> int:
    """Parameters of this rank split over the tp dimension (a DTensor with a Shard placement on tp)."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = trainer.ctx.mesh
    if mesh is None or trainer.ctx.layout.tp == 1:
        return 0
    count = 0
    for p in trainer.model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            tp_dim = p.device_mesh.mesh_dim_names.index("tp")
            count += isinstance(p.placements[tp_dim], Shard)
    return count


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference over the keys of `a` (a pipeline stage holds a subset of the model)."""
    missing = [k for k in a if k not in b]
    if missing:
        raise KeyError(f"not in the reference: {missing}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def train(name: str, cfg: dict[str, Any], run_dir: Path, stop_after: int | None = None) -> Trainer:
    spec = spec_for(name, cfg, run_dir)

    def stop(trainer: Trainer, event: str) -> None:
        if event == "step" and trainer.step == stop_after and trainer.ctx.rank == 0:
            trainer.request_stop()

    trainer = Trainer(
        spec,
        model=model_factory(cfg["model"]),
        train_data=dataset(cfg["model"]),
        val_data=dataset(cfg["model"]),
        callbacks=[stop] if stop_after else [],
    )
    trainer.fit()
    return trainer


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    only = os.environ.get("ONLY")
    for name, cfg in STRATEGIES.items():
        if (only and name != only) or cfg.get("world", 2) != int(os.environ["WORLD_SIZE"]):
            continue
        whole = train(name, cfg, out / name / "whole")
        whole_w = full_weights(whole)
        first = train(name, cfg, out / name / "stopped", stop_after=2)
        resumed = train(name, cfg, out / name / "stopped")
        ref_w, ref_val = reference(cfg, whole.step)
        results[name] = {
            "steps": whole.step,
            "vs_reference": max_diff(whole_w, ref_w),
            "val_loss_vs_reference": abs(whole.last_metrics["val_loss"] - ref_val),
            "stopped_at": first.step,
            "resumed_from": resumed.resumed_from.name if resumed.resumed_from else None,
            "resumed_steps": resumed.step,
            "resume_vs_whole": max_diff(full_weights(resumed), whole_w),
            "keys": len(whole_w),
            "stage": whole.ctx.coord("pp"),
            "dp_rank": whole.ctx.dp_rank,
            "tp_rank": whole.ctx.coord("tp"),
            "tp_sharded_params": tp_sharded(whole),
            "micro_batches_seen": whole.train_source.state_dict().get("batches_done"),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from gpuyard.exitcodes import exit_now

    main(Path(sys.argv[1]))
    exit_now(0)  # as gpuyard's own ranks end: without the interpreter's teardown of torch
