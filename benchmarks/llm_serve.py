"""Language-model serving: gpuyard's continuous-batching engine vs transformers' own continuous batching,
a static-batch generate() server with a gather window, and generate() served one request at a time.

Usage: ``python benchmarks/llm_serve.py [--quick] [--clients 1,8,32] [--requests-per-client 3] [--rounds 1]``

One model for all three: a random-init Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, vocab from
a byte-level BPE trained here), fp32 on the CPU with one torch thread (2 shared cores). Closed-loop
clients: each sends its next request when the previous one is answered; requests have prompts of
8-64 tokens and ``max_tokens`` of 16-128 (seeded, the same list for every server), greedy decoding,
no end-of-sequence stop, so every server generates exactly the same number of tokens.

- ``sequential``: one worker thread, ``model.generate()`` per request, in arrival order;
- ``static``: one worker thread takes the first waiting request, then gathers more for up to
  ``--gather-ms`` (20 ms; until 2026-11-29 it took only those already waiting), up to the batch size,
  left-pads the prompts and runs one ``generate()`` for the longest ``max_tokens`` of the batch; each
  request is answered when its batch is done (its extra tokens are discarded and not counted);
- ``hf_continuous`` (the competent baseline, transformers' own continuous batching):
  ``model.init_continuous_batching()``'s ``ContinuousBatchingManager`` (paged KV cache, requests join
  and leave between steps), one manager kept running, requests added as they arrive; its cache is
  sized for the work (pages of 64 tokens, 4 per request slot: its default sizes the cache from free
  memory, which on this CPU made every step 7x slower), at most 512 tokens per step (gpuyard's
  prefill chunk) and the batch size as the requests per step; TTFT from its per-token timestamps;
- ``gpuyard``: :class:`gpuyard.serve.llm.engine.Engine` (continuous batching, module docstring there);
- ``ct2_int8``, ``ct2_fp32`` (where ``ctranslate2`` is importable; else one line says they are
  skipped): CTranslate2's ``Generator`` on the same model converted by its transformers converter,
  int8 (its documented CPU configuration) and float32 (the others' precision), one intra-op and one
  inter-op thread; a batch per ``generate_batch`` call, gathered for the same window as ``static``
  (it has no continuous batching), each request ending at its own token count (:class:`CT2`).
  Its float32 greedy tokens equal transformers' ``generate()`` on this model (checked by hand,
  2026-11-29). The last line's ``single_vs_ct2`` / ``vs_ct2`` take the faster configuration.

What is equal: the same model object (ct2: its conversion), tokens, requests, greedy decoding, batch
size and one compute thread; every server generates exactly the tokens asked for; the servers take
turns level by level, the order rotated each round.

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
``generate()`` loop (``single_vs_generate``: the engine's per-token overhead, no batching to gain from),
and ``single_vs_ct2_int8_cpu`` / ``single_vs_ct2_fp32_cpu`` (gpuyard over CTranslate2 per CPU-second at
one client, medians over rounds). ``--only ct2_int8,ct2_fp32`` runs gpuyard and just those (the
others' figures are nan): e.g. ``--clients 1 --requests-per-client 3 --rounds 2 --only
ct2_int8,ct2_fp32`` is the one-client comparison with CTranslate2 alone.

``--sides gpuyard,vllm,own`` measures over HTTP instead, the same model saved as a Hugging Face folder:
``gpuyard`` is `gpuyard serve --engine vllm` (one vLLM replica behind gpuyard's gateway: key check,
validation, routing, relay), ``vllm`` the same vLLM server started directly (the arguments the gateway
gives its replicas), ``own`` `gpuyard serve --engine gpuyard`. All sides are up at once and each level
runs on each side in turn; closed-loop streaming clients (httpx), 64 greedy tokens per request (every
stop token biased away), output tokens from each answer's usage; time to first token and the p99 gap
between streamed chunks per side; every level quiet, then again beside three busy processes per core.
Last line: ``vs_vllm_direct`` (gateway / direct output tok/s at 32 clients, quiet) and
``contended_vs_vllm`` (the same ratio beside the busy processes). With ``--rounds N`` the whole
quiet-then-busy sequence runs N times, the order of the sides reversed every other round; each ratio
is then the median of the N rounds' paired ratios (side and vLLM direct in the same round), with its
``_min`` and ``_max``, and each figure the median of its N runs. Side ``gpuyard_base`` with
``--baseline-src OTHER/src`` runs another checkout's gateway in the same run (a change's before and
after, side by side): ``base_vs_vllm_direct`` and ``base_contended_vs_vllm`` on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
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

    from gpuyard.data.tokenizer_train import train_tokenizer
    from gpuyard.data.tokens import load_tokenizer

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


class StaticWindow(Sequential):
    """Static batching with a gather window: after the first request, wait up to ``window`` seconds
    for more (up to the batch size) before running the batch."""

    def __init__(self, model: Any, batch: int, window: float) -> None:
        self.window = window
        super().__init__(model, batch)

    def take(self) -> list[Any]:
        group = [self.q.get()]
        deadline = time.monotonic() + self.window
        while len(group) < self.batch:
            left = deadline - time.monotonic()
            try:
                group.append(self.q.get(timeout=left) if left > 0 else self.q.get_nowait())
            except queue.Empty:
                break
        return group


class HFContinuous:
    """transformers' continuous batching (``ContinuousBatchingManager``), fed requests as they arrive;
    one thread routes finished results to their clients."""

    def __init__(self, model: Any, batch: int) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=128)
        cfg = ContinuousBatchingConfig(
            page_size=64, num_blocks=4 * batch + 16, max_batch_tokens=512, max_requests_per_batch=batch
        )
        self.mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
        self.mgr.start()
        self.waiting: dict[str, tuple[Any, Any]] = {}
        self.lock = threading.Lock()
        self.count = 0
        threading.Thread(target=self.route, daemon=True).start()

    def submit(self, ids: list[int], n: int, done: Any, first: Any) -> None:
        with self.lock:
            self.count += 1
            rid = f"r{self.count}"
            self.waiting[rid] = (done, first)
        self.mgr.add_request(ids, request_id=rid, max_new_tokens=n, record_timestamps=True)

    def close(self) -> None:
        """Stop the manager's generation thread (not a daemon: the process would not exit)."""
        self.mgr.stop(block=True, timeout=30)

    def route(self) -> None:
        while True:
            result = self.mgr.get_result(timeout=0.5)
            if result is None or not result.is_finished():
                continue
            assert len(result.generated_tokens) > 0
            with self.lock:
                done, first = self.waiting.pop(result.request_id)
            first(result.timestamps[0] - result.created_time)
            done()


