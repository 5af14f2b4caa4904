"""Text corpora: ingest documents (plain text, JSONL or Parquet with a text field) and chat records.

A document is kept when it is UTF-8 text, not binary, not empty, at most ``max_bytes`` long and not
an exact duplicate (by SHA-256) of a document kept before it. Every other record goes to the
version's quarantine with its reason, so ``rows_in = rows_kept + rows_quarantined`` always holds:

==================  ===============================================================================
reason              the record
==================  ===============================================================================
text:not_utf8       holds bytes that are not UTF-8
text:binary         holds a NUL byte or mostly control characters (an image, an executable)
text:empty          is empty or whitespace only
text:too_long       is over ``max_bytes`` (UTF-8 bytes); the quarantine keeps its first 64 KiB
text:duplicate      has the same text (or the same messages) as a document kept before it
json:invalid        is a JSONL line that is not a JSON object
field:missing       has no text field (or no messages field), or one that is not a string (list)
chat:invalid        has messages that are not a list of {role, content} with a known role
==================  ===============================================================================

Plain-text files hold one document per paragraph (documents separated by a blank line); a folder
of ``.txt``/``.md`` files holds one document per file. A kept version has the columns ``text``
(or ``messages``: a list of {role, content}) and ``row`` (the record's index in the source). A
folder is read with all its subfolders. The quarantine's ``source`` column names the file and line
of each record (``sub/page.txt:1``, ``chat.jsonl:17``; for Parquet, the row).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from gpuyard.data.catalog import check_new_version_team, record_version
from gpuyard.data.dataset import DatasetVersion, open_dataset
from gpuyard.data.manifest import build_manifest, store_quarantine
from gpuyard.data.shards import DEFAULT_SHARD_BYTES, split_table, store_shard
from gpuyard.data.sources import Progress
from gpuyard.data.stats import finish, merge, partial_stats
from gpuyard.data.validate import QUARANTINE_SCHEMA
from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.refs import check_dataset_name
from gpuyard.store import get_artifacts

TEXT_FORMATS = ("text", "jsonl", "parquet")
# A document over this many UTF-8 bytes is quarantined (text:too_long) unless the caller sets another cap.
DEFAULT_MAX_BYTES = 1 << 20
# What the quarantine keeps of an over-long or binary record.
QUARANTINE_KEEP = 64 << 10
# A record is binary when more than this share of its characters are control characters.
CONTROL_SHARE = 0.3
CHAT_ROLES = ("system", "user", "assistant", "tool")
TEXT_SUFFIXES = {".txt", ".md", ".text", ".rst"}
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class TextOptions:
    """How to read a text corpus.

    Attributes:
        format: text, jsonl or parquet; None guesses from the path (a folder or .txt/.md is text).
        text_field: the field holding a document (JSONL/Parquet).
        messages_field: the field holding a chat record (a list of {role, content}); when set, the
            version holds chat records instead of documents.
        max_bytes: the size cap of a document, in UTF-8 bytes.
        shard_bytes: target shard size.
    """

    format: str | None = None
    text_field: str = "text"
    messages_field: str | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    shard_bytes: int = DEFAULT_SHARD_BYTES


def text_format(path: Path, fmt: str | None) -> str:
    """The text format of ``path``: ``fmt`` when given, else guessed from the path.

    Raises:
        ConfigError: unknown format, or a path whose format cannot be told.
    """
    if fmt is not None:
        fmt = "text" if fmt in ("txt", "text", "plain") else fmt
        if fmt not in TEXT_FORMATS:
            raise ConfigError(f"text format {fmt!r} unknown; use one of {', '.join(TEXT_FORMATS)}")
        return fmt
    if path.is_dir() or path.suffix.lower() in TEXT_SUFFIXES:
        return "text"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ConfigError(f"cannot tell the text format of {path}; pass --format ({', '.join(TEXT_FORMATS)})")


def _preview(raw: bytes) -> dict[str, Any]:
    """What the quarantine keeps of a record that is not (or not only) text: base64 of its first bytes."""
    return {
        "bytes": len(raw),
        "base64": base64.b64encode(raw[:QUARANTINE_KEEP]).decode(),
        "truncated": len(raw) > QUARANTINE_KEEP,
    }


def decode_text(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None) for a UTF-8 text record, else (None, reason)."""
    if b"\0" in raw:
        return None, "text:binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "text:not_utf8"
    return text, text_problem(text)


