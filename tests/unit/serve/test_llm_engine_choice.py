"""Which engine serves a language model, the stop list both engines use, the served folder vLLM
reads, and the one field check both engines' requests go through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.llm_fixtures import corpus

from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit


def _folder(tmp: Path, head: int = 32, eos: object = 0) -> Path:
    from gpuyard.data.tokenizer_train import train_tokenizer

    folder = train_tokenizer(corpus(60), tmp / "m", vocab_size=120, extra_tokens=["<|user|>"])
    cfg = {"hidden_size": head * 2, "num_attention_heads": 2, "max_position_embeddings": 128}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "temperature": 0.7}))
    return folder


def test_auto_falls_back_in_one_line_and_vllm_refuses_without_an_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuyard.serve.llm.vllm_engine import resolve_engine

    monkeypatch.setenv("GPUYARD_VLLM_ENV", str(tmp_path / "none"))
    engine, warning = resolve_engine("auto")
    assert engine == "gpuyard" and warning is not None and "\n" not in warning
    assert f"not installed at {tmp_path / 'none'}" in warning and "make vllm" in warning
    with pytest.raises(ConfigError, match=r"^--engine vllm: vLLM is not installed at .*make vllm"):
        resolve_engine("vllm")
    assert resolve_engine("gpuyard") == ("gpuyard", None)
    with pytest.raises(ConfigError, match="--engine 'fast': use one of auto, vllm, gpuyard"):
        resolve_engine("fast")


def test_a_head_size_vllms_cpu_attention_refuses_keeps_gpuyards_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuyard.serve.llm import vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_python", lambda: Path("/usr/bin/python3"))
    odd = _folder(tmp_path / "odd", head=8)
    engine, warning = vllm_engine.resolve_engine("auto", odd, "cpu")
    assert engine == "gpuyard" and "head size is 8" in (warning or "")
    with pytest.raises(ConfigError, match="vLLM cannot serve this model: its attention head size is 8"):
        vllm_engine.resolve_engine("vllm", odd, "cpu")
    assert vllm_engine.resolve_engine("auto", odd, "cuda") == ("vllm", None)
    assert vllm_engine.resolve_engine("auto", _folder(tmp_path / "ok"), "cpu") == ("vllm", None)


def test_the_stop_list_and_the_served_folder(tmp_path: Path) -> None:
    from gpuyard.data.tokens import load_tokenizer
    from gpuyard.serve.llm.engine import stop_token_ids
    from gpuyard.serve.llm.vllm_engine import served_folder

    folder = _folder(tmp_path, eos=[0, 50, 10**9])
    tok = load_tokenizer(folder)
    user = tok.tokenizer.token_to_id("<|user|>")
    # eos, the generation_config's list (an id past the vocabulary dropped), every special token
    assert stop_token_ids(folder) == sorted({tok.eos_id, 0, 50, 1, user})
    served = served_folder(folder, tmp_path / "served")
    gen = json.loads((served / "generation_config.json").read_text())
    assert gen == {"eos_token_id": stop_token_ids(folder), "temperature": 0.7}
    assert (served / "tokenizer.json").resolve() == (folder / "tokenizer.json").resolve()
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [0, 50, 10**9]


def test_one_field_check_for_both_engines() -> None:
    from gpuyard.serve.llm.app import ChatBody, CompletionBody, sampling

    def check(cls: type, engine: str, **fields: object) -> str | None:
        body = cls.model_validate({"model": "m", **fields})
        try:
            sampling(body, 16, 100, engine)
        except ConfigError as exc:
            return str(exc)
        return None

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert check(CompletionBody, "gpuyard", prompt="a", n=2, logprobs=1) == (
        "n, logprobs: not supported (gpuyard's own engine does not implement them; vLLM does: serve with "
        "--engine vllm)"
    )
    assert check(CompletionBody, "vllm", prompt="a", n=2, logprobs=1) is None
    assert check(ChatBody, "vllm", **chat, tools=[{}], response_format={"type": "json_object"}) == (
        "tools, response_format: not supported (this server does not implement them: leave them out)"
    )
    assert check(ChatBody, "vllm", **chat, logprobs=True, top_logprobs=3) is None
    assert "top_logprobs: needs logprobs: true" in (check(ChatBody, "vllm", **chat, top_logprobs=3) or "")
    assert "logprobs: an integer from 0 to 5" in (check(CompletionBody, "vllm", prompt="a", logprobs=9) or "")
    assert "stop_token_ids: token ids must be in [0, 100)" in (
        check(CompletionBody, "gpuyard", prompt="a", stop_token_ids=[100]) or ""
    )
    assert check(CompletionBody, "gpuyard", prompt="a", stop_token_ids=[5], logprobs=None, n=1) is None


def test_lora_adapters_on_vllms_command_line_with_a_rank_it_takes(tmp_path: Path) -> None:
    from gpuyard.serve.llm.vllm_engine import Adapter, Replica, VllmConfig, adapter_of, lora_rank

    assert adapter_of(str(tmp_path)) is None  # a local folder is served as it is, never looked up
    plain = VllmConfig(folder=tmp_path, name="base:1", context=128)
    assert "--enable-lora" not in plain.argv(Path("python"), Replica(0, 1234))
    assert plain.names == ("base:1",)
    ads = (Adapter("ft:1", tmp_path / "a=b", 4), Adapter("ft:2", tmp_path / "c", 12))
    cfg = VllmConfig(folder=tmp_path, name="base:1", context=128, adapters=ads)
    argv = cfg.argv(Path("python"), Replica(0, 1234))
    assert cfg.names == ("base:1", "ft:1", "ft:2")
    at = argv.index("--lora-modules")
    # JSON, not name=path: a path holding '=' stays whole.
    assert [json.loads(a) for a in argv[at + 1 : at + 3]] == [
        {"name": "ft:1", "path": str(tmp_path / "a=b"), "base_model_name": "base:1"},
        {"name": "ft:2", "path": str(tmp_path / "c"), "base_model_name": "base:1"},
    ]
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and argv[argv.index("--max-loras") + 1] == "2"
    assert lora_rank((Adapter("x", tmp_path, 1),)) == 1 and lora_rank((Adapter("x", tmp_path, 64),)) == 64
    with pytest.raises(ConfigError, match="LoRA rank 1024 is over the largest vLLM serves"):
        lora_rank((Adapter("x", tmp_path, 1024),))
