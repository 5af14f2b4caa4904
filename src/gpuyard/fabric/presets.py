"""Cluster presets and cluster files: load a preset by name (``local`` from this machine) or a YAML/JSON file.

Kept apart from :mod:`gpuyard.fabric.cluster` (the schema) so that the ``local`` preset, which builds a
cluster from the hardware inventory, can import the schema without an import circle.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import ValidationError

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.local import local_cluster
from gpuyard.hardware.catalog import get_spec
from gpuyard.textfiles import parse_yaml, read_text

PRESET_DIR = Path(__file__).parent / "presets"


def list_presets() -> list[str]:
    """Names of the built-in cluster presets (files in presets/ plus ``local``)."""
    files = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    return [*files, "local"]


def _parse(data: object, where: str) -> Cluster:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a cluster must be a mapping, got {type(data).__name__}")
    try:
        cluster = Cluster.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{where}: field {field!r}: {first['msg']}") from None
    if cluster.device is None:
        try:
            get_spec(cluster.accelerator)
        except NotFoundError as exc:
            raise ConfigError(f"{where}: field 'accelerator': {exc}") from None
    return cluster


def read_cluster_file(path: Path) -> Cluster:
    """Read a cluster from a YAML or JSON file.

    Raises:
        ConfigError: the file cannot be parsed or a field is invalid (the message names it).
    """
    try:
        text = read_text(path, "cluster file")
        data = json.loads(text) if path.suffix == ".json" else parse_yaml(text, path)
    except NotFoundError as exc:
        raise ConfigError(f"cannot read cluster file: {exc}") from None
    except ValueError as exc:  # JSON
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    return _parse(data, str(path))


def load_cluster(name_or_path: str) -> Cluster:
    """Load a preset by name (``dgx-a100``, ..., ``local``) or a cluster file by path.

    Raises:
        NotFoundError: neither a preset nor an existing file; the message lists the presets.
        ConfigError: the file is invalid.
    """
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml", ".json") and path.is_file():
        return read_cluster_file(path)
    if name_or_path == "local":
        return local_cluster()
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if preset.is_file():
        return read_cluster_file(preset)
    raise NotFoundError(
        f"unknown cluster {name_or_path!r}: not a preset ({', '.join(list_presets())}) nor a YAML/JSON file"
    )


def save_cluster(cluster: Cluster, path: Path) -> None:
    """Write a cluster as YAML (or JSON when the path ends in .json) that :func:`load_cluster` reads."""
    data = cluster.model_dump(mode="json", exclude_none=True)
    text = json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
