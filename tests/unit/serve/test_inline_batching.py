"""Inline batching: the event loop runs the forward pass on what is queued, each request gets its rows."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from gpuyard.errors import ConfigError
from gpuyard.serve.batching import BatchConfig, Batcher, InlineBatcher, Overloaded, make_batcher

pytestmark = pytest.mark.unit


class Recorder:
    """A forward pass that doubles the first feature and records each batch's size and thread."""

    def __init__(self, fail_on: set[int] | None = None) -> None:
        self.sizes: list[int] = []
        self.firsts: list[np.ndarray] = []
        self.threads: set[str] = set()
        self.fail_on = fail_on or set()

    def __call__(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        self.sizes.append(len(batch))
        self.firsts.append(batch[:, 0].copy())
        self.threads.add(threading.current_thread().name)
        if len(self.sizes) in self.fail_on:
            raise RuntimeError(f"boom in pass {len(self.sizes)}")
        return {"predictions": batch[:, 0] * 2, "rows": batch.copy()}


def _started(forward: Recorder, **cfg: float) -> InlineBatcher:
    batcher = InlineBatcher(forward, BatchConfig(mode="inline", **cfg))  # type: ignore[arg-type]
    batcher.start()
    return batcher


async def _submit_all(batcher: InlineBatcher, batches: list[np.ndarray]) -> list[object]:
    return await asyncio.gather(*(batcher.submit(b) for b in batches), return_exceptions=True)


def test_requests_share_passes_in_order_and_each_gets_its_own_rows() -> None:
    forward = Recorder()
    batcher = _started(forward, max_batch=8, max_wait_ms=0)
    inputs = [np.full((1 + i % 3, 2), i, dtype=np.float32) for i in range(20)]
    outs = asyncio.run(_submit_all(batcher, inputs))
    for x, out in zip(inputs, outs, strict=True):
        assert isinstance(out, dict)
        assert np.array_equal(out["rows"], x) and np.array_equal(out["predictions"], x[:, 0] * 2)
    assert sum(forward.sizes) == sum(len(x) for x in inputs)
    assert max(forward.sizes) <= 8 and len(forward.sizes) < len(inputs)
    # Passes take the oldest requests first: concatenating the batches gives the submission order.
    assert np.array_equal(np.concatenate(forward.firsts), np.concatenate([x[:, 0] for x in inputs]))
    assert forward.threads == {threading.current_thread().name}  # no model thread


def test_a_full_batch_goes_without_waiting_and_a_large_request_runs_alone() -> None:
    forward = Recorder()
    batcher = _started(forward, max_batch=4, max_wait_ms=10_000)
    ones = [np.ones((1, 2), np.float32)] * 8
    outs = asyncio.run(_submit_all(batcher, [*ones, np.ones((6, 2), np.float32)]))
    assert all(isinstance(o, dict) for o in outs)
    assert forward.sizes == [4, 4, 6]  # 6 > max_batch: a request is never split, it goes alone


def test_a_failing_forward_answers_only_its_own_batch() -> None:
    forward = Recorder(fail_on={1})
    batcher = _started(forward, max_batch=2, max_wait_ms=0)
    inputs = [np.full((1, 2), i, np.float32) for i in range(5)]
    outs = asyncio.run(_submit_all(batcher, inputs))
    assert [type(o).__name__ for o in outs] == ["RuntimeError", "RuntimeError", "dict", "dict", "dict"]
    assert all(o["predictions"][0] == 2 * i for i, o in enumerate(outs) if isinstance(o, dict))
    assert forward.sizes == [2, 2, 1] and batcher.alive


def test_a_batch_waits_for_a_request_whose_body_is_arriving() -> None:
    forward = Recorder()
    batcher = _started(forward, max_batch=8, max_wait_ms=10_000)

    async def run() -> list[object]:
        body_in = asyncio.Event()

        async def slow_client() -> object:
            with batcher.arriving():
                await body_in.wait()
            return await batcher.submit(np.full((1, 2), 1.0, np.float32))

        slow = asyncio.ensure_future(slow_client())
        fast = asyncio.ensure_future(batcher.submit(np.full((1, 2), 2.0, np.float32)))
        for _ in range(20):  # many loop turns: the pass must still be waiting for the slow body
            await asyncio.sleep(0)
        assert forward.sizes == [] and not fast.done()
        body_in.set()  # the body is in: it joins, and the pass goes at once (not after 10 s)
        return list(await asyncio.wait_for(asyncio.gather(slow, fast), 5))

    outs = asyncio.run(run())
    assert forward.sizes == [2]
    assert [o["predictions"][0] for o in outs] == [2.0, 4.0]  # type: ignore[index]


def test_stop_answers_queued_requests_and_refuses_later_ones() -> None:
    forward = Recorder()
    batcher = _started(forward, max_batch=3, max_wait_ms=0)

    async def run() -> tuple[list[object], object]:
        tasks = [asyncio.ensure_future(batcher.submit(np.full((1, 2), i, np.float32))) for i in range(7)]
        await asyncio.sleep(0)  # every task has queued its request; no pass has run yet
        assert forward.sizes == [] and batcher.depth == 7
        batcher.stop()  # the passes run here, before the loop gets control back
        assert forward.sizes == [3, 3, 1] and batcher.depth == 0
        late = await asyncio.gather(batcher.submit(np.ones((1, 2), np.float32)), return_exceptions=True)
        return list(await asyncio.gather(*tasks)), late[0]

    outs, late = asyncio.run(run())
    assert [o["predictions"][0] for o in outs] == [2.0 * i for i in range(7)]  # type: ignore[index]
    assert isinstance(late, Overloaded) and not batcher.alive


def test_a_full_queue_refuses_with_overloaded() -> None:
    forward = Recorder()
    batcher = _started(forward, max_batch=1, max_wait_ms=0, max_queue=2)
    outs = asyncio.run(_submit_all(batcher, [np.ones((1, 2), np.float32)] * 5))
    refused = [o for o in outs if isinstance(o, Overloaded)]
    assert len(refused) == 3 and sum(isinstance(o, dict) for o in outs) == 2


def test_setup_runs_once_in_start_and_on_batch_errors_never_fail_requests() -> None:
    seen: list[str] = []

    def on_batch(*_: object) -> None:
        raise ValueError("monitoring bug")

    batcher = InlineBatcher(
        Recorder(),
        BatchConfig(max_batch=2, max_wait_ms=0),
        on_batch=on_batch,
        setup=lambda: seen.append(threading.current_thread().name),
    )
    assert not batcher.alive
    batcher.start()
    batcher.start()
    outs = asyncio.run(_submit_all(batcher, [np.ones((1, 2), np.float32)] * 3))
    assert all(isinstance(o, dict) for o in outs) and seen == [threading.current_thread().name]


def test_the_mode_picks_the_batcher() -> None:
    assert isinstance(make_batcher(Recorder(), BatchConfig(mode="inline")), InlineBatcher)
    assert isinstance(make_batcher(Recorder(), BatchConfig(mode="thread")), Batcher)
    with pytest.raises(ConfigError, match="'gpu'"):
        BatchConfig(mode="gpu")


def test_a_batch_waits_for_the_clients_of_the_last_passes_and_no_longer_than_max_wait() -> None:
    forward = Recorder()
    x = np.ones((1, 2), np.float32)

    async def run(batcher: InlineBatcher) -> None:
        await asyncio.gather(batcher.submit(x, source="a"), batcher.submit(x, source="b"))
        first = asyncio.ensure_future(batcher.submit(x, source="a"))  # a is back, b not yet
        for _ in range(20):
            await asyncio.sleep(0)
        assert forward.sizes == [2] and not first.done()  # waiting for b
        await asyncio.wait_for(asyncio.gather(first, batcher.submit(x, source="b")), 5)

    asyncio.run(run(_started(forward, max_batch=8, max_wait_ms=10_000)))
    assert forward.sizes == [2, 2]  # b joined a's batch
    forward.sizes.clear()
    short = _started(forward, max_batch=8, max_wait_ms=20)

    async def alone() -> None:
        await asyncio.gather(short.submit(x, source="a"), short.submit(x, source="b"))
        await asyncio.wait_for(short.submit(x, source="a"), 5)  # b never comes: max_wait ends it

    asyncio.run(alone())
    assert forward.sizes == [2, 1]
