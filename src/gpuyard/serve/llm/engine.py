"""gpuyard's generation engine: continuous batching over a transformers causal LM with a KV cache.

One engine thread runs decoding steps. Between two steps, finished and cancelled requests leave the
running batch and waiting requests join it (up to ``max_batch``). Joining requests are prefilled
together in left-padded forward passes (grouped by prompt length so padding stays small), and each
one's prompt KV is copied into a row of the batch's cache. A prompt longer than ``PREFILL_CHUNK`` tokens
is prefilled in chunks instead (chunked prefill, as in Sarathi-Serve and vLLM): one chunk per engine
iteration, into a cache of its own, between the running batch's decoding steps, so a long prompt delays
the others' next token by one chunk's forward pass rather than by its whole prefill; its KV joins the
batch when its last chunk is done.

The batch's cache is one preallocated buffer per layer, ``(max_batch, kv_heads, capacity, head_dim)``,
written in place: rows ``0..B-1`` are the running requests, columns ``[lo, hi)`` the positions in use,
and a row's tokens end at column ``hi`` (left padding, with a per-row length for the attention mask
and the position ids). A decoding step is one forward pass of one token per running request, whose
new keys and values are written at column ``hi``: nothing is concatenated or rebuilt per step. A
request that leaves gives its row to the batch's last row (one row copied); the buffer is compacted
or grown only when its columns run out (amortised over as many steps as the batch is wide). A long
generation therefore never holds back a short one: the short one joins at the next step and leaves
as soon as it is done.

Sampling is batched: one argmax over the batch for greedy rows, one softmax (temperature, top-p) for
sampling rows, one multinomial for unseeded rows and the request's own seeded generator for seeded
ones (the same seed gives the same text whatever else runs in the batch, up to float rounding of
batched matmuls), and one device-to-host copy of the step's tokens. Text is decoded incrementally (a
window of the last few tokens, not the whole generation, per token), holding back an incomplete UTF-8
character until a later token completes it. Stops: ``max_tokens``, a token of the model's stop list
(:func:`stop_token_ids`: every end-of-sequence id of the tokenizer and generation_config, and every
special token, role markers included), a request's ``stop_token_ids``, or a stop string.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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


@dataclass
class Request:
    """One generation: its prompt tokens, sampling, and where its events go."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[dict[str, Any]], None]
    created: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    generated: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already emitted
    first_token_at: float | None = None
    last_token_at: float | None = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    pending: int = -1  # the last sampled token, fed to the next step
    prefix: int = 0  # generated[prefix:read] is the context decoded before the new tokens
    read: int = 0  # generated[:read] is in text
    tail: int = 0  # characters of text from generated[read:] (before an incomplete character)


@dataclass
class _Partial:
    """A long prompt being prefilled chunk by chunk: its first ``done`` tokens are in ``cache``."""

    req: Request
    cache: Any
    done: int = 0


