"""Hugging Face causal language models on gpuyard's trainer (docs/llm.md).

A train spec names the model by its ``config.json`` (random initialisation) or a local folder of
weights (``config.json`` + safetensors), for any architecture ``AutoModelForCausalLM`` builds (Llama,
Qwen2/3, Mistral, GPT-2, ...)::

    model:
      entrypoint: gpuyard.train.hf:causal_lm
      kwargs: {config: tiny/config.json}          # or weights: exported/ (and lora: {r: 8})
    data:
      train: {entrypoint: gpuyard.data.tokens:packed_batches, kwargs: {dataset: corpus-tokens, split: train}}
      val: {entrypoint: gpuyard.data.tokens:packed_batches, kwargs: {dataset: corpus-tokens, split: val}}
    loss: gpuyard.train.hf:lm_loss
    callbacks: [gpuyard.train.hf:export_at_end]

Batches are packed sequences (``gpuyard data tokenize``): ``input_ids`` and ``position_ids`` that
restart at every document, which transformers turns into a block-diagonal causal mask (no attention
across documents), and pre-shifted labels with ``-100`` where nothing is to be predicted. The
wrapper gives the trainer the decoder layers as FSDP2 units (``fsdp_units``) and a tensor-parallel
plan (``tp_plan``) for the Llama-family layer names. ``export_at_end`` writes the trained model in
Hugging Face layout (config, safetensors, tokenizer files) under ``<run_dir>/hf``; a LoRA run writes
the adapter (``<run_dir>/hf/adapter``) and the merged model.

transformers is imported here only, when a language model is built: other commands stay fast.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuyard.errors import ConfigError

IGNORE = -100
GPUYARD_FILE = "gpuyard.json"
HF_DIR = "hf"
# The decoder-layer lists of the architectures transformers builds (Llama/Qwen/Mistral, GPT-2, ...).
_LAYER_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path`` (ConfigError naming the file when missing, not JSON or not an object)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} {path}: file not found") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"{what} {path} is a folder, not a file") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{what} {path} is not JSON: {str(exc)[:200]}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{what} {path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def load_config(path: str | Path) -> Any:
    """A transformers ``PretrainedConfig`` from a ``config.json`` (or a folder holding one).

    Raises:
        ConfigError: a missing or malformed file, or a model type transformers does not know.
    """
    from transformers import AutoConfig

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    doc = read_json(file, "model config")
    kind = doc.pop("model_type", None)
    if not isinstance(kind, str):
        raise ConfigError(f"model config {file}: no model_type (llama, qwen2, qwen3, mistral, gpt2, ...)")
    try:
        return AutoConfig.for_model(kind, **doc)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model config {file}: {str(exc).splitlines()[0][:300]}") from exc


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (a PEFT wrapper is looked through)."""
    base: Any = model
    while hasattr(base, "base_model") and base.base_model is not base:
        inner = base.base_model
        base = getattr(inner, "model", inner) if type(inner).__name__ == "LoraModel" else inner
    for path in _LAYER_PATHS:
        obj: Any = base
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return list(obj)
    return []