IN_PROCESS = ("sequential", "static", "hf_continuous", "gpuyard", "ct2_int8", "ct2_fp32")
STREAMING = ("gpuyard", "hf_continuous", "ct2_int8", "ct2_fp32")  # report their first token's time


class Gpuyard:
    def __init__(self, model: Any, tok: Any, batch: int) -> None:
        from gpuyard.serve.llm.engine import Engine

        tok.eos_id = -1  # never stop early: every server generates the tokens asked for
        self.engine = Engine(model, tok, 512, max_batch=batch, max_queue=10_000)

    def submit(self, ids: list[int], n: int, done: Any, first: Any) -> None:
        from gpuyard.serve.llm.scheduler import Event, Finished, Request, SamplingParams

        def emit(ev: Event) -> None:
            if isinstance(ev, Finished):
                assert req.first_token_at is not None
                first(req.first_token_at - req.created)
                done()

        req = Request(ids, SamplingParams(max_tokens=n, temperature=0), emit)
        self.engine.submit(req)


class CT2(StaticWindow):
    """CTranslate2's ``Generator`` (its own C++ runtime) on the same model, converted offline by its
    transformers converter (``compute_type`` int8, its documented CPU configuration, or float32, the
    same precision as the others), one intra-op and one inter-op thread (as torch's one thread here).
    CTranslate2 has no continuous batching: its way to serve many clients is a batch per
    ``generate_batch`` call, so one worker thread gathers waiting requests for up to ``window``
    seconds (up to the batch size) and runs them as one batch, the prompt forwarded at once
    (``include_prompt_in_result=False``, its faster mode); each request stops at its own token count
    (the per-token callback ends it; no end token stops it early) and is answered then; its first
    token's time comes from that callback too."""

    def __init__(self, folder: Path, batch: int, window: float, compute_type: str) -> None:
        import json

        import ctranslate2

        self.gen = ctranslate2.Generator(
            str(folder), device="cpu", compute_type=compute_type, inter_threads=1, intra_threads=1
        )
        self.itos = json.loads((folder / "vocabulary.json").read_text())
        super().__init__(None, batch, window)  # the queue, the gather window, the worker thread

    def submit(self, ids: list[int], n: int, done: Any, first: Any = None) -> None:
        self.q.put(([self.itos[i] for i in ids], n, done, first, time.perf_counter()))

    def loop(self) -> None:
        while True:
            group = self.take()
            made = [0] * len(group)

            def step(res: Any, group: list[Any] = group, made: list[int] = made) -> bool:
                k = res.batch_id
                made[k] += 1
                if made[k] == 1:
                    group[k][3](time.perf_counter() - group[k][4])
                if made[k] == group[k][1]:
                    group[k][2]()
                    return True  # this request has its tokens: its decoding stops here
                return False

            longest = max(g[1] for g in group)
            self.gen.generate_batch(
                [g[0] for g in group], max_length=longest, min_length=longest, end_token=[],
                include_prompt_in_result=False, sampling_topk=1, callback=step,
            )  # fmt: skip
            assert made == [g[1] for g in group], (made, [g[1] for g in group])


