"""The continuous-batching engine without a server, on a small real model: the slot cache's bookkeeping,
greedy output equal to transformers' generate() while requests join and leave a small batch (through
the engine's thread), chunked prefill and cancellation with the executor stepped by the scheduler in
the test's own thread, seeds, and streamed text (incremental decoding, stop strings, SentencePiece
spaces and split UTF-8 characters). tests/unit/serve/test_llm_scheduler.py steps the scheduler alone."""

from __future__ import annotations

import io
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.llm_fixtures import corpus

from gpuyard.data.tokens import load_tokenizer
from gpuyard.serve.llm.engine import Engine
from gpuyard.serve.llm.executor import TorchExecutor, _Slots
from gpuyard.serve.llm.scheduler import (
    DECODE_WINDOW,
    Event,
    Failed,
    Finished,
    FinishReason,
    Request,
    SamplingParams,
    Scheduler,
    TextEmitted,
)

pytestmark = pytest.mark.unit

TEXT = "the cat sat on the mat, caf\u00e9 \u65e5\u672c \U0001f642 then ran"


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A unigram SentencePiece model with byte fallback, trained here."""
    import sentencepiece

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(300, seed=1)), model_writer=buf, model_type="unigram", vocab_size=330,
        hard_vocab_limit=False, byte_fallback=True, minloglevel=2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("spm") / "sp.model"
    path.write_bytes(buf.getvalue())
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def model(spm_tokenizer: Any) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=spm_tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
        bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # sharper logits: greedy text does not hang on float rounding
        for p in m.parameters():
            p.mul_(8.0) if p.dim() > 1 else None
    return m


class Collect:
    """A request's events, and an event set when it is done."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.done: Any = {}  # the last event (Finished or Failed)
        self.finished = threading.Event()

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, TextEmitted):
            self.chunks.append(ev.text)
        if isinstance(ev, Finished | Failed):
            self.done = ev
            self.finished.set()


def test_slots_keep_each_row_at_the_end_through_moves_growth_and_removal() -> None:
    slots = _Slots()
    like = [(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))]
    rows: list[list[float]] = []  # what each row must hold, oldest position first

    def add(values: list[float]) -> None:
        kv = torch.tensor(values).view(1, 1, -1, 1).expand(1, 1, -1, 2)
        slots.make_room(len(values), 4, like)
        slots.add([(kv, kv + 100)], 0, len(values))
        rows.append(list(values))

    def step() -> None:  # one new column for every row, as a decoding step writes it
        slots.make_room(0, 4, like)
        for r in range(slots.rows):
            slots.k[0][r, 0, slots.hi] = 1000.0 * r
            slots.v[0][r, 0, slots.hi] = 1000.0 * r + 100
        slots.hi += 1
        slots.lens = [n + 1 for n in slots.lens]
        for r, row in enumerate(rows):
            row.append(1000.0 * r)

    def check() -> None:
        assert slots.rows == len(rows) and slots.lo == slots.hi - max(slots.lens)
        for r, row in enumerate(rows):
            got = slots.k[0][r, 0, slots.hi - len(row) : slots.hi, 0].tolist()
            assert got == row and slots.lens[r] == len(row)
            assert slots.v[0][r, 0, slots.hi - len(row) : slots.hi, 0].tolist() == [x + 100 for x in row]

    add([1.0, 2.0])
    for _ in range(40):  # past the first capacity: columns are compacted or the buffers grow
        step()
    check()
    add([float(x) for x in range(70)])  # longer than the columns before hi: the batch moves right
    check()
    step()
    slots.remove(0)  # the last row takes row 0's place
    rows[0] = rows.pop()
    check()
    step()
    check()
    slots.remove(0)
    assert slots.rows == 0 and slots.lo == slots.hi == 0


