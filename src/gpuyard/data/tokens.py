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
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from gpuyard.data.catalog import check_new_version_team, record_version
from gpuyard.data.columns import tensor_array, tensor_field
from gpuyard.data.dataset import DatasetVersion, open_dataset
from gpuyard.data.manifest import build_manifest
from gpuyard.data.shards import ROW_GROUP_BYTES, rows_per_shard, store_shard
from gpuyard.data.views import LoaderView
from gpuyard.errors import ConfigError
from gpuyard.refs import check_dataset_name
from gpuyard.store import get_artifacts

IGNORE = -100
MAX_SEQ_LEN = 1 << 20
MAX_TOKENIZER_BYTES = 512 << 20
MAX_SENTENCEPIECE_BYTES = 64 << 20
# Texts a converted SentencePiece model must encode exactly as sentencepiece does (else it is refused).
SPM_PROBES = (
    "the cat sat on the mat.",
    " a leading space,  two spaces   and three; trailing  ",
    "tabs\tand\nnew lines\n\n",
    "Caf\u00e9 na\u00efve \u2014 \u65e5\u672c\u8a9e \u30c6\u30b9\u30c8 \U0001f642 \ufb01 \u2460 x\u00a0y",
    "digits 0123456789, punctuation: (a) [b] {c} 'd' ~!@#$%^&*_+=|;?",
)
# Documents tokenized per call of the (multi-threaded) batch encoder.
ENCODE_BATCH = 1024
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")
# What becomes of a document longer than the sequence length; the defaults per kind of dataset.
OVER_LENGTH = ("split", "truncate", "drop")
OVER_LENGTH_DONE = {"split": "split", "truncate": "truncated", "drop": "dropped"}
LOSS_ON = ("assistant", "all")
# The chat template used when the tokenizer folder has none (ChatML-like), as a Jinja template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class LoadedTokenizer:
    """A tokenizer read from a local ``tokenizer.json`` or SentencePiece ``.model`` (or a folder holding one).

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer`` (a SentencePiece model is converted to one).
        raw: the bytes of tokenizer.json (stored with token datasets and models; for a SentencePiece
            model, the converted tokenizer.json, which ``AutoTokenizer`` and the server read).
        sha256: their hash.
        eos_id / pad_id: the end-of-sequence and padding token ids.
        chat_template: a Jinja chat template (the folder's tokenizer_config.json's, else gpuyard's).
        default_template: True when the folder has no chat template and gpuyard's is used.
        folder: the folder it came from, when one was given (other tokenizer files are exported too).
        source: for a converted SentencePiece model, its format, file name and SHA-256.
        reference: for a SentencePiece model, the ``sentencepiece`` processor it was converted from.
    """

    tokenizer: Any
    raw: bytes
    sha256: str
    eos_id: int
    eos_token: str
    pad_id: int
    chat_template: str
    folder: Path | None = None
    source: dict[str, Any] | None = None
    reference: Any = None
    default_template: bool = False

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, texts: list[str], specials: bool = False) -> list[list[int]]:
        """Token ids of each text (of a SentencePiece model: sentencepiece's own, which never reads
        text as a control piece).

        Special-token strings inside a document are encoded as plain text (a document cannot forge a
        boundary); with ``specials`` (text rendered by the chat template) they are the special tokens.
        """
        if self.reference is not None and not specials:  # SentencePiece: its own encoder, exactly
            return [list(ids) for ids in self.reference.encode(texts)]
        self.tokenizer.encode_special_tokens = not specials
        try:
            return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        finally:
            self.tokenizer.encode_special_tokens = True

    def encode_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Token ids of each chat-rendered text (special-token strings are the special tokens) with each
        token's character span in the text."""
        self.tokenizer.encode_special_tokens = False
        try:
            return [(e.ids, e.offsets) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        finally:
            self.tokenizer.encode_special_tokens = True

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """``messages`` through the chat template (sandboxed Jinja)."""
        return render_chat(self.chat_template, messages, add_generation_prompt, self.eos_token)

    def assistant_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns: from the end of the
        prefix rendered with the generation prompt to the end of the prefix holding that turn.

        Raises:
            ConfigError: the template renders a conversation's prefix as something other than its
                start (then the turns cannot be told apart: tokenize with loss "all").
        """
        text = self.render_chat(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render_chat(messages[:i], add_generation_prompt=True) if i else ""
            through = self.render_chat(messages[: i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ConfigError(
                    "the chat template does not render a conversation's first turns as the start of the "
                    "whole conversation, so assistant turns cannot be found; tokenize with --loss-on all"
                )
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return text, spans

    def turn_markers(self) -> list[int]:
        """Ids of the special tokens the chat template writes between turns (role markers, end of turn):
        a reply that reaches one is over. Found by rendering a probe conversation."""
        turns = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "v"},
        ]
        text = ""
        for probe in ([{"role": "system", "content": "s"}, *turns], turns):  # some templates refuse system
            try:
                text = self.render_chat(probe, add_generation_prompt=True)
                break
            except ConfigError:
                continue
        specials = {
            int(i)
            for i, t in self.tokenizer.get_added_tokens_decoder().items()
            if getattr(t, "special", False)
        }
        [ids] = self.encode_batch([text], specials=True)
        return sorted({i for i in ids if i in specials} - {self.eos_id})

    def stop_ids(self) -> list[int]:
        """The end-of-sequence id then the chat template's turn markers: where generation ends."""
        return [self.eos_id, *self.turn_markers()]

    def doc(self) -> dict[str, Any]:
        """What manifests and the registry record of the tokenizer."""
        return {
            "sha256": self.sha256,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
            "pad_id": self.pad_id,
            "vocab_size": self.vocab_size,
            "chat_template": self.chat_template,
            **({"source": self.source} if self.source else {}),
        }

    def verify(self, texts: list[str]) -> list[str]:
        """The texts a converted SentencePiece tokenizer encodes differently from sentencepiece itself
        (none for a tokenizer.json)."""
        if self.reference is None:
            return []
        self.tokenizer.encode_special_tokens = True
        ours = [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        return [t for t, a, b in zip(texts, ours, self.reference.encode(texts), strict=True) if a != b]


def render_chat(template: str, messages: list[dict[str, str]], add_generation_prompt: bool, eos: str) -> str:
    """Render a Jinja chat template in a sandbox (a template cannot reach Python internals).

    Raises:
        ConfigError: the template does not compile or fails on these messages.
    """
    import jinja2

    try:
        return _compiled_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, eos_token=eos, bos_token=""
        )
    except jinja2.TemplateError as exc:
        raise ConfigError(f"chat template: {exc}") from exc


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str) -> Any:
    """A template compiled once in a sandboxed environment (compiling costs 2-5 ms; a chat dataset
    renders every record through the same one)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def _special(tok: Any, given: str | None, candidates: tuple[str, ...], what: str) -> tuple[int, str] | None:
    names = [given] if given else list(candidates)
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid), name
    if given:
        raise ConfigError(f"{what} {given!r} is not a token of the tokenizer")
    return None


def load_tokenizer(path: str | Path, eos_token: str | None = None) -> LoadedTokenizer:
    """Read a Hugging Face ``tokenizer.json`` or a SentencePiece ``.model`` (a file, or a folder holding
    tokenizer.json or tokenizer.model, and maybe tokenizer_config.json).

    A SentencePiece model is converted to a ``tokenizers`` tokenizer following its own settings
    (transformers' converter), checked to encode probe texts exactly as sentencepiece does.

    Raises:
        ConfigError: a missing, binary, oversized, malformed or unusable tokenizer file, or no
            end-of-sequence token (name one with ``eos_token``); one line naming the file.
    """
    from tokenizers import Tokenizer

    p = Path(path)
    folder = p if p.is_dir() else None
    file = p
    if folder is not None:
        file = p / "tokenizer.json"
        if not file.is_file() and (p / "tokenizer.model").is_file():
            file = p / "tokenizer.model"
    if not file.is_file():
        raise ConfigError(
            f"tokenizer {file}: file not found (a Hugging Face tokenizer.json or a SentencePiece .model)"
        )
    spm = file.suffix == ".model"
    cap = MAX_SENTENCEPIECE_BYTES if spm else MAX_TOKENIZER_BYTES
    if file.stat().st_size > cap:
        raise ConfigError(
            f"tokenizer {file}: {file.stat().st_size} bytes is too large for a tokenizer (at most {cap})"
        )
    source: dict[str, Any] | None = None
    reference = None
    spm_eos = spm_pad = None
    if spm:
        tok, reference, source, spm_eos, spm_pad = _sentencepiece(file)
        raw = tok.to_str().encode()
    else:
        raw = file.read_bytes()
        try:
            json.loads(raw)
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise ConfigError(f"tokenizer {file} is not a valid tokenizer.json: {first}") from exc
        except Exception as exc:  # tokenizers raises its own Exception subclass for a bad model
            raise ConfigError(f"tokenizer {file} is not a valid tokenizer.json: {str(exc)[:200]}") from exc
    template, config_eos, default_template = DEFAULT_CHAT_TEMPLATE, None, True
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{folder / 'tokenizer_config.json'} is not JSON: {exc}") from exc
        if isinstance(cfg.get("chat_template"), str):
            template, default_template = cfg["chat_template"], False
        eos = cfg.get("eos_token")
        config_eos = eos.get("content") if isinstance(eos, dict) else eos
    if folder is not None and (folder / "chat_template.jinja").is_file():
        template, default_template = (folder / "chat_template.jinja").read_text(), False
    found = _special(tok, eos_token or config_eos or spm_eos, EOS_CANDIDATES, "eos_token")
    if found is None:
        raise ConfigError(
            f"tokenizer {file} has none of the end-of-sequence tokens {', '.join(EOS_CANDIDATES)}; "
            "name one with --eos-token"
        )
    eos_id, eos_name = found
    pad = _special(tok, spm_pad, PAD_CANDIDATES, "pad_token")
    loaded = LoadedTokenizer(
        tokenizer=tok,
        raw=raw,
        sha256=hashlib.sha256(raw).hexdigest(),
        eos_id=eos_id,
        eos_token=eos_name,
        pad_id=pad[0] if pad else eos_id,
        chat_template=template,
        folder=folder,
        source=source,
        reference=reference,
        default_template=default_template,
    )
    differ = loaded.verify(list(SPM_PROBES))
    if differ:
        raise ConfigError(
            f"tokenizer {file}: its conversion for the tokenizers library encodes {differ[0][:80]!r} "
            "differently from sentencepiece; not used"
        )
    return loaded


def _sentencepiece(file: Path) -> tuple[Any, Any, dict[str, Any], str | None, str | None]:
    """A SentencePiece model file as (tokenizers.Tokenizer, sentencepiece processor, source record,
    end-of-sequence piece, padding piece).

    Raises:
        ConfigError: sentencepiece is not installed, the file does not parse as a model, or its
            algorithm is not unigram or BPE.
    """
    try:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as exc:
        raise ConfigError(
            f"tokenizer {file}: reading a SentencePiece model needs the sentencepiece package "
            "(pip install sentencepiece)"
        ) from exc
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import SpmConverter

    raw = file.read_bytes()
    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
    try:
        proto.ParseFromString(raw)
        if not proto.pieces:
            raise ValueError("it has no pieces")
        processor = sentencepiece.SentencePieceProcessor(model_proto=raw)
    except Exception as exc:  # protobuf's DecodeError, sentencepiece's RuntimeError/OSError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"tokenizer {file} is not a valid SentencePiece model: {first}") from exc
    kind = proto.trainer_spec.model_type
    if kind not in (1, 2):  # UNIGRAM, BPE (WORD and CHAR models are not read)
        name = {3: "word", 4: "char"}.get(kind, str(kind))
        raise ConfigError(
            f"tokenizer {file} is a SentencePiece {name} model; gpuyard reads unigram and BPE ones"
        )
    if kind == 1:
        vocab: Any = [(p.piece, p.score) for p in proto.pieces]
    else:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    try:
        tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    except Exception as exc:
        raise ConfigError(
            f"tokenizer {file}: cannot convert this SentencePiece model: {str(exc)[:200]}"
        ) from exc
    # Control pieces (<s>, </s>, ...) are special tokens: skipped when decoding, matched in chat text.
    tok.add_special_tokens(
        [AddedToken(p.piece, normalized=False, special=True) for p in proto.pieces if p.type == 3]
    )
    eos = processor.eos_id()
    pad = processor.pad_id()
    source = {"format": "sentencepiece", "file": file.name, "sha256": hashlib.sha256(raw).hexdigest()}
    return (
        tok,
        processor,
        source,
        processor.id_to_piece(eos) if eos >= 0 else None,
        processor.id_to_piece(pad) if pad >= 0 else None,
    )


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


# The role markers gpuyard's default chat template writes: special tokens of a tokenizer trained for chat.
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
MAX_VOCAB = 1 << 20


def check_vocab_size(vocab_size: int, specials: int) -> None:
    """Refuse a vocabulary size a byte-level BPE tokenizer cannot have.

    Raises:
        ConfigError: not over the 256 bytes plus ``specials`` special tokens, or over ``MAX_VOCAB``.
    """
    if not 256 + specials < vocab_size <= MAX_VOCAB:
        raise ConfigError(
            f"vocab size {vocab_size}: must be over {256 + specials} (256 bytes and {specials} special "
            f"tokens) and at most {MAX_VOCAB}"
        )


def train_tokenizer(
    texts: Iterable[str], out: str | Path, vocab_size: int = 512, extra_tokens: tuple[str, ...] = ()
) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` with ``tokenizers`` and write it as a Hugging Face
    tokenizer folder (tokenizer.json, tokenizer_config.json with gpuyard's chat template); returns it.

    Special tokens: ``<|endoftext|>`` (end of sequence), ``<pad>``, then ``extra_tokens``.

    The vocabulary always holds the 256 bytes and the special tokens (more than ``vocab_size`` when
    it is smaller: :func:`check_vocab_size` refuses that for a user's request).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<pad>", *extra_tokens]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<pad>",
        "bos_token": None,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
        "model_max_length": MAX_SEQ_LEN,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def corpus_texts(
    datasets: list[str], files: list[Path], counts: dict[str, int] | None = None
) -> Iterator[str]:
    """The texts of text dataset versions (chat records rendered with gpuyard's chat template) and of
    text files (a folder: its .txt/.md/.text/.rst files, subfolders included; each file one text),
    to train a tokenizer on. Files that are not UTF-8 text are skipped, counted in ``counts``.

    Raises:
        ConfigError: a dataset that is not text, a path that does not exist.
    """
    from gpuyard.data.text import decode_text, text_files

    counts = counts if counts is not None else {}
    for key in ("documents", "bytes", "skipped"):
        counts.setdefault(key, 0)
    for ref in datasets:
        version = open_dataset(ref)
        column = _column(version)
        for table in version.iter_tables(columns=[column]):
            for value in table.column(column).to_pylist():
                text = value if column == "text" else render_chat(DEFAULT_CHAT_TEMPLATE, value, False, "")
                counts["documents"] += 1
                counts["bytes"] += len(text.encode("utf-8", "surrogatepass"))
                yield text
    for path in files:
        if not path.exists():
            raise ConfigError(f"{path}: no such file or folder")
        for f in text_files(path) if path.is_dir() else [path]:
            text, why = decode_text(f.read_bytes())
            if text is None or why is not None:
                counts["skipped"] += 1
                continue
            counts["documents"] += 1
            counts["bytes"] += len(text.encode("utf-8"))
            yield text


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
