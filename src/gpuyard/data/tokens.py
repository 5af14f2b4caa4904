"""Token datasets: a text version tokenized with a local tokenizer and packed into fixed-length sequences.

Each document (a chat record is first rendered with the chat template) becomes its tokens plus the
end-of-sequence token. Documents are packed in order into sequences of ``seq_len`` tokens: a document
that does not fit in what is left of the current sequence starts the next one (the rest is padding),
and one longer than ``seq_len`` (its end-of-sequence token counted) is handled as ``over_length``
says: ``split`` into pieces of ``seq_len`` tokens (the default for documents), ``truncate``d to its
first ``seq_len`` tokens (the default for chat records, as TRL's ``max_length``; no end-of-sequence
token is added, the record did not end there) or ``drop``ped; the manifest counts them
(``long_records``). Each sequence stores three ``(seq_len,)`` int32 tensor columns:

* ``input_ids``: the tokens (padding is the pad token, or end-of-sequence when the tokenizer has none);
* ``position_ids``: positions that restart at 0 at every document (piece) and at every padding token,
  so attention never crosses a document boundary (transformers reads restarting positions as
  separate sequences and masks between them, when no attention mask is given);
* ``labels``: the next token of the same document, ``-100`` (ignored) at a document's last position
  and on padding, so the loss and the perplexity count exactly the predictable tokens. A chat record
  tokenized with ``loss="assistant"`` (the default for chat, as TRL's assistant-only loss) has labels
  only where the next token belongs to an assistant message (as the chat template renders it,
  found by rendering each conversation prefix) or is the end-of-sequence token after a final
  assistant message; ``loss="all"`` trains on every token.

The manifest's ``tokens`` records the tokenizer (SHA-256, artifact key, special tokens, chat
template), the sequence length, token counts (documents, real tokens, padding, counted labels) and
the packing waste (padding / all positions), per split when a validation share is asked.

The parts: :mod:`~gpuyard.data.tokenizer` (reading a tokenizer, chat templates),
:mod:`~gpuyard.data.packing` (packing documents into sequences), :mod:`~gpuyard.data.tokenizer_train`
(training a tokenizer); this module tokenizes a version and reads token datasets back.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from gpuyard.data.catalog import check_new_version_team, record_version
from gpuyard.data.columns import tensor_array, tensor_field
from gpuyard.data.dataset import DatasetVersion, open_dataset
from gpuyard.data.manifest import build_manifest
from gpuyard.data.packing import IGNORE, OVER_LENGTH, OVER_LENGTH_DONE, pack, token_mask
from gpuyard.data.shards import ROW_GROUP_BYTES, rows_per_shard, store_shard
from gpuyard.data.tokenizer import LoadedTokenizer, load_tokenizer
from gpuyard.data.views import LoaderView
from gpuyard.errors import ConfigError
from gpuyard.refs import check_dataset_name
from gpuyard.store import get_artifacts

__all__ = ["load_tokenizer", "packed_batches", "token_info", "tokenize"]

MAX_SEQ_LEN = 1 << 20
# Documents tokenized per call of the (multi-threaded) batch encoder.
ENCODE_BATCH = 1024
LOSS_ON = ("assistant", "all")


def _column(version: DatasetVersion) -> str:
    column = (version.manifest.get("text") or {}).get("column")
    if column not in ("text", "messages"):
        raise ConfigError(
            f"{version.ref} is not a text dataset (kind {version.manifest['kind']!r}); ingest a corpus "
            "with `gpuyard data ingest CORPUS --name N` (a .txt/.jsonl/.parquet with a text field)"
        )
    return str(column)


def _documents(
    version: DatasetVersion, tok: LoadedTokenizer, assistant_only: bool
) -> Iterator[tuple[str, list[tuple[int, int]] | None, bool]]:
    """(text, assistant spans or None, whether the last message is the assistant's) of every record."""
    column = _column(version)
    for table in version.iter_tables(columns=[column]):
        for value in table.column(column).to_pylist():
            if column == "text":
                yield value, None, False
            elif assistant_only:
                text, spans = tok.assistant_spans(value)
                yield text, spans, value[-1]["role"] == "assistant"
            else:
                yield tok.render_chat(value), None, False


def _is_val(text: str, fraction: float, seed: int) -> bool:
    h = hashlib.sha256(f"{seed}:".encode() + text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def tokenize(
    ref: str,
    tokenizer: str | Path,
    seq_len: int,
    *,
    output: str | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    eos_token: str | None = None,
    team: str | None = None,
    over_length: str | None = None,
    loss_on: str | None = None,
    progress: Any = None,
) -> DatasetVersion:
    """Tokenize and pack text version ``ref`` into a token dataset (``output``, default ``NAME-tokens``).

    With ``val_fraction`` each document goes (by a seeded hash of its text) to the ``val`` split
    with that probability, else to ``train``; the splits are packed apart, so no sequence mixes them.
    ``over_length``: split, truncate or drop a document over ``seq_len`` tokens (default: split for
    documents, truncate for chat records). ``loss_on``: for chat records, ``assistant`` (the default:
    labels only on assistant turns) or ``all``. ``progress(stage, done, total)`` is called per batch.

    Raises:
        ConfigError: a bad tokenizer, sequence length, fraction or option, a dataset that is not text,
            or a corpus that yields no sequence in a split asked for.
    """
    if not 2 <= seq_len <= MAX_SEQ_LEN:
        raise ConfigError(f"--seq-len must be between 2 and {MAX_SEQ_LEN}, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if over_length is not None and over_length not in OVER_LENGTH:
        raise ConfigError(f"--over-length {over_length!r} unknown; use one of {', '.join(OVER_LENGTH)}")
    if loss_on is not None and loss_on not in LOSS_ON:
        raise ConfigError(f"--loss-on {loss_on!r} unknown; use one of {', '.join(LOSS_ON)}")
    tok = load_tokenizer(tokenizer, eos_token)
    version = open_dataset(ref)
    name = output or f"{version.name}-tokens"
    check_dataset_name(name)
    check_new_version_team(name, team)
    chat = _column(version) == "messages"
    if loss_on == "assistant" and not chat:
        raise ConfigError(
            f"{version.ref} holds documents, not chat records: --loss-on assistant needs a chat dataset"
        )
    loss = loss_on or ("assistant" if chat else "all")
    over = over_length or ("truncate" if chat else "split")
    notes: list[str] = []
    if chat and tok.default_template:
        notes.append(
            f"tokenizer {tokenizer} has no chat template: chat records are rendered with gpuyard's own "
            "(<|role|>, the content, a new line per message); put the model's in tokenizer_config.json's "
            "chat_template or chat_template.jinja"
        )
    splits: dict[str, list[list[int]]] = {"train": [], "val": []}
    split_masks: dict[str, list[list[bool]]] = {"train": [], "val": []}
    conversion: dict[str, int] = {}
    batch: list[str] = []
    which: list[str] = []
    spans: list[tuple[list[tuple[int, int]], bool]] = []
    done = 0

    def flush() -> None:
        if not chat and not any(splits.values()) and tok.reference is not None:
            # A SentencePiece model: its converted tokenizer.json (what exported models and the server
            # read) is checked on the first documents.
            differ = tok.verify(batch)
            if differ:
                conversion["mismatches"] = len(differ)
                warnings.warn(
                    f"tokenizer: {len(differ)} of the first {len(batch)} documents encode differently with "
                    f"the converted tokenizer.json than with sentencepiece, e.g. {differ[0][:60]!r} "
                    "(text spelling control or byte pieces such as </s>)",
                    stacklevel=2,
                )
        if loss == "assistant":
            for (ids, offsets), split, (turns, last) in zip(
                tok.encode_offsets(batch), which, spans, strict=True
            ):
                splits[split].append(ids)
                split_masks[split].append(token_mask(offsets, turns, last))
        else:
            for ids, split in zip(tok.encode_batch(batch, specials=chat), which, strict=True):
                splits[split].append(ids)
        if progress is not None:
            progress("tokenize", done, version.num_rows)
        batch.clear()
        which.clear()
        spans.clear()

    for text, turns, last in _documents(version, tok, loss == "assistant"):
        batch.append(text)
        spans.append((turns or [], last))
        which.append("val" if val_fraction and _is_val(text, val_fraction, seed) else "train")
        done += 1
        if len(batch) >= ENCODE_BATCH:
            flush()
    flush()
    names = ["train", "val"] if val_fraction else ["train"]
    if val_fraction:
        empty = [s for s in names if not splits[s]]
        if empty:
            raise ConfigError(
                f"{version.ref}: no document went to the {'/'.join(empty)} split with val_fraction "
                f"{val_fraction} ({version.num_rows} documents); change --val-fraction"
            )
    else:
        splits["train"].extend(splits.pop("val"))
        split_masks["train"].extend(split_masks.pop("val"))
    packed = {
        s: pack(
            splits[s], seq_len, tok.eos_id, tok.pad_id, split_masks[s] if loss == "assistant" else None, over
        )
        for s in names
    }
    artifacts = get_artifacts()
    tok_info = artifacts.put_blob(tok.raw)
    fields = [tensor_field(c, tensor_array(np.zeros((1, seq_len), np.int32))[1]) for c in COLUMNS]
    if val_fraction:
        fields.append(pa.field("split", pa.string(), nullable=False))
    schema = pa.schema(fields)
    shards = []
    for s in names:
        p = packed[s]
        cols = [tensor_array(getattr(p, c))[0] for c in COLUMNS]
        if val_fraction:
            cols.append(pa.array([s] * p.sequences, pa.string()))
        table = pa.Table.from_arrays(cols, schema=schema)
        step = max(1, rows_per_shard(table, 16 * ROW_GROUP_BYTES))
        for start in range(0, table.num_rows, step):
            shards.append(store_shard(table.slice(start, step), artifacts))
    counts = {s: packed[s].counts() for s in names}
    total = {k: sum(c[k] for c in counts.values()) for k in counts["train"] if k != "waste"}
    slots = total["sequences"] * seq_len
    total["waste"] = round(total["padding"] / slots, 6) if slots else 0.0
    if total["sequences"] == 0:
        raise ConfigError(
            f"{version.ref}: every one of its {version.num_rows} records is over {seq_len} tokens and "
            "--over-length drop left none; raise --seq-len or truncate"
        )
    long_count = {"split": "split_documents", "truncate": "truncated_documents", "drop": "dropped_documents"}
    long_records = {"limit": seq_len, "action": over, "count": total[long_count[over]]}
    tokens_doc = {
        "seq_len": seq_len,
        "loss_on": loss,
        "long_records": long_records,
        "warnings": notes,
        "tokenizer": {**tok.doc(), "key": tok_info.key, **({"conversion": conversion} if conversion else {})},
        **total,
        "splits": counts if val_fraction else {},
    }
    manifest = build_manifest(
        name=name,
        kind="tokens",
        schema=schema,
        shards=shards,
        stats={},
        source={"uri": version.ref, "format": "dataset"},
        recipe={
            "tokenize": {
                "tokenizer_sha256": tok.sha256,
                "seq_len": seq_len,
                "val_fraction": val_fraction,
                "seed": seed,
                "eos_id": tok.eos_id,
                "pad_id": tok.pad_id,
                "over_length": over,
                "loss_on": loss,
            }
        },
        quarantine={
            "rows_in": version.num_rows,
            "rows_kept": version.num_rows,
            "rows_quarantined": 0,
            "by_reason": {},
            "key": None,
        },
        parent=version.ref,
        extra={
            "tokens": tokens_doc,
            "splits": {s: packed[s].sequences for s in names} if val_fraction else {},
        },
    )
    row = record_version(manifest, team)
    return open_dataset(f"{row.dataset}@{row.version}")


COLUMNS = ("input_ids", "position_ids", "labels")


def long_records_line(info: dict[str, Any]) -> str | None:
    """The one line on records over the sequence length of a token dataset's ``tokens`` record
    ("3 records over 512 tokens: truncated"), None for datasets made before it was counted."""
    long = info.get("long_records")
    if not isinstance(long, dict):
        return None
    n = int(long["count"])
    what = OVER_LENGTH_DONE.get(str(long["action"]), str(long["action"]))
    return f"{n} record{'' if n == 1 else 's'} over {long['limit']} tokens: {what} (--over-length)"


def token_info(version: DatasetVersion) -> dict[str, Any]:
    """The ``tokens`` record of a token dataset.

    Raises:
        ConfigError: the version is not a token dataset.
    """
    info = version.manifest.get("tokens")
    if version.manifest.get("kind") != "tokens" or not isinstance(info, dict):
        raise ConfigError(
            f"{version.ref} is not a token dataset (kind {version.manifest.get('kind')!r}); make one with "
            "`gpuyard data tokenize NAME@VERSION --tokenizer tokenizer.json --seq-len N`"
        )
    return info


def tokenizer_bytes(version: DatasetVersion) -> bytes:
    """The tokenizer.json a token dataset was made with (checked against its hash)."""
    info = token_info(version)["tokenizer"]
    return get_artifacts().get_bytes(info["key"], sha256=info["sha256"])


class PackedBatches(LoaderView):
    """Wraps a ShardLoader over a token dataset: batches become the causal-LM trainer's form,
    ``{"inputs": {"input_ids", "position_ids"}, "targets": labels}`` (int64 tensors of (B, seq_len)).

    The position (state_dict), epochs and global-batch mode are the wrapped loader's, so resume is
    exact as for any shard loader.
    """

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        for batch in self.loader:
            ids, pos, lab = (torch.as_tensor(np.asarray(batch[c])).long() for c in COLUMNS)
            yield {"inputs": {"input_ids": ids, "position_ids": pos}, "targets": lab}


def packed_batches(
    dataset: str,
    batch_size: int = 8,
    split: str | None = None,
    shuffle: bool = True,
    seed: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> PackedBatches:
    """A train-spec data factory: packed sequences of token dataset ``dataset`` (one split, or all).

    Raises:
        ConfigError: not a token dataset, or a split it does not have.
    """
    from gpuyard.data.loader import LoaderConfig, ShardLoader

    version = open_dataset(dataset)
    token_info(version)
    if split is not None and split not in (version.manifest.get("splits") or {}):
        have = sorted(version.manifest.get("splits") or {}) or ["none: tokenize with --val-fraction"]
        raise ConfigError(f"{version.ref} has no split {split!r} (splits: {', '.join(have)})")
    cfg = LoaderConfig(
        batch_size=batch_size, split=split, columns=COLUMNS, shuffle=shuffle, seed=seed, augment=False,
        shuffle_buffer=1024,
    )  # fmt: skip
    return PackedBatches(ShardLoader(version, cfg, rank=dp_rank, world_size=dp_size))


def exact_batches(
    dataset: str, split: str | None, batch_size: int, rank: int = 0, world_size: int = 1
) -> Iterator[dict[str, Any]]:
    """Every sequence of a split once over all ranks, in packed-batch form, for exact evaluation.

    Rank r takes sequences r, r + W, ...; every rank yields the same number of batches (sharded
    models run collectives in each forward), the missing ones all padding with every label ignored,
    so nothing is dropped and nothing is counted twice.
    """
    import torch

    version = open_dataset(dataset)
    token_info(version)
    arrays = version.to_numpy(list(COLUMNS), split)
    n = len(arrays["input_ids"])
    mine = np.arange(rank, n, world_size)
    per_rank = -(-n // world_size)
    batches = -(-per_rank // batch_size)
    for b in range(batches):
        rows = mine[b * batch_size : (b + 1) * batch_size]
        if len(rows) == 0:
            rows = np.zeros(1, dtype=np.int64)  # a stand-in sequence, none of its labels counted
            labels = np.full_like(arrays["labels"][rows], IGNORE)
        else:
            labels = arrays["labels"][rows]
        yield {
            "inputs": {
                "input_ids": torch.as_tensor(arrays["input_ids"][rows]).long(),
                "position_ids": torch.as_tensor(arrays["position_ids"][rows]).long(),
            },
            "targets": torch.as_tensor(labels).long(),
        }
