"""Dynamic batching: requests gathered up to max_batch, answered with their own rows, failures contained."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from gpuyard.errors import ConfigError
from gpuyard.serve.batching import BatchConfig, Batcher, Overloaded

pytestmark = pytest.mark.unit


class Recorder:
    """A forward pass that doubles its input and records each batch's size and thread."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.sizes: list[int] = []
        self.threads: set[str] = set()
        self.gate = gate

    def __call__(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        if self.gate is not None:
            self.gate.wait(10)
        self.sizes.append(len(batch))
        self.threads.add(threading.current_thread().name)
        return {"predictions": batch[:, 0] * 2}


async def _submit_all(batcher: Batcher, batches: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    return await asyncio.gather(*(batcher.submit(b) for b in batches))


def test_requests_are_gathered_and_each_gets_its_own_rows() -> None:
    forward = Recorder()
    batcher = Batcher(forward, BatchConfig(max_batch=8, max_wait_ms=200))
    batcher.start()
    try:
        inputs = [np.full((1 + i % 3, 2), i, dtype=np.float32) for i in range(20)]
        outs = asyncio.run(_submit_all(batcher, inputs))
    finally:
        batcher.stop()
    for x, out in zip(inputs, outs, strict=True):
        assert np.array_equal(out["predictions"], x[:, 0] * 2)
    assert sum(forward.sizes) == sum(len(x) for x in inputs)
    assert max(forward.sizes) <= 8 and len(forward.sizes) < len(inputs)  # batched, never over the cap
    assert forward.threads == {"gpuyard-model"}


def test_a_full_batch_does_not_wait_for_the_deadline() -> None:
    forward = Recorder()
    batcher = Batcher(forward, BatchConfig(max_batch=4, max_wait_ms=10_000))
    batcher.start()
    try:
        # 8 samples with a 10 s wait: completing at all within the test's timeout proves full batches go.
        outs = asyncio.run(_submit_all(batcher, [np.ones((1, 2), np.float32)] * 8))
    finally:
        batcher.stop()
    assert len(outs) == 8 and forward.sizes == [4, 4]


def test_a_failing_forward_answers_its_batch_with_the_error_and_the_thread_survives() -> None:
    calls = {"n": 0}

    def forward(batch: np.ndarray) -> dict[str, np.ndarray]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return {"predictions": batch[:, 0]}

    batcher = Batcher(forward, BatchConfig(max_batch=4, max_wait_ms=0))
    batcher.start()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            asyncio.run(_submit_all(batcher, [np.ones((1, 2), np.float32)]))
        out = asyncio.run(_submit_all(batcher, [np.full((1, 2), 3.0, np.float32)]))
    finally:
        batcher.stop()
    assert out[0]["predictions"][0] == 3.0 and batcher.alive is False


def test_a_full_queue_refuses_with_overloaded() -> None:
    gate = threading.Event()
    batcher = Batcher(Recorder(gate), BatchConfig(max_batch=1, max_wait_ms=0, max_queue=2))
    batcher.start()

    async def flood() -> list[object]:
        return await asyncio.gather(
            *(batcher.submit(np.ones((1, 2), np.float32)) for _ in range(6)), return_exceptions=True
        )

    async def run() -> list[object]:
        task = asyncio.ensure_future(flood())
        await asyncio.sleep(0)  # let every submit run up to its queueing decision
        gate.set()
        return await task

    try:
        results = asyncio.run(run())
    finally:
        gate.set()
        batcher.stop()
    refused = [r for r in results if isinstance(r, Overloaded)]
    assert refused and len(refused) < 6 and all(isinstance(r, dict) or r in refused for r in results)


def test_on_batch_errors_never_fail_requests_and_setup_runs_in_the_model_thread() -> None:
    seen: list[str] = []

    def setup() -> None:
        seen.append(threading.current_thread().name)

    def on_batch(*_: object) -> None:
        raise ValueError("monitoring bug")

    batcher = Batcher(Recorder(), BatchConfig(max_batch=2, max_wait_ms=0), on_batch=on_batch, setup=setup)
    batcher.start()
    try:
        out = asyncio.run(_submit_all(batcher, [np.ones((1, 2), np.float32)] * 3))
    finally:
        batcher.stop()
    assert len(out) == 3 and seen == ["gpuyard-model"]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_batch": 0}, "--max-batch 0:"),
        ({"max_wait_ms": -1}, "--max-wait-ms -1:"),
        ({"threads": -1}, "--threads -1:"),
        ({"max_queue": 0}, "max_queue=0:"),
    ],
)
def test_bad_batch_settings_are_named(kwargs: dict[str, float], named: str) -> None:
    """By the flag a user typed (`gpuyard serve`/`deploy`), or the field where there is no flag."""
    with pytest.raises(ConfigError, match=f"^{named}"):
        BatchConfig(**kwargs)  # type: ignore[arg-type]


def test_stop_answers_queued_requests_then_refuses_new_ones() -> None:
    gate = threading.Event()
    forward = Recorder(gate)
    batcher = Batcher(forward, BatchConfig(max_batch=2, max_wait_ms=0, mode="thread"))
    batcher.start()

    async def run() -> tuple[list[object], object]:
        tasks = [asyncio.ensure_future(batcher.submit(np.full((1, 2), i, np.float32))) for i in range(5)]
        await asyncio.sleep(0)  # all five queued; the first pass is held at the gate
        stopper = asyncio.ensure_future(asyncio.to_thread(batcher.stop))
        deadline = time.monotonic() + 10
        while not batcher._stopping and time.monotonic() < deadline:  # stop() has begun
            await asyncio.sleep(0.001)
        gate.set()
        late = await asyncio.gather(batcher.submit(np.ones((1, 2), np.float32)), return_exceptions=True)
        await stopper
        return list(await asyncio.gather(*tasks)), late[0]

    outs, late = asyncio.run(run())
    assert [o["predictions"][0] for o in outs] == [2.0 * i for i in range(5)]  # type: ignore[index]
    assert sum(forward.sizes) == 5 and isinstance(late, Overloaded) and not batcher.alive
