"""What Slurm says of a job: its states, its exit codes and times, and the ExitStatus gpuyard reads from them.

The Slurm executor (:mod:`gpuyard.scheduler.executors.slurm`) asks the tools; this module only parses
their answers (``squeue``, ``scontrol -o``, ``sacct -P``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from gpuyard.scheduler.executors.base import ExitStatus

# Slurm's job states (squeue/scontrol/sacct spell them alike); those a job does not leave again.
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING"}
ACTIVE |= {"REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT", "STAGE_OUT", "STOPPED"}
# What gpuyard says of a job Slurm ended itself.
SLURM_ENDS = {
    "TIMEOUT": "time limit reached (Slurm TIMEOUT)",
    "OUT_OF_MEMORY": "out of memory (Slurm OUT_OF_MEMORY)",
    "NODE_FAIL": "a node of the job failed (Slurm NODE_FAIL)",
    "BOOT_FAIL": "a node of the job failed to boot (Slurm BOOT_FAIL)",
    "DEADLINE": "its deadline passed (Slurm DEADLINE)",
    "PREEMPTED": "preempted by Slurm (PREEMPTED)",
    "REVOKED": "revoked by Slurm federation (REVOKED)",
}


@dataclass(frozen=True)
class SlurmExit(ExitStatus):
    """An ExitStatus with Slurm's own word on the end: its state and, when Slurm ended it, why."""

    state: str = ""
    reason: str = ""

    def describe(self) -> str:
        """Slurm's reason when Slurm ended the job (time limit, OOM...), else as any exit status."""
        return self.reason or super().describe()

    @property
    def preempted(self) -> bool:
        """Preempted only when Slurm says so: an exit code 75 after a SIGTERM gpuyard did not send (an
        outside ``scancel``) is not a preemption (gpuyard's own preemptions are its stop requests)."""
        return self.state == "PREEMPTED"


def parse_kv_line(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value two`` (scontrol -o) -> dict; a value runs to the next `` Key=``."""
    out: dict[str, str] = {}
    for match in re.finditer(
        r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_:/]*=|$)", line
    ):
        out[match.group(1)] = match.group(2).strip()
    return out


def parse_exit_code(text: str) -> tuple[int, int]:
    """Slurm's ``ExitCode=code:signal`` -> (code, signal)."""
    code, _, sig = (text or "0:0").partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        return 0, 0


def parse_time(text: str) -> datetime | None:
    """Slurm's local ``2026-11-27T03:41:30`` -> an aware datetime; None for Unknown/None/N/A."""
    try:
        return datetime.fromisoformat(text).astimezone(timezone.utc)
    except (TypeError, ValueError):
        return None


def exit_from_state(state: str, exit_code: str, end: str = "", reason: str = "") -> SlurmExit:
    """The ExitStatus of a job Slurm reports ended in ``state`` with ``ExitCode=code:signal``."""
    words = state.split()
    state = words[0].rstrip("+") if words else ""
    code, sig = parse_exit_code(exit_code)
    ended = parse_time(end)
    if state in SLURM_ENDS:
        return SlurmExit(code=None, killed=True, ended_at=ended, state=state, reason=SLURM_ENDS[state])
    if state == "CANCELLED":
        # Cancelled in Slurm (scancel), by gpuyard's kill or by someone else; gpuyard's own stop
        # requests are told apart by the service. A job that exited on the signal (a checkpoint on
        # SIGTERM, exit 75) was still cancelled: not preempted, and not a success.
        by = f" by uid {words[2]}" if len(words) == 3 and words[1] == "by" else ""  # sacct's "CANCELLED by 0"
        by += f" ({reason})" if reason and reason != "None" else ""
        how = f"exit code {code}" if code else "killed" + (f" by signal {sig}" if sig else "")
        return SlurmExit(
            code=code or None,
            killed=not code,
            ended_at=ended,
            state=state,
            reason=f"cancelled in Slurm{by} ({how})",
            cancelled=True,
        )
    if sig:
        return SlurmExit(code=-sig, killed=True, ended_at=ended, state=state)
    return SlurmExit(code=code, ended_at=ended, state=state)