class CausalLM(nn.Module):
    """A transformers causal LM as the trainer sees it: ``forward(inputs) -> logits``.

    ``inputs`` is ``{"input_ids", "position_ids"}`` (packed sequences) or a tensor of token ids.
    """

    def __init__(self, hf: nn.Module, lora: bool = False) -> None:
        super().__init__()
        self.hf = hf
        self.lora = lora

    @property
    def config(self) -> Any:
        """The transformers config."""
        return self.hf.config

    def forward(self, inputs: Any) -> torch.Tensor:
        if isinstance(inputs, dict):
            ids, pos = inputs["input_ids"], inputs.get("position_ids")
        else:
            ids, pos = inputs, None
        return self.hf(input_ids=ids, position_ids=pos, use_cache=False).logits  # type: ignore[no-any-return]

    def fsdp_units(self) -> list[nn.Module]:
        """One FSDP2 unit per decoder layer (then the root holds embeddings and head)."""
        return decoder_layers(self.hf)

    def tp_plan(self, tp: int = 1) -> dict[str, Any]:
        """Megatron-style tensor parallelism of the attention and MLP projections (Llama family) over
        ``tp`` ranks: q/k/v/gate/up column-wise (each rank a share of the heads and of the MLP), o/down
        row-wise (their partial sums all-reduced). Embeddings, norms and the head stay replicated, so
        tied embeddings stay tied.

        Raises:
            ConfigError: the architecture's layers are not named as in Llama/Qwen/Mistral, or its
                head counts or MLP width do not split over ``tp``.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if self.lora:
            raise ConfigError("parallel.tp: LoRA fine-tuning runs with dp only (ddp or fsdp)")
        cfg = self.hf.config
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            n = getattr(cfg, key, None)
            if isinstance(n, int) and n % tp:
                # Column shards must hold whole heads: attention reshapes each rank's share by head_dim.
                raise ConfigError(f"parallel.tp={tp}: the model's {key} ({n}) does not split over {tp} ranks")
        plan: dict[str, Any] = {}
        for name, _ in self.hf.named_modules():
            tail = name.split(".layers.", 1)[-1].split(".", 1)[-1] if ".layers." in name else ""
            if tail in _COLWISE:
                plan[f"hf.{name}"] = ColwiseParallel()
            elif tail in _ROWWISE:
                plan[f"hf.{name}"] = RowwiseParallel()
        if not plan:
            raise ConfigError(
                f"parallel.tp: {type(self.hf).__name__} has no Llama-style attention and MLP projections"
            )
        return plan


def _lora_config(lora: dict[str, Any]) -> Any:
    from peft import LoraConfig

    allowed = {"r", "alpha", "dropout", "target_modules"}
    unknown = sorted(set(lora) - allowed)
    if unknown:
        raise ConfigError(
            f"model.kwargs.lora: unknown key(s) {', '.join(unknown)} (use {', '.join(sorted(allowed))})"
        )
    r = lora.get("r", 8)
    if not isinstance(r, int) or r < 1:
        raise ConfigError(f"model.kwargs.lora.r must be a positive integer, got {r!r}")
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=int(lora.get("alpha", 2 * r)),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=lora.get("target_modules", "all-linear"),
    )


# The attention the trainer's models use (registered with transformers on first use): sdpa, except
# that attention over whole sequences on the CPU runs in float32 with GQA in place (_cpu_float32_sdpa).
GPUYARD_SDPA = "gpuyard_sdpa"


def _cpu_float32_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except on the CPU over a whole sequence (training, prefill) with a
    boolean mask or none: there torch's flash kernel runs in float32 (bf16/fp16 inputs, from autocast or
    half weights, are cast up and the output back, outside autocast) with grouped key/value heads read
    in place (``enable_gqa``: transformers copies them per query head when a mask is given).

    Why: with the block-diagonal mask of packed sequences, the CPU flash kernel's bf16 backward takes
    about 4x its float32 time (measured here in a bf16 training step: 661 vs 166 ms for 4 layers;
    BENCHMARKS.md, llm_train), and the key/value copies cost a sum per layer in backward; float32
    accumulation is also the more exact. Decoding steps, GPUs, float masks (position bias) and
    softcapping go to transformers' sdpa as they are.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    same = query.shape[2] == key.shape[2] and query.shape[2] > 1
    bool_mask = attention_mask is None or attention_mask.dtype == torch.bool
    # Under autocast, rotary embeddings leave q and k in float32 and v in bf16; sdpa would run in bf16.
    cpu = query.device.type == "cpu"
    low = torch.get_autocast_dtype("cpu") if cpu and torch.is_autocast_enabled("cpu") else value.dtype
    if (
        not cpu
        or low not in (torch.bfloat16, torch.float16, torch.float32)
        or not same
        or not bool_mask
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    causal = attention_mask is None and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True)
    )
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    q, k, v = (t.float() for t in (query, key, value))  # no copy where already float32
    with torch.autocast("cpu", enabled=False):  # autocast would cast the float32 inputs back to bf16
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=bool(causal),
            enable_gqa=gqa,
        )  # fmt: skip
    return out.to(low).transpose(1, 2).contiguous(), None


def _register_attention() -> str:
    """Register gpuyard's sdpa variant (and sdpa's mask for it) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GPUYARD_SDPA, _cpu_float32_sdpa)
    AttentionMaskInterface.register(GPUYARD_SDPA, sdpa_mask)
    return GPUYARD_SDPA


