"""Tokenizers read from local files: a Hugging Face ``tokenizer.json`` or a SentencePiece ``.model``
(converted and checked against sentencepiece), their special tokens, and chat templates rendered in a
sandbox. Token datasets (:mod:`gpuyard.data.tokens`) and the LLM trainer and server use them."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError

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
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")
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
