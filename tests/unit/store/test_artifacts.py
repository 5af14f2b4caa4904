"""The artifact store: atomic writes, content hashes, refusal of keys that leave the root."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError, IntegrityError, NotFoundError
from gpuyard.store.artifacts import ArtifactStore, check_key

pytestmark = pytest.mark.unit


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "art"))
    return ArtifactStore(f"memory://gy-{id(request)}")


def test_put_get_roundtrip_with_hash(store: ArtifactStore, tmp_path: Path) -> None:
    data = b"weights" * 1000
    info = store.put("models/m1/weights.bin", data)
    assert info.sha256 == hashlib.sha256(data).hexdigest() and info.size == len(data)
    assert store.exists("models/m1/weights.bin")
    assert store.get_bytes("models/m1/weights.bin", sha256=info.sha256) == data
    out = store.get_file("models/m1/weights.bin", tmp_path / "dl" / "w.bin", sha256=info.sha256)
    assert out.read_bytes() == data
    assert store.sha256("models/m1/weights.bin") == info.sha256


def test_put_from_path_and_stream(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "src.txt"
    src.write_bytes(b"x" * (3 << 20))  # several chunks
    a = store.put("a/from-path", src)
    with open(src, "rb") as fh:
        b = store.put("a/from-stream", fh)
    assert a.sha256 == b.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()


def test_list_is_recursive_sorted_and_hides_temporaries(store: ArtifactStore) -> None:
    for key in ["b/2", "a/1", "a/deep/3"]:
        store.put(key, b"k")
    assert store.list() == ["a/1", "a/deep/3", "b/2"]
    assert store.list("a") == ["a/1", "a/deep/3"]
    assert store.list("nothing-here") == []


def test_hash_mismatch_is_detected(store: ArtifactStore, tmp_path: Path) -> None:
    store.put("f", b"abc")
    with pytest.raises(IntegrityError, match="SHA-256"):
        store.get_bytes("f", sha256="0" * 64)
    with pytest.raises(IntegrityError):
        store.get_file("f", tmp_path / "out", sha256="0" * 64)
    assert not (tmp_path / "out").exists()  # no half-verified file left behind


def test_missing_key(store: ArtifactStore) -> None:
    with pytest.raises(NotFoundError, match="not found"):
        store.get_bytes("nope")
    assert not store.exists("nope")


@pytest.mark.parametrize(
    "key", ["../escape", "a/../../b", "/etc/passwd", "~/x", "s3://bucket/x", "a\\b", "", "./a", ".tmp/x"]
)
def test_keys_leaving_the_root_are_refused(key: str, store: ArtifactStore) -> None:
    with pytest.raises(ConfigError):
        store.put(key, b"x")
    with pytest.raises(ConfigError):
        check_key(key)


def test_blobs_are_content_addressed_and_deduplicated(store: ArtifactStore) -> None:
    a = store.put_blob(b"same")
    b = store.put_blob(b"same")
    c = store.put_blob(b"other")
    assert a.key == b.key != c.key
    assert a.key.endswith(hashlib.sha256(b"same").hexdigest())
    assert len(store.list("blobs")) == 2
    import io

    d = store.put_blob(io.BytesIO(b"same"))  # a stream is read once, hashed as it is copied
    assert d.key == a.key and d.size == 4
    assert not store.fs.ls(f"{store.root}/.tmp")  # the duplicate's temporary copy was dropped


def test_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "art"))
    old, new = b"A" * (8 << 20), b"B" * (8 << 20)
    store.put("big", old)
    seen: set[bytes] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            data = store.get_bytes("big")
            seen.add(data[:1] + data[-1:] + len(data).to_bytes(8, "big"))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(6):
        store.put("big", new if i % 2 == 0 else old)
    stop.set()
    t.join()
    # Every read saw one whole version: first byte == last byte and full length.
    assert all(s[0] == s[1] and int.from_bytes(s[2:], "big") == 8 << 20 for s in seen)
    assert store.list() == ["big"]


def test_put_blob_stores_a_buffer_in_place(store: ArtifactStore) -> None:
    data = bytes(range(256)) * 5000
    info = store.put_blob(memoryview(bytearray(data)))  # e.g. a pyarrow.Buffer: hashed and written as is
    assert info.sha256 == hashlib.sha256(data).hexdigest() and info.size == len(data)
    assert store.get_bytes(info.key, info.sha256) == data
    assert store.put_blob(data).key == info.key  # the same content, stored once
