"""The language-model engine's scheduler: every decision of gpuyard's engine, none of its arithmetic.

:class:`Scheduler` decides which waiting requests are admitted (first come, first served, within the
batch's slots and an optional KV budget), which prompts are prefilled together and which long one is
prefilled chunk by chunk, which requests make up a decoding step, and when each one ends (an
end-of-sequence or stop id, a stop string, ``max_tokens``, a cancellation, an error). It turns sampled
token ids into text and typed events (:class:`TextEmitted`, :class:`Finished`, :class:`Failed`).
What runs the model is an :class:`Executor` (``engine.py``'s runs a transformers model with torch);
this module imports neither torch nor threads, so one engine iteration (:meth:`Scheduler.step`) can be
driven by hand with a fake executor, in a test, in milliseconds.

One iteration: finished and cancelled requests leave the running batch; joining prompts of at most
``chunk`` tokens are prefilled in groups of similar lengths (one forward pass each, at most
``PREFILL_TOKENS`` tokens and ``PREFILL_PADDING`` padding), sample their first token, and the unfinished
ones join the batch; the oldest longer prompt gets one chunk of ``chunk`` tokens (chunked prefill, as
in Sarathi-Serve and vLLM) and joins after its last one; then one decoding step of the running batch.
Row ``r`` of the executor's batch is ``running[r]``: a leaving request's row is taken by the last one,
on both sides.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuyard.errors import CapacityError, ConfigError

# Joining requests prefilled in one padded forward: at most this many tokens (padding included) ...
PREFILL_TOKENS = 4096
# ... and padding at most this share of them (requests are grouped by prompt length).
PREFILL_PADDING = 0.25
# Prompts longer than this are prefilled this many tokens per engine iteration (chunked prefill).
PREFILL_CHUNK = 512
# Tokens an incomplete UTF-8 character is held back at most (then it is sent as U+FFFD).
DECODE_WINDOW = 16


class QueueFull(CapacityError):
    """The engine's waiting queue is full (answered 429)."""

    http_status = 429


class FinishReason(enum.StrEnum):
    """Why a request ended. ``STOP`` and ``LENGTH`` are the OpenAI API's finish reasons (carried by
    :class:`Finished`); ``ERROR`` is a request that failed (its event is :class:`Failed`)."""

    STOP = "stop"  # an end-of-sequence or stop id, or a stop string
    LENGTH = "length"  # max_tokens generated
    ERROR = "error"


@dataclass(frozen=True)
class TextEmitted:
    """New text of a request's reply (never empty; never a part of a stop string or of a character)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """A request's last event when it ended well (``reason`` is STOP or LENGTH)."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int

    @property
    def usage(self) -> dict[str, int]:
        """The OpenAI API's ``usage`` object."""
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": total}  # fmt: skip


@dataclass(frozen=True)
class Failed:
    """A request's last event when it failed: what failed, in one line."""

    message: str


Event = TextEmitted | Finished | Failed


@dataclass
class SamplingParams:
    """How one request samples and when it stops."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_k: int = 0  # 0: every token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: frozenset[int] = frozenset()
    max_tokens_given: bool = True  # False: max_tokens is the server's default (errors say so)

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before sampling (bias, penalties)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass(eq=False)  # compared and hashed by identity: two equal prompts are two requests
class Request:
    """One generation: its prompt tokens, sampling, and where its events go."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    created: float = 0.0  # when it was submitted, on the engine's clock (set by the engine)
    cancelled: bool = False
    generated: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already emitted
    first_token_at: float | None = None
    last_token_at: float | None = None
    generator: Any = None  # the executor's random generator of a seeded request
    finish_reason: FinishReason | None = None
    pending: int = -1  # the last sampled token, fed to the next step
    prefilled: int = 0  # prompt tokens whose KV is computed (a chunked prompt's progress)
    prefix: int = 0  # generated[prefix:read] is the context decoded before the new tokens
    read: int = 0  # generated[:read] is in text
    tail: int = 0  # characters of text from generated[read:] (before an incomplete character)

    @property
    def reserved(self) -> int:
        """The most KV tokens it can hold: its prompt and every token it may generate."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def over(self) -> bool:
        """Whether it has left the engine's work (finished, failed or cancelled)."""
        return self.cancelled or self.finish_reason is not None


