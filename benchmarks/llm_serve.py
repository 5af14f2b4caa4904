"""Language-model serving: gpuyard's continuous-batching engine vs transformers generate() served one
request at a time and vs a static-batch generate() server.

Usage: ``python benchmarks/llm_serve.py [--quick] [--clients 1,8,32] [--requests-per-client 3] [--rounds 1]``

One model for all three: a random-init Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, vocab from
a byte-level BPE trained here), fp32 on the CPU with one torch thread (2 shared cores). Closed-loop
clients: each sends its next request when the previous one is answered; requests have prompts of
8-64 tokens and ``max_tokens`` of 16-128 (seeded, the same list for every server), greedy decoding,
no end-of-sequence stop, so every server generates exactly the same number of tokens.

- ``sequential``: one worker thread, ``model.generate()`` per request, in arrival order;
- ``static``: one worker thread takes every waiting request (up to the batch size), left-pads the
  prompts and runs one ``generate()`` for the longest ``max_tokens`` of the batch; each request is
  answered when its batch is done (its extra tokens are discarded and not counted);
- ``gpuyard``: :class:`gpuyard.serve.llm.engine.Engine` (continuous batching, module docstring there).

Measured in-process (no HTTP, the same for all three): output tokens/s (tokens asked for, over the
wall time of the level) and p99 time to first token. The baselines return whole answers, so their
first token arrives with the last (what a client of a non-streaming server sees); gpuyard's is when
the engine samples the request's first token (its ``time_to_first_token`` metric; the random model's
text is mostly stray UTF-8 bytes, which the server holds back up to 16 tokens before streaming them).
With ``--rounds N`` each level runs N times (the three servers in turn each
round) and each server's best round counts: on a shared machine the load varies between rounds (each
round's ratios are printed too, and the last line has their median). Each level also counts the
process's CPU time: tokens per CPU-second (``_cpu`` ratios, medians over rounds) is what a server
does with the CPU it gets, which the other work on a shared machine changes far less than the wall
time. Last line: ratios at the largest client count, and at 1 client gpuyard over the plain
``generate()`` loop (``single_vs_generate``: the engine's per-token overhead, no batching to gain from).
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "bird",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "tree",
    "roof",
    "and",
    "then",
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "house",
]


def build(tmp: Path, context: int = 512) -> tuple[Any, Any]:
    """The benchmark's random-init Llama and a byte-level BPE trained here (``context`` positions)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gpuyard.data.tokens import load_tokenizer, train_tokenizer

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(500)]
    tok = load_tokenizer(train_tokenizer(texts, tmp / "tok", vocab_size=512))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=context,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg).eval(), tok


def workload(tok: Any, n: int, seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(8, 64)
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(plen)]
        out.append((ids, rng.randint(16, 128)))
    return out


class Sequential:
    def __init__(self, model: Any, batch: int) -> None:
        self.model, self.batch = model, batch
        self.q: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self.loop, daemon=True).start()

    def submit(self, ids: list[int], n: int, done: Any) -> None:
        self.q.put((ids, n, done))

    def take(self) -> list[Any]:
        return [self.q.get()]

    def loop(self) -> None:
        while True:
            group = self.take()
            width = max(len(g[0]) for g in group)
            ids = torch.tensor([[0] * (width - len(g[0])) + g[0] for g in group])
            mask = torch.tensor([[0] * (width - len(g[0])) + [1] * len(g[0]) for g in group])
            longest = max(g[1] for g in group)
            with torch.inference_mode():
                self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip
            for g in group:
                g[2]()


class Static(Sequential):
    def take(self) -> list[Any]:
        group = [self.q.get()]
        while len(group) < self.batch:
            try:
                group.append(self.q.get_nowait())
            except queue.Empty:
                break
        return group


class Gpuyard:
    def __init__(self, model: Any, tok: Any, batch: int) -> None:
        from gpuyard.serve.llm.engine import Engine

        tok.eos_id = -1  # never stop early: every server generates the tokens asked for
        self.engine = Engine(model, tok, 512, max_batch=batch, max_queue=10_000)

    def submit(self, ids: list[int], n: int, done: Any, first: Any) -> None:
        from gpuyard.serve.llm.engine import Request, SamplingParams

        def emit(ev: dict[str, Any]) -> None:
            if "done" in ev:
                assert req.first_token_at is not None
                first(req.first_token_at - req.created)
                done()

        req = Request(ids, SamplingParams(max_tokens=n, temperature=0), emit)
        self.engine.submit(req)


