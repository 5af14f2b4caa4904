"""A registered LoRA adapter deployed with vLLM: its base model is served with the adapter by name
(unmerged, vLLM's --enable-lora); greedy output through the adapter equals transformers + PEFT with the
adapter applied and differs from the base's, which the same deployment serves by its own name. vLLM
really runs (see tests/integration/serve/test_llm_engines.py for when it is skipped)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from tests.integration.serve.test_llm_engines import VLLM_START_S, need_vllm, tiny_chat_model

from gpuyard.serve.deploy import deploy, undeploy
from gpuyard.serve.options import BatchConfig, ServeOptions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3000)]


def _greedy(model: object, folder: Path, prompt: list[int], n: int) -> list[int]:
    from gpuyard.serve.llm.engine import stop_token_ids

    stops = stop_token_ids(folder)
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=stops,
            pad_token_id=1,
        )  # fmt: skip
    gen = out[0, len(prompt) :].tolist()
    return gen[: next((i for i, t in enumerate(gen) if t in stops), len(gen))]


def test_a_lora_adapter_is_served_by_name_on_its_base(serve_home: Path, tmp_path: Path) -> None:
    need_vllm()
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from gpuyard.data.tokens import load_tokenizer
    from gpuyard.models.llm import register_lm

    folder, _ = tiny_chat_model(tmp_path)
    base = register_lm("lorabase", folder)
    torch.manual_seed(1)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
        ),
    )
    with torch.no_grad():  # a strong adapter: its greedy text differs from the base's
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    peft.save_pretrained(tmp_path / "adapter")
    adapter = register_lm("loraft", tmp_path / "adapter", base=base.ref)

    tok = load_tokenizer(folder)
    prompt = tok.encode_batch(["the cat sat on the mat"])[0]
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want_base = tok.tokenizer.decode(_greedy(plain, folder, prompt, 16))
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    want_adapter = tok.tokenizer.decode(_greedy(tuned, folder, prompt, 16))
    assert want_adapter != want_base

    opts = ServeOptions(
        port=0, replicas=1, device="cpu", drift=False, engine="vllm", batch=BatchConfig(max_batch=4)
    )
    doc = deploy(adapter.ref, opts, timeout_s=VLLM_START_S)
    try:
        headers = {"Authorization": f"Bearer {doc['api_key']}"}
        listed = httpx.get(f"{doc['url']}/v1/models", headers=headers, timeout=30).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [(base.ref, None), (adapter.ref, base.ref)]

        def complete(model: str) -> str:
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            r = httpx.post(f"{doc['url']}/v1/completions", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        assert complete(adapter.ref).rstrip("\ufffd") == want_adapter.rstrip("\ufffd")
        assert complete(base.ref).rstrip("\ufffd") == want_base.rstrip("\ufffd")
        body = {"model": "loraft:9", "prompt": "a", "max_tokens": 2}
        r = httpx.post(f"{doc['url']}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 404 and adapter.ref in r.json()["error"]["message"]
    finally:
        undeploy(str(doc["id"]))
