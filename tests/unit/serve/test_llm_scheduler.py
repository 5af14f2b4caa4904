"""The language-model engine's scheduler stepped by hand, one iteration at a time, with an executor that
runs no model: chunked prefill between decoding steps, admission within the slots and the KV budget,
cancellation freeing its slot, stops at end/stop ids and stop strings, max_tokens, and a failure kept
to its own request. No threads, no torch: every test is a few milliseconds and its trace is exact."""

from __future__ import annotations

import itertools

import pytest

from gpuyard.errors import ConfigError
from gpuyard.serve.llm.scheduler import (
    Chunk,
    Event,
    Failed,
    Finished,
    FinishReason,
    QueueFull,
    Request,
    Sampled,
    SamplingParams,
    Scheduler,
    TextEmitted,
)

pytestmark = pytest.mark.unit

EOS = 2


def decode(ids: list[int]) -> str:
    """Token t is the letter chr(ord('a') + t % 26): one character per token."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


class Script:
    """The model's tokens: request ``name`` samples ``tokens[name]`` in order (then 7 for ever)."""

    def __init__(self, **tokens: list[int]) -> None:
        self.tokens = tokens

    def __call__(self, req: Request) -> Sampled:
        seq = self.tokens.get(getattr(req, "name", ""), [])
        n = len(req.generated)
        return seq[n] if n < len(seq) else 7


class FakeExecutor:
    """Carries out the scheduler's choices on a mirror of the batch's rows and records each call."""

    def __init__(self, sample: Script | None = None) -> None:
        self.sample = sample or Script()
        self.calls: list[tuple[object, ...]] = []
        self.rows: list[Request] = []  # what the cache's rows would hold, in order
        self.pending: list[Request] = []
        self.partial: dict[Request, int] = {}
        self.fail_decode: Exception | None = None

    def prefill(self, group: list[Request]) -> list[Sampled]:
        self.calls.append(("prefill", tuple(len(r.prompt_ids) for r in group)))
        self.pending = list(group)
        return [self.sample(r) for r in group]

    def prefill_chunk(self, chunk: Chunk) -> list[Sampled]:
        assert self.partial.get(chunk.req, 0) == chunk.start  # chunks in order, none skipped
        self.calls.append(("chunk", chunk.start, chunk.end))
        self.partial[chunk.req] = chunk.end
        if not chunk.last:
            return []
        del self.partial[chunk.req]
        self.pending = [chunk.req]
        return [self.sample(chunk.req)]

    def join(self, reqs: list[Request]) -> None:
        assert all(any(r is p for p in self.pending) for r in reqs)
        self.rows.extend(reqs)
        self.pending = []

    def decode(self, reqs: list[Request]) -> list[Sampled]:
        assert len(reqs) == len(self.rows) and all(a is b for a, b in zip(reqs, self.rows, strict=True))
        self.calls.append(("decode", len(reqs)))
        if self.fail_decode is not None:
            raise self.fail_decode
        return [self.sample(r) for r in reqs]

    def remove(self, row: int) -> None:
        self.calls.append(("remove", row))
        last = self.rows.pop()
        if row < len(self.rows):
            self.rows[row] = last

    def drop(self, req: Request) -> None:
        self.calls.append(("drop", len(req.prompt_ids)))
        self.partial.pop(req, None)

    def reset(self) -> None:
        self.calls.append(("reset",))
        self.rows, self.pending = [], []
        self.partial.clear()


class Events(list[Event]):
    """A request's events, in order (it is the request's ``emit``)."""

    def __call__(self, ev: Event) -> None:
        self.append(ev)

    @property
    def text(self) -> str:
        return "".join(e.text for e in self if isinstance(e, TextEmitted))

    @property
    def end(self) -> Event | None:
        return self[-1] if self and not isinstance(self[-1], TextEmitted) else None


def request(name: str, prompt: int, max_tokens: int, **params: object) -> Request:
    req = Request(list(range(3, 3 + prompt)), SamplingParams(max_tokens=max_tokens, **params), Events())  # type: ignore[arg-type]
    req.name = name  # type: ignore[attr-defined]  # the script's key
    return req