def run_level(
    server: Any, work: list[tuple[list[int], int]], clients: int, streaming: bool
) -> dict[str, float]:
    per = len(work) // clients
    ttfts: list[float] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for ids, n in work[k * per : (k + 1) * per]:
            ev = threading.Event()
            start = time.perf_counter()
            got: dict[str, float] = {}

            def first(seconds: float, got: dict[str, float] = got) -> None:
                got.setdefault("t", seconds)

            if streaming:
                server.submit(ids, n, ev.set, first)
            else:
                server.submit(ids, n, ev.set)
            ev.wait()
            with lock:
                ttfts.append(got.get("t", time.perf_counter() - start))

    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(n for _, n in work[: per * clients])
    ttfts.sort()
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    return {
        "tok_s": tokens / wall, "cpu_tok_s": tokens / max(cpu, 1e-9), "ttft_p99_ms": 1000 * p99,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument(
        "--rounds", type=int, default=1, help="runs of each level; the best of each server counts"
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    rpc = 1 if args.quick else args.requests_per_client
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build(Path(tmp))
        batch = max(levels)
        servers = {
            "sequential": Sequential(model, 1),
            "static": Static(model, batch),
            "gpuyard": Gpuyard(model, tok, batch),
        }
        results: dict[str, dict[int, dict[str, float]]] = {k: {} for k in servers}
        rounds: dict[int, list[dict[str, float]]] = {}  # per level, each round's ratios (same load)
        for clients in levels:
            work = workload(tok, clients * rpc, seed=clients)
            for _ in range(args.rounds):
                this: dict[str, float] = {}
                cpu_this: dict[str, float] = {}
                for name, server in servers.items():  # in turn, level by level: the load hits all alike
                    if name == "sequential" and clients > 8 and args.quick:
                        continue
                    r = run_level(server, work, clients, name == "gpuyard")
                    this[name], cpu_this[name] = r["tok_s"], r["cpu_tok_s"]
                    best = results[name].get(clients)
                    if best is None or r["tok_s"] > best["tok_s"]:
                        results[name][clients] = r
                    line = f"{name:>10} clients={clients:>2}: {r['tok_s']:8.1f} tok/s"
                    line += f" ({r['cpu_tok_s']:6.1f}/cpu-s)"
                    print(
                        f"{line}  ttft p50 {r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms",
                        flush=True,
                    )
                ratios = {k: this["gpuyard"] / v for k, v in this.items() if k != "gpuyard"}
                ratios.update(
                    {f"{k}_cpu": cpu_this["gpuyard"] / v for k, v in cpu_this.items() if k != "gpuyard"}
                )
                rounds.setdefault(clients, []).append(ratios)
                print(
                    "     round: " + " ".join(f"gpuyard/{k}={v:.2f}" for k, v in ratios.items()), flush=True
                )
    top = max(levels)
    g, s, st = results["gpuyard"][top], results["sequential"].get(top), results["static"][top]
    vs_seq = g["tok_s"] / s["tok_s"] if s else float("nan")
    one = results["sequential"].get(1)
    single = results["gpuyard"][1]["tok_s"] / one["tok_s"] if one else float("nan")
    single_cpu = statistics.median(r.get("sequential_cpu", math.nan) for r in rounds.get(1, [{}]))
    print(
        f"llm_serve: vs_sequential={vs_seq:.2f} vs_static_batch={g['tok_s'] / st['tok_s']:.2f} "
        f"ttft_p99_ms={g['ttft_p99_ms']:.0f} clients={top} gpuyard_tok_s={g['tok_s']:.1f} "
        f"static_tok_s={st['tok_s']:.1f} sequential_tok_s={s['tok_s'] if s else float('nan'):.1f} "
        f"static_ttft_p99_ms={st['ttft_p99_ms']:.0f} single_vs_generate={single:.2f} "
        f"vs_static_batch_round_median={statistics.median(r['static'] for r in rounds[top]):.2f} "
        f"vs_static_batch_cpu={statistics.median(r['static_cpu'] for r in rounds[top]):.2f} "
        f"single_vs_generate_cpu={single_cpu:.2f} "
        f"load1_at_start={load:.2f} load1_at_end={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
