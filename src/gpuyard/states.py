"""The state vocabularies of runs, training, deployments and model versions, as string enums.

Each member's value is the string the state store, the JSON documents and the command line have
always carried, so a member compares equal to (and serialises as) that string. Job states are
:class:`gpuyard.scheduler.spec.JobState`, next to their allowed transitions.
"""

from __future__ import annotations

import enum
import sys

from gpuyard import exitcodes
from gpuyard.errors import ConfigError

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10 has no StrEnum

    class StrEnum(str, enum.Enum):
        """A string enum whose ``str()`` and format are the value, as Python 3.11's."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


__all__ = ["DeploymentState", "ModelStage", "RunStatus", "StrEnum", "TrainOutcome", "straggler_measured"]


class RunStatus(StrEnum):
    """A tracked run's status (the ``status`` of ``gpuyard runs ls``)."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    PRUNED = "pruned"  # a search trial stopped early by its pruner
    PREEMPTED = "preempted"  # stopped to give its GPUs back; a resume continues the same run
    DIVERGED = "diverged"  # the loss became NaN or infinite

    @classmethod
    def ended_as(cls, status: str) -> RunStatus:
        """The status a run ends with for ``status``: a run status other than ``running``, or a
        :class:`TrainOutcome` (a trainer handed a tracker closes it with its outcome).

        Raises:
            ConfigError: any other word.
        """
        if status in _OUTCOMES:
            return TrainOutcome(status).run_status
        if status in _ENDED:
            return cls(status)
        raise ConfigError(f"run status {status!r} must be one of {', '.join(_ENDED)}")


class TrainOutcome(StrEnum):
    """How a training run ended, as its ranks report it to the launcher (``status.json``, read and
    written only through :mod:`gpuyard.train.status`)."""

    COMPLETED = "completed"
    EARLY_STOPPED = "early_stopped"
    PREEMPTED = "preempted"
    DIVERGED = "diverged"
    # A rank stopped on a failure a restart would repeat (a full disk, a configuration error): the
    # trainer's fit() raises rather than return it; the ranks write it for the launcher.
    FAILED = "failed"

    @classmethod
    def parse(cls, value: object) -> TrainOutcome:
        """The outcome named ``value``.

        Raises:
            ValueError: one line naming the value and the known outcomes (a status.json from
                another version, or not written by a rank).
        """
        if isinstance(value, str) and value in _OUTCOMES:
            return cls(value)
        known = ", ".join(o.value for o in cls)
        raise ValueError(f"status {str(value)[:80]!r} is not a training outcome ({known})")

    @property
    def run_status(self) -> RunStatus:
        """The tracked run's status for this outcome (completed and early-stopped runs are finished)."""
        if self in (TrainOutcome.COMPLETED, TrainOutcome.EARLY_STOPPED):
            return RunStatus.FINISHED
        return RunStatus(self.value)

    @property
    def exit_code(self) -> int:
        """The process exit code a worker and the launcher end with (see :mod:`gpuyard.exitcodes`; a
        failure that was a configuration error ends with the usage code instead, as the launcher says)."""
        return _EXIT_CODES[self]


_OUTCOMES = frozenset(TrainOutcome)
_ENDED = tuple(s.value for s in RunStatus if s is not RunStatus.RUNNING)
_EXIT_CODES = {
    TrainOutcome.COMPLETED: exitcodes.SUCCESS,
    TrainOutcome.EARLY_STOPPED: exitcodes.SUCCESS,
    TrainOutcome.PREEMPTED: exitcodes.PREEMPTED,
    TrainOutcome.DIVERGED: exitcodes.DIVERGED,
    TrainOutcome.FAILED: exitcodes.UNRECOVERABLE,
}


class DeploymentState(StrEnum):
    """A deployment's status."""

    STARTING = "starting"  # written before its processes start; again while its job waits to be placed
    RUNNING = "running"  # its /ready answered
    STOPPED = "stopped"  # undeployed
    FAILED = "failed"
    DEAD = "dead"  # its process or job went away without marking it

    @property
    def active(self) -> bool:
        """Whether the deployment is meant to be serving (starting or running)."""
        return self in (DeploymentState.STARTING, DeploymentState.RUNNING)


class ModelStage(StrEnum):
    """A model version's stage; ``NAME@STAGE`` resolves to the newest version in it."""

    NONE = "none"
    STAGING = "staging"
    PRODUCTION = "production"
    ARCHIVED = "archived"


def straggler_measured(cause: str, slowdown: float) -> str:
    """What a straggler's ``slowdown`` measured, in words: its own work's time against the other ranks'
    median (cause data or compute), or, for cause ``link``, its wait in collectives against theirs
    (no rank was slower at its own work: the rank is not slower, it waits longer)."""
    if cause == "link":
        return (
            f"it waits {slowdown:.2f}x as long in collectives as the other ranks' median while no rank "
            "is slower at its own work (its link or transfers are suspect)"
        )
    return f"its own work ({cause} the larger excess) takes {slowdown:.2f}x the other ranks' median"
