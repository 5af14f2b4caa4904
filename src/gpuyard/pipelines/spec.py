"""The pipeline spec (YAML): named stages in order, each a kind with inputs; outputs wired by reference.

A value ``${stage.key}`` anywhere in a stage's ``with`` is replaced by output ``key`` of the earlier
stage ``stage`` (a dataset version, a run id, a model version). A value that is exactly one
reference keeps the output's type; inside a longer string it is formatted in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuyard.errors import ConfigError
from gpuyard.textfiles import load_yaml

REF = re.compile(r"\$\{([A-Za-z0-9_-]+)\.([A-Za-z0-9_.-]+)\}")
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class StageSpec(BaseModel):
    """One stage: what it is (``uses``), its inputs (``with``) and whether its result may be reused."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str
    uses: str = Field(description="a stage kind (see gpuyard.pipelines.stages.KINDS) or module:function")
    inputs: dict[str, Any] = Field(default_factory=dict, alias="with")
    cache: bool = Field(True, description="skip the stage when its inputs are unchanged")
    cpus: int = Field(1, ge=1, le=256, description="CPU slots the stage's job asks the scheduler for")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError(f"stage name {v!r}: use letters, digits, '-' and '_' (up to 64)")
        return v


class PipelineSpec(BaseModel):
    """A pipeline: a name and its stages, run in the order written."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    stages: list[StageSpec] = Field(min_length=1)
    summary: list[str] = Field(
        default_factory=list,
        max_length=20,
        description="lines printed at the end, with ${stage.output} references (numbers to 4 digits)",
    )

    @model_validator(mode="after")
    def _refs(self) -> PipelineSpec:
        from gpuyard.pipelines.inputs import check_names
        from gpuyard.pipelines.stages import check_kind

        if not NAME.match(self.name):
            raise ValueError(f"pipeline name {self.name!r}: use letters, digits, '-' and '_' (up to 64)")
        seen: set[str] = set()
        for st in self.stages:
            if st.name in seen:
                raise ValueError(f"stage {st.name!r} appears twice")
            check_kind(st.uses, st.name)
            for ref, _key in references(st.inputs):
                if ref not in seen:
                    raise ValueError(
                        f"stage {st.name!r} refers to ${{{ref}...}}, which is not an earlier stage"
                        f" (earlier: {', '.join(sorted(seen)) or 'none'})"
                    )
            seen.add(st.name)
        for ref, _key in references(self.summary):
            if ref not in seen:
                raise ValueError(f"summary refers to ${{{ref}...}}, which is not a stage ({', '.join(seen)})")
        for st in self.stages:  # once the stages and their references are known to be sound
            check_names(st.uses, st.inputs, st.name)
        return self


def references(value: Any) -> list[tuple[str, str]]:
    """Every ``(stage, key)`` referenced in ``value`` (nested dicts and lists included)."""
    if isinstance(value, str):
        return [(m.group(1), m.group(2)) for m in REF.finditer(value)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in references(v)]
    if isinstance(value, list):
        return [r for v in value for r in references(v)]
    return []


def resolve(value: Any, outputs: dict[str, dict[str, Any]], where: str) -> Any:
    """Replace references in ``value`` by earlier stages' outputs.

    Raises:
        ConfigError: a referenced output that the stage did not produce (names what it did produce).
    """
    if isinstance(value, dict):
        return {k: resolve(v, outputs, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, outputs, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def lookup(stage: str, key: str) -> Any:
        got = outputs.get(stage, {})
        if key not in got:
            raise ConfigError(
                f"{where}: ${{{stage}.{key}}}: stage {stage!r} has no output {key!r}"
                f" (it produced: {', '.join(sorted(got)) or 'nothing'})"
            )
        return got[key]

    whole = REF.fullmatch(value)
    if whole:
        return lookup(whole.group(1), whole.group(2))
    return REF.sub(lambda m: str(lookup(m.group(1), m.group(2))), value)


def render_summary(lines: list[str], outputs: dict[str, dict[str, Any]]) -> list[str]:
    """The summary lines with references replaced by the stages' outputs (numbers to 4 significant
    digits, text with line breaks quoted; an output a stage did not produce is written ``?``)."""

    def value(m: re.Match[str]) -> str:
        got = outputs.get(m.group(1), {}).get(m.group(2), "?")
        if isinstance(got, float):
            return f"{got:.4g}"
        if isinstance(got, str):
            return got if got.isprintable() else repr(got)  # a line stays one line
        return json.dumps(got)

    return [REF.sub(value, line) for line in lines]


def parse_pipeline(doc: Any, source: str = "pipeline") -> PipelineSpec:
    """Validate a pipeline document.

    Raises:
        ConfigError: naming the source and the field (``stages.2.with: ...``).
    """
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: a pipeline is a mapping with 'name' and 'stages'")
    try:
        return PipelineSpec.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"{source}: {where}: {msg}") from exc


def load_pipeline(path: str | Path) -> PipelineSpec:
    """Read and validate a pipeline YAML file.

    Raises:
        ConfigError: a missing file, bad YAML or an invalid field.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"pipeline file {p} does not exist")
    return parse_pipeline(load_yaml(p, "pipeline file"), str(p))
