"""Byte sizes as people write them (``1MiB``, ``64MiB``, ``16GiB``, ``1GB``) and nccl-tests size ranges."""

from __future__ import annotations

import re

from gpuyard.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse ``"64MiB"`` -> 67108864. Binary units (KiB, MiB, K, M) are powers of 1024, KB/MB/GB of 1000.

    Raises:
        ConfigError: the text is not a number with a known unit, or it is below one byte.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}: use a number with B, KiB, MiB, GiB, KB, MB or GB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"size {text!r} is below one byte")
    return value


def parse_size_range(text: str, factor: int = 2) -> list[int]:
    """Parse ``"1KiB:256MiB"`` into sizes multiplied by ``factor`` (nccl-tests ``-b -e -f``); a lone size too.

    Raises:
        ConfigError: a bound is unreadable or the range runs backwards.
    """
    if ":" not in text:
        return [parse_size(text)]
    lo_text, hi_text = text.split(":", 1)
    lo, hi = parse_size(lo_text), parse_size(hi_text)
    if hi < lo:
        raise ConfigError(f"size range {text!r} runs backwards")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def format_size(n: float) -> str:
    """Format bytes with binary units: 1048576 -> ``"1MiB"``, 1536 -> ``"1.5KiB"``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            value = n / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{int(n)}B"
