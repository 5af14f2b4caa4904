"""Language models in the model registry: flavor ``causal-lm`` (a Hugging Face folder) and LoRA adapters.

A version holds every file of the exported folder (config.json, model.safetensors, tokenizer files,
generation_config.json, gpuyard.json), each stored content-addressed and checked when fetched. Its
config records the architecture, the context length and the tokenizer's SHA-256; an adapter version
records its base (``NAME:VERSION``) and holds adapter_config.json + adapter_model.safetensors, and
:func:`merge_adapter` registers base + adapter merged as a new full version.
Promotion to production can be gated on validation perplexity (:func:`promote_lm`).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError, ConflictError, NotFoundError
from gpuyard.models.flavors import check_model_file
from gpuyard.models.registry import (
    ModelVersion,
    _insert_version,
    _resolve_row,
    fetch,
    get_version,
    model_cache_dir,
    record_event,
)
from gpuyard.refs import ModelRef, check_model_name
from gpuyard.states import ModelStage
from gpuyard.store import get_artifacts, get_store
from gpuyard.store.base import utcnow
from gpuyard.store.tables.models import ModelVersionRow

FLAVOR = "causal-lm"
ADAPTER_FLAVOR = "lora-adapter"
# Files of a Hugging Face folder kept with a version (weights are checked to be safetensors).
KEPT = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "gpuyard.json", "adapter_config.json",
    "adapter_model.safetensors",
)  # fmt: skip


def _weights(folder: Path, adapter: bool) -> list[Path]:
    name = "adapter_model.safetensors" if adapter else "model.safetensors"
    files = [folder / name] if (folder / name).is_file() else []
    if not adapter:
        files += sorted(folder.glob("model-*-of-*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no {name} (a Hugging Face folder saved with safetensors)")
    for f in files:
        if check_model_file(f) != "torch":
            raise ConfigError(f"{f} is not a safetensors file")
    return files


def register_lm(
    name: str,
    folder: str | Path,
    *,
    base: str | None = None,
    metrics: dict[str, Any] | None = None,
    run_id: str | None = None,
    description: str = "",
    team: str | None = None,
    dataset: str | None = None,
) -> ModelVersion:
    """Register an exported causal LM (or, with ``base``, a LoRA adapter of that registered model).

    Lineage, the same whichever way a model is registered: the run is ``run_id``, else the one the
    export's gpuyard.json names (when this store knows it); the dataset is ``dataset``, else the
    export's, else the run's. What cannot be known stays None (`gpuyard llm register` says "unknown").

    Raises:
        ConfigError: not a Hugging Face folder with safetensors weights and a tokenizer; an adapter
            without adapter files, or whose base is not a registered language model.
        NotFoundError: ``base`` is not registered.
    """
    from gpuyard.data.tokens import load_tokenizer
    from gpuyard.train.hf import GPUYARD_FILE

    check_model_name(name)
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder (export a model first: <run_dir>/hf)")
    adapter = base is not None
    src = folder / "adapter" if adapter and (folder / "adapter").is_dir() else folder
    weights = _weights(src, adapter)
    info: dict[str, Any] = {}
    if (folder / GPUYARD_FILE).is_file():
        info = json.loads((folder / GPUYARD_FILE).read_text())
    config: dict[str, Any] = {"flavor": ADAPTER_FLAVOR if adapter else FLAVOR}
    if adapter:
        base_mv = get_version(str(base))
        if base_mv.flavor != FLAVOR:
            raise ConfigError(f"base {base_mv.ref} is a {base_mv.flavor} model, not a causal language model")
        config.update(base=base_mv.ref, context_length=base_mv.config.get("context_length"))
        config.update(tokenizer_sha256=base_mv.config.get("tokenizer_sha256"))
        files = [src / "adapter_config.json", *weights]
    else:
        cfg = hf_config_fields(folder)
        tok = load_tokenizer(folder)
        context = info.get("context_length") or cfg["max_position_embeddings"]
        config.update(
            architecture=cfg["architecture"],
            model_type=cfg["model_type"],
            context_length=int(context) if context else None,
            max_position_embeddings=cfg["max_position_embeddings"],
            vocab_size=cfg["vocab_size"],
            tokenizer_sha256=tok.sha256,
            eos_id=tok.eos_id,
        )
        files = [folder / f for f in KEPT if (folder / f).is_file() and not f.startswith("adapter")]
        files += [w for w in weights if w not in files]
    artifacts = get_artifacts()
    stored: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not adapter and not (folder / "tokenizer.json").is_file():
            # A SentencePiece folder (tokenizer.model only): the version keeps the checked conversion,
            # which is what tokenizer_sha256 hashes and what serving and AutoTokenizer read.
            converted = Path(tmp) / "tokenizer.json"
            converted.write_bytes(tok.raw)
            files.append(converted)
        for path in files:
            put = artifacts.put_blob(path)
            stored[path.name] = {"key": put.key, "sha256": put.sha256, "size": put.size}
    # By split, as the registry keeps every flavor's metrics (`gpuyard models show` prints them so).
    run_id, dataset_version = _lineage(run_id, dataset, info)
    measured = {"perplexity": info["val_perplexity"]} if isinstance(info.get("val_perplexity"), float) else {}
    metrics = {**({"validation": measured} if measured else {}), **(metrics or {})}
    fields = dict(
        flavor=config["flavor"],
        stage=ModelStage.NONE,
        run_id=run_id,
        dataset_version=dataset_version,
        code_version=None,
        metrics=metrics,
        signature={"task": "text-generation"},
        files=stored,
        config=config,
        lineage={"base": config.get("base"), "source": info.get("source")},
        description=description,
    )
    return _insert_version(get_store(), name, fields, team)


def _lineage(run: str | None, dataset: str | None, info: dict[str, Any]) -> tuple[str | None, str | None]:
    """(run id, dataset version) of a model being registered (:func:`register_lm`).

    Raises:
        NotFoundError: a run given that this store does not know. ConfigError: a short or ambiguous id.
    """
    from gpuyard.models.runs import resolve_run_id
    from gpuyard.store.tables.models import RunRow

    store = get_store()
    run_id = resolve_run_id(run, store) if run else None
    if run_id is None and isinstance(info.get("run_id"), str):
        try:
            run_id = resolve_run_id(info["run_id"], store)
        except (NotFoundError, ConfigError):  # an export from elsewhere: its run is not ours
            run_id = None
    if dataset is None and isinstance(info.get("dataset"), str):
        dataset = info["dataset"]
    if dataset is None and run_id is not None:
        with store.read() as s:
            row = s.get(RunRow, run_id)
            dataset = row.dataset_version if row is not None else None
    return run_id, dataset


def lineage_line(mv: ModelVersion) -> str:
    """One line on where a registered model came from; "unknown" for what could not be known."""
    run = mv.run_id[:8] if mv.run_id else "unknown"
    data = mv.dataset_version or "unknown"
    line = f"lineage: run {run}, dataset {data}"
    if not (mv.run_id and mv.dataset_version):
        line += " (give --run RUN and --dataset NAME@VERSION when registering to record them)"
    return line


def hf_config_fields(folder: Path) -> dict[str, Any]:
    """What the registry records of a Hugging Face ``config.json``, read as JSON (importing transformers
    to parse it costs seconds per process; the weights load through transformers when served).

    Raises:
        ConfigError: a missing or malformed file, no model_type, or no positive integer vocab_size.
    """
    from gpuyard.train.hf import read_json

    file = folder / "config.json"
    doc = read_json(file, "model config")
    kind, vocab = doc.get("model_type"), doc.get("vocab_size")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"model config {file}: no model_type (llama, qwen2, gpt2, ...)")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"model config {file}: vocab_size {vocab!r} is not a positive integer")
    context = next((doc[k] for k in ("max_position_embeddings", "n_positions", "n_ctx") if k in doc), None)
    archs = doc.get("architectures")
    return {
        "architecture": str(archs[0]) if isinstance(archs, list) and archs else kind,
        "model_type": kind,
        "max_position_embeddings": int(context) if isinstance(context, int) and context > 0 else None,
        "vocab_size": vocab,
    }


def fetch_lm(ref: str) -> Path:
    """A local folder holding language model ``ref`` (an adapter comes merged into its base).

    Raises:
        NotFoundError: no such model. ConfigError: a model that is not a language model.
    """
    try:
        mv = get_version(ref)
    except NotFoundError as exc:
        raise NotFoundError(f"{exc} (and {ref!r} is not a local folder either)") from None
    if mv.flavor == ADAPTER_FLAVOR:
        merged = model_cache_dir(mv) / "merged"
        if not (merged / "config.json").is_file():
            _merge_into(mv, merged)
        return merged
    if mv.flavor != FLAVOR:
        raise ConfigError(f"{mv.ref} is a {mv.flavor} model, not a causal language model")
    return fetch(mv)


def _merge_into(mv: ModelVersion, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = fetch_lm(str(mv.config["base"]))
    adapter = fetch(mv)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        from gpuyard.train.hf import write_generation_config, write_tokenizer

        write_tokenizer(base, Path(tmp))
        write_generation_config(Path(tmp))
        (Path(tmp) / "gpuyard.json").write_text(json.dumps({"merged_from": [str(mv.config["base"]), mv.ref]}))
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(tmp).rename(out)


def merge_adapter(ref: str, name: str | None = None) -> ModelVersion:
    """Register adapter ``ref`` merged into its base as a new full version (of ``name``, default the base's).

    Raises:
        ConfigError: ``ref`` is not an adapter.
    """
    mv = get_version(ref)
    if mv.flavor != ADAPTER_FLAVOR:
        raise ConfigError(f"{mv.ref} is not a LoRA adapter (flavor {mv.flavor})")
    folder = fetch_lm(mv.ref)
    target = name or ModelRef.parse(str(mv.config["base"])).name
    return register_lm(
        target, folder, description=f"{mv.ref} merged into {mv.config['base']}", run_id=mv.run_id,
        dataset=mv.dataset_version,
    )  # fmt: skip


def evaluate_lm(
    ref: str,
    dataset: str,
    split: str | None = "val",
    batch_size: int = 8,
    samples: dict[str, Any] | None = None,
    record: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """Perplexity of language model ``ref`` (or a local folder) on token dataset ``dataset`` (exact counts),
    and greedy generations of a fixed set of prompts (``samples``: :func:`gpuyard.train.hf.sample_settings`;
    default: the start of the split's first 3 documents; ``{"count": 0}``: none).

    ``progress(stage, done, total)`` hears of each batch (``perplexity``) and generation (``generate``).
    With ``record`` and a registered model, the evaluation (perplexity and generations) is stored
    against the model version and its training run (``gpuyard runs show``).

    Raises:
        ConfigError: the dataset's tokenizer is not the model's, or its sequences are longer than
            the model's context; bad sample settings.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from gpuyard.data.dataset import open_dataset
    from gpuyard.data.tokens import load_tokenizer, packed_batches, token_info
    from gpuyard.train.hf import CausalLM, perplexity, sample_settings

    settings = sample_settings(samples)
    local = Path(ref).is_dir()
    folder = Path(ref) if local else fetch_lm(ref)
    version = open_dataset(dataset)
    info = token_info(version)
    tok = load_tokenizer(folder)
    if tok.sha256 != info["tokenizer"]["sha256"]:
        raise ConfigError(
            f"{version.ref} was tokenized with tokenizer {info['tokenizer']['sha256'][:12]}, the model has "
            f"{tok.sha256[:12]}: perplexities would not be comparable"
        )
    model = CausalLM(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and info["seq_len"] > limit:
        raise ConfigError(f"{version.ref}: sequences of {info['seq_len']} tokens exceed the model's {limit}")
    splits = version.manifest.get("splits") or {}
    use = split if split in splits else None
    batches = packed_batches(version.ref, batch_size=batch_size, split=use, shuffle=False)
    batches.set_epoch(0)
    sequences = int(splits[use]) if use else version.num_rows
    total = -(-sequences // batch_size)
    out: dict[str, Any] = dict(perplexity(model, batches, torch.device("cpu"), None, progress, total))
    out.update(
        dataset=version.ref,
        split=use or "all",
        samples=lm_samples(model, tok, version, use, settings, progress),
    )
    if record and not local:
        record_lm_evaluation(ref, out)
    return out


def lm_samples(
    model: Any, tok: Any, version: Any, split: str | None, settings: dict[str, Any], progress: Any = None
) -> list[Any]:
    """Greedy generations of ``settings``' prompts (given texts, else the start of ``split``'s documents)."""
    from gpuyard.train.hf import default_prompts, generate_samples

    if settings["prompts"]:
        prompts = tok.encode_batch(settings["prompts"], specials=True)
    elif settings["count"]:
        cols = version.to_numpy(["input_ids", "position_ids"], split)
        head = slice(0, settings["count"])
        prompts = default_prompts(
            cols["input_ids"][head], cols["position_ids"][head], settings["count"], settings["prompt_tokens"]
        )
    else:
        return []
    return generate_samples(
        model, tok.tokenizer, prompts, settings["max_new_tokens"], tok.stop_ids(), progress
    )


def record_lm_evaluation(ref: str, result: dict[str, Any]) -> int:
    """Store an :func:`evaluate_lm` result against model version ``ref`` and the run it came from
    (split ``validation``, task ``text-generation``, the generations in its details); returns its id."""
    from gpuyard.models.evaluate import Evaluation, record_evaluation

    mv = get_version(ref)
    metrics = {k: float(result[k]) for k in ("val_perplexity", "val_loss_tokens", "val_tokens")}
    ev = Evaluation(
        split="validation",
        task="text-generation",
        n_samples=int(result["val_tokens"]),
        metrics=metrics,
        details={"samples": result.get("samples", []), "split": result.get("split")},
    )
    where = (
        result["dataset"]
        if result.get("split") in (None, "all")
        else f"{result['dataset']}#split={result['split']}"
    )
    return record_evaluation(
        ev, run_id=mv.run_id, model_name=mv.name, model_version=mv.version, dataset_version=where
    )


def promote_lm(
    ref: str, dataset: str, max_perplexity: float | None = None, split: str | None = "val"
) -> dict[str, Any]:
    """Promote language model ``ref`` to production when its perplexity on ``dataset`` is at most
    ``max_perplexity`` and no higher than the current production version's (measured on the same data).

    Returns the decision (promoted or not, both perplexities, why); it is recorded as a model event.
    """
    mv = get_version(ref)
    if mv.flavor not in (FLAVOR, ADAPTER_FLAVOR):
        raise ConfigError(f"{mv.ref} is a {mv.flavor} model; use `gpuyard models promote`")
    none = {"count": 0}  # promotion compares perplexities; `gpuyard llm eval` records generations
    mine = evaluate_lm(mv.ref, dataset, split, samples=none)["val_perplexity"]
    current = None
    try:
        prod = get_version(f"{mv.name}@production")
        current = (
            None
            if prod.version == mv.version
            else evaluate_lm(prod.ref, dataset, split, samples=none)["val_perplexity"]
        )
    except NotFoundError:
        prod = None
    reasons = []
    if not math.isfinite(mine):
        reasons.append(f"perplexity {mine} is not finite")
    if max_perplexity is not None and mine > max_perplexity:
        reasons.append(f"perplexity {mine:.4f} > the gate {max_perplexity}")
    if current is not None and mine > current:
        reasons.append(f"perplexity {mine:.4f} > production {prod.ref if prod else ''}'s {current:.4f}")
    promoted = not reasons
    decision = {
        "model": mv.ref, "promoted": promoted, "perplexity": mine, "production_perplexity": current,
        "gate": max_perplexity, "dataset": dataset,
        "reason": "; ".join(reasons) or "perplexity within the gate and no worse than production",
    }  # fmt: skip
    store = get_store()
    with store.session() as s:
        if promoted:
            for row in s.query(ModelVersionRow).filter_by(name=mv.name, stage=ModelStage.PRODUCTION):
                row.stage = ModelStage.ARCHIVED
            row = _resolve_row(s, mv.ref)
            row.stage, row.updated_at = ModelStage.PRODUCTION, utcnow()
        record_event(s, mv.name, mv.version, "promoted" if promoted else "promotion_refused", decision)
    if not promoted and prod is None and max_perplexity is None:
        raise ConflictError(decision["reason"])
    return decision


def load_for_serving(folder: str | Path, device: str = "auto") -> tuple[Any, Any, dict[str, Any], Any]:
    """(model in eval mode on its device, tokenizer, gpuyard.json, device) of a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpuyard.data.tokens import load_tokenizer

    folder = Path(folder)
    tok = load_tokenizer(folder)
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.to(dev).eval()  # type: ignore[arg-type]
    info = json.loads((folder / "gpuyard.json").read_text()) if (folder / "gpuyard.json").is_file() else {}
    return model, tok, info, dev


def serving_tokenizer(folder: Path) -> Any:
    """The tokenizer of the language model folder a server serves (gpuyard.data's LoadedTokenizer),
    for the serving package, which reaches the data package only through models."""
    from gpuyard.data.tokens import load_tokenizer

    return load_tokenizer(folder)
