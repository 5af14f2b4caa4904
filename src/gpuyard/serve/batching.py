"""Dynamic batching: requests from the event loop are gathered into one forward pass on a model thread.

The model runs in one dedicated thread (``torch.set_num_threads`` is per thread, so it is set there).
That thread takes the oldest request, then keeps taking queued requests until the batch holds
``max_batch`` samples or ``max_wait_ms`` have passed *since the oldest request arrived*: a request
that already waited during the previous forward pass is not made to wait again, and when no other
request is in the server at all (submitted and unanswered), the batch goes at once: waiting could
only add latency. Results go back to
the event loop in one ``call_soon_threadsafe`` per batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError, GpuyardError

Outputs = dict[str, np.ndarray]


@dataclass(frozen=True)
class BatchConfig:
    """How requests are gathered.

    Attributes:
        max_batch: most samples in one forward pass.
        max_wait_ms: longest time the oldest request waits for others to join its batch.
        threads: intra-op threads of the model thread (``torch.set_num_threads``); 0: chosen by the runner.
        max_queue: requests waiting beyond this are refused with 503 (back-pressure, bounded memory).
    """

    max_batch: int = 32
    max_wait_ms: float = 2.0
    threads: int = 0
    max_queue: int = 4096

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ConfigError(f"max_batch={self.max_batch}: must be at least 1")
        if not 0 <= self.max_wait_ms <= 10_000:
            raise ConfigError(f"max_wait_ms={self.max_wait_ms}: must be between 0 and 10000")
        if self.threads < 0:
            raise ConfigError(f"threads={self.threads}: must be >= 0 (0: cores / replicas)")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue={self.max_queue}: must be at least 1")


class Overloaded(GpuyardError):
    """The queue is full; the client should retry later."""

    http_status = 503


class _Item:
    __slots__ = ("batch", "future", "loop", "t0")

    def __init__(self, batch: np.ndarray, future: asyncio.Future[Outputs], loop: Any) -> None:
        self.batch, self.future, self.loop, self.t0 = batch, future, loop, time.monotonic()


BatchHook = Callable[[np.ndarray, Outputs, int, float], None]


class Batcher:
    """Runs ``forward`` on gathered batches in one thread; ``await submit(x)`` from any event loop.

    Args:
        forward: maps a float32 batch ``(n, ...)`` to a dict of arrays whose first dimension is ``n``.
        config: batching settings.
        on_batch: called in the model thread after each pass with (inputs, outputs, requests, seconds);
            metrics and drift hang here. Its exceptions are swallowed: monitoring never fails a request.
        setup: called once in the model thread before the first batch (thread-local settings).
    """

    def __init__(
        self,
        forward: Callable[[np.ndarray], Outputs],
        config: BatchConfig,
        on_batch: BatchHook | None = None,
        setup: Callable[[], None] | None = None,
    ) -> None:
        self.forward, self.config, self.on_batch, self.setup = forward, config, on_batch, setup
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._carry: _Item | None = None
        self._inflight = 0  # submitted and not yet answered (written under _count_lock)
        self._count_lock = threading.Lock()
        self.ready = threading.Event()

    def start(self) -> None:
        """Start the model thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuyard-model", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the queued requests, then stop the model thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        """True while the model thread runs and has finished its setup."""
        return self._thread is not None and self._thread.is_alive() and self.ready.is_set()

    @property
    def depth(self) -> int:
        """Requests waiting for a batch."""
        return self._queue.qsize()

    async def submit(self, batch: np.ndarray) -> Outputs:
        """Queue ``batch`` (one request's samples) and wait for its outputs.

        Raises:
            Overloaded: the queue already holds ``max_queue`` requests.
        """
        if self._queue.qsize() >= self.config.max_queue:
            raise Overloaded(f"server overloaded: {self.config.max_queue} requests already queued")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outputs] = loop.create_future()
        with self._count_lock:
            self._inflight += 1
        self._queue.put(_Item(batch, future, loop))
        return await future

    # -- the model thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        if self.setup is not None:
            self.setup()
        self.ready.set()
        while True:
            items = self._gather()
            if items is None:
                return
            self._execute(items)

    def _gather(self) -> list[_Item] | None:
        first = self._carry if self._carry is not None else self._queue.get()
        self._carry = None
        if first is None:
            return None
        items, rows = [first], len(first.batch)
        deadline = first.t0 + self.config.max_wait_ms / 1000.0
        while rows < self.config.max_batch:
            if self._inflight <= len(items) and self._queue.empty():
                break  # nobody else is in the server: waiting would only add latency
            try:
                wait = deadline - time.monotonic()
                nxt = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)  # stop after this batch
                break
            if rows + len(nxt.batch) > self.config.max_batch:
                self._carry = nxt  # it opens the next batch
                break
            items.append(nxt)
            rows += len(nxt.batch)
        return items

    def _execute(self, items: list[_Item]) -> None:
        try:
            self._forward_and_deliver(items)
        finally:
            with self._count_lock:
                self._inflight -= len(items)

    def _forward_and_deliver(self, items: list[_Item]) -> None:
        t0 = time.perf_counter()
        try:
            inputs = items[0].batch if len(items) == 1 else np.concatenate([it.batch for it in items])
            outputs = self.forward(inputs)
        except Exception as exc:  # a model failure answers this batch's requests, never kills the thread
            self._deliver(items, None, exc)
            return
        self._deliver(items, outputs, None)
        if self.on_batch is not None:
            # Monitoring must never take the model thread down.
            with contextlib.suppress(Exception):
                self.on_batch(inputs, outputs, len(items), time.perf_counter() - t0)

    @staticmethod
    def _deliver(items: list[_Item], outputs: Outputs | None, exc: BaseException | None) -> None:
        results: list[tuple[asyncio.Future[Outputs], Outputs | None]] = []
        start = 0
        for it in items:
            n = len(it.batch)
            part = None if outputs is None else {k: v[start : start + n] for k, v in outputs.items()}
            results.append((it.future, part))
            start += n
        by_loop: dict[Any, list[tuple[asyncio.Future[Outputs], Outputs | None]]] = {}
        for it, res in zip(items, results, strict=True):
            by_loop.setdefault(it.loop, []).append(res)
        for loop, batch in by_loop.items():
            # RuntimeError: the loop closed (shutdown), nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, batch, exc)


def _resolve(
    results: list[tuple[asyncio.Future[Outputs], Outputs | None]], exc: BaseException | None
) -> None:
    for future, part in results:
        if future.done():  # the client went away and its task was cancelled
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(part)  # type: ignore[arg-type]
