"""Text corpora: ingest with the quarantine, tokenize and pack with document boundaries, stream and resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.llm_fixtures import corpus, tokenizer_folder

from gpuyard.data import open_dataset
from gpuyard.data.packing import IGNORE, pack
from gpuyard.data.text import TextOptions, ingest_text
from gpuyard.data.tokens import load_tokenizer, packed_batches, tokenize
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit


def _jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_jsonl_ingest_quarantines_each_bad_record_with_its_reason(gpuyard_home: Path, tmp_path: Path) -> None:
    good = [json.dumps({"text": t}).encode() for t in corpus(20)]
    bad = [
        b'{"text": "caf\xe9 latin-1"}',  # not UTF-8
        json.dumps({"text": "nul \u0000 inside"}).encode(),  # binary (NUL)
        json.dumps({"text": "   \n "}).encode(),  # empty
        json.dumps({"text": "x" * 600}).encode(),  # over the cap
        good[3],  # exact duplicate
        b"[1, 2, 3]",  # not an object
        b"{not json",
        json.dumps({"body": "no text field"}).encode(),
        json.dumps({"text": 42}).encode(),
        json.dumps({"text": "".join(chr(i) for i in range(1, 9)) * 20}).encode(),  # control characters
    ]
    src = _jsonl(tmp_path / "c.jsonl", good[:5] + bad + good[5:])
    v = ingest_text(src, "corpus", TextOptions(max_bytes=500))
    q = v.manifest["quarantine"]
    assert q["rows_in"] == 30 and q["rows_kept"] == 20 and q["rows_quarantined"] == 10
    assert q["by_reason"] == {
        "text:not_utf8": 1, "text:binary": 2, "text:empty": 1, "text:too_long": 1, "text:duplicate": 1,
        "json:invalid": 2, "field:missing": 2,
    }  # fmt: skip
    texts = v.to_arrow().column("text").to_pylist()
    assert texts == corpus(20)
    rows = v.quarantine().to_pylist()
    assert [r["row"] for r in rows] == list(range(5, 15))
    dup = next(r for r in rows if r["reason"] == "text:duplicate")
    assert json.loads(dup["values"]) == corpus(20)[3]
    long = next(r for r in rows if r["reason"] == "text:too_long")
    assert json.loads(long["values"])["bytes"] == 600
    # Same content: the same version.
    assert ingest_text(src, "corpus", TextOptions(max_bytes=500)).version == v.version


def test_plain_text_binary_and_parquet_and_chat(gpuyard_home: Path, tmp_path: Path) -> None:
    txt = tmp_path / "book.txt"
    txt.write_bytes(b"First paragraph.\nstill first.\n\nSecond one.\n\n\n\xff\xfe\x00\x01binary\n\nThird.")
    v = ingest_text(txt, "book")
    assert v.to_arrow().column("text").to_pylist() == [
        "First paragraph.\nstill first.",
        "Second one.",
        "Third.",
    ]
    assert v.manifest["quarantine"]["by_reason"] == {"text:binary": 1}
    # A binary file given as a corpus: every record quarantined, nothing recorded.
    blob = tmp_path / "blob.txt"
    blob.write_bytes(bytes(range(256)) * 100)
    with pytest.raises(ConfigError, match=r"all 1 records were quarantined \(text:binary=1\)"):
        ingest_text(blob, "blob")
    pq.write_table(pa.table({"content": ["one doc", "two doc", "one doc"]}), tmp_path / "p.parquet")
    p = ingest_text(tmp_path / "p.parquet", "pq", TextOptions(text_field="content"))
    assert p.num_rows == 2 and p.manifest["quarantine"]["by_reason"] == {"text:duplicate": 1}
    with pytest.raises(ConfigError, match="has no column 'text'"):
        ingest_text(tmp_path / "p.parquet", "pq2")
    chats = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": " "}]},
    ]
    c = ingest_text(
        _jsonl(tmp_path / "chat.jsonl", [json.dumps(x).encode() for x in chats]),
        "chat",
        TextOptions(messages_field="messages"),
    )
    assert c.num_rows == 1 and c.manifest["quarantine"]["by_reason"] == {"chat:invalid": 2, "text:empty": 1}
    assert c.to_arrow().column("messages").to_pylist()[0][1] == {"role": "assistant", "content": "hello"}


def test_pack_keeps_documents_apart_and_counts_waste() -> None:
    p = pack([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]], seq_len=5, eos_id=0, pad_id=99)
    assert p.input_ids.tolist() == [[1, 2, 3, 0, 99], [4, 5, 6, 7, 8], [9, 10, 0, 11, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert p.labels.tolist() == [
        [2, 3, 0, IGNORE, IGNORE], [5, 6, 7, 8, IGNORE], [10, 0, IGNORE, 0, IGNORE]
    ]  # fmt: skip
    c = p.counts()
    assert c["tokens"] == 14 and c["padding"] == 1 and c["waste"] == pytest.approx(1 / 15, abs=1e-6)
    assert c["split_documents"] == 1 and c["label_tokens"] == 10
    # Every real token is kept exactly once, in order.
    real = p.input_ids[p.input_ids != 99]
    assert real.tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 10, 0, 11, 0]
    with pytest.raises(ConfigError, match="seq_len must be at least 2"):
        pack([[1]], 1, 0, 0)


def test_bad_tokenizer_files_are_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bin.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (tmp_path / "junk.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    (tmp_path / "text.json").write_text("not json at all")
    for name in ("bin.json", "junk.json", "text.json"):
        with pytest.raises(ConfigError, match=f"{name} is not a valid tokenizer.json") as err:
            load_tokenizer(tmp_path / name)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="file not found"):
        load_tokenizer(tmp_path / "missing.json")
    folder = tokenizer_folder(tmp_path)
    with pytest.raises(ConfigError, match="'<nope>' is not a token"):
        load_tokenizer(folder, eos_token="<nope>")


def test_tokenize_packs_streams_and_resumes_exactly(gpuyard_home: Path, tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path)
    docs = corpus(120)
    docs[7] = docs[7] + " <|endoftext|> forged boundary"
    src = _jsonl(tmp_path / "c.jsonl", [json.dumps({"text": t}).encode() for t in docs])
    text = ingest_text(src, "corpus")
    tv = tokenize(text.ref, folder / "tokenizer.json", seq_len=64, val_fraction=0.2, seed=3)
    info = tv.manifest["tokens"]
    tok = load_tokenizer(folder)
    assert info["tokenizer"]["sha256"] == tok.sha256 and info["seq_len"] == 64
    ids = [tok.encode_batch([t])[0] for t in docs]
    assert info["tokens"] == sum(len(i) + 1 for i in ids) and info["documents"] == 120
    assert info["padding"] == info["sequences"] * 64 - info["tokens"]
    assert 0 < info["waste"] < 0.5 and set(info["splits"]) == {"train", "val"}
    # The forged "<|endoftext|>" inside a document is text, not a boundary.
    arrays = tv.to_numpy(["input_ids", "position_ids", "labels"])
    assert int((arrays["input_ids"] == tok.eos_id).sum()) == 120
    assert int((arrays["labels"] != IGNORE).sum()) == info["label_tokens"]
    # Splits are packed apart and hold every document once.
    assert sum(tv.manifest["splits"].values()) == tv.num_rows
    # The loader streams packed sequences and resumes exactly.
    a = packed_batches(tv.ref, batch_size=4, split="train", seed=1)
    a.set_epoch(0)
    it = iter(a)
    first = [next(it) for _ in range(3)]
    assert (
        first[0]["inputs"]["input_ids"].shape == (4, 64)
        and first[0]["targets"].dtype.is_floating_point is False
    )
    state = a.state_dict()
    rest = list(it)
    b = packed_batches(tv.ref, batch_size=4, split="train", seed=1)
    b.load_state_dict(state)
    again = list(b)
    assert len(again) == len(rest) > 0
    for x, y in zip(rest, again, strict=True):
        assert np.array_equal(x["inputs"]["input_ids"].numpy(), y["inputs"]["input_ids"].numpy())
        assert np.array_equal(x["targets"].numpy(), y["targets"].numpy())
    with pytest.raises(ConfigError, match="has no split 'test'"):
        packed_batches(tv.ref, split="test")
    with pytest.raises(ConfigError, match="is not a text dataset"):
        tokenize(tv.ref, folder, seq_len=64)
    with pytest.raises(ConfigError, match="--seq-len must be between"):
        tokenize(text.ref, folder, seq_len=1)
    assert open_dataset("corpus-tokens").version == tv.version


def test_pack_truncates_or_drops_over_long_documents_and_keeps_masks() -> None:
    docs = [[1, 2], [3, 4, 5, 6, 7, 8, 9], [10]]
    t = pack(docs, seq_len=5, eos_id=0, pad_id=99, over_length="truncate")
    # The long document keeps its first 5 tokens, without an end-of-sequence token it never reached.
    assert t.input_ids.tolist() == [[1, 2, 0, 99, 99], [3, 4, 5, 6, 7], [10, 0, 99, 99, 99]]
    c = t.counts()
    assert (c["truncated_documents"], c["split_documents"], c["dropped_documents"]) == (1, 0, 0)
    d = pack(docs, seq_len=5, eos_id=0, pad_id=99, over_length="drop")
    assert d.input_ids.tolist() == [[1, 2, 0, 10, 0]] and d.counts()["dropped_documents"] == 1
    assert d.documents == 2
    # A mask keeps labels only on the tokens it marks (here: 4 and the end of the first document).
    masks = [[False, False, True], [True] * 8, [False, True]]
    m = pack(docs, seq_len=5, eos_id=0, pad_id=99, masks=masks, over_length="split")
    assert m.labels[0].tolist() == [IGNORE, 0, IGNORE, IGNORE, IGNORE]
    assert m.counts()["split_documents"] == 1
    with pytest.raises(ConfigError, match="over_length 'nope' unknown"):
        pack(docs, 5, 0, 99, over_length="nope")


def _chat_tokenizer(tmp_path: Path) -> Path:
    from gpuyard.data.tokenizer_train import train_tokenizer

    markers = ("<|system|>", "<|user|>", "<|assistant|>")
    return train_tokenizer(corpus(300, seed=1), tmp_path / "chat-tok", vocab_size=220, extra_tokens=markers)


def test_chat_records_train_on_assistant_turns_and_long_ones_are_counted(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from gpuyard.cli.main import app

    folder = _chat_tokenizer(tmp_path)
    tok = load_tokenizer(folder)
    words = corpus(40)
    chats = [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": words[2 * i]},
                {"role": "assistant", "content": words[2 * i + 1]},
            ]
        }
        for i in range(12)
    ]
    huge = " ".join(words) * 3  # one record far over the sequence length
    chats.append(
        {"messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": huge}]}
    )
    src = _jsonl(tmp_path / "chat.jsonl", [json.dumps(c).encode() for c in chats])
    text = ingest_text(src, "chat", TextOptions(messages_field="messages"))
    tv = tokenize(text.ref, folder, seq_len=512)
    info = tv.manifest["tokens"]
    assert info["loss_on"] == "assistant"
    assert info["long_records"] == {"limit": 512, "action": "truncate", "count": 1}
    assert info["truncated_documents"] == 1 and info["split_documents"] == 0
    # Labels are exactly the assistant's content (its tokens, then the end of sequence), never the
    # system or user text.
    arrays = tv.to_numpy(["input_ids", "labels"])
    first = chats[0]["messages"]
    rendered = tok.render_chat(first)
    reply = rendered[len(tok.render_chat(first[:2], add_generation_prompt=True)) :]
    want = [*tok.encode_batch([reply], specials=True)[0], tok.eos_id]
    row = arrays["labels"][0]
    got = []
    for pos in range(len(row)):
        if arrays["input_ids"][0][pos] == tok.eos_id:
            break
        if row[pos] != IGNORE:
            got.append(int(row[pos]))
    assert got == want
    user_ids = set(tok.encode_batch([first[1]["content"]])[0]) - set(want)
    assert not user_ids & {int(x) for x in row if x != IGNORE}
    # --loss-on all trains on every token; the count line is printed at tokenize and kept in show.
    everything = tokenize(text.ref, folder, seq_len=512, loss_on="all", output="chat-all")
    assert everything.manifest["tokens"]["label_tokens"] > info["label_tokens"]
    runner = CliRunner()
    out = runner.invoke(
        app, ["data", "tokenize", text.ref, "--tokenizer", str(folder), "--seq-len", "512",
              "--over-length", "drop", "--output", "chat-drop"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "record over 512 tokens: dropped (--over-length)" in out.output
    shown = runner.invoke(app, ["data", "show", "chat-drop"])
    assert shown.exit_code == 0 and "over 512 tokens: dropped" in shown.output
    dropped = open_dataset("chat-drop").manifest["tokens"]
    assert dropped["dropped_documents"] == dropped["long_records"]["count"] >= 1
    assert dropped["documents"] == 13 - dropped["dropped_documents"]
    with pytest.raises(ConfigError, match="--loss-on assistant needs a chat dataset"):
        docs = ingest_text(_jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "a b"}).encode()]), "docs")
        tokenize(docs.ref, folder, seq_len=16, loss_on="assistant")


def test_a_tokenizer_without_chat_template_is_named_in_one_warning(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    folder = _chat_tokenizer(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    chats = [
        {"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t}]} for t in corpus(5)
    ]
    src = _jsonl(tmp_path / "c.jsonl", [json.dumps(c).encode() for c in chats])
    text = ingest_text(src, "c", TextOptions(messages_field="messages"))
    [note] = tokenize(text.ref, bare, seq_len=64).manifest["tokens"]["warnings"]
    assert "has no chat template: chat records are rendered with gpuyard's own" in note and "\n" not in note
    assert tokenize(text.ref, folder, seq_len=64, output="c2").manifest["tokens"]["warnings"] == []


def test_a_text_folder_with_subfolders_is_ingested_and_the_quarantine_names_file_and_line(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from gpuyard.cli.main import app

    root = tmp_path / "man"
    (root / "man1" / "deep").mkdir(parents=True)
    (root / "man1" / "ls.txt").write_text("ls lists files.\n")
    (root / "man1" / "deep" / "cp.md").write_text("cp copies files.\n")
    (root / "man1" / "deep" / "blob.txt").write_bytes(b"\x00\x01 binary")
    (root / "top.txt").write_text("top level page.\n")
    runner = CliRunner()
    out = runner.invoke(app, ["data", "ingest", str(root), "--name", "man", "--json"])
    assert out.exit_code == 0, (out.output, out.exception)
    v = open_dataset("man")
    assert sorted(v.to_arrow().column("text").to_pylist()) == [
        "cp copies files.\n", "ls lists files.\n", "top level page.\n"
    ]  # fmt: skip
    [bad] = v.quarantine().to_pylist()
    assert (bad["source"], bad["reason"]) == ("man1/deep/blob.txt:1", "text:binary")
    shown = runner.invoke(app, ["data", "quarantine", "man", "--json"])
    assert json.loads(shown.output)["rows"][0]["source"] == "man1/deep/blob.txt:1"
    # A JSONL line and a paragraph of a text file are named by their line.
    lines = [json.dumps({"text": "fine"}).encode(), b"", b"{broken", json.dumps({"text": "also"}).encode()]
    j = ingest_text(_jsonl(tmp_path / "c.jsonl", lines), "j")
    assert [(r["source"], r["reason"]) for r in j.quarantine().to_pylist()] == [("c.jsonl:3", "json:invalid")]
    book = tmp_path / "book.txt"
    book.write_bytes(b"one.\n\ntwo\nstill two.\n\n\n\nthree \x00.\n")
    b = ingest_text(book, "book")
    assert [r["source"] for r in b.quarantine().to_pylist()] == ["book.txt:8"]
    # An image folder is still read as images; the help names text.
    assert "text" in runner.invoke(app, ["data", "ingest", "--help"]).output


def test_progress_is_a_line_every_few_seconds_off_a_terminal_and_nothing_under_json() -> None:
    import io

    from rich.console import Console

    from gpuyard.cli.progress import progress_reporter

    now = [100.0]
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=False, width=200)
    with progress_reporter(True, every_s=5.0, clock=lambda: now[0], console=con) as report:
        assert report is not None
        for done in range(1, 11):
            now[0] += 1.5  # a batch every 1.5 s: a line at 6 s, 12 s, and when the stage completes
            report("tokenize", done, 10)
        report("tokenize", 10, 10)  # completion is said once
    assert buf.getvalue().splitlines() == [
        "tokenize: 4/10 (40%), 6 s", "tokenize: 8/10 (80%), 12 s", "tokenize: 10/10 (100%), 15 s"
    ]  # fmt: skip
    with progress_reporter(False) as quiet:
        assert quiet is None
