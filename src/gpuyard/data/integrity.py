"""Check a whole dataset version against its catalog hashes, and collect blobs nothing references.

``verify_version`` reads every stored object of a version (manifest, shards, quarantine) from the
artifact store itself (not a cache) and compares each with the SHA-256 the catalog recorded.

``collect_garbage`` lists the content-addressed blobs (``blobs/sha256/...``) that nothing in the state
store references, and deletes them only when asked. Blobs are shared: dataset shards, manifests and
quarantines, but also registered model files, LLM weights and tokenizers. So a blob counts as
referenced when its SHA-256 appears anywhere in the state store (any text or JSON column of any
table) or in the manifest of any recorded dataset version, whichever component wrote it. A blob
written less than ``grace_s`` ago is never deleted: an ingest writes its shards before it records the
version that references them, and a collection running meanwhile must not take them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gpuyard.errors import IntegrityError, NotFoundError
from gpuyard.store.artifacts import BLOB_PREFIX, ArtifactStore, blob_sha256

# A day: far longer than any ingest or transform takes between writing a shard and recording its version.
DEFAULT_GRACE_S = 24 * 3600.0
_SHA = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_version`` found: objects checked, bytes read, and each bad one with why."""

    ref: str
    checked: int
    bytes: int
    bad: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every object matched its hash."""
        return not self.bad

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"ref": self.ref, "ok": self.ok, "checked": self.checked, "bytes": self.bytes, "bad": self.bad}


def _objects(
    manifest: dict[str, Any], manifest_key: str, manifest_sha: str
) -> Iterator[tuple[str, str, str]]:
    """(what, key, sha256) of every stored object of a version."""
    yield "manifest", manifest_key, manifest_sha
    for i, s in enumerate(manifest.get("shards") or []):
        yield f"shard {i}", str(s["key"]), str(s["sha256"])
    qkey = (manifest.get("quarantine") or {}).get("key")
    if qkey:
        sha = blob_sha256(str(qkey))
        if sha:
            yield "quarantine", str(qkey), sha


def verify_version(ref: str, artifacts: ArtifactStore | None = None) -> VerifyReport:
    """Hash every stored object of the version ``ref`` and compare with the catalog.

    Raises:
        NotFoundError: no such dataset or version. IntegrityError: the manifest itself is unreadable
            (its shards cannot then be listed); the message names the version.
    """
    from gpuyard.data.catalog import resolve
    from gpuyard.store import get_artifacts

    artifacts = artifacts or get_artifacts()
    row = resolve(ref)
    version_ref = f"{row.dataset}@{row.version}"
    try:
        manifest = json.loads(artifacts.get_bytes(row.manifest_key, sha256=row.manifest_sha256))
    except (IntegrityError, NotFoundError, ValueError) as exc:
        raise IntegrityError(
            f"{version_ref}: its manifest {row.manifest_key} cannot be trusted: {exc}"
        ) from exc
    bad: list[dict[str, str]] = []
    checked = total = 0
    for what, key, sha in _objects(manifest, row.manifest_key, row.manifest_sha256):
        checked += 1
        try:
            total += artifacts.size(key)
            actual = artifacts.sha256(key)
        except NotFoundError:
            bad.append({"object": what, "key": key, "problem": "missing"})
            continue
        if actual != sha:
            bad.append(
                {
                    "object": what,
                    "key": key,
                    "problem": f"content hashes to {actual[:12]}..., catalog records {sha[:12]}...",
                }
            )
    return VerifyReport(version_ref, checked, total, bad)


def referenced_hashes(artifacts: ArtifactStore | None = None) -> set[str]:
    """Every SHA-256 the state store mentions (any text or JSON column of any table) or a recorded
    dataset manifest mentions: the blobs that must stay."""
    from sqlalchemy import JSON, String, Text, select

    import gpuyard.store.tables  # noqa: F401 - every table registered on Base.metadata
    from gpuyard.store import get_artifacts, get_store
    from gpuyard.store.base import Base
    from gpuyard.store.tables.data import DatasetVersionRow

    artifacts = artifacts or get_artifacts()
    found: set[str] = set()
    store = get_store()
    manifests: list[tuple[str, str]] = []
    with store.read() as s:
        for table in Base.metadata.sorted_tables:
            cols = [c for c in table.columns if isinstance(c.type, String | Text | JSON) or _is_json(c.type)]
            if not cols:
                continue
            for row in s.execute(select(*cols)):
                for value in row:
                    if value is not None:
                        found.update(_SHA.findall(value if isinstance(value, str) else json.dumps(value)))
        for key, sha in s.execute(select(DatasetVersionRow.manifest_key, DatasetVersionRow.manifest_sha256)):
            manifests.append((str(key), str(sha)))
    for key, sha in manifests:
        try:
            found.update(_SHA.findall(artifacts.get_bytes(key, sha256=sha).decode(errors="replace")))
        except (NotFoundError, IntegrityError):
            continue  # a lost or damaged manifest: `gpuyard data verify` names it
    return found


def _is_json(type_: Any) -> bool:
    return "json" in type(type_).__name__.lower()


@dataclass(frozen=True)
class GcReport:
    """Unreferenced blobs (deleted, or to delete), the ones too new to touch, and the bytes involved."""

    unreferenced: list[str]
    bytes: int
    deleted: bool
    too_new: int
    referenced: int

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "unreferenced": self.unreferenced,
            "bytes": self.bytes,
            "deleted": self.deleted,
            "kept_too_new": self.too_new,
            "referenced": self.referenced,
        }


def collect_garbage(
    *, delete: bool = False, grace_s: float = DEFAULT_GRACE_S, artifacts: ArtifactStore | None = None
) -> GcReport:
    """Blobs that nothing references and that are older than ``grace_s``; deleted when ``delete``.

    References are read before the blobs are listed, so a version recorded after the reading holds
    blobs written after it started, which the grace period keeps. Each blob's age is checked again
    just before it is deleted.
    """
    from gpuyard.store import get_artifacts

    artifacts = artifacts or get_artifacts()
    keep = referenced_hashes(artifacts)
    now = time.time()
    candidates: list[tuple[str, int]] = []
    too_new = referenced = 0
    for key in artifacts.list(BLOB_PREFIX):
        sha = blob_sha256(key)
        if sha is None:
            continue  # not a blob this store wrote: not ours to judge
        if sha in keep:
            referenced += 1
            continue
        if not _old_enough(artifacts, key, now, grace_s):
            too_new += 1
            continue
        candidates.append((key, artifacts.size(key)))
    if delete:
        for key, _ in candidates:
            if _old_enough(artifacts, key, time.time(), grace_s):
                artifacts.delete(key)
    return GcReport([k for k, _ in candidates], sum(n for _, n in candidates), delete, too_new, referenced)


def _old_enough(artifacts: ArtifactStore, key: str, now: float, grace_s: float) -> bool:
    try:
        written = artifacts.modified(key)
    except NotFoundError:
        return False
    return written is not None and now - written >= grace_s
