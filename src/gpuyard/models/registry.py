"""The model registry: versions with lineage and signatures, aliases and stages, loading by reference.

References: ``NAME`` (latest version), ``NAME:3`` (version 3), ``NAME@ALIAS`` (an alias, or a stage
name: ``@production``, ``@staging``). Files are stored content-addressed in the artifact store and
checked against their SHA-256 when loaded. Promotion to production lives in :mod:`gpuyard.models.promote`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError as SAIntegrityError

from gpuyard.errors import ConfigError, ConflictError, GpuyardError, NotFoundError
from gpuyard.models.flavors import (
    CONFIG_FILE,
    FILE_FOR_FLAVOR,
    Predictor,
    check_model_file,
    load_model,
    save_model,
)
from gpuyard.models.safety import check_model_safety
from gpuyard.models.signature import RECIPE_KEY, attach_recipe
from gpuyard.refs import ALIAS_RE, ModelRef, check_model_name
from gpuyard.settings import load_settings
from gpuyard.states import ModelStage, RunStatus
from gpuyard.store import get_artifacts, get_store
from gpuyard.store.db import Store
from gpuyard.store.tables.models import (
    EvaluationRow,
    ModelAliasRow,
    ModelEventRow,
    ModelVersionRow,
    RunArtifactRow,
    RunRow,
)

# The team a model belongs to when none is named (the scheduler's and the users' default team too).
DEFAULT_TEAM = "default"

STAGES = tuple(ModelStage)


@dataclass(frozen=True)
class ModelVersion:
    """One registered version, as stored."""

    name: str
    version: int
    flavor: str
    stage: str
    run_id: str | None
    dataset_version: str | None
    code_version: str | None
    metrics: dict[str, Any]
    signature: dict[str, Any]
    files: dict[str, Any]
    config: dict[str, Any]
    lineage: dict[str, Any]
    description: str
    created_at: datetime
    aliases: tuple[str, ...] = ()
    team: str = DEFAULT_TEAM

    @property
    def ref(self) -> str:
        """``NAME:VERSION``."""
        return str(ModelRef(self.name, self.version))

    @property
    def task(self) -> str:
        """classification or regression."""
        return str(self.config.get("task") or self.signature.get("task") or "classification")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        doc = asdict(self)
        doc["created_at"] = self.created_at.isoformat()
        doc["aliases"] = list(self.aliases)
        return doc


def _to_version(row: ModelVersionRow, aliases: list[str]) -> ModelVersion:
    return ModelVersion(
        name=row.name,
        version=row.version,
        flavor=row.flavor,
        stage=row.stage,
        run_id=row.run_id,
        dataset_version=row.dataset_version,
        code_version=row.code_version,
        metrics=dict(row.metrics),
        signature=dict(row.signature),
        files=dict(row.files),
        config=dict(row.config),
        lineage=dict(row.lineage),
        description=row.description,
        created_at=row.created_at,
        aliases=tuple(sorted(aliases)),
        team=row.team,
    )


def _aliases(s: Any, name: str, version: int) -> list[str]:
    return list(
        s.scalars(
            select(ModelAliasRow.alias).where(ModelAliasRow.name == name, ModelAliasRow.version == version)
        )
    )


def _known_versions(s: Any, name: str) -> list[int]:
    return list(
        s.scalars(select(ModelVersionRow.version).where(ModelVersionRow.name == name).order_by("version"))
    )


def _resolve_row(s: Any, ref: str) -> ModelVersionRow:
    parsed = ModelRef.parse(ref)
    name, sel = parsed.name, parsed.selector
    query = select(ModelVersionRow).where(ModelVersionRow.name == name)
    if isinstance(sel, int):
        row = s.scalars(query.where(ModelVersionRow.version == sel)).first()
    elif isinstance(sel, str):
        alias = s.get(ModelAliasRow, (name, sel))
        if alias is not None:
            row = s.scalars(query.where(ModelVersionRow.version == alias.version)).first()
        elif sel in STAGES:
            row = s.scalars(
                query.where(ModelVersionRow.stage == sel).order_by(ModelVersionRow.version.desc())
            ).first()
        else:
            raise NotFoundError(f"model {name!r} has no alias {sel!r} and no version in stage {sel!r}")
    else:
        row = s.scalars(query.order_by(ModelVersionRow.version.desc())).first()
    if row is None:
        known = _known_versions(s, name)
        if not known:
            raise NotFoundError(f"model {name!r} is not registered (see `gpuyard models ls`)")
        raise NotFoundError(f"model {ref!r} not found; {name} has versions {', '.join(map(str, known))}")
    return row  # type: ignore[no-any-return]


def get_version(ref: str, store: Store | None = None) -> ModelVersion:
    """The version ``ref`` points at (see the module docstring).

    Raises:
        NotFoundError: no such model, version, alias or stage. ConfigError: a malformed reference.
    """
    store = store or get_store()
    with store.read() as s:
        row = _resolve_row(s, ref)
        return _to_version(row, _aliases(s, row.name, row.version))


def list_versions(name: str, store: Store | None = None) -> list[ModelVersion]:
    """Every version of ``name``, newest first."""
    store = store or get_store()
    check_model_name(name)
    with store.read() as s:
        rows = list(
            s.scalars(
                select(ModelVersionRow)
                .where(ModelVersionRow.name == name)
                .order_by(ModelVersionRow.version.desc())
            )
        )
        if not rows:
            raise NotFoundError(f"model {name!r} is not registered (see `gpuyard models ls`)")
        return [_to_version(r, _aliases(s, r.name, r.version)) for r in rows]


def list_models(store: Store | None = None, team: str | None = None) -> list[dict[str, Any]]:
    """One line per model name: team, version count, latest version, production version, aliases.

    Args:
        team: only the models of this team (None: every team's).
    """
    store = store or get_store()
    q = select(ModelVersionRow).order_by(ModelVersionRow.name, ModelVersionRow.version)
    if team is not None:
        q = q.where(ModelVersionRow.team == team)
    with store.read() as s:
        rows = list(s.scalars(q))
        aliases = list(s.scalars(select(ModelAliasRow)))
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        doc = out.setdefault(
            r.name,
            {
                "name": r.name,
                "versions": 0,
                "latest": None,
                "production": None,
                "staging": None,
                "flavor": r.flavor,
                "team": r.team,
                "aliases": {},
                "updated_at": None,
            },
        )
        doc["versions"] += 1
        doc["latest"] = r.version
        doc["flavor"] = r.flavor
        if r.stage in (ModelStage.PRODUCTION, ModelStage.STAGING):
            doc[r.stage] = r.version
        stamp = r.updated_at.isoformat()
        doc["updated_at"] = max(doc["updated_at"] or stamp, stamp)
    for a in aliases:
        if a.name in out:
            out[a.name]["aliases"][a.alias] = a.version
    return list(out.values())


def record_event(s: Any, name: str, version: int | None, action: str, detail: dict[str, Any]) -> None:
    """Add a model event in the session ``s`` (registered, stage, alias, promoted, refused, retrain)."""
    s.add(ModelEventRow(name=name, version=version, action=action, detail=detail))


def model_events(name: str, limit: int = 50, store: Store | None = None) -> list[dict[str, Any]]:
    """The newest events of model ``name``."""
    store = store or get_store()
    with store.read() as s:
        rows = s.scalars(
            select(ModelEventRow)
            .where(ModelEventRow.name == name)
            .order_by(ModelEventRow.id.desc())
            .limit(limit)
        )
        return [
            {"version": r.version, "action": r.action, "detail": r.detail, "at": r.at.isoformat()}
            for r in rows
        ]


def _store_files(folder: Path, flavor: str) -> dict[str, Any]:
    artifacts = get_artifacts()
    files: dict[str, Any] = {}
    for fname in (FILE_FOR_FLAVOR[flavor], CONFIG_FILE, "signature.json"):
        path = folder / fname
        if path.exists():
            info = artifacts.put_blob(path)
            files[fname] = {"key": info.key, "sha256": info.sha256, "size": info.size}
    return files


def model_team(name: str, store: Store | None = None) -> str:
    """The team model ``name`` belongs to (its first version's).

    Raises:
        NotFoundError: no such model.
    """
    store = store or get_store()
    with store.read() as s:
        team = _team_of(s, check_model_name(name))
    if team is None:
        raise NotFoundError(f"model {name!r} is not registered (see `gpuyard models ls`)")
    return team


def _team_of(s: Any, name: str) -> str | None:
    return s.scalar(
        select(ModelVersionRow.team)
        .where(ModelVersionRow.name == name)
        .order_by(ModelVersionRow.version)
        .limit(1)
    )


def _insert_version(store: Store, name: str, fields: dict[str, Any], team: str | None = None) -> ModelVersion:
    for _attempt in range(5):  # two registrations of one name at once: the loser retries the next number
        try:
            with store.session() as s:
                owner = _team_of(s, name)
                if owner is not None and team is not None and team != owner:
                    raise ConflictError(
                        f"model {name!r} belongs to team {owner!r}: a new version cannot go to team {team!r}"
                    )
                latest = s.scalar(
                    select(func.max(ModelVersionRow.version)).where(ModelVersionRow.name == name)
                )
                row = ModelVersionRow(
                    name=name, version=(latest or 0) + 1, team=owner or team or DEFAULT_TEAM, **fields
                )
                s.add(row)
                s.flush()
                record_event(s, name, row.version, "registered", {"run_id": fields.get("run_id")})
                return _to_version(row, [])
        except SAIntegrityError:
            continue
    raise ConflictError(f"could not allocate a version number for model {name!r}; retry")


def register_folder(
    name: str,
    folder: str | Path,
    *,
    signature: dict[str, Any] | None = None,
    run_id: str | None = None,
    dataset_version: str | None = None,
    code_version: str | None = None,
    metrics: dict[str, Any] | None = None,
    lineage: dict[str, Any] | None = None,
    description: str = "",
    store: Store | None = None,
    team: str | None = None,
) -> ModelVersion:
    """Register the model saved in ``folder`` (a flavor file plus ``config.json``) as a new version.

    A new model belongs to ``team`` (default: ``default``); a new version keeps its model's team.

    Raises:
        ConflictError: ``team`` is not the team of the model ``name`` already registered.
        ConfigError: a model file that is not safetensors / skops / ONNX, or one that disagrees with
        its config; a missing config for a torch model. UnsafeModelError (a ConfigError): a file that
        names a type, function or factory gpuyard does not load (:mod:`gpuyard.models.safety`).
    """
    check_model_name(name)
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    flavor = config.get("flavor")
    if flavor not in FILE_FOR_FLAVOR:
        raise ConfigError(f"{config_path}: flavor {flavor!r} unknown or missing; use torch, sklearn or onnx")
    found = check_model_file(folder / FILE_FOR_FLAVOR[flavor])
    if found != flavor:
        raise ConfigError(
            f"{folder / FILE_FOR_FLAVOR[flavor]} is a {found} file but config.json says {flavor}"
        )
    if flavor == "torch" and not config.get("factory"):
        raise ConfigError(f"{config_path}: a torch model needs 'factory' (module:function) and 'kwargs'")
    # Refused here, before anything is stored, and again at every load (load_model).
    check_model_safety(folder / FILE_FOR_FLAVOR[flavor], flavor, config)
    if signature is None and (folder / "signature.json").exists():
        signature = json.loads((folder / "signature.json").read_text())
    signature, recipe_note = _with_recipe(signature or {}, dataset_version)
    lineage = {**(lineage or {}), "recipe": recipe_note} if recipe_note else dict(lineage or {})
    store = store or get_store()
    fields = dict(
        flavor=flavor,
        stage=ModelStage.NONE,
        run_id=run_id,
        dataset_version=dataset_version,
        code_version=code_version,
        metrics=metrics or {},
        signature=signature,
        files=_store_files(folder, flavor),
        config=config,
        lineage=lineage,
        description=description,
    )
    return _insert_version(store, name, fields, team)


def _with_recipe(signature: dict[str, Any], dataset_version: str | None) -> tuple[dict[str, Any], str | None]:
    """``signature`` carrying the serving contract of its training dataset, and a line saying what happened.

    The contract (:func:`gpuyard.models.signature.serving_recipe`) is the dataset version's fitted
    recipe: the model server applies it to raw records. A dataset that is not a gpuyard version
    (``sklearn:``, ``npz:``) has none; a version that has gone from the catalog is said, not fatal.
    """
    if RECIPE_KEY in signature:
        return signature, f"serving recipe of {signature[RECIPE_KEY].get('dataset')}"
    if not dataset_version:
        return signature, None
    if not signature:
        return signature, "none: the model has no signature"
    if dataset_version.startswith(("sklearn:", "npz:")):
        return signature, f"none: {dataset_version} is not a gpuyard dataset version (no recipe to apply)"
    try:
        out = attach_recipe(signature, dataset_version)
    except GpuyardError as exc:
        return signature, f"none: {exc}"
    if RECIPE_KEY not in out:
        return signature, f"none: {dataset_version} has no recipe whose features are the model's inputs"
    return out, f"serving recipe of {out[RECIPE_KEY]['dataset']}"


def register_from_run(
    name: str, run_ref: str, description: str = "", store: Store | None = None, team: str | None = None
) -> ModelVersion:
    """Register the model a finished run stored, with the run's lineage and evaluation metrics.

    Raises:
        NotFoundError: no such run, or the run stored no model. ConflictError: the run did not finish.
    """
    from gpuyard.models.runs import resolve_run_id

    check_model_name(name)
    store = store or get_store()
    run_id = resolve_run_id(run_ref, store)
    with store.read() as s:
        run = s.get(RunRow, run_id)
        if run is None:
            raise NotFoundError(f"run {run_ref!r} not found")
        if run.status != RunStatus.FINISHED:
            raise ConflictError(f"run {run_id[:8]} is {run.status}: only a finished run can be registered")
        arts = list(
            s.scalars(
                select(RunArtifactRow).where(
                    RunArtifactRow.run_id == run_id, RunArtifactRow.name.startswith("model/")
                )
            )
        )
        evals = list(
            s.scalars(select(EvaluationRow).where(EvaluationRow.run_id == run_id).order_by(EvaluationRow.id))
        )
        lineage = {
            "run_id": run_id,
            "run_name": run.name,
            "experiment": run.experiment,
            "parent_run_id": run.parent_id,
            "params": run.params,
            "dataset_ref": run.tags.get("dataset_ref"),
            "split": run.tags.get("split"),
            "metric": run.tags.get("metric"),
            "direction": run.tags.get("direction"),
            "trainer": run.tags.get("trainer"),
        }
        dataset_version, code = run.dataset_version, run.code_version
    if not arts:
        raise NotFoundError(f"run {run_id[:8]} stored no model (no model/ artifacts)")
    metrics = {e.split: e.metrics for e in evals}
    artifacts = get_artifacts()
    with tempfile.TemporaryDirectory(prefix="gpuyard-register-") as tmp:
        for art in arts:
            artifacts.get_file(art.key, Path(tmp) / art.name.split("/", 1)[1], sha256=art.sha256)
        return register_folder(
            name,
            tmp,
            run_id=run_id,
            dataset_version=dataset_version,
            code_version=code,
            metrics=metrics,
            lineage=lineage,
            description=description,
            store=store,
            team=team,
        )


def register_file(
    name: str,
    path: str | Path,
    *,
    task: str = "classification",
    description: str = "",
    store: Store | None = None,
    team: str | None = None,
) -> ModelVersion:
    """Register one ONNX or skops file (its format judged by content, never by its name).

    Raises:
        ConfigError: pickle or any other format; a safetensors file (it needs a factory config: use
        :func:`register_folder`).
    """
    from gpuyard.models.metrics import check_task

    check_task(task)
    flavor = check_model_file(path)
    if flavor == "torch":
        raise ConfigError(f"{path} holds bare weights: register a folder with config.json naming the factory")
    with tempfile.TemporaryDirectory(prefix="gpuyard-register-") as tmp:
        shutil.copyfile(path, Path(tmp) / FILE_FOR_FLAVOR[flavor])
        (Path(tmp) / CONFIG_FILE).write_text(json.dumps({"flavor": flavor, "task": task}))
        lineage = {"source_file": str(Path(path).resolve())}
        return register_folder(name, tmp, lineage=lineage, description=description, store=store, team=team)


def register_model(
    name: str, model: Any, task: str, signature: dict[str, Any], **kwargs: Any
) -> ModelVersion:
    """Save an in-memory torch module or scikit-learn estimator and register it (library use)."""
    with tempfile.TemporaryDirectory(prefix="gpuyard-register-") as tmp:
        save_model(
            model,
            tmp,
            task,
            factory=kwargs.pop("factory", None),
            factory_kwargs=kwargs.pop("factory_kwargs", None),
        )
        return register_folder(name, tmp, signature=signature, **kwargs)


def set_alias(ref: str, alias: str, store: Store | None = None) -> ModelVersion:
    """Point ``NAME@alias`` at the version ``ref`` (moving it if it existed)."""
    if not ALIAS_RE.match(alias) or alias in STAGES:
        raise ConfigError(
            f"alias {alias!r}: start with a letter; stage names ({', '.join(STAGES)}) are reserved"
        )
    store = store or get_store()
    with store.session() as s:
        row = _resolve_row(s, ref)
        existing = s.get(ModelAliasRow, (row.name, alias))
        if existing is None:
            s.add(ModelAliasRow(name=row.name, alias=alias, version=row.version))
        else:
            existing.version = row.version
        record_event(s, row.name, row.version, "alias", {"alias": alias})
    return get_version(str(ModelRef(row.name, row.version)), store)


def delete_alias(name: str, alias: str, store: Store | None = None) -> None:
    """Remove ``NAME@alias``.

    Raises:
        NotFoundError: no such alias.
    """
    store = store or get_store()
    with store.session() as s:
        row = s.get(ModelAliasRow, (check_model_name(name), alias))
        if row is None:
            raise NotFoundError(f"model {name!r} has no alias {alias!r}")
        s.delete(row)
        record_event(s, name, row.version, "alias_deleted", {"alias": alias})


def set_stage(ref: str, stage: str, store: Store | None = None) -> ModelVersion:
    """Move a version to ``none``, ``staging`` or ``archived`` (production only through promotion).

    Raises:
        ConfigError: unknown stage, or ``production`` (use promote, which compares on the holdout).
    """
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}: use one of {', '.join(STAGES)}")
    if stage == ModelStage.PRODUCTION:
        raise ConfigError(
            "a version reaches production only through `gpuyard models promote` (holdout comparison)"
        )
    store = store or get_store()
    with store.session() as s:
        row = _resolve_row(s, ref)
        old, row.stage = row.stage, stage
        record_event(s, row.name, row.version, "stage", {"from": old, "to": stage})
    return get_version(str(ModelRef(row.name, row.version)), store)


def model_cache_dir(mv: ModelVersion) -> Path:
    """Local folder holding a version's files after :func:`fetch`."""
    return load_settings().home / "cache" / "models" / mv.name / str(mv.version)


def fetch(mv: ModelVersion, dest: str | Path | None = None) -> Path:
    """Copy a version's files into ``dest`` (default: the local cache), each checked against its SHA-256."""
    folder = Path(dest) if dest is not None else model_cache_dir(mv)
    artifacts = get_artifacts()
    for fname, info in mv.files.items():
        target = folder / fname
        if target.exists() and dest is None and target.stat().st_size == info["size"]:
            continue  # cached; sizes match and the cache is ours
        artifacts.get_file(info["key"], target, sha256=info["sha256"])
    return folder


@dataclass
class LoadedModel:
    """A version loaded for use: the record, the raw model and its predictor."""

    version: ModelVersion
    model: Any
    predictor: Predictor


def load(ref: str, store: Store | None = None) -> LoadedModel:
    """Load the model ``ref`` (``NAME``, ``NAME:V``, ``NAME@ALIAS``) for prediction.

    Raises:
        NotFoundError: unknown reference. IntegrityError: a file changed since registration.
    """
    mv = get_version(ref, store)
    folder = fetch(mv)
    model, predictor = load_model(folder, mv.config)
    return LoadedModel(mv, model, predictor)


def export(ref: str, out: str | Path, store: Store | None = None) -> Path:
    """Write a version's files, plus ``model.json`` (the registry record), into the folder ``out``."""
    mv = get_version(ref, store)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConflictError(f"export folder {out} is not empty")
    with tempfile.TemporaryDirectory(prefix="gpuyard-export-") as tmp:
        fetch(mv, tmp)
        (Path(tmp) / "model.json").write_text(json.dumps(mv.to_json(), indent=2, sort_keys=True))
        out.mkdir(parents=True, exist_ok=True)
        for path in Path(tmp).iterdir():
            shutil.copy2(path, out / path.name)
    return out
