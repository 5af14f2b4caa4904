"""Language-model stages (docs/llm.md): text corpora, tokens, training, registry, evaluation, serving.

Each stage calls the library functions the CLI calls (``gpuyard data ingest``/``tokenize``,
``gpuyard train``, ``gpuyard llm register``/``eval``/``promote``, ``gpuyard serve``):

- ``text-ingest``: :func:`gpuyard.data.text.ingest_text` (documents or chat records, quarantine);
- ``tokenize``: :func:`gpuyard.data.tokens.tokenize` (packed sequences, train/val splits);
- ``llm-train``: a ``gpuyard.train`` spec for ``gpuyard.train.hf:causal_lm`` launched with torchrun
  (DDP over ``nproc`` ranks), tracked in the state store, exported in Hugging Face layout; a LoRA
  fine-tune of a registered model when ``weights`` names one;
- ``llm-register``: :func:`gpuyard.models.llm.register_lm` (and :func:`merge_adapter`);
- ``llm-eval``: :func:`gpuyard.models.llm.evaluate_lm` (perplexity and sample generations, recorded);
- ``llm-promote``: :func:`gpuyard.models.llm.promote_lm` (gated on perplexity);
- ``llm-serve``: a real ``gpuyard serve`` process, one streamed chat completion over its
  OpenAI-compatible API (server-sent events), then the server is stopped.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from gpuyard.errors import ConfigError
from gpuyard.pipelines.inputs import (
    LlmEvalInputs,
    LlmPromoteInputs,
    LlmRegisterInputs,
    LlmServeInputs,
    LlmTrainInputs,
    TextIngestInputs,
    TokenizeInputs,
    parse_inputs,
)

HF_LAUNCH_LOG_LINES = 8


def _path(value: str, ctx: dict[str, Any]) -> Path:
    """``value`` as a path: absolute as given, else relative to the pipeline's folder."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else Path(ctx["base"]) / p


def _threads(n: int) -> None:
    """Intra-op threads of this stage's torch (a small model on shared cores gains nothing from more)."""
    import torch

    torch.set_num_threads(n)