def causal_lm(
    config: str | None = None,
    weights: str | None = None,
    lora: dict[str, Any] | None = None,
    activation_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    samples: dict[str, Any] | None = None,
) -> CausalLM:
    """A train-spec model factory: a causal LM from ``config`` (random init) or ``weights`` (a folder).

    ``lora``: ``{r, alpha, dropout, target_modules}`` to fine-tune low-rank adapters (peft) of the
    frozen weights. ``attn_implementation``: transformers' name; the default ``sdpa`` runs as
    :func:`_cpu_float32_sdpa` (the exported config names none: transformers picks its own).
    ``samples``: the greedy generations made at each validation by ``export_at_end``
    (:func:`sample_settings`: ``{prompts, count, prompt_tokens, max_new_tokens}``; ``{count: 0}``: none).

    Raises:
        ConfigError: neither or both of config and weights; unreadable files; bad LoRA or samples settings.
    """
    from transformers import AutoModelForCausalLM

    sampling = sample_settings(samples)
    if attn_implementation == "sdpa":  # the default: sdpa, with float32 GQA attention on the CPU
        attn_implementation = _register_attention()
    if (config is None) == (weights is None):
        raise ConfigError("model.kwargs: give config (a config.json: random init) or weights (a folder)")
    if config is not None:
        cfg = load_config(config)
        cfg._attn_implementation = attn_implementation
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    else:
        folder = resolve_weights(str(weights))
        load_config(folder)  # a clear error for a bad config before transformers reads it
        try:
            hf = AutoModelForCausalLM.from_pretrained(
                folder, attn_implementation=attn_implementation, dtype=torch.float32
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.kwargs.weights {weights}: {str(exc).splitlines()[0][:300]}") from exc
    hf.config.use_cache = False
    if activation_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = hf
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(hf, _lora_config(dict(lora)))
    wrapped = CausalLM(model, lora=lora is not None)
    wrapped._gpuyard_source = {  # type: ignore[assignment]
        "config": str(config) if config else None,
        "weights": str(weights) if weights else None,
        "lora": dict(lora) if lora else None,
    }
    wrapped._gpuyard_samples = sampling  # type: ignore[assignment]
    return wrapped


def resolve_weights(weights: str) -> Path:
    """A local weights folder (a registered model: `gpuyard models export NAME:V --out FOLDER` first).

    Raises:
        ConfigError: not a folder with config.json.
    """
    p = Path(weights).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"model.kwargs.weights {p}: not a folder (config.json + safetensors); for a registered model "
            "run `gpuyard models export NAME:VERSION --out FOLDER` and name the folder"
        )
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.kwargs.weights {p}: no config.json in the folder")
    return p