def test_greedy_output_equals_generate_while_requests_join_and_leave(model: Any, spm_tokenizer: Any) -> None:
    engine = Engine(model, spm_tokenizer, 256, max_batch=3, max_queue=16)
    try:
        rng = random.Random(3)
        work = [
            (
                [rng.randrange(3, spm_tokenizer.vocab_size) for _ in range(rng.randint(2, 60))],
                rng.randint(1, 16),
            )
            for _ in range(6)
        ]
        engine.scheduler.eos_id = -1  # every request runs to max_tokens (generate() has no eos either)
        reqs = [Request(ids, SamplingParams(max_tokens=n, temperature=0), Collect()) for ids, n in work]
        for r in reqs:  # 6 requests through 3 slots: they join as others leave, prompts of 2-60 tokens
            engine.submit(r)
        for r in reqs:
            assert r.emit.finished.wait(60), "request not done"
        for (ids, n), r in zip(work, reqs, strict=True):
            with torch.inference_mode():
                ref = model.generate(
                    input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                )  # fmt: skip
            assert r.generated == ref[0, len(ids) :].tolist(), r.emit.done
            assert r.emit.done == Finished(FinishReason.LENGTH, len(ids), n)
            whole = spm_tokenizer.tokenizer.decode(r.generated)
            if "\ufffd" not in whole:  # random prompts may end in byte pieces that are no UTF-8
                assert "".join(r.emit.chunks) == whole
    finally:
        engine.close()


def drive(sched: Scheduler, ex: TorchExecutor, times: int) -> None:
    """The engine's loop without its thread: admit, then one iteration, ``times`` times."""
    with torch.inference_mode():
        for _ in range(times):
            sched.step(ex, sched.admit(), float)


def test_a_long_prompt_is_prefilled_in_chunks_between_the_batchs_decoding_steps(
    model: Any, spm_tokenizer: Any
) -> None:
    """The model's executor stepped by the scheduler in this thread: the trace of forward passes is
    exact, and both outputs equal generate()."""
    widths: list[int] = []  # tokens per row of each forward pass, in order
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    sched = Scheduler(4, 16, -1, spm_tokenizer.tokenizer.decode, chunk=8)  # no eos: as generate()
    ex = TorchExecutor(model, torch.device("cpu"), 4)
    try:
        rng = random.Random(5)
        short_ids = [rng.randrange(3, spm_tokenizer.vocab_size) for _ in range(5)]
        long_ids = [rng.randrange(3, spm_tokenizer.vocab_size) for _ in range(61)]  # 8 chunks, the last of 5
        short = Request(short_ids, SamplingParams(max_tokens=60, temperature=0), Collect())
        sched.submit(short)
        drive(sched, ex, 2)
        long = Request(long_ids, SamplingParams(max_tokens=6, temperature=0), Collect())
        sched.submit(long)
        widths.clear()
        drive(sched, ex, 8)
        # 7 chunks of 8 and one of 5, each followed by a decoding step (width 1) of the running batch:
        # the long prompt never held the short one back by more than a chunk.
        assert widths == [8, 1] * 7 + [5, 1]
        assert ex.slots.rows == 2 and len(short.generated) == 3 + 8 and len(long.generated) == 2
        while sched.busy:
            drive(sched, ex, 1)
        for ids, req in ((short_ids, short), (long_ids, long)):
            with torch.inference_mode():
                ref = model.generate(
                    input_ids=torch.tensor([ids]), max_new_tokens=req.params.max_tokens, do_sample=False,
                    pad_token_id=0,
                )  # fmt: skip
            assert req.generated == ref[0, len(ids) :].tolist()
            assert req.emit.done == Finished(FinishReason.LENGTH, len(ids), req.params.max_tokens)
        assert ex.slots.rows == 0 and not ex._partial
    finally:
        hook.remove()


