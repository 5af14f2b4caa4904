"""Chunked prefill: how long one long prompt holds back the streams that are already decoding.

Usage: ``python benchmarks/llm_long_prompt.py [--quick] [--prompt 3072] [--streams 8] [--rounds 3]``

One model (a random-init Llama: hidden 256, 4 layers, 8 heads / 4 KV heads, 4K context; fp32 on the CPU
with one torch thread) and gpuyard's engine run two ways, in turn, on the same work:

- ``chunked``: the engine as shipped, a prompt over ``PREFILL_CHUNK`` (512) tokens is prefilled one chunk
  per engine iteration, each chunk followed by a decoding step of the running batch;
- ``whole``: the same engine with chunking off (the whole prompt prefilled in one iteration, as the engine
  did before chunked prefill, and as a continuous-batching server without it does).

``--streams`` greedy requests (16-token prompts) decode; once every one of them has its first token, one
request with a ``--prompt``-token prompt joins. From the engine's own metrics hooks: the longest gap
between two tokens of a running stream from the moment the long request is submitted until it has its
second token (``stall``), and the long request's time to first token (``ttft``). Each round runs both
ways; the best round of each counts (a shared machine's load varies between rounds).

Last line: ``llm_long_prompt: stall_ratio=<whole / chunked longest gap> ttft_ratio=<chunked / whole
long-request TTFT> chunked_stall_s=... whole_stall_s=... chunked_ttft_s=... whole_ttft_s=... prompt=N
streams=M``. ``stall_ratio`` above 1 is what chunking buys the running streams; ``ttft_ratio`` above 1 is
what it costs the long request (more iterations, each with a decoding step in between).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)

from benchmarks.llm_serve import build  # noqa: E402  (the same model, at 4K positions)


class _Hooks:
    """The engine's metrics hooks, keeping (time, inter-token gap) pairs."""

    def __init__(self) -> None:
        self.gaps: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def observe_itl(self, seconds: float) -> None:
        with self.lock:
            self.gaps.append((time.perf_counter(), seconds))

    def observe_ttft(self, seconds: float) -> None:
        pass

    def tokens(self, n: int) -> None:
        pass

    def set_queue(self, n: int) -> None:
        pass

    def set_batch(self, n: int) -> None:
        pass


def one(model: Any, tok: Any, chunked: bool, prompt: int, streams: int) -> tuple[float, float]:
    """(longest gap of a running stream while the long prompt joins, the long request's TTFT) in seconds."""
    from gpuyard.serve.llm.engine import PREFILL_CHUNK, Engine, Request, SamplingParams

    hooks = _Hooks()
    chunk = PREFILL_CHUNK if chunked else 1 << 30
    engine = Engine(model, tok, 4096, max_batch=streams + 1, max_queue=64, metrics=hooks, prefill_chunk=chunk)
    engine.scheduler.eos_id = -1
    rng = random.Random(7)
    try:
        running = [
            Request(
                [rng.randrange(3, tok.vocab_size) for _ in range(16)], SamplingParams(3000, 0), lambda e: None
            )
            for _ in range(streams)
        ]
        for r in running:
            engine.submit(r)
        deadline = time.monotonic() + 120
        while any(len(r.generated) < 2 for r in running):
            if time.monotonic() > deadline:
                raise RuntimeError("the streams did not start within 120 s")
            time.sleep(0.005)
        long = Request(
            [rng.randrange(3, tok.vocab_size) for _ in range(prompt)], SamplingParams(4, 0), lambda e: None
        )
        start = time.perf_counter()
        engine.submit(long)
        while len(long.generated) < 2:
            if time.monotonic() > deadline + 300:
                raise RuntimeError("the long request got no tokens within 300 s")
            time.sleep(0.002)
        end = time.perf_counter()
        assert long.first_token_at is not None
        with hooks.lock:
            stall = max((gap for at, gap in hooks.gaps if start <= at <= end), default=0.0)
        return stall, long.first_token_at - long.created
    finally:
        for r in running:
            engine.cancel(r)
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="A 1,536-token prompt, 4 streams, 1 round.")
    parser.add_argument("--prompt", type=int, default=3072)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CI: a 768-token prompt, 2 streams (no figure)")
    args = parser.parse_args()
    prompt, streams, rounds = (1536, 4, 1) if args.quick else (args.prompt, args.streams, args.rounds)
    if args.smoke:
        prompt, streams, rounds = 768, 2, 1  # over PREFILL_CHUNK: two chunks
    if not 1 <= prompt <= 4000 or streams < 1 or rounds < 1:
        parser.error("--prompt must be 1-4000 tokens (4K context), --streams and --rounds at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build(Path(tmp), context=4096)
        best: dict[bool, tuple[float, float]] = {}
        for r in range(rounds):
            for chunked in (True, False):
                stall, ttft = one(model, tok, chunked, prompt, streams)
                name = "chunked" if chunked else "whole"
                print(
                    f"round {r + 1} {name:>7}: longest gap of a running stream {stall:.3f} s, "
                    f"long TTFT {ttft:.3f} s"
                )
                old = best.get(chunked)
                best[chunked] = (min(stall, old[0]), min(ttft, old[1])) if old else (stall, ttft)
    (c_stall, c_ttft), (w_stall, w_ttft) = best[True], best[False]
    print(
        f"llm_long_prompt: stall_ratio={w_stall / c_stall:.2f} ttft_ratio={c_ttft / w_ttft:.2f} "
        f"chunked_stall_s={c_stall:.3f} whole_stall_s={w_stall:.3f} chunked_ttft_s={c_ttft:.3f} "
        f"whole_ttft_s={w_ttft:.3f} prompt={prompt} streams={streams}"
    )


if __name__ == "__main__":
    main()
