"""On a CUDA GPU: the LLM engine's lean decoding step is the model's own forward bit for bit, in bf16
(how a GPU serves) and fp32, and in fp32 its greedy text equals transformers' generate() (in bf16 a
batch of other shapes may round differently, as in any batching engine, so only the step is compared)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers: `make gpu-wheels` ships it for this test")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral"])
def test_lean_steps_on_cuda_are_the_models_own_forward(family: str, dtype: torch.dtype) -> None:
    from tests.unit.serve.test_llm_lean_decode import assert_generate, run, tiny, workload

    model = tiny(family, **({"sliding_window": None} if family == "Mistral" else {}))
    model = model.to("cuda", dtype)
    work = workload(seed=len(family))
    outputs, logits, ex = run(model, work, lean=True, device="cuda")
    assert ex._lean is not None
    ref_outputs, ref_logits, _ = run(model, work, lean=False, device="cuda")
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits, strict=True):
        assert got.is_cuda and got.dtype == dtype
        assert torch.equal(got, want), f"max |lean - forward| {float((got - want).abs().max())}"
    assert outputs == ref_outputs
    if dtype == torch.float32:
        assert_generate(model, work, outputs)
