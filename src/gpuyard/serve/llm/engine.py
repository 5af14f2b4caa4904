"""gpuyard's generation engine: continuous batching over a transformers causal LM with a KV cache.

One engine thread runs decoding steps. Between two steps, finished and cancelled requests leave the
running batch and waiting requests join it (up to ``max_batch``): a joining request is prefilled
alone (its prompt's KV cache and first token), then its cache is merged into the batch's. The batch's
cache is left-padded to one length, with an attention mask marking each row's real positions and
per-row position ids, so each step is a single forward pass of one new token per running request,
whatever their lengths. A long generation therefore never holds back a short one: the short one
joins at the next step and leaves as soon as it is done.

Sampling per request: greedy (temperature 0) or temperature + top-p with the request's own seeded
generator (the same seed gives the same text whatever else runs in the batch, up to float rounding
of batched matmuls). Stops: ``max_tokens``, the end-of-sequence token, or a stop string.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpuyard.errors import CapacityError, ConfigError


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


class Engine:
    """Continuous batching over one model (module docstring).

    Args:
        model: a transformers causal LM (eval mode, on ``device``).
        tokenizer: gpuyard's :class:`~gpuyard.data.tokens.LoadedTokenizer`.
        context_length: most tokens (prompt + generated) of a request.
        max_batch: most requests decoding at once.
        max_queue: most requests waiting to join; more are refused (:class:`QueueFull`).
        metrics: an object with ``observe_ttft``, ``observe_itl``, ``tokens``, ``set_queue``, ``set_batch``.
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
    ) -> None:
        self.model = model
        self.tok = tokenizer
        self.context_length = context_length
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.device = device or torch.device("cpu")
        self.metrics = metrics
        self.eos_id = tokenizer.eos_id
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._cond = threading.Condition()
        self._stop = False
        # The batch's cache: per layer (keys, values) of (B, kv_heads, L, head_dim), left-padded.
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mask: torch.Tensor | None = None  # (B, L): 1 at real positions
        import inspect

        # transformers renames past_key_values to cache (5.x deprecation): use what forward takes.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._thread = threading.Thread(target=self._loop, name="gpuyard-llm-engine", daemon=True)
        self._thread.start()

    # ----- requests -----------------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request that cannot fit the context.

        Raises:
            ConfigError: prompt + max_tokens over the context length (both numbers named).
        """
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_tokens < 1:
            raise ConfigError("the prompt is empty (0 tokens)")
        if prompt_tokens + max_tokens > self.context_length:
            raise ConfigError(
                f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: "
                f"{prompt_tokens + max_tokens} is over the model's context length of {self.context_length}"
            )

    def submit(self, req: Request) -> None:
        """Queue a request (its events go to ``req.emit`` from the engine thread).

        Raises:
            ConfigError: it does not fit the context. QueueFull: the waiting queue is full.
        """
        self.check(len(req.prompt_ids), req.params.max_tokens)
        if req.params.seed is not None:
            req.generator = torch.Generator(device="cpu").manual_seed(req.params.seed)
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
        """Drop a request (a closed stream): it leaves the batch before the next step."""
        req.cancelled = True
        with self._cond:
            self._cond.notify()

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
                while not self._stop and not self.waiting and not self.running:
                    self._cond.wait()
                if self._stop:
                    return
                joining: list[Request] = []
                while self.waiting and len(self.running) + len(joining) < self.max_batch:
                    req = self.waiting.popleft()
                    if not req.cancelled:
                        joining.append(req)
                if self.metrics is not None:
                    self.metrics.set_queue(len(self.waiting))
            try:
                with torch.inference_mode():
                    self._leave()
                    for req in joining:
                        self._join(req)
                    self._leave()
                    if self.running:
                        self._step()
                        self._leave()
            except Exception as exc:  # a failed step fails its requests, not the server
                for req in [*self.running, *joining]:
                    if req.finish_reason is None:
                        req.finish_reason = "error"
                        req.emit({"error": f"{type(exc).__name__}: {exc}"})
                self.running, self._kv, self._mask = [], [], None
            if self.metrics is not None:
                self.metrics.set_batch(len(self.running))

    def _sample(self, req: Request, logits: torch.Tensor) -> int:
        p = req.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < p.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs.cpu(), 1, generator=req.generator))

    def _accept(self, req: Request, token: int) -> None:
        """Record a sampled token, emit the new text, and decide whether the request is done."""
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
            if self.metrics is not None:
                self.metrics.observe_ttft(now - req.created)
        elif self.metrics is not None and req.last_token_at is not None:
            self.metrics.observe_itl(now - req.last_token_at)
        req.last_token_at = now
        if self.metrics is not None:
            self.metrics.tokens(1)
        if token == self.eos_id:
            req.finish_reason = "stop"
        else:
            req.generated.append(token)
            req.text = self.tok.tokenizer.decode(req.generated)
        text = req.text
        for s in req.params.stop:
            at = text.find(s, max(0, req.sent - len(s)))
            if at >= 0:
                text, req.finish_reason = text[:at], "stop"
                break
        if req.finish_reason is None and len(req.generated) >= req.params.max_tokens:
            req.finish_reason = "length"
        # Hold back text that may be the start of a stop string, or an incomplete UTF-8 character.
        safe = len(text)
        if req.finish_reason is None:
            if text.endswith("\ufffd"):
                safe = len(text) - 1
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
                    "completion_tokens": len(req.generated)
                    + (req.finish_reason == "stop" and token == self.eos_id),
                }
            )

    def _join(self, req: Request) -> None:
        ids = torch.tensor([req.prompt_ids], device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        token = self._sample(req, out.logits[0, -1])
        self._accept(req, token)
        if req.finish_reason is not None:
            return
        kv = [(layer.keys, layer.values) for layer in _cache_of(out).layers]
        mask = torch.ones((1, len(req.prompt_ids)), dtype=torch.long, device=self.device)
        if not self.running:
            self._kv, self._mask = kv, mask
        else:
            assert self._mask is not None
            have, new = self._mask.shape[1], mask.shape[1]
            width = max(have, new)
            self._kv = [
                (torch.cat([_pad(k0, width), _pad(k1, width)]), torch.cat([_pad(v0, width), _pad(v1, width)]))
                for (k0, v0), (k1, v1) in zip(self._kv, kv, strict=True)
            ]
            self._mask = torch.cat([_pad_mask(self._mask, width), _pad_mask(mask, width)])
        req.pending = token  # type: ignore[attr-defined]
        self.running.append(req)

    def _leave(self) -> None:
        keep = [i for i, r in enumerate(self.running) if r.finish_reason is None and not r.cancelled]
        if len(keep) == len(self.running):
            return
        self.running = [self.running[i] for i in keep]
        if not keep:
            self._kv, self._mask = [], None
            return
        idx = torch.tensor(keep, device=self.device)
        assert self._mask is not None
        mask = self._mask.index_select(0, idx)
        # Columns that are padding in every remaining row are dropped (the cache stays as short as it can).
        first = int((mask.cumsum(1) == 0).sum(1).min())
        self._mask = mask[:, first:]
        self._kv = [
            (k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:]) for k, v in self._kv
        ]

    def _step(self) -> None:
        from transformers import DynamicCache

        assert self._mask is not None
        cache = DynamicCache()
        for i, (k, v) in enumerate(self._kv):
            cache.update(k, v, i)
        tokens = torch.tensor([[r.pending] for r in self.running], device=self.device)  # type: ignore[attr-defined]
        positions = self._mask.sum(1, keepdim=True)
        mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        # Without padding in any row the causal mask is all attention needs (cheaper than a padding mask).
        padded = None if bool(self._mask.all()) else mask
        out = self.model(
            input_ids=tokens,
            attention_mask=padded,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: cache},
        )
        self._kv = [(layer.keys, layer.values) for layer in _cache_of(out).layers]
        self._mask = mask
        logits = out.logits[:, -1]
        for i, req in enumerate(self.running):
            if req.cancelled:
                continue
            token = self._sample(req, logits[i])
            req.pending = token  # type: ignore[attr-defined]
            self._accept(req, token)


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence dimension (2) of a (B, heads, L, d) cache tensor with zeros to ``width``."""
    extra = width - t.shape[2]
    if extra == 0:
        return t
    return torch.cat([t.new_zeros((t.shape[0], t.shape[1], extra, t.shape[3])), t], dim=2)


def _pad_mask(m: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - m.shape[1]
    return m if extra == 0 else torch.cat([m.new_zeros((m.shape[0], extra)), m], dim=1)


def load_engine(
    folder: str | Path, device: str = "cpu", max_batch: int = 32, max_queue: int = 256, metrics: Any = None
) -> tuple[Engine, dict[str, Any]]:
    """An engine over the Hugging Face folder ``folder`` (config, safetensors, tokenizer.json)."""
    from gpuyard.models.llm import load_for_serving

    model, tok, info, dev = load_for_serving(folder, device)
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None
    )
    context = int(limit or info.get("context_length") or 2048)
    return Engine(model, tok, context, max_batch, max_queue, dev, metrics), info


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
