"""Language-model stage kinds: their inputs and spec checks, the train spec they write, the summary
lines; and sample generations stored with the run (training's validation) and the model (llm eval)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tests.llm_fixtures import corpus, tokenizer_folder
from typer.testing import CliRunner

from gpuyard.cli.main import app
from gpuyard.errors import ConfigError
from gpuyard.pipelines.inputs import LlmTrainInputs, parse_inputs, stage_inputs
from gpuyard.pipelines.spec import parse_pipeline, render_summary

pytestmark = pytest.mark.unit

TINY = {
    "model_type": "llama", "vocab_size": 260, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 32, "eos_token_id": 0, "pad_token_id": 1,
}  # fmt: skip


def _refused(stages: list[dict[str, Any]], match: str, **top: Any) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        parse_pipeline({"name": "p", "stages": stages, **top}, "p.yaml")
    assert "\n" not in str(info.value)
    return str(info.value)


def test_llm_kinds_refuse_unknown_and_missing_inputs_when_parsed() -> None:
    _refused(
        [{"name": "pre", "uses": "llm-train", "with": {"dataset": "d", "config": "c.json", "epochs": 3}}],
        r"stage 'pre': llm-train takes no input 'epochs' \(it takes: dataset, config, weights",
    )
    _refused(
        [{"name": "chat", "uses": "llm-serve", "with": {"model": "tiny@production"}}],
        r"stage 'chat': input 'message' is required",
    )
    _refused(
        [{"name": "tok", "uses": "tokenize", "with": {"dataset": "d", "tokenizer": "t"}}],
        r"stage 'tok': input 'seq_len' is required",
    )


def test_llm_inputs_bad_values_name_the_input_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"stage 'pre': input 'nproc': .*greater than or equal to 1"):
        stage_inputs("llm-train", {"dataset": "d", "config": "c", "nproc": 0}, "pre")
    with pytest.raises(ConfigError, match=r"stage 'pre': input 'samples.count': .*less than or equal to 32"):
        stage_inputs("llm-train", {"dataset": "d", "config": "c", "samples": {"count": 99}}, "pre")
    with pytest.raises(ConfigError, match=r"stage 'pre': input 'samples.temperature'"):
        stage_inputs("llm-eval", {"model": "m", "dataset": "d", "samples": {"temperature": 1}}, "pre")
    with pytest.raises(ConfigError, match=r"input 'val_fraction'"):
        stage_inputs("tokenize", {"dataset": "d", "tokenizer": "t", "seq_len": 8, "val_fraction": 1.0}, "tok")
    with pytest.raises(ConfigError, match=r"input 'stop'"):
        stage_inputs("llm-serve", {"model": "m", "message": "hi", "stop": ["a", "b", "c", "d", "e"]}, "chat")
    i = stage_inputs("llm-promote", {"model": "tiny:3", "dataset": "d", "max_perplexity": "12.5"}, "p")
    assert i is not None and i.max_perplexity == 12.5  # type: ignore[attr-defined]


def test_summary_references_are_checked_and_rendered() -> None:
    stages = [{"name": "a", "uses": "m:f"}]
    _refused(stages, r"summary refers to \$\{b\.\.\.\}, which is not a stage", summary=["x ${b.y}"])
    spec = parse_pipeline(
        {"name": "p", "stages": stages, "summary": ["ppl ${a.ppl} of ${a.model}: ${a.nope}"]}
    )
    lines = render_summary(spec.summary, {"a": {"ppl": 3.14159265, "model": "tiny:3\n"}})
    assert lines == ["ppl 3.142 of 'tiny:3\\n': ?"]  # a line break is quoted: a line stays one line


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """One home for this file: a text corpus through the text-ingest and tokenize stages (with a val
    split, and without one), its tokenizer, and a tiny random Llama config."""
    from gpuyard.pipelines.stages.llm import text_ingest_stage, tokenize_stage
    from gpuyard.store.db import reset_store_cache

    tmp = tmp_path_factory.mktemp("lm")
    mp = pytest.MonkeyPatch()
    mp.setenv("GPUYARD_HOME", str(tmp / "home"))
    for var in ("GPUYARD_DATABASE_URL", "GPUYARD_ARTIFACTS"):
        mp.delenv(var, raising=False)
    reset_store_cache()
    (tmp / "corpus.txt").write_text("\n\n".join(corpus(120)) + "\n")
    (tmp / "config.json").write_text(json.dumps(TINY))
    tok = tokenizer_folder(tmp)
    ctx = {"base": str(tmp), "workdir": str(tmp), "stage": "s", "pipeline": "p"}
    got = text_ingest_stage({"source": "corpus.txt", "name": "stories"}, ctx)
    assert got["documents"] == 120 and got["quarantined"] == 0
    made = {}
    for name, fraction in (("stories-tokens", 0.2), ("flat-tokens", 0.0)):
        out = tokenize_stage(
            {"dataset": got["dataset"], "tokenizer": str(tok), "seq_len": 32, "val_fraction": fraction,
             "output": name}, ctx,
        )  # fmt: skip
        assert out["dataset"].startswith(f"{name}@") and out["tokens"] > 0
        assert any(line.endswith(" over 32 tokens: split (--over-length)") for line in out["report"])
        made[name] = str(out["dataset"])
    yield SimpleNamespace(tmp=tmp, ctx=ctx, tok=tok, dataset=made["stories-tokens"], flat=made["flat-tokens"])
    mp.undo()
    reset_store_cache()


def test_llm_train_spec_pins_the_dataset_and_passes_samples(lm: SimpleNamespace) -> None:
    from gpuyard.pipelines.stages.llm import llm_train_spec
    from gpuyard.train.spec import parse_spec

    dataset, tmp_path, ctx = lm.dataset, lm.tmp, lm.ctx
    i = parse_inputs(
        LlmTrainInputs,
        {"dataset": "stories-tokens", "config": "config.json", "max_steps": 30, "samples": {"count": 2}},
        "pre",
    )
    spec = llm_train_spec(i, tmp_path / "run", None, ctx)
    parse_spec(spec)  # a valid gpuyard.train spec
    assert spec["data"]["train"]["kwargs"]["dataset"] == dataset  # `stories-tokens` resolved to its version
    assert spec["tracking"]["dataset"] == f"{dataset}#split=train"
    assert spec["model"]["kwargs"]["config"] == str(tmp_path / "config.json")
    assert spec["model"]["kwargs"]["samples"]["count"] == 2
    assert spec["val_every_steps"] == 15 and spec["max_steps"] == 30
    both = parse_inputs(LlmTrainInputs, {"dataset": dataset, "config": "c", "weights": "w"}, "pre")
    with pytest.raises(ConfigError, match=r"give one of config \(random init\) and weights"):
        llm_train_spec(both, tmp_path / "run", tmp_path, ctx)


def test_llm_train_spec_refuses_a_dataset_without_a_val_split(lm: SimpleNamespace) -> None:
    from gpuyard.pipelines.stages.llm import llm_train_spec

    i = parse_inputs(LlmTrainInputs, {"dataset": lm.flat, "config": "c"}, "pre")
    with pytest.raises(
        ConfigError, match=r"llm-train needs train and val \(tokenize with val_fraction > 0\)"
    ):
        llm_train_spec(i, lm.tmp / "run", None, lm.ctx)


class _Tracker:
    """The part of rank 0's tracker the callback uses: a run id in the store, and metrics.jsonl events."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.events: list[dict[str, Any]] = []

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_event(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, **fields})


