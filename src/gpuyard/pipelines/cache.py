"""Stage results cached by the content hash of their resolved inputs.

The key covers the stage kind, its inputs after references are resolved (so a new dataset version
upstream changes every key downstream), the SHA-256 of any input naming an existing file or folder
of files, and gpuyard's version. Records live in ``GPUYARD_HOME/pipelines/cache/<key>.json`` beside
the state store whose datasets, runs and models they point to.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from gpuyard.settings import load_settings


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _files(value: Any, base: Path) -> dict[str, str]:
    """Digests of the existing files and folders named by strings in ``value`` (relative to ``base``)."""
    found: dict[str, str] = {}
    if isinstance(value, dict):
        for v in value.values():
            found |= _files(v, base)
    elif isinstance(value, list):
        for v in value:
            found |= _files(v, base)
    elif isinstance(value, str) and value and "\n" not in value and len(value) < 1024:
        p = (base / value) if not Path(value).is_absolute() else Path(value)
        try:
            if p.exists() and p.resolve() != base.resolve():
                found[value] = _file_digest(p)
        except OSError:
            pass
    return found


def code_digest(uses: str, base: Path) -> str | None:
    """SHA-256 of a pipeline's own stage module (``module:function`` found under ``base``), else None."""
    module = uses.split(":", 1)[0]
    path = base / (module.replace(".", "/") + ".py")
    return _file_digest(path) if path.is_file() else None


def stage_key(kind: str, inputs: dict[str, Any], base: Path) -> str:
    """The content hash of one stage's work: kind, resolved inputs, input files, stage code, gpuyard version.

    A stage from the pipeline's own folder (``uses: friends:train_stage``) is keyed by its module's
    source too, so editing it re-runs the stage; gpuyard's own kinds are keyed by gpuyard's version.
    """
    try:
        version = metadata.version("gpuyard")
    except metadata.PackageNotFoundError:
        version = "unknown"
    doc = {
        "kind": kind,
        "inputs": inputs,
        "files": _files(inputs, base),
        "code": code_digest(kind, base) if ":" in kind else None,
        "gpuyard": version,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def cache_dir() -> Path:
    """Where cached stage results are kept."""
    path = load_settings().ensure_home() / "pipelines" / "cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def lookup(key: str) -> dict[str, Any] | None:
    """The cached record for ``key`` (outputs, when and by which job), or None."""
    p = cache_dir() / f"{key}.json"
    if not p.is_file():
        return None
    try:
        doc: dict[str, Any] = json.loads(p.read_text())
    except (OSError, ValueError):
        return None  # a torn record is as good as none: the stage runs again
    return doc


def save(key: str, record: dict[str, Any]) -> None:
    """Store ``record`` under ``key`` atomically (write, then rename)."""
    p = cache_dir() / f"{key}.json"
    tmp = p.with_suffix(".part")
    tmp.write_text(json.dumps(record, sort_keys=True, default=str))
    tmp.replace(p)
