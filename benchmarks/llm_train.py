"""Language-model training throughput: ``gpuyard train`` vs a Hugging Face ``Trainer`` script, the same
model, data, ranks and threads.

Usage: ``python benchmarks/llm_train.py [--quick] [--steps N] [--nproc N] [--threads T] [--rounds R]
[--precision bf16|fp32]``

The model is a random-init Llama (hidden 256, 4 layers, 8 heads / 4 KV heads) over sequences of 256
tokens packed by ``gpuyard data tokenize`` from a generated corpus (byte-level BPE trained here).
Each side runs as its users run it, in fresh processes: gpuyard as ``gpuyard train SPEC --nproc N``
(``gpuyard.train.hf:causal_lm`` + ``packed_batches`` + ``lm_loss``, jsonl tracking, no checkpoints);
Hugging Face as ``torchrun --nproc-per-node N`` of a ``transformers.Trainer`` script (its DDP through
accelerate) on the same packed sequences (``input_ids``, ``position_ids``, labels unshifted as
transformers expects: the same counted tokens). The same work on both sides:

- the same function: the Hugging Face model gets ``use_cache=False``. With the config's default
  (``use_cache=True``) the Llama forward builds a KV cache even in training, and transformers then skips
  its packed-sequence detection, so every token attends across document boundaries: a cheaper
  (``is_causal`` flash kernel, GQA without copies) but different model than the one gpuyard trains
  (checked: logits differ by ~1.6 on this data; with ``use_cache=False`` they are equal);
- AdamW (fused on both), learning rate 1e-3 constant, no weight decay, gradients clipped at norm 1.0
  (``transformers``' default ``max_grad_norm``; gpuyard's ``clip_grad_norm: 1.0``), the same precision
  (default bf16 autocast, fp32 weights: ``bf16=True`` in the Trainer, ``precision: bf16`` in gpuyard;
  Hugging Face's documented setting for CPUs with AMX, as this one has, and ~1.7x fp32 here), batch 8 per
  rank, no gradient accumulation, ``OMP_NUM_THREADS`` = threads per rank on both, each side's logging
  at every step (gpuyard's metrics line; the Trainer's timing callback), no evaluation or saving.

Both sides are timed the same way: a step-end callback on rank 0 (gpuyard: a trainer callback,
``step_clock`` below; Hugging Face: ``TrainerCallback.on_step_end``) notes the wall clock and the
process's CPU time; tokens/s is all ranks' tokens from the end of step 2 (warm-up) to the end of the
last step over that wall time, so batch loading and every per-step cost count. Tokens per CPU-second
of rank 0 is the same work over CPU time, which the load of a shared machine disturbs less (it still
counts time lost to cache contention and spinning threads). Rounds alternate the sides. Last line:
``llm_train: vs_hf_trainer=<gpuyard/HF tokens/s, best vs best> median_ratio=<x> cpu_ratio=<x> ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SEQ, BATCH, LR = 256, 8, 1e-3
WARMUP = 2
CONFIG = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
}  # fmt: skip


def prepare(tmp: Path) -> tuple[str, Path]:
    os.environ["GPUYARD_HOME"] = str(tmp / "home")
    from gpuyard.data.text import ingest_text
    from gpuyard.data.tokenizer_train import train_tokenizer
    from gpuyard.data.tokens import load_tokenizer, tokenize

    words = "the a cat dog bird sat ran on under mat tree roof and then red blue green small big old"
    rng = random.Random(0)
    docs = [" ".join(rng.choice(words.split()) for _ in range(rng.randint(20, 300))) for _ in range(3000)]
    (tmp / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    tok = train_tokenizer(docs[:500], tmp / "tok", vocab_size=512)
    ref = tokenize(ingest_text(tmp / "c.jsonl", "bench").ref, tok, seq_len=SEQ).ref
    cfg = {**CONFIG, "vocab_size": load_tokenizer(tok).vocab_size}
    (tmp / "config.json").write_text(json.dumps(cfg))
    return ref, tmp / "config.json"


def _env(threads: int) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}


def _rates(clock: list[list[float]], ranks: int) -> tuple[float, float]:
    """(tokens/s over all ranks, tokens per CPU-second of rank 0) from rank 0's step-end clock
    (wall, process CPU) readings, the first WARMUP steps left out."""
    (w0, c0), (w1, c1) = clock[WARMUP - 1], clock[-1]
    steps = len(clock) - WARMUP
    return BATCH * SEQ * ranks * steps / (w1 - w0), BATCH * SEQ * steps / (c1 - c0)


def step_clock(trainer: Any, event: str) -> None:
    """gpuyard side: a trainer callback noting (wall, process CPU) time at each step's end; rank 0
    writes them at the end (what the Hugging Face side's TrainerCallback does)."""
    import time

    clock = trainer.__dict__.setdefault("_bench_clock", [])
    if event == "step":
        clock.append([time.time(), time.process_time()])
    elif event == "end" and trainer.ctx.rank == 0:
        (trainer.run_dir / "clock.json").write_text(json.dumps(clock))


def run_gpuyard(
    ref: str, config: Path, steps: int, nproc: int, threads: int, precision: str, out: Path
) -> tuple[float, float]:
    import yaml

    out.mkdir(parents=True)
    spec = {
        "name": "bench", "run_dir": str(out / "run"), "seed": 0,
        "model": {"entrypoint": "gpuyard.train.hf:causal_lm", "kwargs": {"config": str(config)}},
        "data": {"train": {"entrypoint": "gpuyard.data.tokens:packed_batches",
                           "kwargs": {"dataset": ref, "shuffle": False}}, "batch_size": BATCH},
        "loss": "gpuyard.train.hf:lm_loss", "optimizer": {"lr": LR}, "clip_grad_norm": 1.0,
        "max_steps": steps, "tracking": "jsonl", "callbacks": ["llm_train:step_clock"],
        "checkpoint": {"final": False, "at_epoch_end": False}, "precision": precision,
    }  # fmt: skip
    (out / "spec.yaml").write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "gpuyard.cli.main", "train", str(out / "spec.yaml"), "--nproc", str(nproc)]
    proc = subprocess.run(cmd, env=_env(threads), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"gpuyard train failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return _rates(json.loads((out / "run" / "clock.json").read_text()), nproc)


def run_hf(
    ref: str, config: Path, steps: int, nproc: int, threads: int, precision: str, out: Path
) -> tuple[float, float]:
    out.mkdir(parents=True)
    job = {"ref": ref, "config": str(config), "steps": steps, "out": str(out), "bf16": precision == "bf16"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        __file__, "--hf-worker", json.dumps(job),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(threads), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"Hugging Face Trainer failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return _rates(json.loads((out / "clock.json").read_text()), nproc)


def hf_worker(job: dict[str, Any]) -> None:
    """One rank of the Hugging Face side (run by torchrun)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from gpuyard.data.dataset import open_dataset
    from gpuyard.train.hf import load_config

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    arrays = open_dataset(job["ref"]).to_numpy(["input_ids", "position_ids", "labels"])
    ids, pos = arrays["input_ids"], arrays["position_ids"]
    # transformers shifts labels itself: labels = the input tokens, -100 where gpuyard ignores the
    # prediction made one position earlier (the same counted tokens).
    labels = ids.astype("int64").copy()
    labels[:, 1:][arrays["labels"][:, :-1] == -100] = -100
    labels[:, 0] = -100

    class DS(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {
                "input_ids": torch.as_tensor(ids[i]).long(),
                "position_ids": torch.as_tensor(pos[i]).long(),
                "labels": torch.as_tensor(labels[i]),
            }

    clock: list[list[float]] = []

    class Timer(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.append([time.time(), time.process_time()])

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config(job["config"]))
    model.config.use_cache = False  # packed sequences: see the module docstring
    args = TrainingArguments(
        output_dir=str(Path(job["out"]) / "hf"), per_device_train_batch_size=BATCH, learning_rate=LR,
        max_steps=job["steps"], save_strategy="no", report_to=[], logging_strategy="no", use_cpu=True,
        dataloader_num_workers=0, lr_scheduler_type="constant", seed=0, disable_tqdm=True, bf16=job["bf16"],
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=DS(), callbacks=[Timer()]).train()
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(job["out"]) / "clock.json").write_text(json.dumps(clock))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="12 steps, one round")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=1, help="ranks per side (DDP)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / nproc)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per side, alternated")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--hf-worker", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="CI: 3 steps, one round, fp32 (no figure)")
    args = ap.parse_args()
    if args.hf_worker:
        hf_worker(json.loads(args.hf_worker))
        return
    steps, rounds = (12, 1) if args.quick else (args.steps, args.rounds)
    if args.smoke:  # fp32: bf16 autocast on a CPU without AMX took 5 min for 5 steps a side at load 4
        steps, rounds, args.precision = WARMUP + 1, 1, "fp32"
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    load = os.getloadavg()[0]
    results: dict[str, list[float]] = {"gpuyard": [], "hf": []}
    per_cpu: dict[str, list[float]] = {"gpuyard": [], "hf": []}
    with tempfile.TemporaryDirectory() as tmp:
        ref, config = prepare(Path(tmp))
        for r in range(rounds):
            order = ("gpuyard", "hf") if r % 2 == 0 else ("hf", "gpuyard")
            for side in order:
                run = run_gpuyard if side == "gpuyard" else run_hf
                out = Path(tmp) / f"{side}{r}"
                tps, tpc = run(ref, config, steps, args.nproc, threads, args.precision, out)
                results[side].append(tps)
                per_cpu[side].append(tpc)
                now = os.getloadavg()[0]
                print(
                    f"{side:>8}: {tps:8.1f} tokens/s, {tpc:8.1f} tokens per CPU-second of rank 0 "
                    f"(round {r + 1}, load {now:.1f})",
                    flush=True,
                )
    g, h = results["gpuyard"], results["hf"]
    ratios = [a / b for a, b in zip(g, h, strict=True)]
    cpu = max(per_cpu["gpuyard"]) / max(per_cpu["hf"])
    print(
        f"llm_train: vs_hf_trainer={max(g) / max(h):.2f} median_ratio={statistics.median(ratios):.2f} "
        f"cpu_ratio={cpu:.2f} "
        f"ratio_range={min(ratios):.2f}-{max(ratios):.2f} gpuyard_tok_s={max(g):.0f} "
        f"hf_trainer_tok_s={max(h):.0f} nproc={args.nproc} threads={threads} precision={args.precision} "
        f"steps={steps} "
        f"rounds={rounds} load1_at_start={load:.2f}"
    )


if __name__ == "__main__":
    main()
