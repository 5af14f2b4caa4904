"""Local cache tier for shards on remote artifact stores: LRU by last use, bounded in bytes.

The first epoch downloads each shard once (checked against its SHA-256); later epochs read local
disk. Files are written to a temporary name and renamed, so concurrent DataLoader workers and ranks
on one host can share one cache folder safely.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from gpuyard.errors import IntegrityError
from gpuyard.store.artifacts import CHUNK, ArtifactStore

DEFAULT_CACHE_BYTES = 20 << 30
CACHE_ENV = "GPUYARD_DATA_CACHE_BYTES"


# Local files whose content this process has checked against the catalog's SHA-256, by identity
# (path, device, inode, size, modification and change time): a shard is hashed once per process, not
# once per epoch. The change time is in it because a file's owner can set the modification time back
# after rewriting it (utime), while only the kernel sets the change time.
_VERIFIED: dict[tuple[str, int, int, int, int, int], str] = {}
_VERIFIED_MAX = 100_000


def _identity(path: str) -> tuple[str, int, int, int, int, int]:
    st = os.stat(path)
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def mark_verified(path: str | os.PathLike[str], sha256: str) -> None:
    """Record that ``path`` was just checked against ``sha256`` (e.g. by the cache as it downloaded it)."""
    if len(_VERIFIED) >= _VERIFIED_MAX:
        _VERIFIED.clear()
    with contextlib.suppress(FileNotFoundError):
        _VERIFIED[_identity(str(path))] = sha256


def is_verified(path: str, sha256: str) -> bool:
    """Whether this process already checked the file at ``path``, unchanged since, against ``sha256``."""
    try:
        return _VERIFIED.get(_identity(path)) == sha256
    except FileNotFoundError:
        return False


@dataclass
class ShardCache:
    """Shards cached under ``root`` by SHA-256, at most ``max_bytes`` in total (least recently used go first).

    Attributes:
        root: cache folder.
        max_bytes: bound on the bytes kept; a single shard larger than this is still served.
        hits: shards served from local disk by this object.
        misses: shards downloaded by this object.
    """

    root: Path
    max_bytes: int = DEFAULT_CACHE_BYTES
    hits: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        """Where the shard with this hash lives in the cache."""
        return self.root / sha256[:2] / f"{sha256}.parquet"

    def fetch(self, artifacts: ArtifactStore, key: str, sha256: str) -> Path:
        """A local path holding the shard ``key``: from the cache, or downloaded and verified first."""
        path = self.path_for(sha256)
        if path.exists():
            self.hits += 1
            os.utime(path)  # last use drives eviction
            return path
        self.misses += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        digest = hashlib.sha256()
        size = 0
        try:
            with artifacts.open(key) as inp, open(tmp, "wb") as out:
                while chunk := inp.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            if digest.hexdigest() != sha256:
                raise IntegrityError(
                    f"shard {artifacts.url(key)} does not match its SHA-256 {sha256[:12]}..."
                )
            self._evict(keep_free=size, keep=path)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        mark_verified(path, sha256)  # just hashed as it was written: no second hash on first read
        return path

    def _evict(self, keep_free: int, keep: Path) -> None:
        # Oldest last-use first; a reader that already opened an evicted file keeps reading it (POSIX).
        files = []
        for p in self.root.glob("*/*.parquet"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda t: t[0]):
            if total + keep_free <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= size

    def used_bytes(self) -> int:
        """Bytes currently held in the cache folder."""
        return sum(p.stat().st_size for p in self.root.glob("*/*.parquet"))


def default_cache(home: Path) -> ShardCache:
    """The per-host cache in ``GPUYARD_HOME/cache/shards`` (size from GPUYARD_DATA_CACHE_BYTES)."""
    limit = int(os.environ.get(CACHE_ENV, DEFAULT_CACHE_BYTES))
    return ShardCache(root=home / "cache" / "shards", max_bytes=limit)