def test_validation_stores_sample_generations_with_the_run(lm: SimpleNamespace) -> None:
    import torch

    from gpuyard.models.runs import run_details
    from gpuyard.tracking.store import start_run
    from gpuyard.train.hf import causal_lm, export_at_end

    dataset = lm.dataset
    torch.manual_seed(0)
    model = causal_lm(config=str(lm.tmp / "config.json"), samples={"count": 2, "max_new_tokens": 5})
    run = start_run("lm", kind="train", writer=False)
    tracker = _Tracker(run.run_id)
    val = SimpleNamespace(kwargs={"dataset": dataset, "split": "val", "batch_size": 4})
    ctx = SimpleNamespace(
        rank=0,
        dp_rank=0,
        layout=SimpleNamespace(dp=1, tp=1),
        device=torch.device("cpu"),
        group=lambda _n: None,
    )
    spec = SimpleNamespace(data=SimpleNamespace(val=val), parallel=SimpleNamespace(data_parallel="ddp"))
    trainer = SimpleNamespace(spec=spec, ctx=ctx, model=model, step=7, last_metrics={}, tracker=tracker)
    export_at_end(trainer, "validation")
    assert trainer.last_metrics["val_perplexity"] > 1
    [event] = [e for e in tracker.events if e["event"] == "samples"]
    assert event["step"] == 7 and len(event["samples"]) == 2
    [ev] = [e for e in run_details(run.run_id)["evaluations"] if e["task"] == "text-generation"]
    assert ev["split"] == "validation" and ev["dataset_version"] == f"{dataset}#split=val"
    assert ev["details"]["step"] == 7 and ev["details"]["samples"] == event["samples"]
    for s in ev["details"]["samples"]:
        assert s["prompt"] and isinstance(s["completion"], str)
    assert ev["metrics"]["val_perplexity"] == pytest.approx(trainer.last_metrics["val_perplexity"])
    model.train()
    assert model.training  # generating left the model as it found it


