"""gpuyard's generation engine: continuous batching over a transformers causal LM with a KV cache.

Three parts. The :class:`~gpuyard.serve.llm.scheduler.Scheduler` makes every decision (admission within
the slots and KV budget, which prompts are prefilled together and which long one is chunked, the
decoding batch, stops, cancellation) and turns tokens into typed events, without torch or threads. The
:class:`~gpuyard.serve.llm.executor.TorchExecutor` runs the model on its choices (padded prefill,
chunks, decoding steps into one preallocated slot cache, batched sampling). :class:`Engine` is the
glue: one engine thread waits for work and runs one scheduler iteration at a time; requests are
submitted and cancelled from the server's event loop under the engine's lock, and each request's
events go to its ``emit`` from the engine thread (:func:`collect` puts them on an asyncio queue).

Between two decoding steps, finished and cancelled requests leave the running batch and waiting
requests join it (up to ``max_batch``). A prompt longer than ``PREFILL_CHUNK`` tokens is prefilled in
chunks (chunked prefill, as in Sarathi-Serve and vLLM): one chunk per engine iteration, between the
running batch's decoding steps, so a long prompt delays the others' next token by one chunk's forward
pass rather than by its whole prefill. A long generation never holds back a short one: the short one
joins at the next step and leaves as soon as it is done. Text is decoded incrementally (a window of the
last few tokens, not the whole generation, per token), holding back an incomplete UTF-8 character until
a later token completes it. Stops: ``max_tokens``, a token of the model's stop list
(:func:`stop_token_ids`: every end-of-sequence id of the tokenizer and generation_config, and every
special token, role markers included), a request's ``stop_token_ids``, or a stop string.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpuyard.errors import ConfigError
from gpuyard.serve.llm.executor import TorchExecutor
from gpuyard.serve.llm.scheduler import (
    DECODE_WINDOW,
    PREFILL_CHUNK,
    Event,
    Failed,
    Finished,
    FinishReason,
    QueueFull,
    Request,
    SamplingParams,
    Scheduler,
    TextEmitted,
)

__all__ = [
    "DECODE_WINDOW", "PREFILL_CHUNK", "Engine", "Event", "Failed", "FinishReason", "Finished", "QueueFull",
    "Request", "SamplingParams", "TextEmitted", "collect", "load_engine", "stop_token_ids",
]  # fmt: skip


class Engine:
    """Continuous batching over one model (module docstring).

    Args:
        model: a transformers causal LM (eval mode, on ``device``).
        tokenizer: gpuyard's :class:`~gpuyard.data.tokenizer.LoadedTokenizer`.
        context_length: most tokens (prompt + generated) of a request.
        max_batch: most requests decoding (or being prefilled) at once.
        max_queue: most requests waiting to join; more are refused (:class:`QueueFull`).
        metrics: an object with ``observe_ttft``, ``observe_itl``, ``tokens``, ``set_queue``, ``set_batch``.
        stop_ids: token ids besides the tokenizer's end-of-sequence that end every request
            (:func:`stop_token_ids`).
        kv_tokens: most KV tokens the admitted requests may grow to together (prompt + max_tokens
            each); None: ``max_batch`` alone bounds admission.
        prefill_chunk: prompts longer than this are prefilled this many tokens per iteration.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        context_length: int,
        max_batch: int = 32,
        max_queue: int = 256,
        device: torch.device | None = None,
        metrics: Any = None,
        stop_ids: Any = (),
        kv_tokens: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        self.model = model
        self.tok = tokenizer
        self.context_length = context_length
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.device = device or torch.device("cpu")
        self.metrics = metrics
        self.scheduler = Scheduler(
            max_batch, max_queue, tokenizer.eos_id, tokenizer.tokenizer.decode, stop_ids, kv_tokens,
            prefill_chunk, metrics,
        )  # fmt: skip
        self.executor = TorchExecutor(model, self.device, max_batch)
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="gpuyard-llm-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> list[Request]:
        """The requests decoding now (row r of the batch is ``running[r]``)."""
        return self.scheduler.running

    @property
    def waiting(self) -> Any:
        """The requests waiting to join, oldest first."""
        return self.scheduler.waiting

    # ----- requests -----------------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int, given: bool = True) -> None:
        """Refuse a request that cannot fit the context.

        Args:
            given: whether the client chose ``max_tokens`` (else it is the server's default, and the
                message says so rather than blaming a value the client never sent).

        Raises:
            ConfigError: prompt + max_tokens over the context length (both numbers named).
        """
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_tokens < 1:
            raise ConfigError("the prompt is empty (0 tokens)")
        if prompt_tokens >= self.context_length:
            raise ConfigError(
                f"the prompt has {prompt_tokens} tokens: the model's context length of "
                f"{self.context_length} leaves no room for a generated token"
            )
        if prompt_tokens + max_tokens > self.context_length:
            said = "max_tokens is" if given else "max_tokens was not given; the default is"
            raise ConfigError(
                f"the prompt has {prompt_tokens} tokens and {said} {max_tokens}: "
                f"{prompt_tokens + max_tokens} is over the model's context length of {self.context_length}"
            )

    def submit(self, req: Request) -> None:
        """Queue a request (its events go to ``req.emit`` from the engine thread).

        Raises:
            ConfigError: it does not fit the context or the KV budget. QueueFull: the waiting queue is full.
        """
        self.check(len(req.prompt_ids), req.params.max_tokens, req.params.max_tokens_given)
        if req.params.seed is not None:
            try:
                req.generator = torch.Generator(device="cpu").manual_seed(req.params.seed)
            except (RuntimeError, OverflowError, ValueError) as exc:
                raise ConfigError(f"seed: {exc}") from None
        req.created = time.perf_counter()
        with self._cond:
            self.scheduler.submit(req)
            self._cond.notify()

    def cancel(self, req: Request) -> None:
        """Drop a request (a closed stream, a client gone): a waiting one frees its queue place now, a
        running one leaves the batch before the next step."""
        with self._cond:
            self.scheduler.cancel(req)
            self._cond.notify()

    def inflight(self) -> str:
        """The requests in flight, in words ("" when none): for the shutdown's log lines."""
        s = self.scheduler
        running, waiting = len(s.running) + len(s.prefilling), len(s.waiting)
        if not running and not waiting:
            return ""
        return f"{running} generating, {waiting} waiting"

    def alive(self) -> bool:
        """True while the decoding thread runs (it stops only on :meth:`close`)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the engine thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ----- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.scheduler.busy:
                    self._cond.wait()
                if self._stop:
                    return
                joining = self.scheduler.admit()
            with torch.inference_mode():
                self.scheduler.step(self.executor, joining, time.perf_counter)


def load_engine(
    folder: str | Path, device: str = "cpu", max_batch: int = 32, max_queue: int = 256, metrics: Any = None
) -> tuple[Engine, dict[str, Any]]:
    """An engine over the Hugging Face folder ``folder`` (config, safetensors, tokenizer.json), stopping
    at every id of :func:`stop_token_ids`."""
    from gpuyard.models.llm import load_for_serving

    model, tok, info, dev = load_for_serving(folder, device)
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None
    )
    context = int(limit or info.get("context_length") or 2048)
    stops = stop_token_ids(Path(folder))
    return Engine(model, tok, context, max_batch, max_queue, dev, metrics, stops), info


def stop_token_ids(folder: Path) -> list[int]:
    """Every token id that ends a reply of the model in ``folder``: the tokenizer's end-of-sequence
    token, the ``eos_token_id`` (one or a list) of its generation_config.json and config.json, and every
    special token the tokenizer declares (role markers such as ``<|user|>`` made special tokens: a
    reply that reaches one has run into another turn). Both engines stop there (docs/llm.md)."""
    import json

    from gpuyard.models.llm import serving_tokenizer as load_tokenizer

    tok = load_tokenizer(folder)
    ids = {tok.eos_id}
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            with contextlib.suppress(ValueError, UnicodeDecodeError, AttributeError):
                eos = json.loads(path.read_text()).get("eos_token_id")
                ids |= {i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)}
    added = tok.tokenizer.get_added_tokens_decoder().items()
    ids |= {int(i) for i, t in added if getattr(t, "special", False)}
    return sorted(i for i in ids if 0 <= i < tok.vocab_size)


async def collect(
    engine: Engine, req_factory: Callable[[Callable[[Event], None]], Request]
) -> tuple[Request, asyncio.Queue[Event]]:
    """Submit a request whose events arrive on an asyncio queue of the running loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def emit(ev: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ev)

    req = req_factory(emit)
    engine.submit(req)
    return req, queue
