"""Data stages: ingest a source (scikit-learn's offline sets, a file, or a generator) and transform it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError
from gpuyard.pipelines.inputs import IngestInputs, TransformInputs, parse_inputs


def _sklearn_npz(name: str, out: Path, inject_bad: int) -> Path:
    """Write a scikit-learn bundled set as ``.npz`` (digits as 8x8 uint8 images, others as columns)."""
    import sklearn.datasets as skd

    if name == "digits":
        bunch: Any = skd.load_digits()
        # 0..16 intensities scaled to 0..240, stored as uint8 images (what a scanner would give).
        arrays: dict[str, np.ndarray] = {
            "image": (bunch.images * 15).astype(np.uint8),
            "label": bunch.target.astype(np.int64),
        }
    elif name in ("diabetes", "breast_cancer", "wine", "iris"):
        bunch = getattr(skd, f"load_{name}")()
        arrays = {
            str(n).replace(" ", "_"): np.asarray(bunch.data[:, i]) for i, n in enumerate(bunch.feature_names)
        }
        arrays["target"] = np.asarray(bunch.target)
    else:
        raise ConfigError(f"source sklearn:{name}: use sklearn:digits, diabetes, breast_cancer, wine or iris")
    if inject_bad:
        # Rows a careless upstream could send: a label outside the declared set. They must be
        # quarantined by validation, never trained on.
        label = "label" if "label" in arrays else "target"
        rng = np.random.default_rng(0)
        take = rng.integers(0, len(arrays[label]), inject_bad)
        arrays = {k: np.concatenate([v, v[take]]) for k, v in arrays.items()}
        arrays[label][-inject_bad:] = 99 if arrays[label].dtype.kind == "i" else -1e6
    np.savez(out, **arrays)  # type: ignore[arg-type]
    return out


def ingest_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Ingest ``source`` as a version of dataset ``name`` with validation (``checks``, ``labels``).

    Inputs: ``source`` (``sklearn:NAME``, a file or folder relative to the pipeline, or
    ``module:function(path)`` writing a file), ``name``, optional ``label_column``, ``labels``,
    ``checks`` (a ValidationSpec mapping) and ``inject_bad`` (rows with a bad label added on purpose,
    to show the quarantine).
    """
    from gpuyard.data import IngestOptions, ValidationSpec, ingest

    i = parse_inputs(IngestInputs, inputs, ctx["stage"])
    source, name, inject = i.source, i.name, i.inject_bad
    workdir = Path(ctx["workdir"])
    if source.startswith("sklearn:"):
        path = _sklearn_npz(source.split(":", 1)[1], workdir / "source.npz", inject)
    elif source.startswith("generate:"):
        from gpuyard.refs import import_ref

        kwargs = dict(i.generate_kwargs or {})
        path = Path(import_ref(source.split(":", 1)[1])(workdir / "source", **kwargs))
    else:
        path = Path(ctx["base"]) / source
    opts = IngestOptions(
        label_column=i.label_column,
        labels=i.labels,
        checks=ValidationSpec.model_validate(i.checks or {}),
    )
    v = ingest(path, name, opts)
    q = v.manifest["quarantine"]
    return {
        "dataset": v.ref,
        "rows": v.num_rows,
        "rows_in": q["rows_in"],
        "quarantined": q["rows_quarantined"],
        "by_reason": q["by_reason"],
        "report": [
            f"{v.ref}: {q['rows_in']} rows in, {v.num_rows} kept, {q['rows_quarantined']} quarantined"
            + (f" {q['by_reason']}" if q["by_reason"] else "")
            + (f" ({inject} bad rows injected on purpose)" if inject else "")
        ],
    }


def transform_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Apply a recipe (``recipe``: a mapping, or a YAML file relative to the pipeline) to ``dataset``.

    Outputs the new version and its split sizes.
    """
    from gpuyard.data import load_recipe, open_dataset, transform

    i = parse_inputs(TransformInputs, inputs, ctx["stage"])
    ref = i.dataset
    recipe = load_recipe(Path(ctx["base"]) / i.recipe if isinstance(i.recipe, str) else i.recipe)
    src = open_dataset(ref)
    # Small sets gain nothing from a process pool (the fork costs more than the work).
    engine = i.engine or ("serial" if src.num_rows < 200_000 else "pool")
    v = transform(ref, recipe, output=i.output, engine=engine)
    splits = v.manifest.get("splits") or {}
    out: dict[str, Any] = {"dataset": v.ref, "rows": v.num_rows, "splits": splits}
    lines = [f"{v.ref}: {v.num_rows} rows, splits {splits}"]
    if recipe.augment is not None:
        a = recipe.augment
        lines.append(
            f"augmentation kept in the recipe, applied by the loader: column {a.column},"
            f" rotate <= {a.rotate} deg,"
            f" brightness +-{a.brightness:.0%}"
        )
    out["report"] = lines
    return out