def test_llm_eval_records_perplexity_and_generations_with_the_model(lm: SimpleNamespace) -> None:
    import torch

    from gpuyard.models.llm import evaluate_lm, register_lm
    from gpuyard.store import get_store
    from gpuyard.store.tables.models import EvaluationRow
    from gpuyard.train.hf import causal_lm, save_hf

    dataset = lm.dataset
    torch.manual_seed(0)
    model = causal_lm(config=str(lm.tmp / "config.json"))
    folder = save_hf(model, None, lm.tmp / "hf", lm.tok, {"val_perplexity": 250.0})
    mv = register_lm("tiny", folder)
    assert mv.metrics == {"validation": {"perplexity": 250.0}}  # by split, as every flavor's
    shown = CliRunner().invoke(app, ["models", "show", mv.ref])
    assert shown.exit_code == 0 and "perplexity=250" in shown.output
    prompts = {"prompts": ["the cat sat", "a dog"], "max_new_tokens": 4}
    out = evaluate_lm(mv.ref, dataset, "val", samples=prompts, record=True)
    assert [s["prompt"] for s in out["samples"]] == ["the cat sat", "a dog"]
    again = evaluate_lm(mv.ref, dataset, "val", samples=prompts)
    assert again["samples"] == out["samples"]  # greedy: the same generations every evaluation
    with get_store().read() as s:
        rows = s.query(EvaluationRow).filter_by(model_name="tiny", model_version=mv.version).all()
        assert len(rows) == 1  # only the recorded evaluation
        assert rows[0].task == "text-generation" and rows[0].details["samples"] == out["samples"]
        assert rows[0].metrics["val_perplexity"] == pytest.approx(out["val_perplexity"])
        assert rows[0].dataset_version == f"{dataset}#split=val"
    none = evaluate_lm(mv.ref, dataset, "val", samples={"count": 0})
    assert none["samples"] == [] and none["val_perplexity"] == pytest.approx(out["val_perplexity"])
    # The command says how far it is (off a terminal: a line per stage, at least when it completes);
    # --json prints the result alone.
    said = CliRunner().invoke(
        app, ["llm", "eval", mv.ref, "--data", dataset, "--no-record", "--samples", "2"]
    )
    assert said.exit_code == 0, said.output
    assert re.search(r"perplexity: (\d+)/\1 \(100%\)", said.output) and "generate: 2/2 (100%)" in said.output
    quiet = CliRunner().invoke(app, ["llm", "eval", mv.ref, "--data", dataset, "--no-record", "--json"])
    assert quiet.exit_code == 0, quiet.output
    assert json.loads(quiet.stdout)["val_perplexity"] == pytest.approx(out["val_perplexity"])
    assert "perplexity:" not in quiet.stderr and "Loading weights" not in quiet.stderr