class LmLoss:
    """Mean cross-entropy over the counted (non ``-100``) labels of a packed batch (labels pre-shifted).

    A token-weighted loss for the trainer (:func:`gpuyard.train.step.token_weighted`): packed
    sequences carry different numbers of counted labels, so the mean of per-rank (or per
    micro-batch) means is not the mean over the step's tokens. The trainer divides the summed loss
    (``total``) by the labels ``count`` of the whole step over every data-parallel rank instead,
    which makes a step on N ranks the step on one rank with the same global batch.
    """

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE
        )

    def total(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy over the counted labels (0, with its graph, when none counts)."""
        return F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )

    def count(self, labels: torch.Tensor) -> int:
        """The counted labels of a batch."""
        return int((labels != IGNORE).sum())


lm_loss = LmLoss()


@torch.no_grad()
def perplexity(
    model: nn.Module,
    batches: Any,
    device: torch.device | None = None,
    group: Any = None,
    progress: Any = None,
    total_batches: int = 0,
) -> dict[str, float]:
    """Validation loss and perplexity counted exactly: summed token losses over counted tokens.

    With a process group, the sums of every data-parallel rank are added (each reads its own shard).
    ``progress("perplexity", done, total_batches)`` is called after each batch.
    """
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    done = 0
    for batch in batches:
        inputs = {k: v.to(device) for k, v in batch["inputs"].items()}
        labels = batch["targets"].to(device)
        logits = model(inputs)
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        total += torch.stack([loss.double(), (labels != IGNORE).sum().double()])
        if progress is not None:
            done += 1
            progress("perplexity", done, total_batches)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total, group=group)
    if was_training:
        model.train()
    loss_sum, tokens = float(total[0]), float(total[1])
    mean = loss_sum / tokens if tokens else float("nan")
    return {
        "val_loss_tokens": mean,
        "val_perplexity": math.exp(mean) if tokens else float("nan"),
        "val_tokens": tokens,
    }


SAMPLE_KEYS = ("prompts", "count", "prompt_tokens", "max_new_tokens")


def sample_settings(samples: dict[str, Any] | None) -> dict[str, Any]:
    """The sample-generation settings: ``prompts`` (texts; default: the first ``prompt_tokens`` tokens,
    at most half, of the first ``count`` validation documents), ``max_new_tokens`` generated greedily.

    Raises:
        ConfigError: an unknown key or a bad value (one line naming it).
    """
    got = dict(samples or {})
    unknown = sorted(set(got) - set(SAMPLE_KEYS))
    if unknown:
        raise ConfigError(f"samples: unknown key(s) {', '.join(unknown)} (use {', '.join(SAMPLE_KEYS)})")
    out: dict[str, Any] = {"prompts": None, "count": 3, "prompt_tokens": 16, "max_new_tokens": 16}
    prompts = got.get("prompts")
    if prompts is not None:
        if not isinstance(prompts, list) or not all(isinstance(x, str) and x for x in prompts):
            raise ConfigError("samples.prompts: a list of non-empty strings")
        if len(prompts) > 32:
            raise ConfigError(f"samples.prompts: {len(prompts)} prompts; at most 32 are generated")
        out["prompts"] = list(prompts)
    for key, top in (("count", 32), ("prompt_tokens", 4096), ("max_new_tokens", 1024)):
        value = got.get(key, out[key])
        low = 0 if key == "count" else 1
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise ConfigError(f"samples.{key}: an integer from {low} to {top}, got {value!r}")
        out[key] = value
    return out


def default_prompts(input_ids: Any, position_ids: Any, count: int, prompt_tokens: int) -> list[list[int]]:
    """Token-id prompts from packed sequences: the first ``prompt_tokens`` tokens (at most half) of
    each of the first ``count`` documents that start in them (a document starts where positions restart)."""
    prompts: list[list[int]] = []
    for ids, pos in zip(input_ids, position_ids, strict=True):
        ids, pos = [int(x) for x in ids], [int(x) for x in pos]
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in itertools.pairwise(starts):
            # A document runs until positions restart; padding after the last one restarts them too.
            length = next((k for k in range(1, b - a) if pos[a + k] != k), b - a)
            take = min(prompt_tokens, length // 2)
            if take >= 1 and len(prompts) < count:
                prompts.append(ids[a : a + take])
        if len(prompts) >= count:
            break
    return prompts


@torch.no_grad()
def generate_samples(
    model: nn.Module,
    tokenizer: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | list[int] | None,
    progress: Any = None,
) -> list[dict[str, str]]:
    """Greedy continuations of token-id ``prompts`` by a causal LM (a CausalLM, or one wrapped by DDP),
    as ``[{prompt, completion}]`` texts (``tokenizer``: a ``tokenizers.Tokenizer``). ``eos_id``: the
    id, or the ids (end of sequence, turn markers), generation stops at; the completion leaves it out.
    ``progress("generate", done, len(prompts))`` is called after each prompt."""
    stops = [eos_id] if isinstance(eos_id, int) else list(eos_id or [])
    wrapped = _unwrap(model)
    hf: Any = wrapped.hf
    was_training = wrapped.training
    wrapped.eval()
    device = next(wrapped.parameters()).device
    out = []
    try:
        for ids in prompts:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            gen = hf.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                eos_token_id=stops or None,
                pad_token_id=stops[0] if stops else None,
            )
            new = [int(t) for t in gen[0, len(ids) :]]
            new = new[: next((i for i, t in enumerate(new) if t in stops), len(new))]
            out.append(
                {
                    "prompt": tokenizer.decode(ids, skip_special_tokens=False),
                    "completion": tokenizer.decode(new, skip_special_tokens=False),
                }
            )
            if progress is not None:
                progress("generate", len(out), len(prompts))
    finally:
        if was_training:
            wrapped.train()
    return out


def _validation_samples(trainer: Any, dataset: str, split: str | None) -> list[dict[str, str]]:
    """The generations of this validation (every rank runs them when the weights are sharded)."""
    from tokenizers import Tokenizer

    from gpuyard.data.dataset import open_dataset
    from gpuyard.data.tokens import token_info, tokenizer_bytes

    wrapped = _unwrap(trainer.model)
    settings = getattr(wrapped, "_gpuyard_samples", None) or sample_settings(None)
    # From the layout, not the parameters' type: FSDP2 leaves the root's parameters unsharded (plain
    # tensors) after a forward without backward (the perplexity just run), yet every rank must join.
    layout = trainer.ctx.layout
    sharded = layout.tp > 1 or (layout.dp > 1 and trainer.spec.parallel.data_parallel == "fsdp")
    if (settings["count"] == 0 and not settings["prompts"]) or (trainer.ctx.rank != 0 and not sharded):
        return []
    cache = trainer.__dict__.setdefault("_gpuyard_sample_cache", {})
    if "prompts" not in cache:
        version = open_dataset(dataset)
        tok = Tokenizer.from_str(tokenizer_bytes(version).decode("utf-8"))
        if settings["prompts"]:
            prompts = [tok.encode(p, add_special_tokens=False).ids for p in settings["prompts"]]
        else:
            cols = version.to_numpy(["input_ids", "position_ids"], split)
            head = slice(0, settings["count"])
            count, take = settings["count"], settings["prompt_tokens"]
            prompts = default_prompts(cols["input_ids"][head], cols["position_ids"][head], count, take)
        cache.update(prompts=prompts, tokenizer=tok, eos=token_info(version)["tokenizer"]["eos_id"])
    return generate_samples(
        trainer.model, cache["tokenizer"], cache["prompts"], settings["max_new_tokens"], cache["eos"]
    )


def _record_samples(trainer: Any, record: dict[str, Any] | None) -> None:
    """Keep a validation's generations with the run: a ``samples`` event in metrics.jsonl and, for a run
    in the state store, an evaluation record (``gpuyard runs show``) once the store has the run
    (``record`` None: write the ones kept back, at the end)."""
    pending = trainer.__dict__.setdefault("_gpuyard_pending_samples", [])
    if record is not None:
        log_event = getattr(trainer.tracker, "log_event", None)
        if log_event is not None:
            log_event("samples", **record)
        pending.append(record)
    run_id = getattr(trainer.tracker, "run_id", None)
    if run_id is None or getattr(trainer.tracker, "failed", False) or not pending:
        pending.clear()
        return
    try:
        from gpuyard.store import get_store
        from gpuyard.store.tables.models import EvaluationRow, RunRow

        with get_store().session() as s:
            if s.get(RunRow, run_id) is None and record is not None:
                return  # the tracker's thread has not created the run yet: the next validation or the end
            for rec in pending:
                s.add(
                    EvaluationRow(
                        run_id=run_id, split="validation", task="text-generation",
                        dataset_version=rec["dataset"], n_samples=int(rec["metrics"].get("val_tokens", 0)),
                        metrics=rec["metrics"], details={"step": rec["step"], "samples": rec["samples"]},
                    )
                )  # fmt: skip
    except Exception as exc:  # the database is down or locked: the samples stay in metrics.jsonl
        import logging

        logging.getLogger("gpuyard.train").warning(
            "gpuyard train: warning: %d sample generation record(s) not stored in run %s (%s); "
            "they are in metrics.jsonl",
            len(pending),
            run_id[:8],
            " ".join(str(exc).split())[:200],
        )
    pending.clear()


def _unwrap(model: nn.Module) -> CausalLM:
    inner = getattr(model, "module", model)  # DDP
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile
    if not isinstance(inner, CausalLM):
        raise ConfigError(f"the model is a {type(inner).__name__}, not gpuyard.train.hf:causal_lm")
    return inner


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state (FSDP2/tensor-parallel shards gathered) on the CPU, on rank 0 (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)  # type: ignore[return-value]


def save_hf(
    wrapped: CausalLM,
    state: dict[str, torch.Tensor] | None,
    out: Path,
    tokenizer: Path | bytes | None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the model in Hugging Face layout into ``out`` (and, for LoRA, the adapter and the merged model).

    ``state`` (keys prefixed ``hf.``) replaces the module's own tensors (gathered FSDP shards).
    """
    hf: Any = wrapped.hf
    if state is not None:
        # Gathered shards go into a fresh, unsharded copy (FSDP2 parameters are DTensors).
        from transformers import AutoModelForCausalLM

        own = {k[len("hf.") :]: v for k, v in state.items() if k.startswith("hf.")}
        if wrapped.lora:
            from peft import get_peft_model

            base = AutoModelForCausalLM.from_config(hf.get_base_model().config)
            fresh = get_peft_model(base, hf.peft_config["default"])
        else:
            fresh = AutoModelForCausalLM.from_config(hf.config)
        fresh.load_state_dict(own, strict=True)
        hf = fresh
    out.mkdir(parents=True, exist_ok=True)
    if wrapped.lora:
        hf.save_pretrained(out / "adapter")
        if state is None:  # merging changes the module: merge a copy, the live model keeps its adapters
            import copy

            hf = copy.deepcopy(hf)
        hf = hf.merge_and_unload()
    hf.config.use_cache = True
    hf.save_pretrained(out, safe_serialization=True)
    write_tokenizer(tokenizer, out, (extra or {}).get("tokenizer"))
    write_generation_config(out)
    info = {"format": "gpuyard.lm/1", **(extra or {})}
    (out / GPUYARD_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))
    return out


