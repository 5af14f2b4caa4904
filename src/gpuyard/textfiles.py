"""Users' text files (specs, policies, clusters, tables): read or refused in one line naming where.

A binary file given where text belongs (an image as a job spec, a model file as a CSV) is said to be
binary instead of failing deep in a parser; invalid YAML is ``FILE:LINE:COLUMN: problem``, the way
compilers point at a mistake, not PyYAML's multi-line report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuyard.errors import ConfigError, NotFoundError

# A NUL byte among the first bytes: what git and grep take as the sign of a binary file.
_SNIFF_BYTES = 8192


def check_text(sample: bytes, where: str | Path, what: str = "text file") -> None:
    """Refuse ``sample`` (a file's first bytes) when it looks binary.

    Raises:
        ConfigError: a NUL byte is there.
    """
    if b"\x00" in sample[:_SNIFF_BYTES]:
        raise ConfigError(f"{where}: a binary file, not a {what}")


def _read_bytes(p: Path, what: str, size: int = -1) -> bytes:
    """The first ``size`` bytes of ``p`` (all with -1), refused in one line unless text-like."""
    try:
        with p.open("rb") as fh:
            data = fh.read(size)
    except FileNotFoundError:
        raise NotFoundError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: a folder, not a {what}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read it ({exc.strerror})") from None
    check_text(data, p, what)
    return data


def _decode(data: bytes, p: Path, what: str, cut_tail: bool = False) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if cut_tail and exc.start >= len(data) - 3:  # a character cut at the end of a sample
            return data[: exc.start].decode("utf-8")
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start}); a {what} must be UTF-8") from None


def sniff_text(path: str | Path, what: str = "text file", size: int = 1 << 16) -> None:
    """Refuse ``path`` when its first ``size`` bytes are binary or not UTF-8 (a cheap look at a big file).

    Raises:
        NotFoundError: no such file.
        ConfigError: a folder, unreadable, binary, or not UTF-8 at the start (one line).
    """
    p = Path(path)
    _decode(_read_bytes(p, what, size), p, what, cut_tail=True)


def read_text(path: str | Path, what: str = "text file") -> str:
    """The UTF-8 text of ``path`` (``what`` names the kind of file in errors, e.g. ``job spec``).

    Raises:
        NotFoundError: no such file.
        ConfigError: a folder, unreadable, binary, or not UTF-8 (one line naming the file).
    """
    p = Path(path)
    return _decode(_read_bytes(p, what), p, what)


def parse_yaml(text: str, where: str | Path) -> Any:
    """Parse YAML ``text``; ``where`` (usually the file) prefixes the position of an error.

    Raises:
        ConfigError: ``WHERE:LINE:COLUMN: not valid YAML: problem``.
    """
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(where)
        problem = " ".join(str(exc.problem or exc.context or "syntax error").split())
        raise ConfigError(f"{at}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None


def load_yaml(path: str | Path, what: str = "YAML file") -> Any:
    """Read and parse a YAML file (:func:`read_text` then :func:`parse_yaml`).

    Raises:
        NotFoundError: no such file.
        ConfigError: unreadable, binary, not UTF-8, or not valid YAML (one line with the position).
    """
    return parse_yaml(read_text(path, what), path)
