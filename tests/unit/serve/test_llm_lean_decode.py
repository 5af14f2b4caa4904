"""The executor's lean decoding step of Llama-family models: bit for bit the model's own forward (logits
compared at every step of a batch that requests join and leave, padded rows included) and greedy
output equal to transformers' generate(), for Llama, Qwen2 (projection biases) and Mistral; any model
it does not know module for module (another architecture, eager attention, a sliding window, a hook,
a replaced projection) keeps the model's own forward and still matches generate()."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpuyard.serve.llm.executor import TorchExecutor, _LeanDecode
from gpuyard.serve.llm.scheduler import Request, SamplingParams, Scheduler

pytestmark = pytest.mark.unit

VOCAB = 300


def tiny(family: str, **extra: Any) -> Any:
    """A random two-layer model of ``family`` with grouped-query attention, weights sharpened so greedy
    text does not hang on float rounding."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
        pad_token_id=0, **extra,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))  # biases non-zero too
    return model


def workload(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 30))], rng.randint(1, 14)) for _ in range(6)
    ]


def run(
    model: Any, work: list[tuple[list[int], int]], lean: bool, device: str = "cpu"
) -> tuple[list[list[int]], list[Any], Any]:
    """The work through a scheduler of 3 slots (prompts over 8 tokens prefilled in chunks) stepped here:
    each request's tokens, the logits of every sampling, and the executor (``model`` on ``device``)."""
    ex = TorchExecutor(model, torch.device(device), 3)
    if not lean:
        ex._lean = None
    logits: list[Any] = []
    sample = ex._sample

    def record(reqs: list[Request], rows: torch.Tensor) -> Any:
        logits.append(rows.clone())
        return sample(reqs, rows)

    ex._sample = record  # type: ignore[method-assign]
    sched = Scheduler(3, 16, -1, lambda ids: " ".join(map(str, ids)), chunk=8)  # no eos: as generate()
    reqs = [Request(ids, SamplingParams(max_tokens=n, temperature=0), lambda ev: None) for ids, n in work]
    for r in reqs:
        sched.submit(r)
    with torch.inference_mode():
        while sched.busy:
            sched.step(ex, sched.admit(), float)
    for r, (_, n) in zip(reqs, work, strict=True):
        assert r.finish_reason is not None and len(r.generated) == n
    return [r.generated for r in reqs], logits, ex


def assert_generate(model: Any, work: list[tuple[list[int], int]], outputs: list[list[int]]) -> None:
    for (ids, n), got in zip(work, outputs, strict=True):
        with torch.inference_mode():
            ids_t = torch.tensor([ids], device=model.device)
            ref = model.generate(input_ids=ids_t, max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert got == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral"])
def test_lean_steps_are_the_models_own_forward_bit_for_bit_and_equal_generate(family: str) -> None:
    model = tiny(family, **({"sliding_window": None} if family == "Mistral" else {}))
    work = workload(seed=len(family))
    outputs, logits, ex = run(model, work, lean=True)
    assert ex._lean is not None
    ref_outputs, ref_logits, _ = run(model, work, lean=False)
    assert outputs == ref_outputs
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits, strict=True):
        assert torch.equal(got, want)
    assert_generate(model, work, outputs)


def test_padded_rows_take_the_masked_lean_step() -> None:
    """Rows of different lengths decode together through the lean step with a padding mask."""
    model = tiny("Llama")
    work = workload(seed=11)
    calls: list[bool] = []
    original = _LeanDecode.__call__

    def spy(self: _LeanDecode, tokens: torch.Tensor, positions: torch.Tensor, mask: Any, cache: Any) -> Any:
        calls.append(mask is not None and tokens.shape[0] > 1)
        return original(self, tokens, positions, mask, cache)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_LeanDecode, "__call__", spy)
        outputs, logits, _ = run(model, work, lean=True)
    _, ref_logits, _ = run(model, work, lean=False)
    assert any(calls) and not all(calls)  # masked batches and unmasked steps both ran
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    assert_generate(model, work, outputs)


class Adapter(torch.nn.Linear):
    """A projection replaced by a subclass (as adapters and quantized layers do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1.5


def eager() -> Any:
    return tiny("Llama", attn_implementation="eager")


def hooked() -> Any:
    model = tiny("Llama")
    model.model.layers[1].mlp.register_forward_hook(lambda _m, _a, out: out * 0.5)
    return model


def adapted() -> Any:
    model = tiny("Llama")
    old = model.model.layers[0].self_attn.q_proj
    new = Adapter(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    model.model.layers[0].self_attn.q_proj = new
    return model


def gpt2() -> Any:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize(
    "make",
    [eager, hooked, adapted, gpt2, lambda: tiny("Mistral", sliding_window=16), lambda: tiny("Llama").train()],
    ids=["eager", "hooked", "adapted", "gpt2", "sliding-window", "training"],
)
def test_models_it_does_not_know_keep_their_own_forward(make: Callable[[], Any]) -> None:
    model = make()
    assert _LeanDecode.of(model) is None
    if not model.training:
        work = workload(seed=5)
        outputs, _, ex = run(model, work, lean=True)
        assert ex._lean is None
        assert_generate(model, work, outputs)


def test_a_non_finite_row_fails_its_own_request_alone() -> None:
    ex = TorchExecutor(tiny("Llama"), torch.device("cpu"), 3)
    reqs = [Request([3], SamplingParams(max_tokens=1, temperature=0), lambda ev: None) for _ in range(3)]
    for bad in (float("nan"), float("inf"), float("-inf")):
        rows = torch.tensor([[0.0, 2.0, 1.0], [0.0, bad, 1.0], [5.0, 2.0, 1.0]])
        first, second, third = ex._sample(reqs, rows)
        assert (first, third) == (1, 0)
        assert isinstance(second, FloatingPointError) and "non-finite" in str(second)
    with pytest.raises(FloatingPointError):
        ex._sample(reqs[:1], torch.tensor([[0.0, float("nan")]]))
