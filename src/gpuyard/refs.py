"""References parsed in one place: datasets (``NAME@VERSION#split=a,b``), models, ``module:attr``.

- :class:`DatasetRef`: ``NAME``, ``NAME@latest``, ``NAME@VERSION`` (4-64 hex digits, a prefix of the
  version id) and any of them with ``#split=NAME[,NAME...]``, the splits of the version to read.
- :class:`ModelRef`: ``NAME`` (the newest version), ``NAME:VERSION`` (a positive integer) or
  ``NAME@ALIAS`` (an alias or a stage name).
- :func:`import_ref`: ``package.module:function`` (or ``:Class.method``), the one loader of user code
  named in specs (entry points, trainers, factories, pipeline stages).

Only the syntax is checked here; whether the dataset, version, split or model exists is for the
catalog and the registry to say.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuyard.errors import ConfigError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
_VERSION_RE = re.compile(r"[0-9a-f]{4,64}")
_SPLIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SELECTION_FORM = "NAME[@VERSION]#split=NAME[,NAME...]"


def check_dataset_name(name: str) -> str:
    """Return ``name`` or raise ConfigError when it is not a valid dataset name."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(
            f"dataset name {name!r}: use letters, digits, '.', '_' or '-' (at most 128, no '@' or '/')"
        )
    return name


def check_model_name(name: str) -> str:
    """Return ``name`` or raise ConfigError when it is not a valid model name."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(f"model name {name!r}: use letters, digits, '.', '_' or '-' (at most 128)")
    return name


@dataclass(frozen=True)
class DatasetRef:
    """A dataset version, or some splits of it.

    Attributes:
        name: the dataset.
        version: a version id or a unique prefix of one; None for the newest (``@latest``).
        splits: the selected splits in the order given, or None for every row.
    """

    name: str
    version: str | None = None
    splits: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, text: str) -> DatasetRef:
        """Parse ``NAME[@VERSION|@latest][#split=a,b]``.

        Raises:
            ConfigError: a bad name, version or split selection; the message names ``text``.
        """
        base = cls.parse_base(text)
        if not cls.has_selection(text):
            return base
        key, eq, value = text.partition("#")[2].partition("=")
        names = tuple(n.strip() for n in value.split(","))
        if key.strip() != "split" or not eq or not all(_SPLIT_NAME.fullmatch(n) for n in names):
            raise ConfigError(f"dataset reference {text!r}: use {SELECTION_FORM}")
        if len(set(names)) != len(names):
            raise ConfigError(f"dataset reference {text!r}: a split is named twice")
        return base.with_splits(names)

    @classmethod
    def parse_base(cls, text: str) -> DatasetRef:
        """Parse ``text`` without its ``#...`` part, which is left unchecked (a caller replacing it).

        Raises:
            ConfigError: a bad name or version.
        """
        name, _, version = text.partition("#")[0].partition("@")
        check_dataset_name(name)
        if version in ("", "latest"):
            return cls(name)
        if not _VERSION_RE.fullmatch(version):
            raise ConfigError(f"dataset reference {text!r}: version must be 4-64 hex digits or 'latest'")
        return cls(name, version)

    @staticmethod
    def has_selection(text: str) -> bool:
        """Whether ``text`` has a ``#...`` part, well formed or not (:meth:`parse` checks it)."""
        return "#" in text

    @property
    def base(self) -> DatasetRef:
        """This reference without its split selection."""
        return DatasetRef(self.name, self.version)

    def with_splits(self, splits: Sequence[str] | None) -> DatasetRef:
        """This reference selecting ``splits`` instead of its own selection (None: every row)."""
        return DatasetRef(self.name, self.version, None if splits is None else tuple(splits))

    def __str__(self) -> str:
        text = self.name if self.version is None else f"{self.name}@{self.version}"
        return text if self.splits is None else f"{text}#split={','.join(self.splits)}"


@dataclass(frozen=True)
class ModelRef:
    """A registered model version: the newest, a version number, or an alias (or stage name).

    Attributes:
        name: the model.
        version: a version number, or None.
        alias: an alias or stage name, or None (never set together with ``version``).
    """

    name: str
    version: int | None = None
    alias: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        """Parse ``NAME``, ``NAME:VERSION`` or ``NAME@ALIAS``.

        Raises:
            ConfigError: a bad name, a version that is not a positive integer, or a bad alias.
        """
        if "@" in text:
            name, _, alias = text.partition("@")
            if not ALIAS_RE.match(alias):
                raise ConfigError(f"model reference {text!r}: alias {alias!r} must start with a letter")
            return cls(check_model_name(name), alias=alias)
        if ":" in text:
            name, _, version = text.rpartition(":")
            if not version.isdigit() or int(version) < 1:
                raise ConfigError(f"model reference {text!r}: version must be a positive integer")
            return cls(check_model_name(name), version=int(version))
        return cls(check_model_name(text))

    @property
    def selector(self) -> int | str | None:
        """The version number, the alias, or None for the newest version."""
        return self.version if self.version is not None else self.alias

    def __str__(self) -> str:
        if self.alias is not None:
            return f"{self.name}@{self.alias}"
        return self.name if self.version is None else f"{self.name}:{self.version}"


def import_ref(ref: str, field: str = "reference") -> Callable[..., Any]:
    """Import ``package.module:attr`` (``attr`` may be dotted) and return it; it must be callable.

    Args:
        ref: the reference.
        field: what names it, for the message (``model.entrypoint``, ``trainer``).

    Raises:
        ConfigError: a malformed reference, a module that fails to import (its own exception is
            named), a missing attribute, or one that is not callable; the message names ``field``.
    """
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{field}: {ref!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the named module's: report it
        raise ConfigError(
            f"{field}: cannot import module {module_name!r} for {ref!r}: {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{field}: module {module_name!r} has no attribute {attr!r} (from {ref!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{field}: {ref!r} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]