def ct2_servers(model: Any, tok_folder: Path, tmp: Path, batch: int, window: float) -> dict[str, Any]:
    """``ct2_int8`` and ``ct2_fp32`` on the benchmark's model (converted here), or none, said in one
    line, when ctranslate2 is not importable (it is no dependency of gpuyard: ``pip install ctranslate2``)."""
    import json

    try:
        from ctranslate2.converters import TransformersConverter
    except ImportError as exc:
        print(f"ct2: skipped (ctranslate2 not importable: {exc})", flush=True)
        return {}
    from gpuyard.train.hf import CausalLM, save_hf

    folder = save_hf(CausalLM(model), None, tmp / "hf", tok_folder)
    out = {}
    for compute in ("int8", "float32"):
        converted = tmp / f"ct2-{compute}"
        TransformersConverter(str(folder)).convert(str(converted), quantization=compute)
        config = json.loads((converted / "config.json").read_text())
        if config.get("bos_token") is None:  # this tokenizer has none; the Generator refuses a null
            config["bos_token"] = config["eos_token"]  # (never used: prompts are given whole)
            (converted / "config.json").write_text(json.dumps(config))
        out["ct2_int8" if compute == "int8" else "ct2_fp32"] = CT2(converted, batch, window, compute)
    return out


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


# ----- over HTTP: the deployment through gpuyard's gateway, vLLM directly, gpuyard's own engine ------
HTTP_KEY = "gyk_llm-serve-benchmark-key-0123456789"
HTTP_TOKENS = 64  # greedy tokens per request (every stop token biased away: each side makes all of them)


