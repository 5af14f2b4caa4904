"""Registered LoRA adapters deployed with vLLM on their base model, unmerged, by name (vLLM's
--enable-lora): `gpuyard deploy BASE --adapter A --adapter B` of two random PEFT adapters of different
ranks on one random Llama. Greedy output through each adapter equals transformers + PEFT with that
adapter applied, and the base answers by its own name, all from one deployment (one vLLM start). vLLM
really runs (see tests/integration/serve/test_llm_engines.py for when it is skipped)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch
from tests.integration.serve.test_llm_engines import VLLM_START_S, VLLM_TEST_ENV, need_vllm, tiny_chat_model

from gpuyard.serve.deploy import undeploy

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


def _peft(folder: Path, out: Path, seed: int, rank: int, modules: list[str]) -> Path:
    """A random PEFT LoRA adapter of the model in ``folder``, strong enough to change its greedy text."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=16, target_modules=modules, init_lora_weights=False),
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    peft.save_pretrained(out)
    return out


def test_two_lora_adapters_are_served_by_name_on_their_base(
    serve_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    need_vllm()
    for key, value in VLLM_TEST_ENV.items():  # the deployment's process and its replica inherit it
        monkeypatch.setenv(key, value)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gpuyard.cli.main import main
    from gpuyard.data.tokens import load_tokenizer
    from gpuyard.models.llm import register_lm
    from gpuyard.serve.records import get_deployment

    folder, _ = tiny_chat_model(tmp_path)
    base = register_lm("lorabase", folder)
    made = {
        "loraft": _peft(folder, tmp_path / "a", 1, 4, ["q_proj", "v_proj", "o_proj"]),
        "lorawide": _peft(
            folder, tmp_path / "b", 2, 12, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
        ),
    }
    adapters = {register_lm(name, out, base=base.ref).ref: out for name, out in made.items()}

    tok = load_tokenizer(folder)
    prompt = tok.encode_batch(["the cat sat on the mat"])[0]
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = {base.ref: tok.tokenizer.decode(_greedy(plain, folder, prompt, 16))}
    for ref, out in adapters.items():
        tuned = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), out
        )
        want[ref] = tok.tokenizer.decode(_greedy(tuned.eval(), folder, prompt, 16))
    assert len(set(want.values())) == 3, want  # each adapter's greedy text differs from the other two

    a, b = adapters
    args = ["deploy", base.ref, "--adapter", a, "--adapter", b, "--device", "cpu", "--engine", "vllm"]
    args += ["--no-drift", "--max-batch", "4", "--timeout", str(VLLM_START_S)]
    with pytest.raises(SystemExit) as exited:
        main(args)
    said = capsys.readouterr().out
    assert exited.value.code == 0, said
    dep_id = int(re.search(r"^deployment (\d+): ", said, re.M).group(1))  # type: ignore[union-attr]
    try:
        assert f"model {base.ref!r}, or a LoRA adapter of it: {a!r}, {b!r}" in said
        key = re.search(r"^  key \(shown once.*\): (\S+)$", said, re.M).group(1)  # type: ignore[union-attr]
        doc = get_deployment(dep_id)
        assert doc["adapters"] == [a, b] and doc["config"]["adapters"] == [a, b]
        headers = {"Authorization": f"Bearer {key}"}
        listed = httpx.get(f"{doc['url']}/v1/models", headers=headers, timeout=30).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [
            (base.ref, None),
            (a, base.ref),
            (b, base.ref),
        ]

        def complete(model: str) -> str:
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            r = httpx.post(f"{doc['url']}/v1/completions", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        for model in (a, b, base.ref, a):  # each by name, in turn, on one replica
            assert complete(model).rstrip("\ufffd") == want[model].rstrip("\ufffd"), model
        body = {"model": "loraft:9", "prompt": "a", "max_tokens": 2}
        r = httpx.post(f"{doc['url']}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 404 and b in r.json()["error"]["message"]
    finally:
        undeploy(str(dep_id))
