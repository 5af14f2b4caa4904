"""Job specs (YAML or HTTP, validated by pydantic) and job states with their allowed transitions."""

from __future__ import annotations

import enum
import getpass
import shlex
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuyard.errors import ConfigError, NotFoundError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class JobState(str, enum.Enum):
    """Where a job is in its life."""

    QUEUED = "queued"
    SCHEDULED = "scheduled"  # GPUs chosen, process being launched
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"  # stopped to give GPUs back; goes to queued again at once

    @property
    def terminal(self) -> bool:
        """True when the job will never run again."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.SCHEDULED, JobState.CANCELLED, JobState.FAILED}),
    JobState.SCHEDULED: frozenset({JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED, JobState.QUEUED}
    ),
    JobState.PREEMPTED: frozenset({JobState.QUEUED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class Resources(BaseModel):
    """What a job needs, all at once."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(0, ge=0, le=65536, description="GPUs (0: a CPU-only job)")
    gpu_type: str | None = Field(None, description="required GPU type, e.g. A100-80GB; any when absent")
    cpus: int = Field(1, ge=1, le=4096, description="CPU slots (placed on for CPU-only jobs)")
    memory_gb: float | None = Field(None, gt=0, description="host memory, recorded for the executor")


class JobSpec(BaseModel):
    """A job as a user writes it (YAML) or posts it (HTTP)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME_PATTERN)
    command: list[str] | None = Field(None, description="argv to run (a string is split like a shell)")
    train: str | None = Field(None, description="training spec: runs `gpuyard train SPEC --nproc N`")
    nproc: int | None = Field(None, ge=1, le=1024, description="processes for train (default: GPUs or 1)")
    resources: Resources = Field(default_factory=lambda: Resources.model_validate({}))
    team: str = Field("default", pattern=NAME_PATTERN)
    user: str = Field(default_factory=lambda: _whoami(), pattern=NAME_PATTERN)
    priority: int = Field(0, ge=-1000, le=1000)
    max_restarts: int = Field(0, ge=0, le=100, description="re-runs after a failure (not preemptions)")
    checkpoint_dir: str | None = Field(None, description="exported as GPUYARD_CHECKPOINT_DIR")
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return shlex.split(value)
        return value

    @model_validator(mode="after")
    def _one_of(self) -> JobSpec:
        if (self.command is None) == (self.train is None):
            raise ValueError("give exactly one of command or train")
        if self.command is not None and not self.command:
            raise ValueError("command is empty")
        return self


def _whoami() -> str:
    try:
        return getpass.getuser() or "user"
    except (KeyError, OSError):
        return "user"


def format_validation(err: ValidationError, where: str) -> str:
    """One line naming each bad field, e.g. ``job.yaml: resources.gpus: must be >= 0``."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "spec"
        parts.append(f"{loc}: {e['msg']}")
    return f"{where}: " + "; ".join(parts)


def parse_spec(data: Any, where: str = "job spec") -> JobSpec:
    """Validate a job spec from a mapping.

    Raises:
        ConfigError: naming every invalid field.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation(exc, where)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec YAML file.

    Raises:
        NotFoundError: no such file.
        ConfigError: the YAML is malformed or a field is invalid (named).
    """
    path = Path(path)
    if not path.is_file():
        raise NotFoundError(f"job spec {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"job spec {path}: not valid YAML: {exc}") from None
    return parse_spec(data, str(path))


def parse_team_weights(items: list[str]) -> dict[str, float]:
    """Parse ``TEAM`` or ``TEAM=WEIGHT`` options into quotas (weight 1 by default).

    Raises:
        ConfigError: a weight is not a positive number.
    """
    weights: dict[str, float] = {}
    for item in items:
        team, _, weight = item.partition("=")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"team {item!r}: weight {weight!r} is not a number") from None
        if not team or value <= 0:
            raise ConfigError(f"team {item!r}: expected TEAM=WEIGHT with a weight > 0")
        weights[team] = value
    return weights