def test_lineage_is_the_same_whichever_way_a_model_is_registered(lm: SimpleNamespace) -> None:
    import torch

    from gpuyard.models.llm import merge_adapter
    from gpuyard.tracking.store import start_run
    from gpuyard.train.hf import causal_lm, save_hf

    torch.manual_seed(0)
    run = start_run("lm", kind="train", writer=False, dataset_version=lm.dataset)
    runner = CliRunner()
    # An export names its run and dataset (as export_at_end writes them): registered by hand, it keeps them.
    folder = save_hf(causal_lm(config=str(lm.tmp / "config.json")), None, lm.tmp / "hf", lm.tok,
                     {"run_id": run.run_id, "dataset": lm.dataset})  # fmt: skip
    out = runner.invoke(app, ["llm", "register", "tiny", str(folder), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert (doc["run_id"], doc["dataset_version"]) == (run.run_id, lm.dataset)
    # A folder that says nothing: "unknown" in one line, and --run fills in the run and its dataset.
    bare = save_hf(causal_lm(config=str(lm.tmp / "config.json")), None, lm.tmp / "bare", lm.tok)
    out = runner.invoke(app, ["llm", "register", "bare", str(bare)])
    assert out.exit_code == 0 and "lineage: run unknown, dataset unknown (give --run" in out.output
    out = runner.invoke(app, ["llm", "register", "bare", str(bare), "--run", run.run_id[:8]])
    assert f"lineage: run {run.run_id[:8]}, dataset {lm.dataset}" in out.output
    out = runner.invoke(app, ["llm", "register", "bare", str(bare), "--run", "ffffffff"])
    assert out.exit_code != 0 and "run 'ffffffff' not found" in str(out.exception)
    # A LoRA adapter merged by the registry: the merged version has the adapter's lineage.
    lora = causal_lm(config=str(lm.tmp / "config.json"), lora={"r": 2, "target_modules": ["q_proj"]})
    save_hf(lora, None, lm.tmp / "lora", lm.tok)
    out = runner.invoke(app, ["llm", "register", "tiny", str(lm.tmp / "lora"), "--base", "tiny:1",
                              "--run", run.run_id, "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    merged = merge_adapter(json.loads(out.output)["ref"])
    assert (merged.run_id, merged.dataset_version) == (run.run_id, lm.dataset)


def test_the_registry_reads_a_config_json_without_transformers(tmp_path: Path) -> None:
    from gpuyard.models.llm import hf_config_fields

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "vocab_size": 50, "n_positions": 64})
    )
    got = hf_config_fields(tmp_path)
    assert got == {
        "architecture": "gpt2",
        "model_type": "gpt2",
        "max_position_embeddings": 64,
        "vocab_size": 50,
    }
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": "many"}))
    with pytest.raises(ConfigError, match=r"config.json: vocab_size 'many' is not a positive integer"):
        hf_config_fields(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\x00\x01binary")
    with pytest.raises(ConfigError, match=r"model config .*config.json is not JSON"):
        hf_config_fields(tmp_path)


def test_a_lora_export_is_registered_as_merged_only_when_trained_on_that_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpuyard.models.llm as llm
    from gpuyard.pipelines.stages.llm import _merged_export_of

    fetched = {"tiny:1": tmp_path / "cache" / "tiny" / "1", "tiny:5": tmp_path / "cache" / "tiny" / "5"}
    monkeypatch.setattr(llm, "fetch_lm", lambda ref: fetched[ref])
    hf = tmp_path / "hf"
    (hf / "adapter").mkdir(parents=True)
    (hf / "model.safetensors").write_bytes(b"weights")
    (hf / "gpuyard.json").write_text(json.dumps({"source": {"weights": str(fetched["tiny:1"])}}))
    assert _merged_export_of(hf, "tiny:1")
    assert not _merged_export_of(hf, "tiny:5")  # trained on another base: merged from the registry instead
    (hf / "gpuyard.json").write_text("{not json")
    assert not _merged_export_of(hf, "tiny:1")


def test_the_serve_stage_reads_a_streamed_chat_completion_and_refuses_a_bad_stream() -> None:
    import httpx

    from gpuyard.pipelines.stages.llm import stream_chat

    def server(events: list[str], status: int = 200) -> httpx.MockTransport:
        def answer(request: httpx.Request) -> httpx.Response:
            sent = json.loads(request.content)
            assert sent["stream"] is True and sent["model"] == "tiny:3" and sent["max_tokens"] == 4
            return httpx.Response(status, content="".join(f"data: {e}\n\n" for e in events).encode())

        return httpx.MockTransport(answer)

    def chunk(text: str | None, finish: str | None = None) -> str:
        return json.dumps({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ok = [chunk("the"), chunk(" fox"), chunk(None, "stop"), "[DONE]"]
    got = stream_chat("http://x/v1", "tiny:3", body, server(ok))
    assert got["reply"] == "the fox" and got["chunks"] == 2 and got["finish_reason"] == "stop"
    with pytest.raises(ConfigError, match=r"ended without data: \[DONE\]"):
        stream_chat("http://x/v1", "tiny:3", body, server(ok[:2]))
    with pytest.raises(ConfigError, match=r"not an OpenAI chunk: '<html>'"):
        stream_chat("http://x/v1", "tiny:3", body, server(["<html>", "[DONE]"]))
    with pytest.raises(ConfigError, match=r"not an OpenAI chunk"):
        stream_chat("http://x/v1", "tiny:3", body, server(['{"choices": 3}', "[DONE]"]))
    with pytest.raises(ConfigError, match=r"HTTP 400"):
        stream_chat("http://x/v1", "tiny:3", body, server(["{}"], status=400))
