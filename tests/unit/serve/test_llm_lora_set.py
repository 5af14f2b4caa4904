"""Several LoRA adapters on one base (`gpuyard serve|deploy MODEL --adapter A --adapter B`): which
adapters may go together, refused in one line naming the adapter before anything starts; the folders
vLLM is given are the registry's; the flag reaches the options and the deployment's record."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tests.llm_fixtures import tokenizer_folder

from gpuyard.errors import ConfigError, GpuyardError, NotFoundError

pytestmark = pytest.mark.unit

CONFIG = {
    "model_type": "llama", "vocab_size": 200, "hidden_size": 64, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 64, "eos_token_id": 0, "pad_token_id": 1,
}  # fmt: skip


def _weights(path: Path) -> None:
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(path))


def _adapter_folder(tmp: Path, name: str, rank: int) -> Path:
    folder = tmp / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    _weights(folder / "adapter_model.safetensors")
    return folder


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A home of its own with two bases (one of team 'other' too) and adapters of various ranks: the
    weights are placeholders (nothing here loads them; test_llm_lora_vllm.py serves real ones)."""
    from gpuyard.models.llm import register_lm
    from gpuyard.models.registry import set_alias
    from gpuyard.store.db import reset_store_cache

    tmp = tmp_path_factory.mktemp("lora")
    mp = pytest.MonkeyPatch()
    mp.setenv("GPUYARD_HOME", str(tmp / "home"))
    for var in ("GPUYARD_DATABASE_URL", "GPUYARD_ARTIFACTS"):
        mp.delenv(var, raising=False)
    reset_store_cache()
    folder = tokenizer_folder(tmp)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    _weights(folder / "model.safetensors")
    base = register_lm("base", folder).ref
    other = register_lm("otherbase", folder).ref
    made = {
        "a": register_lm("ada", _adapter_folder(tmp, "a", 4), base=base).ref,
        "b": register_lm("adb", _adapter_folder(tmp, "b", 12), base=base).ref,
        "off": register_lm("adoff", _adapter_folder(tmp, "off", 4), base=other).ref,
        "team": register_lm("adteam", _adapter_folder(tmp, "t", 4), base=base, team="other").ref,
        "huge": register_lm("adhuge", _adapter_folder(tmp, "h", 1024), base=base).ref,
    }
    set_alias(made["a"], "prod")
    yield SimpleNamespace(tmp=tmp, base=base, other=other, **made)
    mp.undo()
    reset_store_cache()


def _refusal(call: object, *args: object, kind: type[Exception] = ConfigError) -> str:
    with pytest.raises(kind) as info:
        call(*args)  # type: ignore[operator]
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_several_adapters_on_one_base_from_the_registrys_folders(reg: SimpleNamespace) -> None:
    from gpuyard.models.registry import get_version, model_cache_dir
    from gpuyard.serve.llm.vllm_engine import Replica, VllmConfig, lora_set

    assert lora_set(reg.base) is None  # a base alone: no adapter, served as it is
    found = lora_set(reg.base, ("ada@prod", reg.b))
    assert found is not None
    base, folder, adapters = found
    assert base == reg.base and folder == model_cache_dir(get_version(reg.base))
    # Named by their registry references (the alias resolved), their folders the registry's copies.
    assert [(a.name, a.rank) for a in adapters] == [(reg.a, 4), (reg.b, 12)]
    assert [a.folder for a in adapters] == [model_cache_dir(get_version(r)) for r in (reg.a, reg.b)]
    assert all((a.folder / "adapter_model.safetensors").is_file() for a in adapters)
    # An adapter served itself comes first, then the others.
    found = lora_set(reg.b, (reg.a,))
    assert found is not None and [a.name for a in found[2]] == [reg.b, reg.a] and found[0] == reg.base
    # vLLM's command line: every adapter by name, a slot each in a batch, the rank that fits the largest.
    cfg = VllmConfig(folder=folder, name=base, context=64, adapters=adapters)
    argv = cfg.argv(Path("python"), Replica(0, 1234))
    assert argv[argv.index("--max-loras") + 1] == "2" and argv[argv.index("--max-lora-rank") + 1] == "16"
    at = argv.index("--lora-modules")
    assert [json.loads(m)["path"] for m in argv[at + 1 : at + 3]] == [str(a.folder) for a in adapters]


def test_adapters_that_cannot_go_together_are_refused_in_one_line(reg: SimpleNamespace) -> None:
    from gpuyard.serve.llm.vllm_engine import lora_set

    assert _refusal(lora_set, reg.base, (reg.off,)) == (
        f"--adapter {reg.off}: an adapter of {reg.other}, not of {reg.base} (the base served)"
    )
    assert _refusal(lora_set, reg.a, (reg.off,)).startswith(f"--adapter {reg.off}: an adapter of {reg.other}")
    assert f"--adapter {reg.team}: belongs to team 'other'" in _refusal(lora_set, reg.base, (reg.team,))
    assert "is served already (given twice)" in _refusal(lora_set, reg.base, (reg.a, "ada@prod"))
    assert "is served already" in _refusal(lora_set, reg.a, ("ada@prod",))  # the served adapter again
    assert _refusal(lora_set, reg.base, (reg.other,)) == (
        f"--adapter {reg.other}: a causal-lm model, not a LoRA adapter"
    )
    assert _refusal(lora_set, reg.base, (reg.a, reg.huge)) == (
        f"{reg.huge}: LoRA rank 1024 is over the largest vLLM serves (512)"
    )
    gone = _refusal(lora_set, reg.base, ("nope:3",), kind=NotFoundError)
    assert gone.startswith("--adapter 'nope:3': ")
    # A path is never read as an adapter: only registry references name one.
    path = str(reg.tmp / "a")
    assert _refusal(lora_set, reg.base, (path,), kind=GpuyardError).startswith(f"--adapter {path!r}: ")
    assert _refusal(lora_set, reg.base, ("a\nb",), kind=GpuyardError).startswith("--adapter 'a\\nb': ")
    # Nor is the model they go on a local folder.
    assert "is a local folder" in _refusal(lora_set, str(reg.tmp / "a"), (reg.a,))