def _serve_side(
    side: str, folder: Path, port: int, batch: int, log: Path, base_src: str = ""
) -> tuple[Any, str, str]:
    """Start one side; (handle with .stop(), base URL, key). ``vllm``: vLLM's own server, started as the
    gateway starts its replicas; ``gpuyard``/``own``: `gpuyard serve --engine vllm`/`gpuyard`;
    ``gpuyard_base``: `gpuyard serve --engine vllm` of the checkout at ``base_src`` (--baseline-src)."""
    import subprocess

    from gpuyard.serve.llm import vllm_engine

    if side == "vllm":
        cfg = vllm_engine.VllmConfig(
            folder=vllm_engine.served_folder(folder, log.parent / f"served-{port}"),
            name="bench",
            context=vllm_engine.context_length(folder),
            max_batch=batch,
            logs=log.parent,
        )
        rep = vllm_engine.Replica(0, port)
        vllm_engine.start(cfg, rep)
        vllm_engine.wait_ready(rep, "bench", 1800)
        return rep, rep.url, rep.key
    engine = "gpuyard" if side == "own" else "vllm"
    env = {**os.environ, "GPUYARD_HOME": str(log.parent)}
    if side == "gpuyard_base":
        env["PYTHONPATH"] = base_src
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuyard.cli.main",
            "serve",
            str(folder),
            "--engine",
            engine,
            "--device",
            "cpu",
            "--port",
            str(port),
            "--max-batch",
            str(batch),
            "--api-key",
            HTTP_KEY,
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    import httpx

    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"llm_serve: the {side} server exited with {proc.returncode}: {log.read_text()[-800:]}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # a server process: its readiness can only be polled

    class Proc:
        def stop(self) -> None:
            proc.terminate()
            proc.wait(120)

    return Proc(), f"http://127.0.0.1:{port}", HTTP_KEY


async def _http_level(
    url: str, key: str, name: str, work: list[tuple[list[int], int]], clients: int, bias: dict[str, int]
) -> dict[str, float]:
    """Closed-loop streaming clients; output tok/s (from each answer's usage), TTFT and inter-chunk p99."""
    import json

    import httpx

    ttft: list[float] = []
    gaps: list[float] = []
    failed: list[str] = []  # one line per request that got no answer (its tokens count as none)
    tokens = 0
    it = iter(work)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:

        async def client() -> None:
            nonlocal tokens
            for ids, _ in it:
                body = {
                    "model": name,
                    "prompt": ids,
                    "max_tokens": HTTP_TOKENS,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "logit_bias": bias,
                }
                t0 = time.perf_counter()
                last = None
                headers = {"Authorization": f"Bearer {key}"}
                try:
                    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
                        if r.status_code != 200:
                            failed.append(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                            continue
                        async for line in r.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            ev = json.loads(line[6:])
                            now = time.perf_counter()
                            if ev.get("choices") and ev["choices"][0].get("text"):
                                if last is None:
                                    ttft.append(now - t0)
                                else:
                                    gaps.append(now - last)
                                last = now
                            if ev.get("usage"):
                                tokens += int(ev["usage"]["completion_tokens"])
                except httpx.HTTPError as e:  # counted and shown, not a crash of the whole run
                    failed.append(f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    p99 = lambda xs: sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] * 1000 if xs else math.nan  # noqa: E731
    if failed:
        print(f"{url}: {len(failed)} of {len(work)} requests failed, the first: {failed[0]}", flush=True)
    return {"tok_s": tokens / wall, "ttft_p99_ms": p99(ttft), "itl_p99_ms": p99(gaps), "errors": len(failed)}


def _show_logs(side: str, tmp: Path) -> None:
    """The last lines of a side's logs (after a level with failed requests)."""
    pattern = "vllm-replica-*.log" if side == "vllm" else f"{side}.log"
    for log in sorted(tmp.glob(pattern)) + sorted((tmp / "logs").glob("*.log") if side != "vllm" else []):
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"{side}: {log.name}, last lines:", *tail, sep="\n  ", flush=True)