def text_problem(text: str) -> str | None:
    """Why a decoded string is not a usable document (None when it is)."""
    if "\0" in text:
        return "text:binary"
    if not text.strip():
        return "text:empty"
    controls = len(_CONTROL.findall(text[:QUARANTINE_KEEP]))
    if controls > CONTROL_SHARE * min(len(text), QUARANTINE_KEEP):
        return "text:binary"
    return None


def _paragraphs(raw: bytes) -> Iterator[tuple[int, bytes]]:
    """(line it starts at, 1-based; text) of each paragraph (separated by blank lines)."""
    at = 0
    for sep in [*re.finditer(rb"\r?\n[ \t]*\r?\n", raw), None]:
        end = sep.start() if sep is not None else len(raw)
        part = raw[at:end]
        if part.strip():
            lead = len(part) - len(part.lstrip(b"\r\n"))  # blank lines before it (after 3+ newlines)
            yield raw.count(b"\n", 0, at + lead) + 1, part.strip(b"\r\n")
        if sep is not None:
            at = sep.end()


def text_files(root: Path) -> list[Path]:
    """The .txt/.md/.text/.rst files under ``root``, every subfolder included, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)


def _read_records(path: Path, fmt: str, opts: TextOptions) -> Iterator[tuple[Any, str | None, str]]:
    """(value, None, where) or (what to keep, reason, where) for every record of the source, in order;
    ``where`` names the file and line it came from (``sub/a.txt:12``; a Parquet file's row).

    The value is a document (str) or, for chat, a list of messages.
    """
    field = opts.messages_field or opts.text_field
    if fmt == "text":
        files = text_files(path) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise ConfigError(f"{path}: no .txt/.md/.text/.rst files found in it or its subfolders")
        for f in files:
            raw = f.read_bytes()
            name = f.relative_to(path).as_posix() if path.is_dir() else f.name
            for start, piece in [(1, raw)] if path.is_dir() else _paragraphs(raw):
                text, why = decode_text(piece)
                where = f"{name}:{start}"
                yield (
                    (text, None, where)
                    if why is None
                    else (_preview(piece) if text is None else text, why, where)
                )
        return
    if fmt == "jsonl":
        with path.open("rb") as fh:
            for number, line in enumerate(fh, 1):
                where = f"{path.name}:{number}"
                stripped = line.strip()
                if not stripped:
                    continue
                text, why = decode_text(stripped)
                if text is None:
                    yield _preview(stripped), why, where
                    continue
                try:
                    doc = json.loads(text)
                except ValueError:
                    yield text[:QUARANTINE_KEEP], "json:invalid", where
                    continue
                if not isinstance(doc, dict):
                    yield text[:QUARANTINE_KEEP], "json:invalid", where
                    continue
                yield (*_field(doc, field, opts), where)
        return
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{path} is not valid parquet: {str(exc).splitlines()[0][:200]}") from exc
    if field not in table.column_names:
        raise ConfigError(f"{path} has no column {field!r} (has {', '.join(table.column_names)})")
    for number, value in enumerate(table.column(field).to_pylist()):
        where = f"{path.name} row {number}"
        if isinstance(value, bytes):
            text, why = decode_text(value)
            yield (
                (text, None, where)
                if why is None
                else (_preview(value) if text is None else text, why, where)
            )
        else:
            yield (*_field({field: value}, field, opts), where)


def _field(doc: dict[str, Any], field: str, opts: TextOptions) -> tuple[Any, str | None]:
    value = doc.get(field)
    if opts.messages_field is None:
        if not isinstance(value, str):
            return doc, "field:missing"
        return value, None
    if value is None:
        return doc, "field:missing"
    messages = chat_messages(value)
    return (messages, None) if messages is not None else (doc, "chat:invalid")


def chat_messages(value: Any) -> list[dict[str, str]] | None:
    """``value`` as a list of {role, content} messages, or None when it is not one."""
    if not isinstance(value, list) or not value:
        return None
    out = []
    for m in value:
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            return None
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES or not isinstance(content, str):
            return None
        out.append({"role": str(role), "content": content})
    return out


def _doc_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _check(value: Any, chat: bool, max_bytes: int) -> str | None:
    texts = [m["content"] for m in value] if chat else [value]
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from JSON escapes: not text
            return "text:not_utf8"
    if chat:
        if not any(m["content"].strip() for m in value):
            return "text:empty"
        problems = [text_problem(t) for t in texts if t.strip()]
        return next((p for p in problems if p is not None), None)
    return text_problem(value)


def ingest_text(
    src: str | Path,
    name: str,
    options: TextOptions | None = None,
    progress: Progress | None = None,
    team: str | None = None,
) -> DatasetVersion:
    """Ingest a text corpus as a new version of dataset ``name`` (the same version if unchanged).

    Raises:
        ConfigError: bad name or options, an unreadable source, or a source with no usable document
            (the message counts the reasons).
        NotFoundError: ``src`` does not exist.
    """
    opts = options or TextOptions()
    check_dataset_name(name)
    check_new_version_team(name, team)
    if opts.max_bytes <= 0 or opts.shard_bytes <= 0:
        raise ConfigError(
            f"max_bytes and shard_bytes must be positive, got {opts.max_bytes}, {opts.shard_bytes}"
        )
    path = Path(src)
    if not path.exists():
        raise NotFoundError(f"source {path} does not exist")
    fmt = text_format(path, opts.format)
    chat = opts.messages_field is not None
    seen: set[bytes] = set()
    kept_values: list[Any] = []
    kept_rows: list[int] = []
    bad_rows: list[int] = []
    bad_reasons: list[str] = []
    bad_values: list[str] = []
    bad_where: list[str] = []
    total_bytes = 0
    rows_in = 0
    for i, (value, why, where) in enumerate(_read_records(path, fmt, opts)):
        rows_in += 1
        if why is None:
            why = _check(value, chat, opts.max_bytes)
        raw = b""
        if why is None:
            raw = _doc_bytes(value)
            if len(raw) > opts.max_bytes:
                why = "text:too_long"
                value = {"bytes": len(raw), "head": raw[:QUARANTINE_KEEP].decode("utf-8", "replace")}
        if why is None:
            digest = hashlib.sha256(raw).digest()
            if digest in seen:
                why = "text:duplicate"
            else:
                seen.add(digest)
        if why is not None:
            bad_rows.append(i)
            bad_reasons.append(why)
            bad_values.append(json.dumps(value, ensure_ascii=False, default=str))
            bad_where.append(where)
            continue
        kept_values.append(value)
        kept_rows.append(i)
        total_bytes += len(raw)
        if progress is not None and rows_in % 10000 == 0:
            progress("read", rows_in, 0)
    by_reason = dict(Counter(bad_reasons))
    if rows_in == 0:
        raise ConfigError(f"{path} holds no records: an empty dataset is not recorded")
    if not kept_values:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]))
        raise ConfigError(
            f"{path}: all {rows_in} records were quarantined ({reasons}); an empty dataset is not recorded"
        )
    column = "messages" if chat else "text"
    kept = pa.table(
        {
            column: pa.array(kept_values, MESSAGES_TYPE if chat else pa.string()),
            "row": pa.array(kept_rows, pa.int64()),
        }
    )
    quarantine_table = pa.table(
        {
            "row": pa.array(bad_rows, pa.int64()),
            "reason": pa.array(bad_reasons, pa.string()),
            "values": pa.array(bad_values, pa.string()),
            "source": pa.array(bad_where, pa.string()),
        },
        schema=QUARANTINE_SCHEMA.append(pa.field("source", pa.string())),
    )
    artifacts = get_artifacts()
    shards, parts = [], []
    pieces = list(split_table(kept, opts.shard_bytes))
    for i, piece in enumerate(pieces):
        shards.append(store_shard(piece, artifacts))
        parts.append(partial_stats(piece.select(["row"])))
        if progress is not None:
            progress("shards", i + 1, len(pieces))
    quarantine = {
        "rows_in": rows_in,
        "rows_kept": kept.num_rows,
        "rows_quarantined": len(bad_rows),
        "by_reason": by_reason,
        "key": store_quarantine(quarantine_table),
    }
    manifest = build_manifest(
        name=name,
        kind="text",
        schema=kept.schema,
        shards=shards,
        stats=finish(merge(parts)),
        source={"uri": str(path.resolve()), "format": fmt},
        recipe={
            "text": {
                "field": opts.messages_field or opts.text_field,
                "chat": chat,
                "max_bytes": opts.max_bytes,
                "shard_bytes": opts.shard_bytes,
            }
        },
        quarantine=quarantine,
        extra={"text": {"column": column, "documents": kept.num_rows, "bytes": total_bytes}},
    )
    row = record_version(manifest, team)
    return open_dataset(f"{row.dataset}@{row.version}")
