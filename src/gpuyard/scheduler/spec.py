"""Job specs (YAML or HTTP, validated by pydantic) and job states with their allowed transitions."""

from __future__ import annotations

import getpass
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.privileged import job_env_refusal
from gpuyard.states import StrEnum
from gpuyard.textfiles import load_yaml

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"

# What a spec may carry. Linux refuses one argument longer than MAX_ARG_STRLEN (128 KiB) and an argv
# plus environment over ARG_MAX (2 MiB by default): a spec within these bounds can be launched.
MAX_ARG_CHARS = 128 * 1024
MAX_ARGS = 4096
MAX_ENV = 1024
MAX_ENV_NAME = 256
MAX_COMMAND_CHARS = 1024 * 1024  # argv and environment together (and a command given as one string)
MAX_PATH_CHARS = 4096  # PATH_MAX: workdir, checkpoint_dir, train
MAX_COUNT = 1_000_000  # GPUs, parallel degrees, ...
MAX_TOKENS = 10_000_000  # sequence lengths, global batch, vocabulary, hidden sizes

Arg = Annotated[str, Field(max_length=MAX_ARG_CHARS)]
EnvName = Annotated[str, Field(min_length=1, max_length=MAX_ENV_NAME)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]


class JobState(StrEnum):
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
    """What a job needs, all at once.

    Whole GPUs (``gpus: 2``), part of one GPU (``gpus: 0.25`` and/or ``gpu_memory_gb: 20``: a share,
    see docs/scheduler.md on its isolation) or MIG slices (``mig: 1g.10gb``, ``slices: 2``). A
    fractional ``gpus`` is stored as ``gpu_fraction`` (``gpus`` stays the whole-GPU count, 0).
    An elastic job gives a range, ``gpus: {min: 2, max: 8}``: stored as ``gpus`` (the minimum, what
    admission and policies use) and ``gpus_max``; see :mod:`gpuyard.scheduler.elastic`.
    """

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(0, ge=0, le=65536, description="GPUs (0: a CPU-only job); 0 < gpus < 1: a share")
    gpus_max: int | None = Field(
        None, ge=1, le=65536, description="elastic: the most GPUs, gpus the fewest (gpus: {min: 2, max: 8})"
    )
    gpu_fraction: float | None = Field(
        None, gt=0, lt=1, description="share of one GPU's compute (what gpus: 0.25 becomes)"
    )
    gpu_memory_gb: float | None = Field(
        None, gt=0, le=4096, description="GPU memory (GiB) of a share of one GPU"
    )
    mig: str | None = Field(None, max_length=20, description="MIG profile, e.g. 1g.10gb (A100, H100)")
    slices: int | None = Field(None, ge=1, le=64, description="MIG slices of that profile (default 1)")
    gpu_type: str | None = Field(
        None, max_length=100, description="required GPU type, e.g. A100-80GB; any when absent"
    )
    cpus: int = Field(1, ge=1, le=4096, description="CPU slots (placed on for CPU-only jobs)")
    memory_gb: float | None = Field(
        None, gt=0, le=1_048_576, description="host memory, recorded for the executor"
    )

    @field_validator("gpus", mode="before")
    @classmethod
    def _whole_or_share(cls, value: Any) -> Any:
        if isinstance(value, dict):  # not turned into gpus/gpus_max by _range: malformed
            raise ValueError(
                "an elastic range is {min: N, max: M} with whole numbers 1 <= N <= M <= 65536, got "
                f"{_short(value)}"
            )
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, float) and value > 1:
            raise ValueError(
                f"{value:g} GPUs: above 1 only whole GPUs (a share is part of one GPU: 0 < gpus < 1)"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _range(cls, data: Any) -> Any:
        # gpus: {min: 2, max: 8} becomes gpus: 2, gpus_max: 8; a malformed range is left for the
        # gpus field validator, so the error names resources.gpus.
        if isinstance(data, dict) and isinstance(data.get("gpus"), dict):
            rng = data["gpus"]
            low, high = rng.get("min"), rng.get("max")
            whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high))
            if set(rng) == {"min", "max"} and whole and 1 <= low <= high <= 65536:
                if data.get("gpus_max") is not None:
                    raise ValueError("give the range once: gpus: {min: 2, max: 8} or gpus and gpus_max")
                data = {**data, "gpus": low, "gpus_max": high}
        return data

    @model_validator(mode="before")
    @classmethod
    def _fraction(cls, data: Any) -> Any:
        # gpus: 0.25 is a share: it becomes gpu_fraction, and gpus (whole GPUs) 0.
        if isinstance(data, dict):
            value = data.get("gpus")
            if isinstance(value, float) and 0 < value < 1:
                if data.get("gpu_fraction") is not None:
                    raise ValueError("give the share once: gpus: 0.25 or gpu_fraction: 0.25")
                data = {**data, "gpus": 0, "gpu_fraction": value}
        return data

    @field_validator("gpus_max")
    @classmethod
    def _max_above_min(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        gpus = info.data.get("gpus")
        if not gpus:
            raise ValueError("an elastic range needs whole GPUs: gpus: {min: 2, max: 8}")
        if value < gpus:
            raise ValueError(f"{value} is below the minimum gpus: {gpus}")
        return None if value == gpus else value  # a range of one size is a rigid job

    @field_validator("gpu_fraction", "gpu_memory_gb")
    @classmethod
    def _share_alone(cls, value: float | None, info: ValidationInfo) -> float | None:
        gpus = info.data.get("gpus")
        if value is not None and gpus:
            raise ValueError(f"a share is part of one GPU; it cannot go with gpus: {gpus} (whole GPUs)")
        return value

    @field_validator("mig")
    @classmethod
    def _mig_profile(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        from gpuyard.hardware.mig import PROFILE_NAMES

        if value not in PROFILE_NAMES:
            raise ValueError(f"{value!r} is not an A100/H100 MIG profile; known: {', '.join(PROFILE_NAMES)}")
        d = info.data
        if d.get("gpus") or d.get("gpu_fraction") is not None or d.get("gpu_memory_gb") is not None:
            raise ValueError("MIG slices go alone, without gpus, gpu_fraction or gpu_memory_gb")
        return value

    @field_validator("slices")
    @classmethod
    def _slices_of_mig(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("mig"):
            raise ValueError("counts MIG slices; give mig: PROFILE with it")
        return value

    @property
    def elastic(self) -> bool:
        """Whether the job may run on any GPU count from ``gpus`` to ``gpus_max``."""
        return self.gpus_max is not None

    @property
    def shared(self) -> bool:
        """Whether the job asks for part of a GPU or MIG slices rather than whole GPUs."""
        return self.mig is not None or self.gpu_fraction is not None or self.gpu_memory_gb is not None


class ModelDims(BaseModel):
    """A transformer by its dimensions (what `gpuyard plan --model FILE` reads)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("custom", max_length=100)
    layers: int = Field(..., gt=0, le=100_000)
    hidden: int = Field(..., gt=0, le=MAX_TOKENS)
    heads: int = Field(..., gt=0, le=100_000)
    kv_heads: int | None = Field(None, gt=0, le=100_000, description="key/value heads (default: heads)")
    ffn_hidden: int = Field(..., gt=0, le=MAX_TOKENS)
    vocab: int = Field(..., gt=0, le=MAX_TOKENS)
    seq_len: int = Field(2048, gt=0, le=MAX_TOKENS)
    gated_mlp: bool = False
    tied_embeddings: bool = False
    experts: int = Field(0, ge=0, le=100_000)
    top_k: int = Field(1, ge=1, le=100_000)

    @model_validator(mode="after")
    def _shape(self) -> ModelDims:
        kv = self.kv_heads or self.heads
        if self.hidden % self.heads or self.heads % kv:
            raise ValueError(
                f"heads={self.heads} must divide hidden={self.hidden} and be a multiple of kv_heads"
            )
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        return self


class LayoutSpec(BaseModel):
    """Parallel layout knobs as `gpuyard plan --json` prints a plan (its figures are ignored)."""

    model_config = ConfigDict(extra="ignore")

    tp: Count | None = None
    pp: Count | None = None
    dp: Count | None = None
    cp: Count | None = None
    micro_batch: int | None = Field(None, ge=1, le=MAX_TOKENS)
    virtual_stages: Count | None = None
    recompute: Literal["none", "selective", "full"] | None = None
    zero: Literal[0, 1, 2, 3] | None = None
    sequence_parallel: bool | None = None
    ep: Count | None = None


class WorkloadSpec(BaseModel):
    """What a training job runs, so fabric-aware placement can predict its step time per placement."""

    model_config = ConfigDict(extra="forbid")

    model: str | ModelDims = Field(
        ..., description="a fabric model preset (llama3-8b, ...) or its dimensions"
    )
    global_batch: int = Field(..., ge=1, le=MAX_TOKENS, description="sequences per step")
    seq_len: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="tokens per sequence (default: the model's)"
    )
    layout: LayoutSpec | None = Field(None, description="knobs held; the rest chosen by the planner")
    steps: int | None = Field(
        None, ge=1, le=10**12, description="training steps it runs, for its predicted run time"
    )

    @field_validator("model")
    @classmethod
    def _preset_name(cls, value: str | ModelDims) -> str | ModelDims:
        if isinstance(value, str) and len(value) > 100:
            raise ValueError(f"a preset name has at most 100 characters, got {len(value)}")
        return value


class JobSpec(BaseModel):
    """A job as a user writes it (YAML) or posts it (HTTP)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME_PATTERN)
    command: list[Arg] | None = Field(
        None, max_length=MAX_ARGS, description="argv to run (a string is split like a shell)"
    )
    train: str | None = Field(
        None, max_length=MAX_PATH_CHARS, description="training spec: runs `gpuyard train SPEC --nproc N`"
    )
    nproc: int | None = Field(None, ge=1, le=1024, description="processes for train (default: GPUs or 1)")
    resources: Resources = Field(default_factory=lambda: Resources.model_validate({}))
    team: str = Field("default", pattern=NAME_PATTERN)
    user: str = Field(default_factory=lambda: _whoami(), pattern=NAME_PATTERN)
    priority: int = Field(0, ge=-1000, le=1000)
    max_restarts: int = Field(0, ge=0, le=100, description="re-runs after a failure (not preemptions)")
    time_limit_min: int | None = Field(
        None,
        ge=1,
        le=525600,
        description="wall-clock limit of one attempt, minutes; enforced by Slurm (gpuyard server --slurm)",
    )
    checkpoint_dir: str | None = Field(
        None, max_length=MAX_PATH_CHARS, description="exported as GPUYARD_CHECKPOINT_DIR"
    )
    env: dict[EnvName, Arg] = Field(default_factory=dict, max_length=MAX_ENV)
    workdir: str | None = Field(None, max_length=MAX_PATH_CHARS)
    workload: WorkloadSpec | None = Field(None, description="model and batch, for fabric-aware placement")
    on_straggler: Literal["report", "restart"] = Field(
        "report",
        description="when a rank stays slower: report it (an event on the job), or also restart the job "
        "without that rank's node when another placement of its size is free now",
    )

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            if len(value) > MAX_COMMAND_CHARS:
                raise ValueError(f"at most {MAX_COMMAND_CHARS} characters, got {len(value)}")
            return split_command(value)
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        # The job's environment reaches the job only, never a program the server runs as itself (see
        # gpuyard.privileged); names that would steer such a program, or gpuyard's own, are refused.
        for name in value:
            why = job_env_refusal(name)
            if why:
                raise ValueError(f"{_short(name, 60)}: {why}")
        return value

    @model_validator(mode="after")
    def _one_of(self) -> JobSpec:
        if (self.command is None) == (self.train is None):
            raise ValueError("give exactly one of command or train")
        if self.command is not None and not self.command:
            raise ValueError("command is empty")
        size = sum(map(len, self.command or ())) + sum(len(k) + len(v) + 2 for k, v in self.env.items())
        if size > MAX_COMMAND_CHARS:
            raise ValueError(f"command and env hold {size} characters together; at most {MAX_COMMAND_CHARS}")
        layout = self.workload.layout if self.workload else None
        if self.resources.elastic:
            if self.nproc is not None:
                raise ValueError("nproc: an elastic job runs one process per GPU it gets; leave nproc out")
            if layout is not None and layout.dp is not None:
                raise ValueError(
                    "workload.layout.dp: an elastic job changes its data-parallel size; leave dp out"
                )
        if layout is not None and layout.dp is not None:
            used = (layout.tp or 1) * (layout.pp or 1) * layout.dp * (layout.cp or 1)
            if used != self.resources.gpus:
                raise ValueError(
                    f"workload.layout: tp x pp x dp x cp = {used}, not the {self.resources.gpus} GPUs of "
                    "resources.gpus"
                )
        return self


# One piece of a shell word: unquoted text, a '...' or "..." string, a backslash escape, or whitespace.
_PIECE = re.compile(r"""[^ \t\r\n'"\\]+|'[^']*'|"(?:[^"\\]|\\.)*"|\\.|[ \t\r\n]+|.""", re.DOTALL)
_DQ_ESCAPE = re.compile(r"""\\([\\"])""")


def split_command(text: str) -> list[str]:
    """Split ``text`` into words as :func:`shlex.split` does, in time linear in its length.

    ``shlex`` grows each word one character at a time (quadratic: a 400 KB word takes about 2 s);
    this reads whole runs of characters with one regular expression.

    Raises:
        ValueError: an unclosed quote or a trailing backslash.
    """
    words: list[str] = []
    parts: list[str] = []
    in_word = False
    for match in _PIECE.finditer(text):
        piece = match.group()
        first = piece[0]
        if first in " \t\r\n":
            if in_word:
                words.append("".join(parts))
                parts, in_word = [], False
            continue
        if first in "'\"" and len(piece) == 1:  # only the catch-all matched: the string never closes
            raise ValueError(f"No closing quotation (the {first} at character {match.start()})")
        if first == "\\" and len(piece) == 1:
            raise ValueError("No escaped character (a backslash ends the command)")
        in_word = True
        if first == "'":
            parts.append(piece[1:-1])
        elif first == '"':
            parts.append(_DQ_ESCAPE.sub(r"\1", piece[1:-1]))
        elif first == "\\":
            parts.append(piece[1])
        else:
            parts.append(piece)
    if in_word:
        words.append("".join(parts))
    return words


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    if not path.exists():
        raise NotFoundError(f"job spec {path}: no such file")
    return parse_spec(load_yaml(path, "job spec"), str(path))


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
