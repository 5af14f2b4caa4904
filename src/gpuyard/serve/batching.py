"""Dynamic batching: requests are gathered into one forward pass, in the event loop or in a model thread.

Two modes, chosen with ``BatchConfig.mode`` (``gpuyard serve --batching inline|thread``):

- ``inline`` (:class:`InlineBatcher`, the default): the event loop itself runs the forward pass on
  everything queued. Requests that arrive during a pass wait in the sockets' buffers; after the pass
  the loop is given back once, so every request that is ready gets read, parsed and submitted, and
  then the next batch runs with all of them (a batch that is not full waits, at most
  ``max_wait_ms``, for the clients the last two passes answered: they are likely on their way
  back). No thread hand-off: on a busy machine each hand-off
  (event loop -> model thread -> event loop) waits for the scheduler to wake a thread, which cost
  more than the forward pass of a small model. While a pass runs, the loop answers nothing else.
- ``thread`` (:class:`Batcher`): one dedicated model thread takes the oldest request from a queue,
  then keeps taking queued requests until the batch holds ``max_batch`` samples or ``max_wait_ms``
  have passed *since the oldest request arrived*; when no other request is in the server, the batch
  goes at once. Results go back to the event loop in one ``call_soon_threadsafe`` per batch. The
  event loop keeps parsing and encoding while the model runs, which pays when the forward pass
  releases the GIL for long (a GPU, a large model) and a core is free.

In both modes a request's outputs are the rows of the batch's outputs at its own offset, a failing
forward pass answers only the requests of its batch (with the error), and ``stop()`` answers every
queued request before returning.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from gpuyard.errors import GpuyardError
from gpuyard.serve.options import BatchConfig

Outputs = dict[str, np.ndarray]


class Overloaded(GpuyardError):
    """The queue is full; the client should retry later."""

    http_status = 503


class _Item:
    __slots__ = ("batch", "future", "loop", "source", "t0")

    def __init__(
        self, batch: np.ndarray, future: asyncio.Future[Outputs], loop: Any, source: Hashable = None
    ) -> None:
        self.batch, self.future, self.loop, self.t0 = batch, future, loop, time.monotonic()
        self.source = source


BatchHook = Callable[[np.ndarray, Outputs, int, float], None]


class _BatcherBase:
    """What both modes share: their arguments, the admission of a request, and one forward pass.

    Args:
        forward: maps a float32 batch ``(n, ...)`` to a dict of arrays whose first dimension is ``n``.
        config: batching settings.
        on_batch: called after each pass with (inputs, outputs, requests, seconds), in the thread that
            ran it; metrics and drift hang here. Its exceptions are swallowed: monitoring never fails a
            request.
        setup: called once, before the first batch, in the thread that will run the model
            (thread-local settings such as ``torch.set_num_threads``).
    """

    def __init__(
        self,
        forward: Callable[[np.ndarray], Outputs],
        config: BatchConfig,
        on_batch: BatchHook | None = None,
        setup: Callable[[], None] | None = None,
    ) -> None:
        self.forward, self.config, self.on_batch, self.setup = forward, config, on_batch, setup
        self._stopping = False
        self.ready = threading.Event()
        self._init_mode()

    def _init_mode(self) -> None:
        """Set up the mode's own state (called last by the constructor)."""

    def _admit(self, queued: int) -> None:
        """Refuse a new request while stopping or when ``queued`` requests already fill the queue.

        Raises:
            Overloaded: the server is stopping, or ``max_queue`` requests are already queued.
        """
        if self._stopping:
            raise Overloaded("the server is stopping")
        if queued >= self.config.max_queue:
            raise Overloaded(f"server overloaded: {self.config.max_queue} requests already queued")

    def _pass(self, items: list[_Item]) -> None:
        """Run one forward pass on ``items`` and answer each with its own rows (or the pass's error)."""
        t0 = time.perf_counter()
        try:
            inputs = items[0].batch if len(items) == 1 else np.concatenate([it.batch for it in items])
            outputs = self.forward(inputs)
        except Exception as exc:  # a model failure answers this batch's requests, nothing else
            _deliver(items, None, exc)
            return
        _deliver(items, outputs, None)
        if self.on_batch is not None:
            with contextlib.suppress(Exception):  # monitoring never fails a request
                self.on_batch(inputs, outputs, len(items), time.perf_counter() - t0)