class Driver:
    """The engine's loop without its thread: admit, then one step, on a clock that ticks per call."""

    def __init__(self, sched: Scheduler, ex: FakeExecutor) -> None:
        self.sched, self.ex = sched, ex
        self.clock = itertools.count().__next__

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            self.sched.step(self.ex, self.sched.admit(), lambda: float(self.clock()))

    def until_idle(self, limit: int = 1000) -> int:
        for n in range(limit):
            if not self.sched.busy:
                return n
            self.step()
        raise AssertionError(f"still busy after {limit} iterations")


def make(max_batch: int = 4, sample: Script | None = None, **kw: object) -> Driver:
    sched = Scheduler(max_batch, 8, EOS, decode, **kw)  # type: ignore[arg-type]
    return Driver(sched, FakeExecutor(sample))


def test_a_long_prompt_is_prefilled_one_chunk_per_iteration_between_decoding_steps() -> None:
    d = make(chunk=8)
    short = request("short", 5, 60)
    d.sched.submit(short)
    d.step(2)
    assert d.ex.calls == [("prefill", (5,)), ("decode", 1), ("decode", 1)]
    long = request("long", 61, 6)  # 7 chunks of 8 and one of 5
    d.sched.submit(long)
    d.ex.calls.clear()
    d.step(8)
    chunks = [("chunk", s, min(s + 8, 61)) for s in range(0, 61, 8)]
    # Each chunk is followed by the running request's decoding step: the short one is held back by one
    # chunk at a time; after its last chunk the long one decodes in the same batch.
    steps = [c for chunk in chunks for c in (chunk, ("decode", 1))]
    assert d.ex.calls == [*steps[:-1], ("decode", 2)]
    assert len(short.generated) == 3 + 8 and len(long.generated) == 2  # first token from its last chunk
    assert d.ex.rows == [short, long]
    d.until_idle()
    assert short.emit.end == Finished(FinishReason.LENGTH, 5, 60)
    assert long.emit.end == Finished(FinishReason.LENGTH, 61, 6)
    assert d.ex.rows == [] and not d.ex.partial


def test_short_prompts_joining_together_are_prefilled_in_groups_of_similar_length() -> None:
    d = make(max_batch=8, chunk=512)
    for n, size in enumerate((40, 38, 10, 9, 400)):
        d.sched.submit(request(f"r{n}", size, 3))
    d.step()
    # Longest first; 40 and 38 pad little, 10 beside them would be 75% padding: a group of its own.
    assert d.ex.calls[:3] == [("prefill", (400,)), ("prefill", (40, 38)), ("prefill", (10, 9))]
    assert d.ex.calls[3] == ("decode", 5) and len(d.ex.rows) == 5


def test_admission_stays_within_the_slots_and_a_freed_slot_is_taken_at_the_next_iteration() -> None:
    d = make(max_batch=2)
    reqs = [request(f"r{i}", 4, n) for i, n in enumerate((3, 10, 5))]
    for r in reqs:
        d.sched.submit(r)
    d.step()
    assert d.ex.rows == reqs[:2] and list(d.sched.waiting) == [reqs[2]]
    d.step()  # r0's third token: it finishes and leaves within this iteration
    assert reqs[0].finish_reason is FinishReason.LENGTH and d.ex.rows == [reqs[1]]
    d.step()
    assert d.ex.rows == [reqs[1], reqs[2]] and not d.sched.waiting
    for _ in range(20):
        assert len(d.ex.rows) <= 2
        d.step()
    assert all(isinstance(r.emit.end, Finished) for r in reqs)


def test_admission_within_the_kv_budget_waits_in_order_and_refuses_what_never_fits() -> None:
    d = make(max_batch=8, kv_tokens=40)
    big = request("big", 10, 15)  # 25 KV tokens
    second = request("second", 10, 10)  # 20: 45 with big, over 40
    small = request("small", 2, 4)  # 6: would fit beside big, but waits behind second (first come)
    for r in (big, second, small):
        d.sched.submit(r)
    d.step()
    assert d.ex.rows == [big] and list(d.sched.waiting) == [second, small] and d.sched.reserved == 25
    while big.finish_reason is None:
        d.step()
    d.step()
    assert d.ex.rows == [second, small] and d.sched.reserved == 26
    with pytest.raises(ConfigError, match="need 41 KV tokens: more than the engine's budget of 40"):
        d.sched.submit(request("huge", 21, 20))
    d.until_idle()
    assert [type(r.emit.end) for r in (big, second, small)] == [Finished] * 3