def write_tokenizer(tokenizer: Path | bytes | None, out: Path, meta: dict[str, Any] | None = None) -> None:
    """Copy a tokenizer (a folder, a tokenizer.json, or its bytes) into ``out`` with a tokenizer_config.json
    that ``AutoTokenizer`` reads (end-of-sequence and pad tokens, chat template)."""
    from gpuyard.data.tokenizer import DEFAULT_CHAT_TEMPLATE, load_tokenizer

    if tokenizer is None:
        return
    if isinstance(tokenizer, bytes):
        (out / "tokenizer.json").write_bytes(tokenizer)
    else:
        if tokenizer.is_dir():
            for name in (
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "chat_template.jinja",
            ):
                if (tokenizer / name).is_file():
                    shutil.copyfile(tokenizer / name, out / name)
        elif tokenizer.suffix != ".model":
            shutil.copyfile(tokenizer, out / "tokenizer.json")
        if not (out / "tokenizer.json").is_file():
            # A SentencePiece model (a .model file, or a folder with tokenizer.model only): its checked
            # conversion, which AutoTokenizer, the registry and the server read.
            (out / "tokenizer.json").write_bytes(load_tokenizer(tokenizer).raw)
    tok = load_tokenizer(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    for key in ("eos_token", "chat_template"):
        if (meta or {}).get(key):
            cfg[key] = meta[key]  # type: ignore[index]
    cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    cfg.setdefault("eos_token", tok.eos_token)
    pad = tok.tokenizer.id_to_token(tok.pad_id)
    cfg.setdefault("pad_token", pad)
    cfg.setdefault("chat_template", DEFAULT_CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=1))