def test_an_adapter_whose_stored_files_are_gone_is_one_line(reg: SimpleNamespace) -> None:
    import shutil

    from gpuyard.models.llm import register_lm
    from gpuyard.models.registry import get_version, model_cache_dir
    from gpuyard.serve.llm.vllm_engine import lora_set
    from gpuyard.store.artifacts import get_artifacts

    ref = register_lm("adlost", _adapter_folder(reg.tmp, "lost", 4), base=reg.base).ref
    mv = get_version(ref)
    store = get_artifacts()
    for info in mv.files.values():
        store.delete(info["key"])
    shutil.rmtree(model_cache_dir(mv), ignore_errors=True)
    said = _refusal(lora_set, reg.base, (ref,))
    assert said.startswith(f"{ref}: its adapter files cannot be read: artifact ") and "not found" in said


def test_gpuyards_own_engine_refuses_adapters_by_name_and_deploy_records_them(
    reg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.serve.llm import vllm_engine
    from gpuyard.serve.options import ServeOptions

    said = _refusal(vllm_engine.check_lora, reg.base, ServeOptions(engine="gpuyard", adapters=(reg.a,)))
    assert (
        said.startswith(f"--adapter {reg.a}: gpuyard's own engine serves one model")
        and "--engine vllm" in said
    )
    monkeypatch.setenv("GPUYARD_VLLM_ENV", str(reg.tmp / "none"))  # auto, and no vLLM: refused, with why
    said = _refusal(vllm_engine.check_lora, reg.base, ServeOptions(engine="auto", adapters=(reg.a,)))
    assert "needs vLLM" in said and "vLLM is not installed at" in said
    monkeypatch.setattr(vllm_engine, "vllm_python", lambda: Path("/usr/bin/python3"))
    opts = ServeOptions(engine="auto", device="cpu", adapters=("ada@prod", reg.b))
    assert vllm_engine.check_lora(reg.base, opts) == (reg.a, reg.b)  # what a deployment records
    assert vllm_engine.check_lora(reg.base, ServeOptions()) == ()

    from gpuyard.serve.deploy import create_record
    from gpuyard.serve.records import get_deployment, recorded_options

    doc = create_record(reg.base, ServeOptions(device="cpu", adapters=(reg.a, reg.b)))
    assert doc["adapters"] == [reg.a, reg.b] and get_deployment(doc["id"])["adapters"] == [reg.a, reg.b]
    assert recorded_options(doc["id"]).adapters == (reg.a, reg.b)
    plain = create_record(reg.base, ServeOptions(device="cpu"))
    assert plain["adapters"] == [] and recorded_options(plain["id"]).adapters == ()
    from gpuyard.cli.main import main

    with pytest.raises(SystemExit):
        main(["deployments", "ls"])
    rows = [line for line in capsys.readouterr().out.splitlines() if f" {reg.base}" in line]
    assert len(rows) == 2 and sum(f"{reg.base} + {reg.a} + {reg.b} " in row for row in rows) == 1, rows


def test_the_options_refuse_a_repeated_or_overlong_adapter_list() -> None:
    from gpuyard.serve.options import MAX_ADAPTERS, ServeOptions

    assert ServeOptions(adapters=["x:1", "y:2"]).adapters == ("x:1", "y:2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^--adapter 'x:1': given twice$"):
        ServeOptions(adapters=("x:1", "x:1"))
    with pytest.raises(ConfigError, match=f"^--adapter: {MAX_ADAPTERS + 1} given; one deployment serves"):
        ServeOptions(adapters=tuple(f"a{i}:1" for i in range(MAX_ADAPTERS + 1)))
    with pytest.raises(ConfigError, match=r"^--adapter '': name a registered LoRA adapter"):
        ServeOptions(adapters=("",))
    doc = ServeOptions(adapters=("x:1",)).to_json()
    assert ServeOptions.from_json(json.loads(json.dumps(doc))).adapters == ("x:1",)
    del doc["adapters"]  # a record written before --adapter existed
    assert ServeOptions.from_json(doc).adapters == ()


def test_the_adapter_flag_reaches_the_server_and_a_refusal_comes_before_the_key(
    reg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from typer.testing import CliRunner

    from gpuyard.cli.main import app, main
    from gpuyard.serve import runner

    seen: list[object] = []
    monkeypatch.setattr(runner, "serve_with_record", lambda ref, opts: seen.append(opts))
    args = ["serve", reg.base, "--adapter", reg.a, "--adapter", reg.b, "--deployment-id", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen[0].adapters == (reg.a, reg.b)  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as info:
        main(["serve", reg.base, "--adapter", reg.off, "--engine", "gpuyard", "--port", "0"])
    out = capsys.readouterr()
    assert info.value.code == 2 and "key" not in out.out + out.err
    assert (
        out.err.strip()
        == f"error: --adapter {reg.off}: an adapter of {reg.other}, not of {reg.base} (the base served)"
    )
    with pytest.raises(SystemExit):
        main(["serve", reg.base, "--adapter", reg.a, "--engine", "gpuyard", "--port", "0"])
    assert "gpuyard's own engine serves one model" in capsys.readouterr().err