def test_a_full_queue_refuses_and_a_cancelled_waiting_request_frees_its_place() -> None:
    sched = Scheduler(1, 2, EOS, decode)
    a, b = request("a", 3, 4), request("b", 3, 4)
    sched.submit(a)
    sched.submit(b)
    with pytest.raises(QueueFull, match=r"queue is full \(2 requests waiting\)"):
        sched.submit(request("c", 3, 4))
    sched.cancel(a)
    assert list(sched.waiting) == [b]
    sched.submit(request("c", 3, 4))


def test_a_cancelled_request_frees_its_slot_and_row_and_a_prefilling_one_its_kv() -> None:
    d = make(max_batch=2, chunk=8)
    first, second, third = request("first", 4, 100), request("second", 30, 100), request("third", 4, 5)
    for r in (first, second, third):
        d.sched.submit(r)
    d.step()
    assert d.ex.rows == [first] and d.ex.partial == {second: 8} and list(d.sched.waiting) == [third]
    d.sched.cancel(first)  # from the client's side, between two iterations
    assert d.sched.admitted == [second]  # its slot is free at once ...
    d.ex.calls.clear()
    d.step()
    # ... its row leaves before anything joins, and the waiting request takes the slot.
    assert d.ex.calls[:2] == [("remove", 0), ("prefill", (4,))] and d.ex.rows == [third]
    d.sched.cancel(second)  # mid-prefill: its partial KV is dropped, no further chunk runs
    d.ex.calls.clear()
    d.step()
    assert ("drop", 30) in d.ex.calls and not any(c[0] == "chunk" for c in d.ex.calls)
    assert not d.ex.partial and d.sched.admitted == [third]
    d.until_idle()
    assert first.finish_reason is None and first.emit.end is None and len(first.generated) == 2
    assert isinstance(third.emit.end, Finished) and d.ex.rows == []


def test_a_short_request_passes_a_long_one_and_a_dropped_stream_leaves_before_its_max_tokens() -> None:
    """The server's dropped stream, step by step: a short request joins a long one's running batch and
    finishes first; the client of the long one hangs up (the app cancels it) and it leaves the batch
    at the next iteration, far from its max_tokens, with no end event."""
    d = make(max_batch=2)
    long = request("long", 4, 200)
    d.sched.submit(long)
    d.step(3)
    assert d.ex.rows == [long] and len(long.generated) == 4
    short = request("short", 2, 3)
    d.sched.submit(short)
    d.step()  # admitted, prefilled (its first token) and decoded beside the long one
    assert d.ex.rows == [long, short] and len(short.generated) == 2
    d.step()  # its third token: it finishes and leaves within this iteration
    assert short.emit.end == Finished(FinishReason.LENGTH, 2, 3) and short.emit.text == "hhh"
    assert d.ex.rows == [long] and long.finish_reason is None and len(long.generated) == 6
    d.sched.cancel(long)  # the client closed its stream
    assert d.sched.admitted == []
    d.ex.calls.clear()
    d.until_idle()
    assert d.ex.calls == [("remove", 0)]  # it leaves before any further decoding step
    assert d.ex.rows == [] and len(long.generated) == 6 and long.emit.end is None