def test_seeds_repeat_in_a_batch(model: Any, spm_tokenizer: Any) -> None:
    engine = Engine(model, spm_tokenizer, 256, max_batch=4, max_queue=16)
    try:
        prompt = spm_tokenizer.encode_batch(["the cat sat on"])[0]
        params = [
            SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7),
            SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7),
            SamplingParams(max_tokens=30, temperature=0.9, seed=8),
            SamplingParams(max_tokens=30, temperature=0),
        ]
        reqs = [Request(prompt, p, Collect()) for p in params]
        for r in reqs:
            engine.submit(r)
        for r in reqs:
            assert r.emit.finished.wait(60)
        a, b, c, greedy = (r.generated for r in reqs)
        assert a == b and a != c and len(greedy) == 30
    finally:
        engine.close()


def test_a_cancelled_request_leaves_the_batchs_cache(model: Any, spm_tokenizer: Any) -> None:
    sched = Scheduler(4, 16, -1, spm_tokenizer.tokenizer.decode, chunk=8)
    ex = TorchExecutor(model, torch.device("cpu"), 4)
    prompt = spm_tokenizer.encode_batch(["the cat sat on"])[0]
    long, other = (Request(prompt, SamplingParams(max_tokens=200, temperature=0), Collect()) for _ in "ab")
    chunked = Request(list(range(3, 40)), SamplingParams(max_tokens=5, temperature=0), Collect())
    for r in (long, other, chunked):
        sched.submit(r)
    drive(sched, ex, 2)
    assert ex.slots.rows == 2 and chunked in ex._partial
    sched.cancel(long)
    sched.cancel(chunked)
    drive(sched, ex, 1)
    assert ex.slots.rows == 1 and sched.running == [other] and not ex._partial
    assert len(long.generated) == 3 and long.emit.done == {} and not sched.prefilling


def test_streamed_text_holds_back_split_characters_and_stop_strings(spm_tokenizer: Any) -> None:
    sched = Scheduler(1, 1, -1, spm_tokenizer.tokenizer.decode)  # accept_token by hand: a known text
    ids = spm_tokenizer.encode_batch([TEXT])[0]
    assert any(spm_tokenizer.tokenizer.id_to_token(i).startswith("<0x") for i in ids)  # byte pieces

    def feed(stop: list[str]) -> Collect:
        req = Request([1], SamplingParams(max_tokens=len(ids), stop=stop), Collect())
        for t in ids:
            sched.accept_token(req, t, 0.0)
            assert all("\ufffd" not in c and "\u2581" not in c for c in req.emit.chunks)
            if req.finish_reason:
                break
        return req.emit

    out = feed([])
    assert "".join(out.chunks) == TEXT and out.done.reason is FinishReason.LENGTH and len(out.chunks) > 5
    out = feed(["on the m"])
    assert "".join(out.chunks) == "the cat sat " and out.done.reason is FinishReason.STOP
    out = feed(["\U0001f642"])  # a stop string made of byte pieces
    assert "".join(out.chunks) == TEXT[: TEXT.index("\U0001f642")] and out.done.reason is FinishReason.STOP
    # Stray bytes that never make a character are held back at most DECODE_WINDOW tokens.
    stray = Request([1], SamplingParams(max_tokens=40), Collect())
    for _ in range(40):
        sched.accept_token(stray, spm_tokenizer.tokenizer.token_to_id("<0x80>"), 0.0)
    assert "".join(stray.emit.chunks) == "\ufffd" * 40 and len(stray.emit.chunks) == 40 // DECODE_WINDOW + 1


def test_a_sentencepiece_folder_serves(tmp_path: Path, model: Any, spm_tokenizer: Any) -> None:
    from gpuyard.serve.llm.run import language_model

    (tmp_path / "config.json").write_text(model.config.to_json_string())
    (tmp_path / "tokenizer.model").write_bytes(spm_tokenizer.reference.serialized_model_proto())
    assert language_model(str(tmp_path)) == tmp_path
    assert load_tokenizer(tmp_path).sha256 == spm_tokenizer.sha256