@dataclass(frozen=True)
class Chunk:
    """Tokens ``[start, end)`` of a long prompt, prefilled in one iteration."""

    req: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.req.prompt_ids)


# What an executor answers for each request it sampled: the token, or what failed for that one alone.
Sampled = int | Exception


class Executor(Protocol):
    """What runs the model on the scheduler's choices; rows of its batch follow ``Scheduler.running``."""

    def prefill(self, group: list[Request]) -> list[Sampled]:
        """Run ``group``'s whole prompts (one pass) and sample each one's first token; their KV waits
        for :meth:`join`. Raises when the pass fails (the group fails)."""
        ...

    def prefill_chunk(self, chunk: Chunk) -> list[Sampled]:
        """Run one chunk of a long prompt on that prompt's own KV; after its last chunk, sample the first
        token (``[token]``; else ``[]``) and its KV waits for :meth:`join`. Raises when it fails."""
        ...

    def join(self, reqs: list[Request]) -> None:
        """Append these requests (of the last prefill or last chunk, in order) as the batch's next rows;
        the KV of the other requests of that prefill is dropped."""
        ...

    def decode(self, reqs: list[Request]) -> list[Sampled]:
        """One decoding step of the batch (row r is ``reqs[r]``, fed ``reqs[r].pending``)."""
        ...

    def remove(self, row: int) -> None:
        """Drop row ``row``: the last row takes its place."""
        ...

    def drop(self, req: Request) -> None:
        """Forget a partly prefilled prompt's KV (it was cancelled or failed)."""
        ...

    def reset(self) -> None:
        """Forget every row and every pending KV (after a failed batch)."""
        ...