def _fmt(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def text_ingest_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Ingest a text corpus (``gpuyard data ingest`` of text): records kept or quarantined with a reason."""
    from gpuyard.data.text import TextOptions, ingest_text

    i = parse_inputs(TextIngestInputs, inputs, ctx["stage"])
    opts = TextOptions(
        format=i.format, text_field=i.text_field, messages_field=i.messages_field, max_bytes=i.max_doc_bytes
    )
    v = ingest_text(_path(i.source, ctx), i.name, opts)
    q, t = v.manifest["quarantine"], v.manifest.get("text") or {}
    what = "chat records" if t.get("column") == "messages" else "documents"
    return {
        "dataset": v.ref,
        "documents": v.num_rows,
        "quarantined": q["rows_quarantined"],
        "by_reason": q["by_reason"],
        "report": [
            f"{v.ref}: {q['rows_in']} records in, {v.num_rows} {what} kept ({t.get('bytes')} bytes of text),"
            f" {q['rows_quarantined']} quarantined" + (f" {q['by_reason']}" if q["by_reason"] else "")
        ],
    }


def tokenize_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Tokenize and pack a text version (``gpuyard data tokenize``); outputs the token dataset."""
    from gpuyard.data.tokens import long_records_line, token_info, tokenize

    i = parse_inputs(TokenizeInputs, inputs, ctx["stage"])
    v = tokenize(
        i.dataset,
        _path(i.tokenizer, ctx),
        i.seq_len,
        output=i.output,
        val_fraction=i.val_fraction,
        seed=i.seed,
        over_length=i.over_length,
        loss_on=i.loss_on,
    )
    info = token_info(v)
    long = long_records_line(info)
    splits = v.manifest.get("splits") or {}
    return {
        "dataset": v.ref,
        "tokens": int(info["tokens"]),
        "sequences": int(info["sequences"]),
        "splits": splits,
        "waste": float(info["waste"]),
        "tokenizer_sha256": info["tokenizer"]["sha256"],
        "report": [
            f"{v.ref}: {info['documents']} documents, {info['tokens']} tokens in {info['sequences']}"
            f" sequences of {i.seq_len} (splits {splits}), padding {info['waste']:.1%};"
            f" tokenizer {info['tokenizer']['sha256'][:12]} ({info['tokenizer']['vocab_size']} tokens)"
        ]
        + ([long] if long else [])
        + list(info.get("warnings") or []),
    }


def llm_train_spec(
    i: LlmTrainInputs, run_dir: Path, weights: Path | None, ctx: dict[str, Any]
) -> dict[str, Any]:
    """The ``gpuyard.train`` spec of a causal LM on ``i.dataset``'s train split, validated on val.

    Raises:
        ConfigError: neither or both of config and weights; a dataset without train and val splits.
    """
    from gpuyard.data.arrays import pin
    from gpuyard.data.dataset import open_dataset
    from gpuyard.data.tokens import token_info

    if (i.config is None) == (weights is None):
        raise ConfigError(f"stage {ctx['stage']!r}: give one of config (random init) and weights (a model)")
    version = open_dataset(pin(i.dataset))
    token_info(version)
    splits = version.manifest.get("splits") or {}
    if not {"train", "val"} <= set(splits):
        raise ConfigError(
            f"stage {ctx['stage']!r}: {version.ref} has splits {sorted(splits) or 'none'}; llm-train needs"
            " train and val (tokenize with val_fraction > 0)"
        )
    kwargs: dict[str, Any] = {"samples": i.samples.model_dump()}
    if i.config is not None:
        kwargs["config"] = str(_path(i.config, ctx))
    else:
        kwargs["weights"] = str(weights)
    if i.lora is not None:
        kwargs["lora"] = dict(i.lora)
    every = i.val_every_steps or max(1, i.max_steps // 2)
    name = i.run_name or f"{ctx['pipeline']}-{ctx['stage']}"
    loader = "gpuyard.data.tokens:packed_batches"
    return {
        "name": name,
        "run_dir": str(run_dir),
        "seed": i.seed,
        "model": {"entrypoint": "gpuyard.train.hf:causal_lm", "kwargs": kwargs},
        "data": {
            "train": {
                "entrypoint": loader,
                "kwargs": {"dataset": version.ref, "split": "train", "seed": i.seed},
            },
            "val": {
                "entrypoint": loader,
                "kwargs": {"dataset": version.ref, "split": "val", "batch_size": i.batch_size},
            },
            "batch_size": i.batch_size,
        },
        "loss": "gpuyard.train.hf:lm_loss",
        "optimizer": {"lr": i.lr, "weight_decay": i.weight_decay},
        "schedule": {"kind": "warmup_cosine", "warmup_steps": min(i.warmup_steps, i.max_steps - 1)},
        # As many epochs as max_steps needs: the steps decide when training ends.
        "epochs": max(1, i.max_steps),
        "max_steps": i.max_steps,
        "val_every_steps": every,
        "checkpoint": {"keep": 1},
        "max_restarts": 0,
        "log_every_steps": 1,  # the first step's loss is the untrained model's (about ln of the vocabulary)
        "callbacks": ["gpuyard.train.hf:export_at_end"],
        "tracking": {
            "backend": "db",
            "experiment": i.experiment,
            "run_name": name,
            "dataset": f"{version.ref}#split=train",
            "tags": {"validation": f"{version.ref}#split=val", "pipeline": str(ctx["pipeline"])},
        },
    }


def _weights(ref: str, ctx: dict[str, Any]) -> Path:
    """A weights folder: the folder ``ref`` names, else registered model ``ref`` fetched (adapters merged)."""
    p = _path(ref, ctx)
    if p.is_dir():
        return p
    from gpuyard.models.llm import fetch_lm

    return fetch_lm(ref)


def _curves(run_dir: Path) -> dict[str, Any]:
    """First and last training loss, validation perplexity per step, the last generations (metrics.jsonl)."""
    from gpuyard.tracking.files import read_metrics

    losses: list[float] = []
    ppl: dict[int, float] = {}
    samples: list[Any] = []
    for ev in read_metrics(run_dir):
        if ev.get("event") == "samples":
            samples = ev.get("samples") or []
        elif ev.get("event") == "metrics":
            if isinstance(ev.get("loss"), float):
                losses.append(float(ev["loss"]))
            if isinstance(ev.get("val_perplexity"), float):
                ppl[int(ev["step"])] = float(ev["val_perplexity"])
    return {"losses": losses, "perplexity": ppl, "samples": samples}


def llm_train_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """``gpuyard train`` of a causal LM (torchrun, ``nproc`` DDP ranks); outputs the run and its export.

    Raises:
        ConfigError: a bad input, or training that did not complete (names its status and folder).
    """
    from gpuyard.tracking.training import tracked_run_id
    from gpuyard.train.hf import HF_DIR
    from gpuyard.train.launch import LaunchConfig, launch

    i = parse_inputs(LlmTrainInputs, inputs, ctx["stage"])
    work = Path(ctx["workdir"])
    run_dir = work / "run"
    if run_dir.exists():
        # The stage runs again (--no-cache, or after a failure): train afresh, not resume its last run.
        shutil.rmtree(run_dir)
    weights = _weights(i.weights, ctx) if i.weights is not None else None
    spec = llm_train_spec(i, run_dir, weights, ctx)
    spec_path = work / "train.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    # The ranks' intra-op threads (torchrun sets one per rank only for several ranks).
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(i.threads)
    t0 = time.perf_counter()
    try:
        res = launch(LaunchConfig(spec_path=spec_path, nproc=i.nproc))
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before
    seconds = time.perf_counter() - t0
    hf = run_dir / HF_DIR
    if res.exit_code != 0 or not (hf / "config.json").is_file():
        log = run_dir / "train.log"
        tail = log.read_text(errors="replace").splitlines()[-HF_LAUNCH_LOG_LINES:] if log.is_file() else []
        raise ConfigError(
            f"training did not complete: exit {res.exit_code}, status {res.status.get('status')}"
            f" (run folder {run_dir}); last lines of train.log:\n  " + "\n  ".join(tail)
        )
    run_id = tracked_run_id(run_dir)
    curves = _curves(run_dir)
    losses, ppl = curves["losses"], curves["perplexity"]
    steps = int(res.status.get("step") or 0)
    last_ppl = ppl[max(ppl)] if ppl else float("nan")
    what = (
        f"LoRA {i.lora} on {i.weights}" if i.lora else (f"from {i.weights}" if i.weights else "from scratch")
    )
    ranks = f"{i.nproc} ranks (DDP, gloo)" if i.nproc > 1 else "1 rank"
    curve = ", ".join(f"{_fmt(v)} at step {k}" for k, v in sorted(ppl.items()))
    lines = [
        f"{what}: {steps} steps on {ranks} in {seconds:.1f} s;"
        f" run {str(run_id)[:8]} on {spec['tracking']['dataset']}",
        f"train loss {_fmt(losses[0])} at step 1 (perplexity {_fmt(math.exp(min(losses[0], 50)))})"
        f" -> {_fmt(losses[-1])}; validation perplexity {curve}"
        if losses
        else "no training step logged",
    ]
    lines += [f"sample: {s['prompt']!r} -> {s['completion']!r}" for s in curves["samples"]]
    return {
        "run": run_id,
        "run_dir": str(run_dir),
        "model_dir": str(hf),
        "steps": steps,
        "seconds": round(seconds, 2),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "val_perplexity": last_ppl,
        "samples": curves["samples"],
        "report": lines,
    }


def _merged_export_of(folder: Path, base: str) -> bool:
    """Whether ``folder`` is a LoRA run's export (adapter and merged model) trained on the weights of
    registered model ``base`` (its gpuyard.json names the folder the registry fetched ``base`` to)."""
    from gpuyard.models.llm import fetch_lm

    info_file = folder / "gpuyard.json"
    if not (
        (folder / "adapter").is_dir() and (folder / "model.safetensors").is_file() and info_file.is_file()
    ):
        return False
    try:
        source = json.loads(info_file.read_text()).get("source") or {}
    except (OSError, ValueError):
        return False
    return bool(source.get("weights")) and Path(str(source["weights"])) == fetch_lm(base)


def llm_register_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Register an exported model (``gpuyard llm register``), or its LoRA adapter of ``base`` (and merged)."""
    from gpuyard.models.llm import merge_adapter, register_lm

    i = parse_inputs(LlmRegisterInputs, inputs, ctx["stage"])
    if i.merge and i.base is None:
        raise ConfigError(f"stage {ctx['stage']!r}: merge needs base (the model the adapter was trained on)")
    mv = register_lm(i.name, _path(i.model_dir, ctx), base=i.base, run_id=i.run)
    out: dict[str, Any] = {"model": mv.ref, "version": mv.version, "flavor": mv.flavor}
    cfg = mv.config
    measured = "perplexity" in mv.metrics.get("validation", {})
    lines = [
        f"registered {mv.ref} ({mv.flavor}{', adapter of ' + str(cfg.get('base')) if i.base else ''}),"
        f" context {cfg.get('context_length')}, tokenizer {str(cfg.get('tokenizer_sha256'))[:12]}"
        + (f", validation perplexity {_fmt(mv.metrics['validation']['perplexity'])}" if measured else "")
    ]
    if i.merge:
        folder = _path(i.model_dir, ctx)
        if _merged_export_of(folder, str(i.base)):
            # A LoRA run's export holds the adapter merged into the weights it trained on (peft's
            # merge_and_unload at export): registering it spares a process loading peft to merge again.
            how = "merged at export"
            merged = register_lm(
                mv.name, folder, run_id=i.run, description=f"{mv.ref} merged into {cfg.get('base')}"
            )
        else:
            how = "merged by peft"
            merged = merge_adapter(mv.ref)
        out.update(adapter=mv.ref, model=merged.ref, version=merged.version, flavor=merged.flavor)
        lines.append(
            f"{mv.ref} merged into {cfg.get('base')} ({how}): registered {merged.ref} ({merged.flavor})"
        )
    out["report"] = lines
    return out


def llm_eval_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Perplexity and sample generations of a model (``gpuyard llm eval``), recorded with the model."""
    from gpuyard.models.llm import evaluate_lm

    i = parse_inputs(LlmEvalInputs, inputs, ctx["stage"])
    _threads(i.threads)
    folder = _path(i.model, ctx)
    ref = str(folder) if folder.is_dir() else i.model
    out = evaluate_lm(ref, i.dataset, i.split, i.batch_size, samples=i.samples.model_dump(), record=True)
    lines = [
        f"{i.model} on {out['dataset']} ({out['split']}): perplexity {_fmt(out['val_perplexity'])}"
        f" over {int(out['val_tokens'])} tokens (recorded with the model)"
    ]
    lines += [f"sample: {s['prompt']!r} -> {s['completion']!r}" for s in out["samples"]]
    return {
        "perplexity": out["val_perplexity"],
        "loss": out["val_loss_tokens"],
        "tokens": out["val_tokens"],
        "dataset": out["dataset"],
        "samples": out["samples"],
        "report": lines,
    }


def llm_promote_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Promote to production gated on perplexity (``gpuyard llm promote``); outputs what is in production.

    Raises:
        ConfigError: refused, and no version of the model is in production to serve instead.
    """
    from gpuyard.errors import NotFoundError
    from gpuyard.models.llm import promote_lm
    from gpuyard.models.registry import get_version
    from gpuyard.refs import ModelRef

    i = parse_inputs(LlmPromoteInputs, inputs, ctx["stage"])
    _threads(i.threads)
    d = promote_lm(i.model, i.dataset, i.max_perplexity, i.split)
    name = ModelRef.parse(i.model).name
    try:
        production = get_version(f"{name}@production").ref
    except NotFoundError:
        raise ConfigError(f"stage {ctx['stage']!r}: {d['model']} not promoted ({d['reason']})") from None
    prod = d["production_perplexity"]
    verdict = "promoted to production" if d["promoted"] else f"not promoted; {production} stays in production"
    return {
        "promoted": bool(d["promoted"]),
        "perplexity": d["perplexity"],
        "production_perplexity": prod,
        "production": production,
        "reason": d["reason"],
        "report": [
            f"{d['model']}: perplexity {_fmt(d['perplexity'])} on {i.dataset} ({i.split}), gate"
            f" {_fmt(i.max_perplexity)}"
            + (f", production {_fmt(prod)}" if prod is not None else ", nothing in production before")
            + f": {verdict} ({d['reason']})"
        ],
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(
    proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float, headers: dict[str, str]
) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-6:]
            raise ConfigError(f"gpuyard serve exited with code {proc.returncode}:\n  " + "\n  ".join(tail))
        try:
            if httpx.get(f"{url}/models", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ConfigError(f"gpuyard serve did not answer at {url} within {timeout_s:.0f} s (log {log})")
        time.sleep(0.2)  # the server is a separate process: its readiness can only be polled


MAX_REPLY_CHARS = 1 << 20


def stream_chat(
    url: str, model: str, body: dict[str, Any], transport: Any = None, api_key: str | None = None
) -> dict[str, Any]:
    """One streamed chat completion over the OpenAI API at ``url`` (server-sent events up to ``[DONE]``):
    the reply, the time to its first token, the chunks and the finish reason. ``api_key`` is sent as
    ``Authorization: Bearer`` (gpuyard's model servers need one).

    Raises:
        ConfigError: an error answer (its status and message), an event that is not a JSON object of
            choices, a reply over 1 MiB, or a stream that ended without ``[DONE]``.
    """
    import httpx

    t0 = time.perf_counter()
    reply: list[str] = []
    first: float | None = None
    finish, done, chunks, size = None, False, 0, 0
    with (
        httpx.Client(
            timeout=60,
            transport=transport,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        ) as client,
        client.stream("POST", f"{url}/chat/completions", json={**body, "model": model, "stream": True}) as r,
    ):
        if r.status_code != 200:
            r.read()
            raise ConfigError(f"chat completion: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                doc = json.loads(data)
                choices = doc["choices"]
                deltas = [(c.get("delta") or {}, c.get("finish_reason")) for c in choices]
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ConfigError(f"chat completion: not an OpenAI chunk: {data[:200]!r}") from None
            for delta, reason in deltas:
                piece = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(piece, str) and piece:
                    first = first if first is not None else time.perf_counter() - t0
                    reply.append(piece)
                    chunks, size = chunks + 1, size + len(piece)
                finish = reason or finish
            if size > MAX_REPLY_CHARS:
                raise ConfigError(f"chat completion: the reply passed {MAX_REPLY_CHARS} characters")
    if not done:
        raise ConfigError("chat completion: the stream ended without data: [DONE]")
    return {
        "reply": "".join(reply),
        "ttft_ms": round(1000 * first, 1) if first is not None else None,
        "seconds": round(time.perf_counter() - t0, 3),
        "chunks": chunks,
        "finish_reason": finish,
    }


def llm_serve_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Start ``gpuyard serve MODEL`` (OpenAI API), stream one chat completion, stop the server."""
    from gpuyard.serve.access import KEY_ENV, new_key

    i = parse_inputs(LlmServeInputs, inputs, ctx["stage"])
    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1"
    log = Path(ctx["workdir"]) / "serve.log"
    argv = [sys.executable, "-m", "gpuyard.cli.main", "serve", i.model, "--port", str(port)]
    argv += ["--max-batch", str(i.max_batch), "--engine", i.engine]
    # The server's key goes to it in its environment (never on its command line, never in its log).
    key = new_key()
    env = {**os.environ, "OMP_NUM_THREADS": str(i.threads), KEY_ENV: key}
    t0 = time.perf_counter()
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(proc, url, log, i.start_timeout_s, {"Authorization": f"Bearer {key}"})
        started = time.perf_counter() - t0
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": i.message}],
            "max_tokens": i.max_tokens,
            "temperature": 0,
        }
        if i.stop:
            body["stop"] = i.stop
        got = stream_chat(url, i.model, body, api_key=key)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        **got,
        "url": url,
        "start_seconds": round(started, 2),
        "report": [
            f"gpuyard serve {i.model} at {url} (OpenAI API): ready in {started:.1f} s;"
            " stopped after the chat",
            f"user: {i.message}",
            f"assistant (streamed in {got['chunks']} chunks, first token after {got['ttft_ms']} ms,"
            f" finish {got['finish_reason']}): {got['reply']!r}",
        ],
    }
