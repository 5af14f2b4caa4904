"""Artifact store: files under one fsspec root, written atomically, addressed by key or by content hash."""

from __future__ import annotations

import hashlib
import posixpath
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.core import url_to_fs

from gpuyard.errors import ConfigError, IntegrityError, NotFoundError, StoreError
from gpuyard.settings import Settings, load_settings

CHUNK = 1 << 20
_TMP = ".tmp"
BLOB_PREFIX = "blobs/sha256"


@dataclass(frozen=True)
class ArtifactInfo:
    """What was stored: its key, size in bytes and SHA-256 of its content."""

    key: str
    size: int
    sha256: str


_BLOB_KEY = re.compile(rf"^{BLOB_PREFIX}/([0-9a-f]{{2}})/([0-9a-f]{{64}})$")


def blob_sha256(key: str) -> str | None:
    """The SHA-256 a content-addressed key names (``blobs/sha256/ab/abcd...``), else None."""
    m = _BLOB_KEY.match(key)
    return m.group(2) if m and m.group(2).startswith(m.group(1)) else None


def check_key(key: str) -> str:
    """Return ``key`` normalised, or refuse one that could leave the artifact root.

    Raises:
        ConfigError: empty, absolute, with a URL scheme, backslashes or ``..`` components.
    """
    if not key or key.startswith(("/", "~")) or "://" in key or "\\" in key or "\x00" in key:
        raise ConfigError(f"artifact key {key!r} is not a relative path inside the artifact root")
    parts = key.split("/")
    if any(p in ("..", ".") for p in parts):
        raise ConfigError(f"artifact key {key!r} may not contain '.' or '..' components")
    norm = posixpath.normpath(key)
    if norm.startswith(_TMP):
        raise ConfigError(f"artifact key {key!r} uses the reserved folder {_TMP}/")
    return norm