def http_main(args: Any) -> None:
    """``--sides``: every side started on the same model, each level run on each side in turn, quiet and
    then beside three busy processes per core; last line the gateway's cost against vLLM direct."""
    import subprocess

    from gpuyard.serve.llm.engine import stop_token_ids
    from gpuyard.train.hf import CausalLM, save_hf

    sides = args.sides.split(",")
    levels = [int(x) for x in args.clients.split(",")]
    rpc = 1 if args.quick else args.requests_per_client
    busy_n = 3 * (os.cpu_count() or 1)
    load = os.getloadavg()[0]
    res: dict[tuple[str, str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, _tok = build(Path(tmp))
        folder = save_hf(CausalLM(model), None, Path(tmp) / "model", Path(tmp) / "tok")
        bias = {str(i): -100 for i in stop_token_ids(folder)}
        from gpuyard.data.tokens import load_tokenizer

        tok = load_tokenizer(folder)
        # Every side up at once, then each level run on each side in turn: the machine's other load
        # falls on all sides alike (it changes by the minute on a shared machine).
        up: dict[str, tuple[Any, str, str]] = {}
        try:
            # Started at once (vLLM takes minutes to start on a busy CPU); the direct vLLM side from this
            # thread, which its parent-death signal is tied to.
            from concurrent.futures import ThreadPoolExecutor

            def start(side: str) -> tuple[Any, str, str]:
                port = 20000 + random.randrange(20000)
                log = Path(tmp) / f"{side}.log"
                return _serve_side(side, folder, port, max(levels), log, args.baseline_src)

            with ThreadPoolExecutor(len(sides)) as pool:
                starting = {side: pool.submit(start, side) for side in sides if side != "vllm"}
                if "vllm" in sides:
                    up["vllm"] = start("vllm")
                up |= {side: fut.result() for side, fut in starting.items()}
            for rnd in range(args.rounds):
                # The order of the sides alternates round to round, so that neither always runs first
                # (a level right after another one's meets a warmer cache and a different load).
                order = sides if rnd % 2 == 0 else sides[::-1]
                for busy in (False, True):
                    hog = [sys.executable, "-c", "while True: pass"]
                    hogs = [subprocess.Popen(hog) for _ in range(busy_n if busy else 0)]
                    cond = "busy" if busy else "quiet"
                    try:
                        for clients in levels:
                            work = workload(tok, clients * rpc, seed=clients)
                            for side in order:
                                _, url, key = up[side]
                                name = "bench" if side == "vllm" else str(folder)
                                r = asyncio.run(_http_level(url, key, name, work, clients, bias))
                                res.setdefault((side, cond, clients), []).append(r)
                                if r["errors"]:
                                    _show_logs(side, Path(tmp))
                                print(
                                    f"round {rnd + 1} {side:>8} {cond:>5} clients={clients:>3}: "
                                    f"{r['tok_s']:8.1f} tok/s  ttft p99 {r['ttft_p99_ms']:8.1f} ms  "
                                    f"inter-token p99 {r['itl_p99_ms']:7.1f} ms",
                                    flush=True,
                                )
                    finally:
                        for h in hogs:
                            h.kill()
                            h.wait()
        finally:
            for handle, _, _ in up.values():
                handle.stop()
    at = 32 if 32 in levels else max(levels)

    def paired(cond: str, side: str = "gpuyard") -> list[float]:
        """Each round's ratio of side over vLLM direct (the two ran minutes apart at most)."""
        g, v = res.get((side, cond, at), []), res.get(("vllm", cond, at), [])
        return [a["tok_s"] / b["tok_s"] for a, b in zip(g, v, strict=True)]

    def ratio(cond: str, side: str = "gpuyard") -> float:
        rs = paired(cond, side)
        return statistics.median(rs) if rs else math.nan

    base = ""
    if "gpuyard_base" in sides:
        base = f"base_vs_vllm_direct={ratio('quiet', 'gpuyard_base'):.2f} "
        base += f"base_contended_vs_vllm={ratio('busy', 'gpuyard_base'):.2f} "

    figures = " ".join(
        f"{s}_{c}_tok_s={statistics.median(r['tok_s'] for r in rs):.1f}"
        for (s, c, n), rs in res.items()
        if n == at
    )
    spread = ""
    if args.rounds > 1:
        for cond, key in (("quiet", "vs_vllm_direct"), ("busy", "contended_vs_vllm")):
            rs = paired(cond)
            if rs:
                spread += f"{key}_min={min(rs):.2f} {key}_max={max(rs):.2f} "
        print(
            "per-round gpuyard / vllm at",
            at,
            "clients:",
            {c: [round(x, 3) for x in paired(c)] for c in ("quiet", "busy")},
        )
    errors = " ".join(
        f"{side}_errors={sum(r['errors'] for (s, _, _), rs in res.items() if s == side for r in rs)}"
        for side in sides
    )
    end = os.getloadavg()[0]
    print(
        f"llm_serve: vs_vllm_direct={ratio('quiet'):.2f} contended_vs_vllm={ratio('busy'):.2f} clients={at} "
        f"rounds={args.rounds} {spread}{base}{figures} {errors} busy_processes={busy_n} "
        f"load1_at_start={load:.2f} load1_at_end={end:.2f}"
    )


def ct2_figures(results: dict[str, dict[int, dict[str, float]]], top: int) -> str:
    """gpuyard against CTranslate2's faster configuration per level (and each apart): tok/s ratios at
    one client and at the most clients, and their figures (nan where ct2 did not run)."""
    g1, g = results["gpuyard"].get(1), results["gpuyard"][top]
    out = []
    for level, key in ((1, "single_vs_ct2"), (top, "vs_ct2")):
        runs = {k: results.get(k, {}).get(level) for k in ("ct2_int8", "ct2_fp32")}
        mine = g1 if level == 1 else g
        best = max((r["tok_s"] for r in runs.values() if r), default=math.nan)
        out.append(f"{key}={mine['tok_s'] / best if mine else math.nan:.2f}")
        for k, r in runs.items():
            suffix = "single" if level == 1 else "top"
            out.append(f"{k}_{suffix}_tok_s={r['tok_s'] if r else math.nan:.1f}")
            out.append(f"{k}_{suffix}_ttft_p50_ms={r['ttft_p50_ms'] if r else math.nan:.0f}")
    if g1:
        out.append(
            f"gpuyard_single_tok_s={g1['tok_s']:.1f} gpuyard_single_ttft_p50_ms={g1['ttft_p50_ms']:.0f}"
        )
    return " ".join(out)


def median_of(rounds: list[dict[str, float]], key: str) -> float:
    """The median of ``key`` over the rounds' ratios (nan where that server did not run)."""
    return statistics.median(r.get(key, math.nan) for r in rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument(
        "--rounds", type=int, default=1, help="runs of each level; the best of each server counts"
    )
    ap.add_argument("--gather-ms", type=float, default=20.0, help="the static batcher's gather window")
    ap.add_argument("--smoke", action="store_true", help="CI: 1 and 2 clients, one request each (no figure)")
    ap.add_argument(
        "--only",
        default="",
        help="in-process: run gpuyard and only these of the others (comma list: sequential, static, "
        "hf_continuous, ct2_int8, ct2_fp32); the figures of the others are nan",
    )
    ap.add_argument(
        "--sides",
        default="",
        help="over HTTP instead: any of gpuyard (deployment via the gateway), vllm (direct), own, "
        "gpuyard_base (the gateway of the checkout at --baseline-src)",
    )
    ap.add_argument(
        "--baseline-src",
        default="",
        help="the src folder of another checkout: side gpuyard_base runs its gateway (before/after)",
    )
    args = ap.parse_args()
    if args.sides:
        if args.smoke:
            args.quick, args.clients = True, "1,2"
        http_main(args)
        return
    if args.smoke:
        args.quick, args.clients = True, "1,2"
    levels = [int(x) for x in args.clients.split(",")]
    rpc = 1 if args.quick else args.requests_per_client
    only = {x for x in args.only.split(",") if x}
    if only - set(IN_PROCESS):
        raise SystemExit(f"--only: no in-process server {sorted(only - set(IN_PROCESS))} (of {IN_PROCESS})")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build(Path(tmp))
        batch = max(levels)
        servers = {
            "sequential": Sequential(model, 1),
            "static": StaticWindow(model, batch, args.gather_ms / 1000),
            "hf_continuous": HFContinuous(model, batch),
            "gpuyard": Gpuyard(model, tok, batch),
            **ct2_servers(model, Path(tmp) / "tok", Path(tmp), batch, args.gather_ms / 1000),
        }
        for name in [k for k in servers if only and k not in only and k != "gpuyard"]:
            if name == "hf_continuous":
                servers[name].close()
            del servers[name]
        names = list(servers)
        results: dict[str, dict[int, dict[str, float]]] = {k: {} for k in servers}
        rounds: dict[int, list[dict[str, float]]] = {}  # per level, each round's ratios (same load)
        for clients in levels:
            work = workload(tok, clients * rpc, seed=clients)
            for rnd in range(args.rounds):
                this: dict[str, float] = {}
                cpu_this: dict[str, float] = {}
                # In turn, level by level, the order rotated each round: the load hits all alike.
                turn = (len(levels) * rnd + levels.index(clients)) % len(names)
                for name in names[turn:] + names[:turn]:
                    server = servers[name]
                    if name == "sequential" and clients > 8 and args.quick:
                        continue
                    r = run_level(server, work, clients, name in STREAMING)
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
        if "hf_continuous" in servers:
            servers["hf_continuous"].close()
    top = max(levels)
    none = {"tok_s": math.nan, "ttft_p99_ms": math.nan}
    g, s = results["gpuyard"][top], results.get("sequential", {}).get(top)
    st, hf = results.get("static", {}).get(top, none), results.get("hf_continuous", {}).get(top, none)
    hf_one = results.get("hf_continuous", {}).get(1)
    vs_seq = g["tok_s"] / s["tok_s"] if s else float("nan")
    one = results.get("sequential", {}).get(1)
    single = results["gpuyard"][1]["tok_s"] / one["tok_s"] if one else float("nan")
    single_cpu = median_of(rounds.get(1, [{}]), "sequential_cpu")
    single_hf = results["gpuyard"][1]["tok_s"] / hf_one["tok_s"] if hf_one else float("nan")
    ct2 = ct2_figures(results, top)
    print(
        f"llm_serve: vs_hf_continuous={g['tok_s'] / hf['tok_s']:.2f} "
        f"vs_hf_continuous_round_median={median_of(rounds[top], 'hf_continuous'):.2f} "
        f"single_vs_hf_continuous={single_hf:.2f} hf_continuous_tok_s={hf['tok_s']:.1f} "
        f"hf_continuous_ttft_p99_ms={hf['ttft_p99_ms']:.0f} "
        f"vs_sequential={vs_seq:.2f} vs_static_batch={g['tok_s'] / st['tok_s']:.2f} "
        f"ttft_p99_ms={g['ttft_p99_ms']:.0f} clients={top} gpuyard_tok_s={g['tok_s']:.1f} "
        f"static_tok_s={st['tok_s']:.1f} sequential_tok_s={s['tok_s'] if s else float('nan'):.1f} "
        f"static_ttft_p99_ms={st['ttft_p99_ms']:.0f} single_vs_generate={single:.2f} "
        f"vs_static_batch_round_median={median_of(rounds[top], 'static'):.2f} "
        f"vs_static_batch_cpu={median_of(rounds[top], 'static_cpu'):.2f} "
        f"single_vs_generate_cpu={single_cpu:.2f} {ct2} "
        f"single_vs_ct2_int8_cpu={median_of(rounds.get(1, [{}]), 'ct2_int8_cpu'):.2f} "
        f"single_vs_ct2_fp32_cpu={median_of(rounds.get(1, [{}]), 'ct2_fp32_cpu'):.2f} "
        f"gather_ms={args.gather_ms:g} load1_at_start={load:.2f} load1_at_end={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
