"""The dataset catalog in the state store: record versions, resolve ``name[@version]``, list them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import select

from gpuyard.errors import ConfigError, ConflictError, NotFoundError
from gpuyard.refs import DatasetRef, check_dataset_name
from gpuyard.store import get_artifacts, get_store
from gpuyard.store.tables.data import DatasetRow, DatasetVersionRow

VERSION_CHARS = 12
# The team a dataset belongs to when none is named (the scheduler's, users' and models' default too).
DEFAULT_TEAM = "default"
# Fields that define a version's content; timestamps are left out so equal content gives an equal id.
_IDENTITY_FIELDS = ("schema", "shards", "parent", "recipe", "fitted", "label_column", "kind")


def canonical_json(doc: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no spaces) used for hashing."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


def version_id(manifest: dict[str, Any]) -> str:
    """The content address of a version: a SHA-256 prefix over its identity fields."""
    ident = {k: manifest.get(k) for k in _IDENTITY_FIELDS}
    return hashlib.sha256(canonical_json(ident)).hexdigest()[:VERSION_CHARS]


def parse_ref(ref: str | DatasetRef) -> tuple[str, str | None]:
    """(name, version prefix or None for the newest) of ``name`` / ``name@version`` / ``name@latest``.

    Raises:
        ConfigError: a malformed reference, or one that selects splits (a split is not a version).
    """
    parsed = DatasetRef.parse(ref) if isinstance(ref, str) else ref
    if parsed.splits is not None:
        raise ConfigError(f"dataset reference {str(ref)!r} selects splits; name a version (NAME[@VERSION])")
    return parsed.name, parsed.version


def dataset_team(name: str) -> str:
    """The team dataset ``name`` belongs to.

    Raises:
        NotFoundError: no such dataset.
    """
    check_dataset_name(name)
    with get_store().read() as s:
        team = s.scalar(select(DatasetRow.team).where(DatasetRow.name == name))
    if team is None:
        raise NotFoundError(f"dataset {name!r} not found (see `gpuyard data ls`)")
    return str(team)


def _owner(s: Any, name: str, team: str | None) -> str | None:
    """The team of dataset ``name`` (None: no such dataset yet); a conflict when ``team`` is another."""
    owner: str | None = s.scalar(select(DatasetRow.team).where(DatasetRow.name == name))
    if owner is not None and team is not None and team != owner:
        raise ConflictError(
            f"dataset {name!r} belongs to team {owner!r}: a new version cannot go to team {team!r}"
        )
    return owner


def check_new_version_team(name: str, team: str | None) -> None:
    """Refuse, before any work, a version of an existing dataset for a team other than its own.

    Raises:
        ConflictError: dataset ``name`` exists and belongs to another team than ``team``.
    """
    with get_store().read() as s:
        _owner(s, name, team)


def record_version(manifest: dict[str, Any], team: str | None = None) -> DatasetVersionRow:
    """Store the manifest (content-addressed) and add the version to the catalog; idempotent.

    A new dataset belongs to ``team`` (default: ``default``); a new version keeps its dataset's team.

    Raises:
        ConflictError: ``team`` is not the team of the dataset ``name`` already recorded.
    """
    name, version = manifest["name"], manifest["version"]
    store = get_store()
    with store.read() as s:
        _owner(s, name, team)
        existing = s.get(DatasetVersionRow, (name, version))
    if existing is not None:
        return existing
    info = get_artifacts().put_blob(canonical_json(manifest))
    q = manifest["quarantine"]
    row = DatasetVersionRow(
        dataset=name,
        version=version,
        parent=manifest.get("parent"),
        kind=manifest["kind"],
        num_rows=manifest["num_rows"],
        num_shards=len(manifest["shards"]),
        num_bytes=sum(s["bytes"] for s in manifest["shards"]),
        rows_in=q["rows_in"],
        rows_quarantined=q["rows_quarantined"],
        quarantine_counts=q["by_reason"],
        manifest_key=info.key,
        manifest_sha256=info.sha256,
        quarantine_key=q.get("key"),
        source=str(manifest["source"].get("uri", "")),
    )
    with store.session() as s:
        if _owner(s, name, team) is None:
            s.add(DatasetRow(name=name, team=team or DEFAULT_TEAM))
            s.flush()
        if s.get(DatasetVersionRow, (name, version)) is None:
            s.add(row)
    return row


def resolve(ref: str | DatasetRef) -> DatasetVersionRow:
    """The catalog row of ``name`` (latest version), ``name@latest`` or ``name@VERSION`` (a unique prefix).

    Raises:
        NotFoundError: no such dataset or version; the message lists what exists.
        ConfigError: the version prefix matches more than one version.
    """
    name, version = parse_ref(ref)
    with get_store().read() as s:
        stmt = select(DatasetVersionRow).where(DatasetVersionRow.dataset == name)
        if version is not None:
            stmt = stmt.where(DatasetVersionRow.version.startswith(version))
        rows = list(s.scalars(stmt.order_by(DatasetVersionRow.created_at.desc())))
        if not rows:
            known = list(s.scalars(select(DatasetRow.name).order_by(DatasetRow.name)))
    if not rows:
        if version is None or name not in known:
            raise NotFoundError(f"dataset {name!r} not found (known: {', '.join(known) or 'none'})")
        raise NotFoundError(f"dataset {name!r} has no version {version!r}")
    if version is not None and len({r.version for r in rows}) > 1:
        raise ConfigError(f"version prefix {version!r} of {name!r} is ambiguous; give more digits")
    return rows[0]


def load_manifest(row: DatasetVersionRow) -> dict[str, Any]:
    """The manifest of a catalog row, checked against its recorded hash."""
    data = get_artifacts().get_bytes(row.manifest_key, sha256=row.manifest_sha256)
    return dict(json.loads(data))


def _version_doc(r: DatasetVersionRow, team: str) -> dict[str, Any]:
    return {
        "dataset": r.dataset,
        "team": team,
        "version": r.version,
        "parent": r.parent,
        "kind": r.kind,
        "rows": r.num_rows,
        "shards": r.num_shards,
        "bytes": r.num_bytes,
        "rows_in": r.rows_in,
        "rows_quarantined": r.rows_quarantined,
        "quarantine": r.quarantine_counts,
        "source": r.source,
        "created_at": r.created_at.isoformat(),
    }


def list_versions(name: str) -> list[dict[str, Any]]:
    """Every version of ``name``, newest first (catalog fields only; open one for its manifest)."""
    check_dataset_name(name)
    with get_store().read() as s:
        stmt = select(DatasetVersionRow).where(DatasetVersionRow.dataset == name)
        rows = list(s.scalars(stmt.order_by(DatasetVersionRow.created_at.desc())))
        team = s.scalar(select(DatasetRow.team).where(DatasetRow.name == name))
    if not rows:
        raise NotFoundError(f"dataset {name!r} not found")
    return [_version_doc(r, team or DEFAULT_TEAM) for r in rows]


def list_datasets(team: str | None = None) -> list[dict[str, Any]]:
    """One entry per dataset: its team, its latest version's catalog fields and how many versions it has.

    Args:
        team: only the datasets of this team (None: every team's).
    """
    q = (
        select(DatasetVersionRow, DatasetRow.team)
        .join(DatasetRow, DatasetRow.name == DatasetVersionRow.dataset)
        .order_by(DatasetVersionRow.created_at.desc())
    )
    if team is not None:
        q = q.where(DatasetRow.team == team)
    with get_store().read() as s:
        rows = [(r, str(t)) for r, t in s.execute(q).tuples()]
    out: dict[str, dict[str, Any]] = {}
    for r, owner in rows:
        if r.dataset not in out:
            out[r.dataset] = {**_version_doc(r, owner), "versions": 0}
        out[r.dataset]["versions"] += 1
    return [out[k] for k in sorted(out)]