class Batcher(_BatcherBase):
    """Runs ``forward`` on gathered batches in one model thread; ``await submit(x)`` from any event loop.

    Arguments: see :class:`_BatcherBase`; ``setup`` and ``on_batch`` run in the model thread.
    """

    def _init_mode(self) -> None:
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._carry: _Item | None = None
        self._inflight = 0  # submitted and not yet answered (written under _count_lock)
        self._count_lock = threading.Lock()

    def start(self) -> None:
        """Start the model thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuyard-model", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the queued requests, then stop the model thread; later submissions get 503."""
        self._stopping = True
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

    @contextlib.contextmanager
    def arriving(self) -> Any:
        """A request's body is being read (the model thread batches what is queued: nothing to do)."""
        yield

    async def submit(self, batch: np.ndarray, source: Hashable = None) -> Outputs:
        """Queue ``batch`` (one request's samples) and wait for its outputs (``source`` is unused here).

        Raises:
            Overloaded: the server is stopping, or the queue already holds ``max_queue`` requests.
        """
        self._admit(self._queue.qsize())
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
            self._pass(items)
        finally:
            with self._count_lock:
                self._inflight -= len(items)


Results = list[tuple[asyncio.Future[Outputs], Outputs | None]]


def _deliver(items: list[_Item], outputs: Outputs | None, exc: BaseException | None) -> None:
    """Answer each request with its own rows of ``outputs`` (or with ``exc``), on its own event loop.

    A loop that runs in this thread (inline mode) gets its futures resolved here and now; any other
    (the model thread's answers) through one ``call_soon_threadsafe`` per loop and batch.
    """
    by_loop: dict[Any, Results] = {}
    for it, res in zip(items, _split(items, outputs), strict=True):
        by_loop.setdefault(it.loop, []).append(res)
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for loop, results in by_loop.items():
        # RuntimeError: the loop closed (shutdown), nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            if loop is running or loop.is_closed():
                _resolve(results, exc)
            else:
                loop.call_soon_threadsafe(_resolve, results, exc)


def _split(items: list[_Item], outputs: Outputs | None) -> Results:
    """Each request's future with its own rows of the batch's outputs (None when the pass failed)."""
    results: Results = []
    start = 0
    for it in items:
        n = len(it.batch)
        part = None if outputs is None else {k: v[start : start + n] for k, v in outputs.items()}
        results.append((it.future, part))
        start += n
    return results


def _resolve(results: Results, exc: BaseException | None) -> None:
    for future, part in results:
        if future.done():  # the client went away and its task was cancelled
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(part)  # type: ignore[arg-type]


