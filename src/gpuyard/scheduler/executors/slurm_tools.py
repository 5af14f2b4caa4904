"""Talking to Slurm: each client tool run with the privileged allow-list, its failure read as an answer
(no such job) or as no answer (the controller is down: :class:`ExecutorUnreachable`)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from gpuyard import privileged
from gpuyard.errors import StoreError
from gpuyard.scheduler.executors.base import ExecutorUnreachable
from gpuyard.scheduler.executors.isolation import JobIsolation
from gpuyard.scheduler.executors.slurm_config import SlurmConfig

CALL_TIMEOUT_S = 30.0
# A Slurm tool's error that means the controller did not answer, not that a job is gone.
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|Connection reset|"
    r"Zero Bytes were transmitted|Communication connection failure|Transport endpoint|"
    r"standby mode|not responding|Resource temporarily unavailable|persistent connection",
    re.IGNORECASE,
)
# ... and those that mean it did answer: no such job (any more), or no accounting to ask.
_NO_TRACE = ("Invalid job id specified", "accounting storage is disabled")


class SlurmTools:
    """The Slurm executor's calls to the client tools, and the state its parts share."""

    jobs_dir: Path
    prefix: str
    config: SlurmConfig
    isolation: JobIsolation | None
    _addr: dict[str, str]
    _states: dict[str, dict[str, str]]
    _states_at: float
    _seen: dict[str, tuple[str, float]]
    _held: dict[str, float]
    _drained_by_us: set[str]

    # -- talking to Slurm ---------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        # Every Slurm tool runs with the privileged allow-list: a fixed system PATH (the tool is found
        # there, nowhere else), the server's own SLURM_CONF, nothing of any job's environment.
        conf = {"SLURM_CONF": os.environ["SLURM_CONF"]} if os.environ.get("SLURM_CONF") else {}
        return privileged.environment({**conf, **self.config.env})

    def _call(
        self, argv: list[str], check: bool = True, stdin: str | None = None, env: dict[str, str] | None = None
    ) -> str:
        try:
            proc = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=CALL_TIMEOUT_S,
                env=self._env() if env is None else env,
            )
        except subprocess.TimeoutExpired:
            raise ExecutorUnreachable(
                f"Slurm: {argv[0]} did not answer within {CALL_TIMEOUT_S:g} s (is slurmctld up?)",
                submitted=None,
            ) from None
        except OSError as exc:
            raise ExecutorUnreachable(f"Slurm: cannot run {argv[0]}: {exc.strerror or exc}") from None
        if proc.returncode != 0:
            lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
            last = lines[-1] if lines else f"exit code {proc.returncode}"
            if _UNREACHABLE.search(proc.stderr or ""):
                # Refused at connect: nothing was sent. Any other failure may have reached it.
                sent = None if not re.search(r"connect failure|Connection refused", proc.stderr) else False
                raise ExecutorUnreachable(
                    f"Slurm's controller did not answer {argv[0]}: {last}", submitted=sent
                )
            if check:
                raise StoreError(f"Slurm: {' '.join(argv[:2])} failed: {last}")
        return proc.stdout

    def _ask(self, argv: list[str]) -> str:
        """A query's answer; "" when Slurm answered that it has no such job (or no accounting).

        Raises:
            ExecutorUnreachable: any other failure: the answer is unknown, not empty.
        """
        try:
            return self._call(argv)
        except ExecutorUnreachable:
            raise
        except StoreError as exc:
            if any(word in str(exc) for word in _NO_TRACE):
                return ""
            raise ExecutorUnreachable(str(exc)) from None