class Scheduler:
    """The engine's decisions (module docstring). Not thread-safe: the engine holds its lock around
    :meth:`submit`, :meth:`cancel` and :meth:`admit`, and only its own thread calls :meth:`step`.

    Args:
        max_batch: slots: most requests running or being prefilled at once.
        max_queue: most requests waiting; more are refused (:class:`QueueFull`).
        eos_id: the tokenizer's end-of-sequence id (ends every request).
        decode_text: token ids to text (the tokenizer's decode).
        stop_ids: other ids that end every request.
        kv_tokens: most KV tokens the admitted requests may grow to together (each counts its prompt
            and ``max_tokens``); None: the slots alone bound admission.
        chunk: prompts longer than this are prefilled this many tokens per iteration.
        metrics: an object with ``observe_ttft``, ``observe_itl``, ``tokens``, ``set_queue``,
            ``set_batch`` (or None).
    """

    def __init__(
        self,
        max_batch: int,
        max_queue: int,
        eos_id: int,
        decode_text: Callable[[list[int]], str],
        stop_ids: Iterable[int] = (),
        kv_tokens: int | None = None,
        chunk: int = PREFILL_CHUNK,
        metrics: Any = None,
    ) -> None:
        if max_batch < 1 or max_queue < 0 or chunk < 1 or (kv_tokens is not None and kv_tokens < 2):
            raise ConfigError(
                f"engine limits: max_batch {max_batch} (>= 1), max_queue {max_queue} (>= 0), "
                f"chunk {chunk} (>= 1), kv_tokens {kv_tokens} (>= 2 or none)"
            )
        self.max_batch, self.max_queue, self.kv_tokens, self.chunk = max_batch, max_queue, kv_tokens, chunk
        self.eos_id = eos_id
        self.stop_ids = frozenset(int(i) for i in stop_ids) - {eos_id}
        self.decode_text = decode_text
        self.metrics = metrics
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # row r of the executor's batch is running[r]
        self.prefilling: collections.deque[Request] = collections.deque()  # long prompts, oldest first

    # ----- admission ----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether an iteration has anything to do."""
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def admitted(self) -> list[Request]:
        """The requests holding a slot: running or being prefilled, and not over (a cancelled one's
        slot is free at once; its row leaves at the start of the next iteration, before any joins)."""
        return [r for r in (*self.running, *self.prefilling) if not r.over]

    @property
    def reserved(self) -> int:
        """KV tokens the admitted requests may grow to together (:attr:`Request.reserved`)."""
        return sum(r.reserved for r in self.admitted)

    def check(self, req: Request) -> None:
        """Refuse a request that could never be admitted.

        Raises:
            ConfigError: its prompt and max_tokens are over the KV budget (both numbers named).
        """
        if self.kv_tokens is not None and req.reserved > self.kv_tokens:
            raise ConfigError(
                f"the prompt ({len(req.prompt_ids)} tokens) and max_tokens ({req.params.max_tokens}) "
                f"need {req.reserved} KV tokens: more than the engine's budget of {self.kv_tokens}"
            )

    def submit(self, req: Request) -> None:
        """Queue ``req``.

        Raises:
            ConfigError: it can never be admitted. QueueFull: the waiting queue is full.
        """
        self.check(req)
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
        self.waiting.append(req)
        self._queue_changed()

    def cancel(self, req: Request) -> None:
        """Drop ``req``: a waiting one frees its queue place now; a running or prefilling one leaves at
        the next iteration (its slot and KV are freed there)."""
        req.cancelled = True
        with contextlib.suppress(ValueError):  # not waiting (any more): running, prefilling or done
            self.waiting.remove(req)
            self._queue_changed()

    def admit(self) -> list[Request]:
        """Take waiting requests, oldest first, while a slot is free and the KV budget holds them (the
        oldest that does not fit waits, and so do the ones behind it: none is passed over for ever)."""
        joining: list[Request] = []
        held = self.admitted
        reserved = sum(r.reserved for r in held)
        while self.waiting and len(held) + len(joining) < self.max_batch:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                continue
            if self.kv_tokens is not None and reserved + req.reserved > self.kv_tokens:
                break
            joining.append(self.waiting.popleft())
            reserved += req.reserved
        self._queue_changed()
        return joining

    def _queue_changed(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self.waiting))

    # ----- one iteration ------------------------------------------------------------------------
    def step(self, executor: Executor, joining: list[Request], clock: Callable[[], float]) -> None:
        """One engine iteration over ``joining`` (from :meth:`admit`): see the module docstring. A failure
        of one request's own work fails that request; any other failure fails the whole batch, never
        the engine."""
        try:
            self._leave(executor)
            joining = [r for r in joining if not r.cancelled]
            short = [r for r in joining if len(r.prompt_ids) <= self.chunk]
            self.prefilling.extend(r for r in joining if len(r.prompt_ids) > self.chunk)
            for group in prefill_groups(short):
                try:
                    tokens = executor.prefill(group)
                except Exception as exc:  # this group's forward pass: fails this group only
                    for req in group:
                        fail(req, exc)
                    continue
                self.accept(group, tokens, clock())
                self._join(executor, group)
            self._advance(executor, clock)
            self._leave(executor)
            if self.running:
                self.accept(self.running, executor.decode(self.running), clock())
                self._leave(executor)
        except Exception as exc:  # a failed batch step (or KV copy) fails the batch, not the engine
            for req in [*self.running, *joining, *self.prefilling]:
                fail(req, exc)
            self.running = []
            self.prefilling.clear()
            executor.reset()
        if self.metrics is not None:
            self.metrics.set_batch(len(self.running))

    def _join(self, executor: Executor, prefilled: list[Request]) -> None:
        """The prefilled requests that did not end on their first token join the running batch."""
        joined = [r for r in prefilled if not r.over]
        executor.join(joined)
        self.running.extend(joined)

    def _advance(self, executor: Executor, clock: Callable[[], float]) -> None:
        """Prefill the next chunk of the oldest long prompt; after its last one it joins the batch."""
        while self.prefilling and self.prefilling[0].over:
            executor.drop(self.prefilling.popleft())
        if not self.prefilling:
            return
        req = self.prefilling[0]
        chunk = Chunk(req, req.prefilled, min(req.prefilled + self.chunk, len(req.prompt_ids)))
        try:
            tokens = executor.prefill_chunk(chunk)
        except Exception as exc:  # this prompt's own prefill: fails this request only
            self.prefilling.popleft()
            executor.drop(req)
            fail(req, exc)
            return
        req.prefilled = chunk.end
        if not chunk.last:
            return
        self.prefilling.popleft()
        self.accept([req], tokens, clock())
        self._join(executor, [req])

    def _leave(self, executor: Executor) -> None:
        """Finished and cancelled requests leave the batch: each row is taken by the last row."""
        gone = [i for i, r in enumerate(self.running) if r.over]
        for i in reversed(gone):
            executor.remove(i)
            last = self.running.pop()
            if i < len(self.running):
                self.running[i] = last

    # ----- tokens to text and stops -------------------------------------------------------------
    def accept(self, reqs: list[Request], tokens: list[Sampled], now: float) -> None:
        """Record each request's sampled token (a failed sample fails its request alone)."""
        accepted = 0
        for req, token in zip(reqs, tokens, strict=True):
            if req.over:
                continue
            if isinstance(token, Exception):
                fail(req, token)
                continue
            try:
                self.accept_token(req, token, now)
            except Exception as exc:  # this request's text or stop handling: fails it alone
                fail(req, exc)
                continue
            accepted += 1
        if self.metrics is not None:
            self.metrics.tokens(accepted)

    def accept_token(self, req: Request, token: int, now: float) -> None:
        """Record a sampled token, emit the new text, and decide whether the request is done."""
        if req.first_token_at is None:
            req.first_token_at = now
            if self.metrics is not None:
                self.metrics.observe_ttft(now - req.created)
        elif self.metrics is not None and req.last_token_at is not None:
            self.metrics.observe_itl(now - req.last_token_at)
        req.last_token_at = now
        req.pending = token
        ends = token == self.eos_id or token in self.stop_ids or token in req.params.stop_token_ids
        if ends:
            req.finish_reason = FinishReason.STOP
        else:
            req.generated.append(token)
            self._detokenize(req, len(req.generated) >= req.params.max_tokens)
        text = req.text
        for s in req.params.stop:
            at = text.find(s, max(0, req.sent - len(s)))
            if at >= 0:
                text, req.finish_reason = text[:at], FinishReason.STOP
                break
        if req.finish_reason is None and len(req.generated) >= req.params.max_tokens:
            req.finish_reason = FinishReason.LENGTH
        if req.finish_reason is not None and req.read < len(req.generated) and text is req.text:
            self._detokenize(req, True)  # the tokens held back (an incomplete character), as they decode
            text = req.text
        # Hold back text that may be the start of a stop string.
        safe = len(text)
        if req.finish_reason is None:
            for s in req.params.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        safe = min(safe, len(text) - k)
                        break
        if safe > req.sent:
            req.emit(TextEmitted(text[req.sent : safe]))
            req.sent = safe
        if req.finish_reason is not None:
            # An end id counts as a generated token (as the OpenAI API counts it); a stop string's
            # tokens are already in generated.
            req.emit(Finished(req.finish_reason, len(req.prompt_ids), len(req.generated) + ends))

    def _detokenize(self, req: Request, final: bool) -> None:
        """Add the text of the tokens not yet read to ``req.text``, decoding a window of a few tokens
        (the last ones read give the context, e.g. a leading space): O(1) per token. An incomplete
        UTF-8 character at the end is held back until a later token completes it, ``final``, or
        ``DECODE_WINDOW`` tokens (then it stays a replacement character)."""
        ids, decode = req.generated, self.decode_text
        before = decode(ids[req.prefix : req.read]) if req.read > req.prefix else ""
        after = decode(ids[req.prefix :])
        new = after[len(before) :]
        complete = final or not new.endswith("\ufffd") or len(ids) - req.read >= DECODE_WINDOW
        stable = new if complete else new.rstrip("\ufffd")
        if len(stable) > req.tail:
            req.text += stable[req.tail :]
            req.tail = len(stable)
        if complete:
            req.prefix, req.read, req.tail = req.read, len(ids), 0


def fail(req: Request, exc: BaseException) -> None:
    """End ``req`` with a :class:`Failed` event naming what failed (once)."""
    if req.finish_reason is None:
        req.finish_reason = FinishReason.ERROR
        with contextlib.suppress(Exception):  # the client's loop is gone: nobody to tell
            req.emit(Failed(f"{type(exc).__name__}: {exc}"))


def prefill_groups(joining: list[Request]) -> list[list[Request]]:
    """Joining requests in groups of similar prompt lengths for padded prefill (module constants)."""
    groups: list[list[Request]] = []
    group: list[Request] = []
    real = 0
    for req in sorted(joining, key=lambda r: len(r.prompt_ids), reverse=True):
        n = len(req.prompt_ids)
        if group:
            width = len(group[0].prompt_ids)
            slots = width * (len(group) + 1)
            if slots > PREFILL_TOKENS or slots - real - n > PREFILL_PADDING * slots:
                groups.append(group)
                group, real = [], 0
        group.append(req)
        real += n
    if group:
        groups.append(group)
    return groups
