"""Readers that turn a source (CSV, Parquet, JSONL, .npy/.npz, image folder) into one Arrow table.

Image folders hold one sub-folder per class. Files that cannot be decoded, or whose shape differs
from the dataset's, still become rows (zero pixels) flagged bad, so validation quarantines them with
their path and the row count adds up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from gpuyard.data.columns import tensor_array, tensor_field, with_tensor
from gpuyard.errors import ConfigError, IntegrityError, NotFoundError, one_line

FORMATS = ("csv", "parquet", "jsonl", "npy", "npz", "images")
# Suffixes the CSV and JSON readers decompress by themselves: their bytes are not text.
COMPRESSED_SUFFIXES = {".gz", ".bz2", ".zst", ".lz4", ".br"}
# Bytes looked at to tell text from binary.
SNIFF_BYTES = 64 * 1024
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
# 2-D NumPy arrays up to this width become one column per feature (tabular); wider ones a tensor column.
MAX_SPLIT_WIDTH = 1024
Progress = Callable[[str, int, int], None]


@dataclass
class SourceTable:
    """A source read into memory: the table, and rows already known bad (index -> reason)."""

    table: pa.Table
    bad: dict[int, str] = field(default_factory=dict)


def detect_format(src: Path) -> str:
    """Guess the format from a path: a folder is an image folder, otherwise the suffix decides."""
    if src.is_dir():
        return "images"
    suffix = src.suffix.lower().lstrip(".")
    fmt = {"csv": "csv", "parquet": "parquet", "pq": "parquet", "jsonl": "jsonl", "ndjson": "jsonl"}.get(
        suffix
    )
    fmt = fmt or ({"npy": "npy", "npz": "npz"}.get(suffix))
    if fmt is None:
        raise ConfigError(f"cannot tell the format of {src}; pass --format ({', '.join(FORMATS)})")
    return fmt


def read_source(
    src: Path, fmt: str, image_size: tuple[int, int] | None = None, progress: Progress | None = None
) -> SourceTable:
    """Read ``src`` in format ``fmt``.

    Raises:
        NotFoundError: ``src`` does not exist.
        ConfigError: unknown format, or a file that is not valid for its format (the message names it).
    """
    if not src.exists():
        raise NotFoundError(f"source {src} does not exist")
    if fmt not in FORMATS:
        raise ConfigError(f"format {fmt!r} unknown; use one of {', '.join(FORMATS)}")
    if fmt == "images":
        return _read_images(src, image_size, progress)
    if fmt in ("csv", "jsonl") and src.suffix.lower() not in COMPRESSED_SUFFIXES:
        check_text_file(src, fmt.upper() if fmt == "csv" else "JSON lines")
    try:
        if fmt == "csv":
            import pyarrow.csv as pcsv

            return SourceTable(pcsv.read_csv(src))
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return SourceTable(pq.read_table(src))
        if fmt == "jsonl":
            import pyarrow.json as pjson

            return SourceTable(pjson.read_json(src))
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError(f"{src} is not valid {fmt}: {one_line(str(exc))}") from exc
    return SourceTable(_read_numpy(src, fmt))


def check_text_file(path: Path, what: str) -> None:
    """Refuse a file that is not UTF-8 text (an executable, an image, a zip given as CSV or YAML).

    Looks at the first ``SNIFF_BYTES``: a NUL byte, or bytes that are not UTF-8, mean binary.

    Raises:
        ConfigError: one line naming the file, what it was given as, and the first offending offset.
        NotFoundError: no such file.
    """
    import codecs

    try:
        with path.open("rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except FileNotFoundError as exc:
        raise NotFoundError(f"{path} does not exist") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"{path} is a directory, not a {what} file") from exc
    if not head:
        raise ConfigError(f"{path} is empty (0 bytes): an empty dataset is not recorded")
    nul = head.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{path} is a binary file, not {what} text (a NUL byte at offset {nul})")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not {what} text: bytes at offset {exc.start} are not UTF-8 (binary, or another "
            "encoding: convert it to UTF-8)"
        ) from exc


def _read_numpy(src: Path, fmt: str) -> pa.Table:
    try:
        # allow_pickle=False: a .npy/.npz from elsewhere must not run code when loaded.
        loaded = np.load(src, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{src} is not a readable {fmt} file: {exc}") from exc
    arrays = {src.stem: loaded} if fmt == "npy" else {k: loaded[k] for k in loaded.files}
    lengths = {k: len(v) for k, v in arrays.items() if v.ndim >= 1}
    if not lengths or len(set(lengths.values())) != 1:
        raise ConfigError(f"{src}: arrays must share their first dimension, got {lengths}")
    fields: list[pa.Field] = []
    columns: list[pa.Array] = []
    for key, arr in arrays.items():
        if arr.ndim == 1:
            fields.append(pa.field(key, pa.from_numpy_dtype(arr.dtype)))
            columns.append(pa.array(arr))
        elif arr.ndim == 2 and arr.shape[1] <= MAX_SPLIT_WIDTH:
            width = len(str(arr.shape[1] - 1))
            for i in range(arr.shape[1]):
                fields.append(pa.field(f"{key}_{i:0{width}d}", pa.from_numpy_dtype(arr.dtype)))
                columns.append(pa.array(np.ascontiguousarray(arr[:, i])))
        else:
            tensor, spec = tensor_array(arr)
            fields.append(tensor_field(key, spec))
            columns.append(tensor)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _decode(path: Path, image_size: tuple[int, int] | None) -> tuple[np.ndarray | None, str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            mode = "L" if img.mode in ("L", "1", "I", "I;16", "F") else "RGB"
            out = img.convert(mode)
            if image_size is not None:
                out = out.resize((image_size[1], image_size[0]), Image.Resampling.BILINEAR)
            return np.asarray(out, dtype=np.uint8), mode
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None, ""


def _read_images(root: Path, image_size: tuple[int, int] | None, progress: Progress | None) -> SourceTable:
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    files = [
        (f, c.name)
        for c in classes
        for f in sorted(c.rglob("*"))
        if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise ConfigError(f"{root}: no images found (expected one folder per class holding PNG/JPEG files)")
    decoded: list[np.ndarray | None] = []
    for i, (path, _) in enumerate(files):
        arr, _mode = _decode(path, image_size)
        decoded.append(arr)
        if progress is not None and (i % 256 == 0 or i == len(files) - 1):
            progress("decode", i + 1, len(files))
    # Colour wins over grey: one RGB image makes every grey image RGB too, so shapes agree.
    if any(a is not None and a.ndim == 3 for a in decoded):
        decoded = [
            np.repeat(a[:, :, None], 3, axis=2) if a is not None and a.ndim == 2 else a for a in decoded
        ]
    shapes = Counter(a.shape for a in decoded if a is not None)
    if not shapes:
        raise IntegrityError(f"{root}: none of the {len(files)} images could be decoded")
    shape = shapes.most_common(1)[0][0]
    bad: dict[int, str] = {}
    pixels = np.zeros((len(files), *shape), dtype=np.uint8)
    for i, arr in enumerate(decoded):
        if arr is None:
            bad[i] = "image:corrupt"
        elif arr.shape != shape:
            bad[i] = "image:shape"
        else:
            pixels[i] = arr
    table = pa.table(
        {
            "path": pa.array([str(p.relative_to(root)) for p, _ in files]),
            "label": pa.array([label for _, label in files]),
        }
    )
    return SourceTable(with_tensor(table, "image", pixels), bad)
