"""Packing tokenized documents into fixed-length sequences with restarting positions and labels that
never cross a document (the rules are in :mod:`gpuyard.data.tokens`' docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError

IGNORE = -100
# What becomes of a document longer than the sequence length; the defaults per kind of dataset.
OVER_LENGTH = ("split", "truncate", "drop")
OVER_LENGTH_DONE = {"split": "split", "truncate": "truncated", "drop": "dropped"}


@dataclass
class Packed:
    """Sequences packed from documents, and their counts."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    labels: np.ndarray
    documents: int = 0
    tokens: int = 0
    padding: int = 0
    split_documents: int = 0
    truncated_documents: int = 0
    dropped_documents: int = 0

    @property
    def sequences(self) -> int:
        """Packed sequences."""
        return len(self.input_ids)

    def counts(self) -> dict[str, Any]:
        """The figures recorded in the manifest."""
        slots = self.sequences * (self.input_ids.shape[1] if self.sequences else 0)
        return {
            "documents": self.documents,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "padding": self.padding,
            "label_tokens": int((self.labels != IGNORE).sum()),
            "split_documents": self.split_documents,
            "truncated_documents": self.truncated_documents,
            "dropped_documents": self.dropped_documents,
            "waste": round(self.padding / slots, 6) if slots else 0.0,
        }


def pack(
    docs: list[list[int]],
    seq_len: int,
    eos_id: int,
    pad_id: int,
    masks: list[list[bool]] | None = None,
    over_length: str = "split",
) -> Packed:
    """Pack token lists (each gets ``eos_id`` appended) into sequences of ``seq_len`` (module docstring).

    ``masks``: per document, per token (its end-of-sequence token included), whether predicting that
    token counts in the loss (default: every token). ``over_length``: split, truncate or drop a
    document longer than ``seq_len``.
    """
    if seq_len < 2:
        raise ConfigError(f"seq_len must be at least 2, got {seq_len}")
    if over_length not in OVER_LENGTH:
        raise ConfigError(f"over_length {over_length!r} unknown; use one of {', '.join(OVER_LENGTH)}")
    pieces: list[list[tuple[list[int], list[bool]]]] = []  # per sequence, its document pieces
    current: list[tuple[list[int], list[bool]]] = []
    used = 0
    split = truncated = dropped = 0
    total = 0
    for n_doc, ids in enumerate(docs):
        doc = [*ids, eos_id]
        mask = masks[n_doc] if masks is not None else [True] * len(doc)
        if len(doc) > seq_len:
            if over_length == "drop":
                dropped += 1
                continue
            if over_length == "truncate":
                truncated += 1
                doc, mask = doc[:seq_len], mask[:seq_len]
        total += len(doc)
        if len(doc) > seq_len:
            split += 1
            if current:
                pieces.append(current)
                current, used = [], 0
            for start in range(0, len(doc), seq_len):
                chunk = (doc[start : start + seq_len], mask[start : start + seq_len])
                if len(chunk[0]) == seq_len:
                    pieces.append([chunk])
                else:
                    current, used = [chunk], len(chunk[0])
            continue
        if used + len(doc) > seq_len:
            pieces.append(current)
            current, used = [], 0
        current.append((doc, mask))
        used += len(doc)
    if current:
        pieces.append(current)
    n = len(pieces)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    position_ids = np.zeros((n, seq_len), dtype=np.int32)
    labels = np.full((n, seq_len), IGNORE, dtype=np.int32)
    for s, seq in enumerate(pieces):
        at = 0
        for piece, keep in seq:
            k = len(piece)
            input_ids[s, at : at + k] = piece
            position_ids[s, at : at + k] = np.arange(k, dtype=np.int32)
            labels[s, at : at + k - 1] = np.where(keep[1:], piece[1:], IGNORE)
            at += k
    return Packed(
        input_ids, position_ids, labels, documents=len(docs) - dropped, tokens=total,
        padding=n * seq_len - total, split_documents=split, truncated_documents=truncated,
        dropped_documents=dropped,
    )  # fmt: skip


def token_mask(
    offsets: list[tuple[int, int]], spans: list[tuple[int, int]], last_assistant: bool
) -> list[bool]:
    """Per token (then the appended end-of-sequence token): whether it overlaps one of ``spans``
    (character spans of assistant turns); the end-of-sequence token counts after a final assistant turn."""
    out = [any(a < e and b > s for s, e in spans) for a, b in offsets]
    return [*out, last_assistant]
