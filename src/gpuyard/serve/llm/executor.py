"""gpuyard's engine's executor: runs a transformers causal LM with torch on what the scheduler chose.

:class:`TorchExecutor` implements :class:`~gpuyard.serve.llm.scheduler.Executor`: padded prefill of a
group of prompts, one chunk of a long prompt into a cache of its own, a decoding step of the batch,
and batched sampling. It decides nothing: which requests, which chunk and which rows come from the
scheduler.

The batch's cache is one preallocated buffer per layer, ``(max_batch, kv_heads, capacity, head_dim)``,
written in place: rows ``0..B-1`` are the running requests, columns ``[lo, hi)`` the positions in use,
and a row's tokens end at column ``hi`` (left padding, with a per-row length for the attention mask
and the position ids). A decoding step is one forward pass of one token per running request, whose
new keys and values are written at column ``hi``: nothing is concatenated or rebuilt per step. A
request that leaves gives its row to the batch's last row (one row copied); the buffer is compacted
or grown only when its columns run out (amortised over as many steps as the batch is wide).

For transformers' Llama, Mistral and Qwen2 models a decoding step skips the model's forward: a lean
step (:class:`_LeanDecode`) runs the same operations on the same weights and cache, bit for bit the
same logits, without transformers' per-step mask building, output capture and module plumbing (about
half of a small model's step on the CPU, where the matrix products are the rest). Any other model, or
one with a hook or a replaced layer, runs its own forward.

Sampling is batched: one argmax over the batch for greedy rows, one softmax (temperature, top-p) for
sampling rows, one multinomial for unseeded rows and the request's own seeded generator for seeded
ones (the same seed gives the same text whatever else runs in the batch, up to float rounding of
batched matmuls), and one device-to-host copy of the step's tokens.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from gpuyard.serve.llm.scheduler import Chunk, Request, Sampled


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


class TorchExecutor:
    """Runs ``model`` (a transformers causal LM in eval mode, on ``device``) for the scheduler; its
    batch has at most ``max_batch`` rows. Call its methods under ``torch.inference_mode()``."""

    def __init__(self, model: Any, device: torch.device, max_batch: int) -> None:
        self.model, self.device, self.max_batch = model, device, max_batch
        self.slots = _Slots()
        self._cache: Any = None  # the transformers Cache over the slots, made at the first join
        self._partial: dict[Request, Any] = {}  # a long prompt's own cache while it is prefilled
        # The KV of the last prefill waiting for join(): per request, (the KV, its row, its length).
        self._pending: dict[Request, tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]] = {}
        # transformers renames past_key_values to cache (5.x deprecation): use what forward takes.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._lean = _LeanDecode.of(model)  # None: decoding steps run the model's own forward

    def prefill(self, group: list[Request]) -> list[Sampled]:
        """``group``'s prompts in one left-padded forward; each one's first token sampled."""
        self._pending = {}
        lengths = [len(r.prompt_ids) for r in group]
        width = max(lengths)
        ids = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group], device=self.device
        )
        kwargs: dict[str, Any] = {
            "input_ids": ids, "use_cache": True, self._cache_arg: _new_cache(), **self._last_only
        }  # fmt: skip
        if min(lengths) < width:
            mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=self.device)
            kwargs["attention_mask"] = mask
            kwargs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(**kwargs)
        tokens = self._sample(group, out.logits[:, -1])
        kv = [(layer.keys, layer.values) for layer in _cache_of(out).layers]
        self._pending = {r: (kv, row, n) for row, (r, n) in enumerate(zip(group, lengths, strict=True))}
        return tokens

    def prefill_chunk(self, chunk: Chunk) -> list[Sampled]:
        """One chunk into the prompt's own cache; after the last, its first token sampled."""
        self._pending = {}
        ids = chunk.req.prompt_ids
        cache = self._partial.setdefault(chunk.req, _new_cache())
        out = self.model(
            input_ids=torch.tensor([ids[chunk.start : chunk.end]], device=self.device),
            position_ids=torch.arange(chunk.start, chunk.end, device=self.device)[None, :],
            use_cache=True,
            **{self._cache_arg: cache},
            **self._last_only,
        )
        if not chunk.last:
            return []
        del self._partial[chunk.req]
        tokens = self._sample([chunk.req], out.logits[:, -1])
        self._pending = {chunk.req: ([(layer.keys, layer.values) for layer in cache.layers], 0, len(ids))}
        return tokens

    def join(self, reqs: list[Request]) -> None:
        """Copy each request's prompt KV into the next row of the batch's cache."""
        pending, self._pending = self._pending, {}
        slots = self.slots
        for req in reqs:
            kv, row, length = pending[req]
            if self._cache is None:
                slots.make_room(length, self.max_batch, kv)
                layer = _slot_layer_class()
                self._cache = _new_cache()
                self._cache.layers = [layer(slots, i) for i in range(len(kv))]
                self._cache.layer_class_to_replicate = None
            slots.make_room(length, self.max_batch, kv)
            slots.add(kv, row, length)

    def decode(self, reqs: list[Request]) -> list[Sampled]:
        """One token per running request, written at the batch's next column."""
        slots = self.slots
        slots.make_room(0, self.max_batch, [])
        tokens = torch.tensor([[r.pending] for r in reqs], device=self.device)
        positions = torch.tensor(slots.lens, device=self.device)[:, None]
        width = slots.hi - slots.lo
        mask = None
        if min(slots.lens) < width:  # some rows are padded: a mask of each row's columns (and the new one)
            cols = torch.arange(width + 1, device=self.device)[None, :]
            mask = cols >= width - positions
        if self._lean is not None:
            logits = self._lean(tokens, positions, mask, self._cache.layers)
        else:
            out = self.model(
                input_ids=tokens,
                attention_mask=None if mask is None else mask.long(),
                position_ids=positions,
                use_cache=True,
                **{self._cache_arg: self._cache},
                **self._last_only,
            )
            logits = out.logits[:, -1]
        slots.hi += 1
        slots.lens = [n + 1 for n in slots.lens]
        return self._sample(reqs, logits)

    def remove(self, row: int) -> None:
        self.slots.remove(row)

    def drop(self, req: Request) -> None:
        self._partial.pop(req, None)

    def reset(self) -> None:
        self.slots.reset()
        self._partial.clear()
        self._pending = {}

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[Sampled]:
        """The next token of each request from its row of ``logits`` (rows, vocab), or the exception of a
        request whose own sampling failed (the scheduler fails it: the others go on).

        Sampling is batched; when the batch fails (one row's values), each row is sampled alone so the
        failure stays with its own request.
        """
        logits = self._adjusted(reqs, logits)
        try:
            return list(self._sample_batch(reqs, logits))
        except Exception:
            if len(reqs) == 1:
                raise
        out: list[Sampled] = []
        for i, req in enumerate(reqs):
            try:
                out.append(self._sample_batch([req], logits[i : i + 1])[0])
            except Exception as exc:
                out.append(exc)
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
        if not bool(torch.isfinite(logits).all()):
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