class ArtifactStore:
    """Files under ``root`` (a local folder or any fsspec URL: s3://, gs://, memory://, ...).

    Writes go to a temporary object first and are moved into place, so a reader never sees half a
    file. Every write returns the content's SHA-256, which callers record in the state store and
    pass back to :meth:`get_bytes` / :meth:`get_file` to verify.
    """

    def __init__(self, root: str, **storage_options: Any) -> None:
        self.root_url = root
        try:
            self.fs, self.root = url_to_fs(root, **storage_options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"artifact root {root!r}: {exc}") from exc
        self.root = self.root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def url(self, key: str) -> str:
        """The full fsspec URL of ``key`` (to hand to other fsspec readers, e.g. pyarrow)."""
        return self.fs.unstrip_protocol(self._path(key))

    # -- writing -----------------------------------------------------------------------------------

    def put(self, key: str, src: bytes | str | Path | IO[bytes]) -> ArtifactInfo:
        """Store ``src`` (bytes, a local file path, or a binary stream) under ``key``, atomically."""
        dest = self._path(key)
        tmp, sha, size = self._write_tmp(src, key)
        self._commit(tmp, dest, key)
        return ArtifactInfo(key=check_key(key), size=size, sha256=sha)

    def put_blob(self, src: bytes | bytearray | memoryview | str | Path | IO[bytes]) -> ArtifactInfo:
        """Store ``src`` content-addressed (``blobs/sha256/ab/abcd...``); identical content is stored once.

        The content is read once: hashed while it is copied to a temporary object, which then becomes
        the blob, or is dropped when that blob already exists. Bytes in memory (``memoryview`` of any
        buffer, e.g. a ``pyarrow.Buffer``) are hashed and written in place, never copied.
        """
        tmp, sha, size = self._write_tmp(src, "a blob")
        key = f"{BLOB_PREFIX}/{sha[:2]}/{sha}"
        if self.exists(key):
            self.fs.rm(tmp)
        else:
            self._commit(tmp, self._path(key), key)
        return ArtifactInfo(key=key, size=size, sha256=sha)

    def _write_tmp(
        self, src: bytes | bytearray | memoryview | str | Path | IO[bytes], what: str
    ) -> tuple[str, str, int]:
        """Copy ``src`` to a fresh temporary object under the root; return (path, sha256, size)."""
        tmp = f"{self.root}/{_TMP}/{uuid.uuid4().hex}"
        self.fs.makedirs(posixpath.dirname(tmp), exist_ok=True)
        digest, size = hashlib.sha256(), 0
        try:
            with self.fs.open(tmp, "wb") as out:
                if isinstance(src, bytes | bytearray | memoryview):
                    # Bytes in memory (an encoded Parquet shard: tens of MiB) are hashed and written
                    # as they are, without copying them into chunks first.
                    view = memoryview(src).cast("B")
                    digest.update(view)
                    out.write(view)
                    size = view.nbytes
                else:
                    with _open_source(src) as inp:
                        while chunk := inp.read(CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
        except FileNotFoundError as exc:
            self._drop(tmp)
            raise NotFoundError(f"cannot store {what!r}: source {src!s:.200} does not exist") from exc
        except OSError as exc:
            self._drop(tmp)
            raise StoreError(f"cannot write {what!r} to {self.root_url}: {exc}") from exc
        return tmp, digest.hexdigest(), size

    def _commit(self, tmp: str, dest: str, key: str) -> None:
        """Move a finished temporary object into place (a rename on local disk: readers see all or none)."""
        try:
            self.fs.makedirs(posixpath.dirname(dest), exist_ok=True)
            self.fs.mv(tmp, dest)
        except OSError as exc:
            raise StoreError(f"cannot write artifact {key!r} to {self.root_url}: {exc}") from exc
        finally:
            self._drop(tmp)

    def _drop(self, tmp: str) -> None:
        if self.fs.exists(tmp):
            self.fs.rm(tmp)

    def delete(self, key: str) -> None:
        """Remove ``key`` (a file or a whole folder); missing keys are ignored."""
        path = self._path(key)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    # -- reading -----------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """True when ``key`` is stored."""
        return bool(self.fs.exists(self._path(key)))

    def size(self, key: str) -> int:
        """Size of ``key`` in bytes."""
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError as exc:
            raise NotFoundError(f"artifact {key!r} not found in {self.root_url}") from exc

    def open(self, key: str) -> IO[bytes]:
        """A binary read stream of ``key``."""
        try:
            return self.fs.open(self._path(key), "rb")  # type: ignore[no-any-return]
        except FileNotFoundError as exc:
            raise NotFoundError(f"artifact {key!r} not found in {self.root_url}") from exc

    def get_bytes(self, key: str, sha256: str | None = None) -> bytes:
        """The content of ``key``; checked against ``sha256`` when given."""
        with self.open(key) as fh:
            data = fh.read()
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise IntegrityError(f"artifact {key!r} does not match its recorded SHA-256 {sha256[:12]}...")
        return data

    def get_file(self, key: str, dest: str | Path, sha256: str | None = None) -> Path:
        """Copy ``key`` to the local file ``dest`` (atomically), checking ``sha256`` when given."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.part")
        digest = hashlib.sha256()
        try:
            with self.open(key) as inp, open(tmp, "wb") as out:
                while chunk := inp.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
            if sha256 is not None and digest.hexdigest() != sha256:
                raise IntegrityError(f"artifact {key!r} does not match its recorded SHA-256 {sha256[:12]}...")
            tmp.replace(dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def sha256(self, key: str) -> str:
        """SHA-256 of the stored content of ``key``."""
        digest = hashlib.sha256()
        with self.open(key) as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (recursively), sorted; temporary uploads are never listed."""
        base = self._path(prefix) if prefix else self.root
        if not self.fs.exists(base):
            return []
        if self.fs.isfile(base):
            return [check_key(prefix)]
        found = self.fs.find(base)
        keys = [posixpath.relpath(p, self.root) for p in found]
        return sorted(k for k in keys if not k.startswith(_TMP + "/"))

    def modified(self, key: str) -> float | None:
        """When ``key`` was last written (POSIX seconds), or None when the store does not say."""
        try:
            info = self.fs.info(self._path(key))
        except FileNotFoundError as exc:
            raise NotFoundError(f"artifact {key!r} not found in {self.root_url}") from exc
        for field in ("mtime", "LastModified", "last_modified", "updated", "created"):
            value = info.get(field)
            if value is None:
                continue
            if isinstance(value, int | float):
                return float(value)
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
            try:
                from datetime import datetime

                return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
        return None

    def walk_info(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size) for each key under ``prefix``."""
        for key in self.list(prefix):
            yield key, self.size(key)


class _Source:
    def __init__(self, src: str | Path | IO[bytes]) -> None:
        self.src = src
        self.fh: IO[bytes] | None = None

    def __enter__(self) -> IO[bytes]:
        if isinstance(self.src, str | Path):
            self.fh = fsspec.open(str(self.src), "rb").open()
        else:
            return self.src
        return self.fh

    def __exit__(self, *exc: object) -> None:
        if self.fh is not None:
            self.fh.close()


def _open_source(src: str | Path | IO[bytes]) -> _Source:
    return _Source(src)


_artifact_stores: dict[str, ArtifactStore] = {}


def get_artifacts(settings: Settings | None = None) -> ArtifactStore:
    """The artifact store at the configured root (one per process and root)."""
    settings = settings or load_settings()
    store = _artifact_stores.get(settings.artifact_root)
    if store is None:
        store = ArtifactStore(settings.artifact_root)
        _artifact_stores[settings.artifact_root] = store
    return store