class InlineBatcher(_BatcherBase):
    """Runs ``forward`` on gathered batches in the event loop's own thread; ``await submit(x)``.

    A submission queues the request and, if no pass is due yet, schedules one with ``call_soon``: the
    requests the loop has already read get parsed and submitted before it runs, so they share the
    pass. After a pass the loop is given back once before the next batch (answers go out, requests
    that arrived during the pass are read). When the batch is not full and more requests are
    expected (bodies still being read: see :meth:`arriving`; or fewer queued than the clients the
    last two passes answered), the pass waits for them with ``call_later``, at most ``max_wait_ms``
    after the oldest queued request arrived.

    Arguments: see :class:`_BatcherBase`; ``setup`` runs in :meth:`start`, in the caller's thread,
    which must be the thread that runs the event loop (``torch.set_num_threads`` is per thread).
    """

    def _init_mode(self) -> None:
        self._pending: list[_Item] = []
        self._rows = 0  # samples in _pending
        self._arriving = 0  # requests whose bodies are being read (they will submit soon)
        self._expect = 1  # clients answered by the last two passes: likely to come back for the next
        self._recent: deque[set[Hashable]] = deque(maxlen=2)  # the sources of the last two passes
        self._timer: asyncio.Handle | None = None  # the scheduled pass, if any
        self._timer_loop: Any = None
        self._timer_delayed = False  # the scheduled pass is a call_later (waiting for arrivals)
        self._started = False

    def start(self) -> None:
        """Run ``setup`` (idempotent); call it from the thread that will run the event loop."""
        if not self._started:
            if self.setup is not None:
                self.setup()
            self._started = True
            self.ready.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Answer every queued request (passes run now, in the caller's thread); later submissions get
        503. Call it from the event loop's thread, or after the loop has stopped."""
        del timeout  # the passes run here, synchronously: nothing to wait for
        self._stopping = True
        self._cancel_timer()
        while self._pending:
            self._run_batch()
        self.ready.clear()

    @property
    def alive(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._started and not self._stopping

    @property
    def depth(self) -> int:
        """Requests waiting for a batch."""
        return len(self._pending)

    @contextlib.contextmanager
    def arriving(self) -> Any:
        """Mark a request whose body is being read: a batch that is not full waits for it (up to
        ``max_wait_ms``) rather than leaving without it."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1

    async def submit(self, batch: np.ndarray, source: Hashable = None) -> Outputs:
        """Queue ``batch`` (one request's samples) and wait for its outputs.

        Args:
            batch: the request's samples.
            source: who sent it (the connection's address): clients seen in the last two passes are
                expected back, so a batch waits for them (see :meth:`_worth_waiting`).

        Raises:
            Overloaded: the server is stopping, or ``max_queue`` requests are already queued.
        """
        self._admit(len(self._pending))
        loop = asyncio.get_running_loop()
        item = _Item(batch, loop.create_future(), loop, source)
        self._pending.append(item)
        self._rows += len(batch)
        waiting = self._timer_delayed and not self._worth_waiting()
        if self._timer is None or self._timer_loop is not loop or waiting:
            # No pass due on this loop yet, or a pass waiting for arrivals that are all in (or for a
            # batch that is now full): run right after the requests the loop has already read have
            # been submitted (call_soon queues behind them).
            self._schedule(loop, 0.0)
        return await item.future

    # -- scheduling ---------------------------------------------------------------------------------

    def _schedule(self, loop: Any, delay: float) -> None:
        self._cancel_timer()
        self._timer_loop, self._timer_delayed = loop, delay > 0
        self._timer = loop.call_soon(self._due) if delay <= 0 else loop.call_later(delay, self._due)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        if not self._pending:
            return
        left = self.config.max_wait_ms / 1000.0 - (time.monotonic() - self._pending[0].t0)
        if left > 0 and self._worth_waiting():
            self._schedule(self._timer_loop, left)  # others are on their way: let them join
            return
        self._run_batch()
        if self._pending:  # more than one batch was queued: give the loop back once, then go on
            self._schedule(self._pending[0].loop, 0.0)

    def _worth_waiting(self) -> bool:
        """The batch is not full and more requests are expected: bodies are being read, or fewer
        requests are queued than there were clients in the last two passes (two, not one: clients
        that split into two groups, one computing while the other's answers travel, are gathered
        into one batch again, which pays when a pass has a fixed cost)."""
        if self._rows >= self.config.max_batch:
            return False
        return self._arriving > 0 or len(self._pending) < self._expect

    def _take(self) -> list[_Item]:
        """The oldest requests up to ``max_batch`` samples (the first one even if it alone is larger)."""
        rows, n = len(self._pending[0].batch), 1
        while n < len(self._pending) and rows + len(self._pending[n].batch) <= self.config.max_batch:
            rows += len(self._pending[n].batch)
            n += 1
        items = self._pending[:n]
        del self._pending[:n]
        self._rows -= rows
        return items

    def _run_batch(self) -> None:
        items = self._take()
        self._recent.append({it.source if it.source is not None else id(it) for it in items})
        self._expect = len(self._recent[0] | self._recent[-1])
        self._pass(items)


AnyBatcher = Batcher | InlineBatcher


def make_batcher(
    forward: Callable[[np.ndarray], Outputs],
    config: BatchConfig,
    on_batch: BatchHook | None = None,
    setup: Callable[[], None] | None = None,
) -> AnyBatcher:
    """The batcher of ``config.mode``: :class:`InlineBatcher` or :class:`Batcher` (model thread)."""
    cls = InlineBatcher if config.mode == "inline" else Batcher
    return cls(forward, config, on_batch, setup)
