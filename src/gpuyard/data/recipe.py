"""Transform recipes: declarative steps written in YAML or built in Python, checked before any work.

Steps run in a fixed order: ``derive`` -> ``image`` -> ``text_hash`` -> ``split`` -> ``normalize`` ->
``encode`` -> ``drop``. ``augment`` is not applied here: it is stored with the version and applied on
the fly by the loader, seeded, so every epoch sees new variants without storing them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuyard.data import expr
from gpuyard.errors import ConfigError, NotFoundError


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Derive(_Step):
    """A new column computed from an expression over existing numeric columns."""

    name: str
    expr: str


class ImageFeatures(_Step):
    """Resize and/or grayscale a uint8 image column (in place, or into ``output``)."""

    column: str
    resize: tuple[int, int] | None = Field(default=None, description="(height, width)")
    grayscale: bool = False
    output: str | None = None


class TextHash(_Step):
    """Hash the tokens of a text column into ``buckets`` counts (a float32 tensor column)."""

    column: str
    buckets: int = Field(default=256, ge=2, le=1 << 20)
    output: str | None = None


class Split(_Step):
    """Assign each row to a split (random, stratified by ``column``, or by time ``column``), seeded."""

    method: Literal["random", "stratified", "time"] = "random"
    fractions: dict[str, float] = Field(default_factory=lambda: {"train": 0.8, "val": 0.1, "test": 0.1})
    column: str | None = None
    seed: int = 0
    kfold: int | None = Field(default=None, ge=2, le=100, description="add a fold column over train rows")

    @model_validator(mode="after")
    def _check(self) -> Split:
        if "train" not in self.fractions:
            raise ValueError("fractions must include 'train' (statistics are fitted on it)")
        if any(f < 0 for f in self.fractions.values()) or abs(sum(self.fractions.values()) - 1) > 1e-6:
            raise ValueError(f"fractions must be >= 0 and sum to 1, got {self.fractions}")
        if self.method != "random" and not self.column:
            raise ValueError(f"split method {self.method!r} needs a column")
        return self


class Normalize(_Step):
    """Scale numeric columns with statistics fitted on the train split (all rows when there is no split)."""

    columns: list[str]
    method: Literal["zscore", "minmax"] = "zscore"


class Encode(_Step):
    """Encode a categorical column with categories seen in the train split.

    ``ordinal``: an int32 code per row (-1 for unknown). ``onehot``: the column becomes a uint8 tensor
    column of shape (number of categories,), all zeros for unknown; the category order is in the
    manifest's fitted statistics.
    """

    column: str
    method: Literal["onehot", "ordinal"] = "onehot"


class Augment(_Step):
    """On-the-fly image augmentation applied by the loader (each a probability or a maximum magnitude)."""

    column: str
    hflip: float = Field(default=0.0, ge=0, le=1, description="probability of a horizontal flip")
    vflip: float = Field(default=0.0, ge=0, le=1, description="probability of a vertical flip")
    rotate: float = Field(default=0.0, ge=0, le=180, description="maximum rotation in degrees")
    brightness: float = Field(default=0.0, ge=0, le=1, description="maximum relative brightness change")
    contrast: float = Field(default=0.0, ge=0, le=1, description="maximum relative contrast change")
    crop_padding: int = Field(default=0, ge=0, description="pad by this much, then crop back at random")


class Recipe(BaseModel):
    """A declarative transform recipe (see the module docstring for the step order)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    derive: list[Derive] = Field(default_factory=list)
    image: list[ImageFeatures] = Field(default_factory=list)
    text_hash: list[TextHash] = Field(default_factory=list)
    split: Split | None = None
    normalize: list[Normalize] = Field(default_factory=list)
    encode: list[Encode] = Field(default_factory=list)
    drop: list[str] = Field(default_factory=list)
    augment: Augment | None = None

    @property
    def needs_fit(self) -> bool:
        """True when some step fits statistics on the train split."""
        return bool(self.normalize or self.encode)

    def check(self, kinds: dict[str, str]) -> dict[str, str]:
        """Check every column reference against ``kinds`` (column -> kind); return the output columns.

        Raises:
            ConfigError: a step names an unknown column or one of the wrong kind.
        """
        cols = dict(kinds)

        def need(col: str, step: str, allowed: tuple[str, ...] | None = None) -> None:
            if col not in cols:
                raise ConfigError(f"recipe {step}: unknown column {col!r} (columns: {', '.join(cols)})")
            if allowed and cols[col] not in allowed:
                raise ConfigError(
                    f"recipe {step}: column {col!r} is {cols[col]}, needs {' or '.join(allowed)}"
                )

        for d in self.derive:
            for name in sorted(expr.names(d.expr)):
                need(name, f"derive {d.name}", ("int", "float", "bool"))
            cols[d.name] = "float"
        for im in self.image:
            need(im.column, "image", ("tensor",))
            cols[im.output or im.column] = "tensor"
        for th in self.text_hash:
            need(th.column, "text_hash", ("string",))
            cols[th.output or th.column] = "tensor"
        if self.split is not None:
            if self.split.column:
                if self.split.column not in kinds:
                    raise ConfigError(
                        f"recipe split: column {self.split.column!r} must be a column of the input"
                    )
                need(self.split.column, "split")
            cols["split"] = "string"
            if self.split.kfold:
                cols["fold"] = "int"
        for n in self.normalize:
            for c in n.columns:
                need(c, "normalize", ("int", "float", "bool"))
                cols[c] = "float"
        for e in self.encode:
            need(e.column, "encode", ("string", "int", "bool"))
        for e in self.encode:
            cols[e.column] = "int" if e.method == "ordinal" else "tensor"
        for c in self.drop:
            need(c, "drop")
            del cols[c]
        if self.augment is not None:
            need(self.augment.column, "augment", ("tensor",))
        return cols

    def input_columns(self) -> list[str]:
        """Input columns that derive, image, text_hash, normalize and encode steps may read.

        Columns these steps create are listed too (harmless: a fit pass reads only what exists).
        """
        cols: set[str] = set()
        for d in self.derive:
            cols |= expr.names(d.expr)
        cols |= {im.column for im in self.image} | {th.column for th in self.text_hash}
        cols |= {c for n in self.normalize for c in n.columns} | {e.column for e in self.encode}
        return sorted(cols)

    def written_columns(self) -> set[str]:
        """What the steps create or change: derived, image and text outputs, split, fold, scaled, encoded."""
        cols = {d.name for d in self.derive}
        cols |= {im.output or im.column for im in self.image} | {
            th.output or th.column for th in self.text_hash
        }
        if self.split is not None:
            cols |= {"split", "fold"}
        cols |= {c for n in self.normalize for c in n.columns} | {e.column for e in self.encode}
        return cols

    def to_json(self) -> dict[str, Any]:
        """The form stored in manifests (defaults included, so the recipe is explicit)."""
        return self.model_dump(mode="json")


def _recipe_text(source: str | Path) -> str:
    looks_like_path = isinstance(source, Path) or ("\n" not in source and source.endswith((".yaml", ".yml")))
    if looks_like_path:
        try:
            return Path(source).read_text()
        except FileNotFoundError as exc:
            raise NotFoundError(f"recipe file {source} does not exist") from exc
    return str(source)


def load_recipe(source: str | Path | dict[str, Any]) -> Recipe:
    """A recipe from a YAML file path, YAML text, or a dict.

    Raises:
        ConfigError: unreadable YAML or an invalid field; the message names the field.
    """
    if isinstance(source, dict):
        doc: Any = source
    else:
        text = _recipe_text(source)
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"recipe {str(source)[:80]!r} is not valid YAML: {exc}") from exc
        if not isinstance(doc, dict):
            raise ConfigError(
                f"recipe {str(source)[:80]!r}: expected a mapping of steps, got {type(doc).__name__}"
            )
    try:
        return Recipe.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ConfigError(f"recipe field {where}: {err['msg']}") from exc