@pytest.mark.parametrize(
    ("tokens", "params", "stop_ids", "text", "reason", "completion"),
    [
        ([4, 5, EOS, 6], {}, (), "ef", FinishReason.STOP, 3),  # the tokenizer's eos
        ([4, 5, 9, 6], {}, (9,), "ef", FinishReason.STOP, 3),  # a model stop id (generation_config)
        ([4, 11, 5], {"stop_token_ids": frozenset({11})}, (), "e", FinishReason.STOP, 2),  # the request's
        ([4, 5, 6, 7, 8], {}, (), "efgh", FinishReason.LENGTH, 4),  # max_tokens=4
        ([4, 5, 6, 7, 8], {"stop": ["fg"]}, (), "e", FinishReason.STOP, 3),  # a stop string, cut off
        ([4, 5, 4, 8], {"stop": ["ee"]}, (), "efei", FinishReason.LENGTH, 4),  # "e" held, then sent
    ],
)
def test_stops_at_end_ids_stop_ids_stop_strings_and_max_tokens(
    tokens: list[int], params: dict[str, object], stop_ids: tuple[int, ...], text: str, reason: FinishReason,
    completion: int,
) -> None:  # fmt: skip
    d = make(sample=Script(r=tokens), stop_ids=stop_ids)
    req = request("r", 3, 4, **params)
    d.sched.submit(req)
    d.until_idle()
    assert req.emit.text == text and req.emit.end == Finished(reason, 3, completion)
    assert req.emit.end.usage == {"prompt_tokens": 3, "completion_tokens": completion,  # type: ignore[union-attr]
                                  "total_tokens": 3 + completion}  # fmt: skip
    assert all(e.text for e in req.emit if isinstance(e, TextEmitted))


def test_a_request_ending_on_its_first_token_never_joins_the_batch() -> None:
    d = make(sample=Script(r=[EOS]))
    req = request("r", 3, 10)
    d.sched.submit(req)
    d.step()
    assert d.ex.calls == [("prefill", (3,))] and d.ex.rows == []
    assert req.emit == [Finished(FinishReason.STOP, 3, 1)]


def test_a_failed_sample_fails_its_request_and_a_failed_step_fails_only_that_batch() -> None:
    d = make(sample=Script(bad=[4, FloatingPointError("non-finite logits")], good=[4, 5, 6]))  # type: ignore[list-item]
    bad, good = request("bad", 3, 3), request("good", 3, 3)
    d.sched.submit(bad)
    d.sched.submit(good)
    d.until_idle()
    assert bad.emit.end == Failed("FloatingPointError: non-finite logits")
    assert bad.finish_reason is FinishReason.ERROR and good.emit.end == Finished(FinishReason.LENGTH, 3, 3)
    d.ex.fail_decode = RuntimeError("CUDA error: device-side assert")
    one, two = request("one", 3, 5), request("two", 4, 5)
    d.sched.submit(one)
    d.sched.submit(two)
    d.step()
    assert one.emit.end == two.emit.end == Failed("RuntimeError: CUDA error: device-side assert")
    assert d.ex.calls[-1] == ("reset",) and d.sched.running == [] and not d.sched.busy
    d.ex.fail_decode = None  # the engine goes on with the next request
    after = request("after", 3, 2)
    d.sched.submit(after)
    d.until_idle()
    assert after.emit.end == Finished(FinishReason.LENGTH, 3, 2)


def test_the_clock_gives_each_requests_first_token_and_gaps() -> None:
    class Hooks:
        def __init__(self) -> None:
            self.ttft: list[float] = []
            self.itl: list[float] = []
            self.count = 0
            self.queue: list[int] = []
            self.batch: list[int] = []

        def observe_ttft(self, s: float) -> None:
            self.ttft.append(s)

        def observe_itl(self, s: float) -> None:
            self.itl.append(s)

        def tokens(self, n: int) -> None:
            self.count += n

        def set_queue(self, n: int) -> None:
            self.queue.append(n)

        def set_batch(self, n: int) -> None:
            self.batch.append(n)

    hooks = Hooks()
    d = make(metrics=hooks)
    req = request("r", 3, 3)
    d.sched.submit(req)
    req.created = 0.0
    d.until_idle()
    # The clock ticks once per prefill and decoding step: tokens at 0, 1, 2.
    assert hooks.ttft == [0.0] and hooks.itl == [1.0, 1.0] and hooks.count == 3
    assert hooks.queue[0] == 1 and hooks.queue[-1] == 0 and hooks.batch[-1] == 0


def test_the_scheduler_imports_no_torch_and_no_threads() -> None:
    import ast
    from pathlib import Path

    import gpuyard.serve.llm.scheduler as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"torch", "threading", "asyncio", "transformers", "time"}, names