class _Slots:
    """The batch's KV cache: per layer a (rows, kv_heads, capacity, head_dim) key and value buffer.

    Row r's cached tokens are columns ``[hi - lens[r], hi)``; ``lo`` is the first column any row uses.
    """

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lens: list[int] = []
        self.lo = 0
        self.hi = 0

    @property
    def rows(self) -> int:
        return len(self.lens)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def reset(self) -> None:
        self.lens, self.lo, self.hi = [], 0, 0

    def make_room(self, left: int, rows: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Ensure a row of ``left`` cached tokens can end at column ``hi`` and one more column fits
        after it: move the used columns right or to the start, or grow the buffers (zeros, so masked
        columns are finite)."""
        width = self.hi - self.lo
        if self.k and self.hi >= left and self.hi < self.capacity:
            return
        new_hi = max(width, left)
        need = new_hi + 1
        if not self.k or need > self.capacity:
            like = list(zip(self.k, self.v, strict=True)) or like
            cap = max(need + max(need, 32), self.capacity)
            k = [kk.new_zeros((rows, kk.shape[1], cap, kk.shape[3])) for kk, _ in like]
            v = [vv.new_zeros((rows, vv.shape[1], cap, vv.shape[3])) for _, vv in like]
            if self.k and width:
                for old, new in zip([*self.k, *self.v], [*k, *v], strict=True):
                    new[: self.rows, :, new_hi - width : new_hi] = old[: self.rows, :, self.lo : self.hi]
            self.k, self.v = k, v
        elif width:
            for buf in [*self.k, *self.v]:
                buf[: self.rows, :, new_hi - width : new_hi] = buf[: self.rows, :, self.lo : self.hi].clone()
        self.lo, self.hi = new_hi - width, new_hi

    def add(self, kv: list[tuple[torch.Tensor, torch.Tensor]], row: int, length: int) -> None:
        """Append a request whose cache is the last ``length`` columns of row ``row`` of ``kv``."""
        r, start = self.rows, self.hi - length
        for (k, v), bk, bv in zip(kv, self.k, self.v, strict=True):
            bk[r, :, start : self.hi] = k[row, :, k.shape[2] - length :]
            bv[r, :, start : self.hi] = v[row, :, v.shape[2] - length :]
        self.lens.append(length)
        self.lo = min(self.lo, start) if r else start

    def remove(self, r: int) -> None:
        """Drop row ``r``: the last row takes its place."""
        last = self.rows - 1
        if r != last:
            for buf in [*self.k, *self.v]:
                buf[r, :, self.lo : self.hi] = buf[last, :, self.lo : self.hi]
            self.lens[r] = self.lens[last]
        self.lens.pop()
        if self.lens:
            self.lo = self.hi - max(self.lens)
        else:
            self.reset()


def _slot_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class SlotLayer(DynamicLayer):  # type: ignore[misc]
        """One layer of the batch's cache as transformers sees it: new keys/values are written in place
        at column ``hi`` and attention reads the columns ``[lo, hi + new)``."""

        def __init__(self, slots: _Slots, index: int) -> None:
            super().__init__()
            self.slots, self.index = slots, index
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            s, rows, q = self.slots, key_states.shape[0], key_states.shape[2]
            k, v = s.k[self.index], s.v[self.index]
            k[:rows, :, s.hi : s.hi + q] = key_states
            v[:rows, :, s.hi : s.hi + q] = value_states
            return k[:rows, :, s.lo : s.hi + q], v[:rows, :, s.lo : s.hi + q]

        def get_seq_length(self) -> int:
            return self.slots.hi - self.slots.lo

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

    return SlotLayer


class Engine:
    """Continuous batching over one model (module docstring).

    Args:
        model: a transformers causal LM (eval mode, on ``device``).
        tokenizer: gpuyard's :class:`~gpuyard.data.tokens.LoadedTokenizer`.
        context_length: most tokens (prompt + generated) of a request.
        max_batch: most requests decoding at once.
        max_queue: most requests waiting to join; more are refused (:class:`QueueFull`).
        metrics: an object with ``observe_ttft``, ``observe_itl``, ``tokens``, ``set_queue``, ``set_batch``.
        stop_ids: token ids besides the tokenizer's end-of-sequence that end every request
            (:func:`stop_token_ids`).
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
    ) -> None:
        self.model = model
        self.tok = tokenizer
        self.context_length = context_length
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.device = device or torch.device("cpu")
        self.metrics = metrics
        self.eos_id = tokenizer.eos_id
        self.stop_ids = frozenset(int(i) for i in stop_ids) - {self.eos_id}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # row r of the cache is running[r]
        self.partial: collections.deque[_Partial] = collections.deque()  # long prompts, oldest first
        self._cond = threading.Condition()
        self._stop = False
        self._slots = _Slots()
        self._cache: Any = None  # the transformers Cache over the slots, made at the first join
        self._joined: tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]] = ([], [])
        # transformers renames past_key_values to cache (5.x deprecation): use what forward takes.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._thread = threading.Thread(target=self._loop, name="gpuyard-llm-engine", daemon=True)
        self._thread.start()

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
            ConfigError: it does not fit the context. QueueFull: the waiting queue is full.
        """
        self.check(len(req.prompt_ids), req.params.max_tokens, req.params.max_tokens_given)
        if req.params.seed is not None:
            try:
                req.generator = torch.Generator(device="cpu").manual_seed(req.params.seed)
            except (RuntimeError, OverflowError, ValueError) as exc:
                raise ConfigError(f"seed: {exc}") from None
        with self._cond:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(
                    f"the server's queue is full ({self.max_queue} requests waiting); retry later"
                )
            self.waiting.append(req)
            if self.metrics is not None:
                self.metrics.set_queue(len(self.waiting))
            self._cond.notify()

    def cancel(self, req: Request) -> None:
        """Drop a request (a closed stream, a client gone): a waiting one frees its queue place now, a
        running one leaves the batch before the next step."""
        req.cancelled = True
        with self._cond:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass  # not waiting (any more): running, prefilling or done
            else:
                if self.metrics is not None:
                    self.metrics.set_queue(len(self.waiting))
            self._cond.notify()

    def inflight(self) -> str:
        """The requests in flight, in words ("" when none): for the shutdown's log lines."""
        running, waiting = len(self.running) + len(self.partial), len(self.waiting)
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
                while not self._stop and not self.waiting and not self.running and not self.partial:
                    self._cond.wait()
                if self._stop:
                    return
                joining: list[Request] = []
                while self.waiting and len(self.running) + len(self.partial) + len(joining) < self.max_batch:
                    req = self.waiting.popleft()
                    if not req.cancelled:
                        joining.append(req)
                if self.metrics is not None:
                    self.metrics.set_queue(len(self.waiting))
            try:
                with torch.inference_mode():
                    self._leave()
                    short = [r for r in joining if len(r.prompt_ids) <= PREFILL_CHUNK]
                    self.partial.extend(_Partial(r, self._new_cache()) for r in joining if r not in short)
                    for group in _prefill_groups(short):
                        try:
                            self._prefill(group)
                        except Exception as exc:  # this group's forward pass: fails this group only
                            for req in group:
                                _fail(req, exc)
                            continue
                        self._admit(group, *self._joined)
                    self._advance()
                    self._leave()
                    if self.running:
                        self._step()
                        self._leave()
            except Exception as exc:  # a failed batch step (or cache copy) fails the batch, not the server
                for req in [*self.running, *joining, *(p.req for p in self.partial)]:
                    _fail(req, exc)
                self.running = []
                self.partial.clear()
                self._slots.reset()
            if self.metrics is not None:
                self.metrics.set_batch(len(self.running))

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int | None]:
        """The next token of each request from its row of ``logits`` (rows, vocab); None for a request
        whose own sampling failed (it has been failed: the others go on).

        Sampling is batched; when the batch fails (one row's values), each row is sampled alone so the
        failure stays with its own request.
        """
        logits = self._adjusted(reqs, logits)
        try:
            return list(self._sample_batch(reqs, logits))
        except Exception:
            if len(reqs) == 1:
                raise
        out: list[int | None] = []
        for i, req in enumerate(reqs):
            try:
                out.append(self._sample_batch([req], logits[i : i + 1])[0])
            except Exception as exc:
                _fail(req, exc)
                out.append(None)
        return out

    def _adjusted(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with each request's logit bias and presence/frequency penalties applied."""
        rows = [i for i, r in enumerate(reqs) if r.params.adjusts]
        if not rows:
            return logits
        logits = logits.float().clone()
        vocab = logits.shape[-1]
        for i in rows:
            p = reqs[i].params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
                vals = torch.tensor([v for t, v in p.logit_bias.items() if t < vocab])
                logits[i].index_add_(0, ids.to(logits.device), vals.to(logits.device))
            if (p.presence_penalty or p.frequency_penalty) and reqs[i].generated:
                seen = torch.tensor(reqs[i].generated, dtype=torch.long).clamp(max=vocab - 1)
                counts = torch.bincount(seen, minlength=vocab).to(logits.device, logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _sample_batch(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        bad = ~torch.isfinite(logits).all(dim=-1)
        if bool(bad.any()):
            raise FloatingPointError("the model produced non-finite logits")
        tokens = torch.argmax(logits, dim=-1)
        rows = [i for i, r in enumerate(reqs) if r.params.temperature > 0]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            temp = torch.tensor([reqs[i].params.temperature for i in rows], device=logits.device)
            sel_logits = logits.index_select(0, idx).float()
            # Shifted so the largest is 0: a tiny temperature sends the others to -inf, never to NaN.
            sel_logits = (sel_logits - sel_logits.amax(dim=-1, keepdim=True)) / temp[:, None]
            top_k = [reqs[i].params.top_k for i in rows]
            if any(0 < k < sel_logits.shape[-1] for k in top_k):
                for j, k in enumerate(top_k):
                    if 0 < k < sel_logits.shape[-1]:
                        kth = torch.topk(sel_logits[j], k).values[-1]
                        sel_logits[j] = sel_logits[j].masked_fill(sel_logits[j] < kth, float("-inf"))
            probs = torch.softmax(sel_logits, dim=-1)
            top_p = [reqs[i].params.top_p for i in rows]
            if min(top_p) < 1.0:
                sorted_p, order = torch.sort(probs, dim=-1, descending=True)
                limit = torch.tensor(top_p, device=logits.device)[:, None]
                keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < limit
                keep[:, 0] = True
                probs = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
            drawn = torch.empty(len(rows), dtype=torch.long)
            free = [j for j, i in enumerate(rows) if reqs[i].generator is None]
            if free:
                sel = torch.tensor(free, device=logits.device)
                drawn[free] = torch.multinomial(probs.index_select(0, sel), 1)[:, 0].cpu()
            cpu = probs.cpu() if len(free) < len(rows) else probs
            for j, i in enumerate(rows):
                if reqs[i].generator is not None:
                    drawn[j] = torch.multinomial(cpu[j], 1, generator=reqs[i].generator)[0]
            tokens = tokens.cpu()
            tokens[rows] = drawn
        return [int(t) for t in tokens.tolist()]

    def _accept(self, req: Request, token: int, now: float) -> None:
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
            req.finish_reason = "stop"
        else:
            req.generated.append(token)
            self._detokenize(req, len(req.generated) >= req.params.max_tokens)
        text = req.text
        for s in req.params.stop:
            at = text.find(s, max(0, req.sent - len(s)))
            if at >= 0:
                text, req.finish_reason = text[:at], "stop"
                break
        if req.finish_reason is None and len(req.generated) >= req.params.max_tokens:
            req.finish_reason = "length"
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
            req.emit({"text": text[req.sent : safe]})
            req.sent = safe
        if req.finish_reason is not None:
            req.emit(
                {
                    "done": req.finish_reason,
                    "prompt_tokens": len(req.prompt_ids),
                    "completion_tokens": len(req.generated) + (req.finish_reason == "stop" and ends),
                }
            )

    def _detokenize(self, req: Request, final: bool) -> None:
        """Add the text of the tokens not yet read to ``req.text``, decoding a window of a few tokens
        (the last ones read give the context, e.g. a leading space): O(1) per token. An incomplete
        UTF-8 character at the end is held back until a later token completes it, ``final``, or
        ``DECODE_WINDOW`` tokens (then it stays a replacement character)."""
        ids, decode = req.generated, self.tok.tokenizer.decode
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

    def _accept_all(self, reqs: list[Request], tokens: list[int | None]) -> None:
        now = time.perf_counter()
        accepted = 0
        for req, token in zip(reqs, tokens, strict=True):
            if not req.cancelled and token is not None and req.finish_reason is None:
                try:
                    self._accept(req, token, now)
                except Exception as exc:  # this request's text or stop handling: fails it alone
                    _fail(req, exc)
                    continue
                accepted += 1
        if self.metrics is not None:
            self.metrics.tokens(accepted)

    def _prefill(self, group: list[Request]) -> None:
        """Prefill ``group`` in one left-padded forward and sample each one's first token; the prompt
        KV waits in ``self._joined`` for :meth:`_admit`."""
        lengths = [len(r.prompt_ids) for r in group]
        width = max(lengths)
        ids = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group], device=self.device
        )
        kwargs: dict[str, Any] = {
            "input_ids": ids, "use_cache": True, self._cache_arg: self._new_cache(), **self._last_only
        }  # fmt: skip
        if min(lengths) < width:
            mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=self.device)
            kwargs["attention_mask"] = mask
            kwargs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(**kwargs)
        self._accept_all(group, self._sample(group, out.logits[:, -1]))
        self._joined = ([(layer.keys, layer.values) for layer in _cache_of(out).layers], lengths)

    @staticmethod
    def _new_cache() -> Any:
        from transformers import DynamicCache

        # A cache of full layers (not the config's sliding-window ones, which keep only the window).
        return DynamicCache()

    def _advance(self) -> None:
        """Prefill the next chunk of the oldest long prompt; after its last chunk, sample its first token
        and move its KV into the batch."""
        while self.partial and (self.partial[0].req.cancelled or self.partial[0].req.finish_reason):
            self.partial.popleft()
        if not self.partial:
            return
        part = self.partial[0]
        ids = part.req.prompt_ids
        end = min(part.done + PREFILL_CHUNK, len(ids))
        try:
            out = self.model(
                input_ids=torch.tensor([ids[part.done : end]], device=self.device),
                position_ids=torch.arange(part.done, end, device=self.device)[None, :],
                use_cache=True,
                **{self._cache_arg: part.cache},
                **self._last_only,
            )
            part.done = end
            if end < len(ids):
                return
            self.partial.popleft()
            self._accept_all([part.req], self._sample([part.req], out.logits[:, -1]))
        except Exception as exc:  # this prompt's own prefill: fails this request only
            if self.partial and self.partial[0] is part:
                self.partial.popleft()
            _fail(part.req, exc)
            return
        self._admit([part.req], [(layer.keys, layer.values) for layer in part.cache.layers], [len(ids)])

    def _admit(
        self, group: list[Request], kv: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int]
    ) -> None:
        """Copy each unfinished request's prompt KV (the last ``lengths[i]`` columns of row i of ``kv``)
        into a row of the batch's cache and add it to the running batch."""
        width = max(lengths)
        slots = self._slots
        if self._cache is None:
            slots.make_room(width, self.max_batch, kv)
            layer = _slot_layer_class()
            self._cache = self._new_cache()
            self._cache.layers = [layer(slots, i) for i in range(len(kv))]
            self._cache.layer_class_to_replicate = None
        for row, req in enumerate(group):
            if req.finish_reason is None and not req.cancelled:
                slots.make_room(lengths[row], self.max_batch, kv)
                slots.add(kv, row, lengths[row])
                self.running.append(req)

    def _leave(self) -> None:
        gone = [i for i, r in enumerate(self.running) if r.finish_reason is not None or r.cancelled]
        for i in reversed(gone):  # the last row takes a leaving row's place
            self._slots.remove(i)
            last = self.running.pop()
            if i < len(self.running):
                self.running[i] = last

    def _step(self) -> None:
        slots = self._slots
        slots.make_room(0, self.max_batch, [])
        tokens = torch.tensor([[r.pending] for r in self.running], device=self.device)
        positions = torch.tensor(slots.lens, device=self.device)[:, None]
        width = slots.hi - slots.lo
        mask = None
        if min(slots.lens) < width:  # some rows are padded: a mask of each row's columns (and the new one)
            cols = torch.arange(width + 1, device=self.device)[None, :]
            mask = (cols >= width - positions).long()
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: self._cache},
            **self._last_only,
        )
        slots.hi += 1
        slots.lens = [n + 1 for n in slots.lens]
        self._accept_all(self.running, self._sample(self.running, out.logits[:, -1]))


def _fail(req: Request, exc: BaseException) -> None:
    """End ``req`` with an error event naming what failed (once)."""
    if req.finish_reason is None:
        req.finish_reason = "error"
        with contextlib.suppress(Exception):  # the client's loop is gone: nobody to tell
            req.emit({"error": f"{type(exc).__name__}: {exc}"})


def _prefill_groups(joining: list[Request]) -> list[list[Request]]:
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


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


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
    engine: Engine, req_factory: Callable[[Callable[[dict[str, Any]], None]], Request]
) -> tuple[Request, asyncio.Queue[dict[str, Any]]]:
    """Submit a request whose events arrive on an asyncio queue of the running loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def emit(ev: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ev)

    req = req_factory(emit)
    engine.submit(req)
    return req, queue