# The model families whose decoding step _LeanDecode runs: transformers' Llama, Mistral and Qwen2, whose
# modules share one forward code (pre-norm attention with rotary embeddings and a gated MLP; Qwen2's
# query, key and value projections have biases).
_LEAN_FAMILIES = ("Llama", "Mistral", "Qwen2")


class _LeanDecode:
    """A decoding step (one new token per row) of a Llama-family model: the same operations as the
    model's own forward, in the same order, on the same weights and the same slot cache (its logits are
    bit for bit those of ``model(...)``), without what transformers adds around them per step (mask
    building, output capture, keyword plumbing, module calls and attribute lookups).

    :meth:`of` gives one only for a model it knows module for module; any other (another architecture,
    another attention implementation, a sliding window, a replaced or hooked module: an adapter, a
    quantized layer, an offloading hook) keeps the model's own forward.
    """

    def __init__(self, model: Any) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        base = model.model
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.attend = ALL_ATTENTION_FUNCTIONS["sdpa"]  # what the model's attention calls (same GQA path)
        self.norm, self.head = _norm(base.norm), _linear(model.lm_head)
        self.layers = []
        for layer in base.layers:
            at, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                _norm(layer.input_layernorm), at, at.head_dim, at.scaling,
                _linear(at.q_proj), _linear(at.k_proj), _linear(at.v_proj), _linear(at.o_proj),
                _norm(layer.post_attention_layernorm), mlp.act_fn,
                _linear(mlp.gate_proj), _linear(mlp.up_proj), _linear(mlp.down_proj),
            ))  # fmt: skip

    @classmethod
    def of(cls, model: Any) -> _LeanDecode | None:
        """The lean step of ``model``, or None where it would not be exactly the model's own."""
        name = type(model).__name__
        fam = next((f for f in _LEAN_FAMILIES if name == f"{f}ForCausalLM"), None)
        cfg, base = getattr(model, "config", None), getattr(model, "model", None)
        if fam is None or cfg is None or base is None or model.training:
            return None
        if getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "sliding_window", None):
            return None
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return None
        layers = list(base.layers)
        if not layers or len(layers) != cfg.num_hidden_layers:
            return None
        expected: list[tuple[Any, str]] = [
            (base.norm, "RMSNorm"), (base.rotary_emb, "RotaryEmbedding"), (base, "Model")
        ]  # fmt: skip
        linears = [model.lm_head]
        for layer in layers:
            at, mlp = layer.self_attn, layer.mlp
            expected += [(layer, "DecoderLayer"), (at, "Attention"), (mlp, "MLP")]
            expected += [(layer.input_layernorm, "RMSNorm"), (layer.post_attention_layernorm, "RMSNorm")]
            linears += [at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m).__name__ != fam + kind for m, kind in expected):
            return None
        if (
            any(type(m) is not torch.nn.Linear for m in linears)
            or type(base.embed_tokens) is not torch.nn.Embedding
        ):
            return None
        if _hooked(model):
            return None
        return cls(model)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: list[Any]
    ) -> torch.Tensor:
        linear, rms, attend = torch.nn.functional.linear, _rms_norm, self.attend
        h = self.embed(tokens)
        rows = tokens.shape[0]
        # Rotary embedding, with transformers' x * cos + rotate_half(x) * sin written as
        # x * cos + roll(x) * sin' (sin' is sin with its first half negated: the same products, as
        # -(a * b) == (-a) * b exactly), on the queries and keys of a layer at once.
        cos, sin = self.rotary(h, positions)
        half = cos.shape[-1] // 2
        cos, sin = cos[:, :, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None]
        if mask is not None:
            mask = mask[:, None, None, :]
        for (n1, at, dim, scale, q, k, v, o, n2, act, gate, up, down), slot in zip(
            self.layers, cache, strict=True
        ):
            x = rms(h, *n1)
            qk = torch.cat((linear(x, *q), linear(x, *k)), dim=-1).view(rows, 1, -1, dim)
            qk = qk * cos + qk.roll(half, -1) * sin
            heads = qk.shape[2] - (k[0].shape[0] // dim)
            qs, ks = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
            vs = linear(x, *v).view(rows, 1, -1, dim).transpose(1, 2)
            ks, vs = slot.update(ks, vs)
            a, _ = attend(at, qs, ks, vs, mask, dropout=0.0, scaling=scale)
            h = h + linear(a.reshape(rows, 1, -1).contiguous(), *o)
            x = rms(h, *n2)
            h = h + linear(act(linear(x, *gate)) * linear(x, *up), *down)
        return linear(rms(h, *self.norm), *self.head)[:, -1]


def _hooked(model: Any) -> bool:
    """Whether a forward hook or a replaced forward may change what a module of ``model`` computes."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in model.modules())


def _linear(m: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return m.weight, m.bias


def _norm(m: Any) -> tuple[torch.Tensor, float]:
    return m.weight, m.variance_epsilon


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, operation for operation."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x if dtype == torch.float32 else x.to(dtype))


def _new_cache() -> Any:
    from transformers import DynamicCache

    # A cache of full layers (not the config's sliding-window ones, which keep only the window).
    return DynamicCache()


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
