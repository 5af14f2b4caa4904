"""Language-model training throughput: gpuyard's trainer vs a Hugging Face Trainer script, same model
and data, one process each (this machine: 2 shared CPU cores; ``--nproc`` is not offered yet).

Usage: ``python benchmarks/llm_train.py [--quick] [--steps N]``

The model is a random-init Llama (hidden 256, 4 layers, 8 heads / 4 KV heads) over sequences of 256
tokens packed by ``gpuyard data tokenize`` from a generated corpus (byte-level BPE trained here).
gpuyard: ``gpuyard.train.hf:causal_lm`` + ``packed_batches`` + ``lm_loss`` through
:class:`gpuyard.train.trainer.Trainer` (jsonl tracking, no checkpoints). Hugging Face:
``transformers.Trainer`` on the same packed sequences (``input_ids``, ``position_ids``, labels
unshifted as transformers expects: the same counted tokens), AdamW, the same batch, learning rate and
steps, fp32, no evaluation or saving. Each side's best setting here is its default on the CPU
(fp32, no compile). Tokens/s is measured over the steps after the first two (warm-up), from each
side's own step timing. Last line: ``llm_train: vs_hf_trainer=<gpuyard/HF tokens/s> ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SEQ, BATCH, LR = 256, 8, 1e-3
CONFIG = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
}  # fmt: skip


def prepare(tmp: Path) -> tuple[str, Path]:
    os.environ["GPUYARD_HOME"] = str(tmp / "home")
    from gpuyard.data.text import ingest_text
    from gpuyard.data.tokens import load_tokenizer, tokenize, train_tokenizer

    words = "the a cat dog bird sat ran on under mat tree roof and then red blue green small big old"
    rng = random.Random(0)
    docs = [" ".join(rng.choice(words.split()) for _ in range(rng.randint(20, 300))) for _ in range(3000)]
    (tmp / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    tok = train_tokenizer(docs[:500], tmp / "tok", vocab_size=512)
    ref = tokenize(ingest_text(tmp / "c.jsonl", "bench").ref, tok, seq_len=SEQ).ref
    cfg = {**CONFIG, "vocab_size": load_tokenizer(tok).vocab_size}
    (tmp / "config.json").write_text(json.dumps(cfg))
    return ref, tmp / "config.json"


def run_gpuyard(ref: str, config: Path, steps: int, tmp: Path) -> float:
    from gpuyard.train.spec import parse_spec
    from gpuyard.train.trainer import Trainer

    spec = parse_spec({
        "name": "bench", "run_dir": str(tmp / "run"), "seed": 0,
        "model": {"entrypoint": "gpuyard.train.hf:causal_lm", "kwargs": {"config": str(config)}},
        "data": {"train": {"entrypoint": "gpuyard.data.tokens:packed_batches",
                           "kwargs": {"dataset": ref, "shuffle": False}}, "batch_size": BATCH},
        "loss": "gpuyard.train.hf:lm_loss", "optimizer": {"lr": LR}, "max_steps": steps,
        "tracking": "jsonl", "checkpoint": {"final": False, "at_epoch_end": False},
    })  # fmt: skip
    Trainer(spec).fit()
    rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    times = [r.get("metrics", r)["step_time"] for r in rows if "step_time" in r.get("metrics", r)][2:]
    return BATCH * SEQ * len(times) / sum(times)


def run_hf(ref: str, config: Path, steps: int, tmp: Path) -> float:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from gpuyard.data.dataset import open_dataset
    from gpuyard.train.hf import load_config

    arrays = open_dataset(ref).to_numpy(["input_ids", "position_ids", "labels"])
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

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.t)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config(config))
    args = TrainingArguments(
        output_dir=str(tmp / "hf"), per_device_train_batch_size=BATCH, learning_rate=LR, max_steps=steps,
        save_strategy="no", report_to=[], logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
        lr_scheduler_type="constant", seed=0, disable_tqdm=True,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=DS(), callbacks=[Timer()]).train()
    t = times[2:]
    return BATCH * SEQ * len(t) / sum(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    steps = 8 if args.quick else args.steps
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        ref, config = prepare(Path(tmp))
        results = []
        for side in ("gpuyard", "hf", "gpuyard", "hf"):  # alternated: the machine's load hits both alike
            run = run_gpuyard if side == "gpuyard" else run_hf
            tps = run(ref, config, steps, Path(tmp) / f"{side}{len(results)}")
            results.append((side, tps))
            print(f"{side:>8}: {tps:8.1f} tokens/s", flush=True)
    g = max(t for s, t in results if s == "gpuyard")
    h = max(t for s, t in results if s == "hf")
    print(
        f"llm_train: vs_hf_trainer={g / h:.2f} gpuyard_tok_s={g:.0f} hf_trainer_tok_s={h:.0f} "
        f"steps={steps} load1_at_start={load:.2f}"
    )


if __name__ == "__main__":
    main()