def write_generation_config(folder: Path) -> dict[str, Any]:
    """Make ``folder``'s generation_config.json one that generates fast and stops where a reply ends:
    ``use_cache`` true (training turns the cache off), ``eos_token_id`` the list of the tokenizer's
    end-of-sequence token, then the chat template's turn markers that are special tokens (role
    markers, end of turn), then any other the file named, and ``pad_token_id`` the tokenizer's pad.
    ``generate()`` and serving engines read these. Returns what was written.
    """
    from gpuyard.data.tokens import load_tokenizer

    path = folder / "generation_config.json"
    doc = read_json(path, "generation config") if path.is_file() else {}
    doc["use_cache"] = True
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        tok = load_tokenizer(folder)
        had = doc.get("eos_token_id")
        had_ids = had if isinstance(had, list) else [had] if isinstance(had, int) else []
        stops = tok.stop_ids()
        doc["eos_token_id"] = [*stops, *(i for i in had_ids if isinstance(i, int) and i not in stops)]
        doc["pad_token_id"] = tok.pad_id
    doc.pop("_from_model_config", None)  # else transformers regenerates it from config.json
    path.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return doc


def _dataset_of(spec: Any) -> str | None:
    entry = spec.data.train
    return None if entry is None else entry.kwargs.get("dataset")


def export_at_end(trainer: Any, event: str) -> None:
    """Trainer callback: exact validation perplexity after each validation, and on ``end`` the model
    in Hugging Face layout under ``<run_dir>/hf`` (with the training dataset's tokenizer).

    The perplexity reads every sequence of ``data.val``'s token dataset split once over the
    data-parallel ranks (the trainer's own ``val_loss`` is a mean over batches of its loader, which
    leaves out up to world_size - 1 sequences so ranks stay in step).
    """
    val = trainer.spec.data.val
    if event == "validation" and val is not None and "dataset" in val.kwargs:
        from gpuyard.data.tokens import exact_batches

        ctx = trainer.ctx
        batches = exact_batches(
            val.kwargs["dataset"], val.kwargs.get("split"), int(val.kwargs.get("batch_size", 8)),
            ctx.dp_rank, ctx.layout.dp,
        )  # fmt: skip
        metrics = perplexity(trainer.model, batches, ctx.device, ctx.group("dp"))
        trainer.last_metrics.update(metrics)
        trainer.tracker.log_metrics(trainer.step, metrics)
        samples = _validation_samples(trainer, val.kwargs["dataset"], val.kwargs.get("split"))
        if samples and ctx.rank == 0:
            from gpuyard.data.dataset import open_dataset

            ref = open_dataset(val.kwargs["dataset"]).ref
            split = val.kwargs.get("split")
            record = {
                "step": trainer.step,
                "dataset": f"{ref}#split={split}" if split else ref,
                "metrics": metrics,
                "samples": samples,
            }
            _record_samples(trainer, record)
        return
    if event != "end":
        return
    if trainer.ctx.rank == 0:
        _record_samples(trainer, None)  # the ones the store could not take at their validation
    wrapped = _unwrap(trainer.model)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    state = full_state_dict(trainer.model) if distributed else None
    if trainer.ctx.rank != 0:
        return
    tokenizer: bytes | None = None
    info: dict[str, Any] = {"source": getattr(wrapped, "_gpuyard_source", {}), "step": trainer.step}
    run_id = getattr(trainer.tracker, "run_id", None)
    if run_id:  # lineage for `gpuyard llm register` of this folder by hand
        info["run_id"] = str(run_id)
    dataset = _dataset_of(trainer.spec)
    if dataset:
        from gpuyard.data.dataset import open_dataset
        from gpuyard.data.tokens import token_info, tokenizer_bytes

        version = open_dataset(dataset)
        tokenizer = tokenizer_bytes(version)
        tinfo = token_info(version)
        info.update(
            dataset=version.ref,
            context_length=int(tinfo["seq_len"]),
            tokenizer_sha256=tinfo["tokenizer"]["sha256"],
            tokenizer={k: tinfo["tokenizer"][k] for k in ("eos_token", "chat_template", "eos_id", "pad_id")},
        )
    if "val_perplexity" in trainer.last_metrics:
        info["val_perplexity"] = trainer.last_metrics["val_perplexity"]
    save_hf(wrapped, state, trainer.run_dir / HF_DIR, tokenizer, info)
