"""The Slurm executor: gpuyard decides where a job runs, Slurm runs and confines it.

Each attempt of a gpuyard job becomes one Slurm batch job (``sbatch``), named
``gpuyard-<job>-<attempt>`` so a restarted server finds it again. The nodes gpuyard's placement chose
(topology- or fabric-aware) become ``--nodelist`` with ``--nodes`` equal to their count, so Slurm
runs the job exactly there or keeps it pending; a gang job is one allocation. The batch script runs
the job's command once per node under ``srun`` (one task per node); a training job runs
``gpuyard train --nproc <that node's GPUs> --nnodes N --rdzv <batch host>:<port> --world-size <the
job's GPUs>`` on every node, so torchrun's c10d rendezvous meets on the batch host and numbers the
ranks across nodes, and each node's launcher checks the job's world (not its own --nproc x N).

A gang placed with the same GPUs on every node asks ``--gpus-per-node``. One placed unequally (8 + 4
GPUs, or 5 + 3 + 3 on fragmented nodes) is a Slurm heterogeneous job: one component per distinct GPU
count (``sbatch`` options separated by ``:``, each with its own ``--nodes``, ``--nodelist`` and
``--gpus-per-node``), the first node's component first, and one ``srun`` step over all components
(``srun --het-group=0 ... : --het-group=1 ...``) whose tasks run ``--nproc`` of their own node's GPUs.
Slurm lists such a job once per component (``123+0``, ``123+1``); gpuyard knows it by its first
component's id, which ``scancel`` and ``scontrol`` take for the whole job. Slurm starts
heterogeneous jobs from its backfill scheduler only, so they wait for its next pass
(``SchedulerParameters=bf_interval``, 30 s by default).

Why the command-line tools rather than ``slurmrestd``: they are on every Slurm cluster (login and
controller nodes), need no JWT or REST daemon to be set up by the cluster admin, speak munge like
every other Slurm client, and their parsable output formats are stable across releases. The cost is
one process per call, which the poll below keeps to one ``squeue`` per tick for all running jobs.

State comes from ``squeue`` while the job is known to the controller (pending reason, node list),
``scontrol show job`` for a job that ended in the last ``MinJobAge`` seconds, and ``sacct`` where the
cluster keeps accounting. A job Slurm ended itself (time limit, out of memory, node failure,
preemption by Slurm, cancelled by someone else) ends in gpuyard with that reason.

What Slurm says of a job has three values, not two: active (pending, running, still ending), ended
(with Slurm's state and exit code), or unknown. A Slurm tool that fails, is refused or times out (the
controller is down or restarting) answers nothing: the job stays as it was, with its GPUs, until the
controller answers again (:class:`ExecutorUnreachable`; nothing new starts meanwhile, see
:meth:`SlurmExecutor.unavailable`). Every row Slurm gives is checked against the attempt by its job
name (``<prefix><job>-<attempt>``) and submit time, so a Slurm id reused after a controller lost its
state is never read as this attempt's. An attempt Slurm has no trace of at all ends "lost: ..." and
is not run again: it may have finished.

Stop: ``scancel --signal=TERM`` reaches the job's tasks (the batch script ``exec``s srun, which
forwards it): the job checkpoints and exits 75 as it does locally; the service kills it
(``scancel``) once its grace period is over.

The executor's parts, one concept each: :mod:`~gpuyard.scheduler.executors.slurm_script` builds an
attempt's sbatch options and batch script, :mod:`~gpuyard.scheduler.executors.slurm_poll` reads the
jobs' states, :mod:`~gpuyard.scheduler.executors.slurm_states` parses what Slurm says of a job,
:mod:`~gpuyard.scheduler.executors.slurm_nodes` the cluster's nodes and drains,
:mod:`~gpuyard.scheduler.executors.slurm_tools` runs the client tools,
:mod:`~gpuyard.scheduler.executors.slurm_config` holds partition/account settings, and
:mod:`~gpuyard.scheduler.executors.slurm_monitor` keeps gpuyard's node states in step with Slurm's.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError, StoreError
from gpuyard.scheduler.executors.base import Executor, ExecutorUnreachable, LaunchPlan
from gpuyard.scheduler.executors.isolation import JobIsolation
from gpuyard.scheduler.executors.slurm_batch import SlurmBatch
from gpuyard.scheduler.executors.slurm_config import NAME_PREFIX, SlurmConfig, instance_tag
from gpuyard.scheduler.executors.slurm_poll import SlurmPolling
from gpuyard.scheduler.executors.slurm_script import SlurmScripts

__all__ = ["SlurmConfig", "SlurmExecutor"]


class SlurmExecutor(SlurmScripts, SlurmPolling, Executor):
    """Runs gpuyard's jobs as Slurm batch jobs on the cluster the Slurm client tools reach.

    Args:
        jobs_dir: the server's folder of job files (batch scripts; logs when jobs run as the server's
            user).
        config: partition/account/QoS settings.
        isolation: with a root server, the Unix user each job runs as (``sbatch --uid``), its
            allow-listed environment and its working directory, as on the local executor.
    """

    name = "slurm"
    multi_node = True
    time_limits = True  # JobSpec.time_limit_min becomes --time

    def __init__(
        self,
        jobs_dir: Path,
        config: SlurmConfig | None = None,
        isolation: JobIsolation | None = None,
        instance: str = "",
    ) -> None:
        self.jobs_dir = Path(jobs_dir)
        # Several gpuyard stores may share one cluster, and job ids restart with each store: the Slurm
        # job name carries a short tag of the store, so a server finds its own jobs and no other's.
        self.prefix = f"{NAME_PREFIX}{instance_tag(instance)}-" if instance else NAME_PREFIX
        self.config = config or SlurmConfig()
        self.isolation = isolation
        self._addr: dict[str, str] = {}
        # Slurm id -> squeue row of this server's jobs, one squeue for all of them every STATES_TTL_S
        # (the scheduling loop polls each running job every tick).
        self._states: dict[str, dict[str, str]] = {}
        self._states_at = float("-inf")
        # Why the last squeue of all jobs got no answer ("" : it did), and since when (monotonic).
        self._down, self._down_since = "", 0.0
        # Slurm id -> (its last state seen, when: wall clock), for what a lost attempt's report says.
        self._seen: dict[str, tuple[str, float]] = {}
        # Slurm id -> since when (monotonic) its end is held back for a node that does not answer.
        self._held: dict[str, float] = {}
        self._drained_by_us: set[str] = set()
        for tool in ("sbatch", "squeue", "scancel", "scontrol", "sinfo"):
            if shutil.which(tool, path=self._env().get("PATH")) is None:
                raise ConfigError(
                    f"--slurm: {tool} is not on {self._env().get('PATH')} (install the Slurm client tools, "
                    "or give their folder as PATH under env: in --slurm-config; not the server's PATH)"
                )
        self._call(["sinfo", "-h", "-o", "%P"])  # the controller answers, or one line saying why not
        # An unequal gang runs as one step over a heterogeneous job's components, which a cluster's
        # admin may disable (srun then fails the job after Slurm allocated it).
        settings = self._call(["scontrol", "show", "config"], check=False)
        self.het_steps = "disable_hetjob_steps" not in settings

    def launch(self, plan: LaunchPlan) -> dict[str, Any]:
        """Write the script and submit it; the handle carries the Slurm job id.

        Raises:
            ConfigError: an unequal gang on a cluster that disables steps over heterogeneous jobs.
        """
        batch = SlurmBatch.of(plan.extra)
        if batch.het_groups and not getattr(self, "het_steps", True):
            split = ", ".join(f"{node}: {g.gpus_per_node}" for g in batch.het_groups for node in g.nodes)
            raise ConfigError(
                "Slurm: this cluster disables job steps over heterogeneous jobs "
                f"(SchedulerParameters=disable_hetjob_steps), so a gang placed unequally (GPUs per node "
                f"{split}) cannot run as one step (Slurm's default, enable_hetjob_steps, allows it)"
            )
        script = Path(batch.script)
        script.parent.mkdir(parents=True, exist_ok=True)
        if self.isolation is not None:
            if batch.uid is None or batch.gid is None or batch.user_name is None:
                raise StoreError(f"Slurm: job {plan.job_id}'s batch request names no user to run as")
            iso = replace(self.isolation, user=batch.user_name, uid=batch.uid, gid=batch.gid, template=None)
            folder = iso.workdir(plan.job_id)
            iso.prepare(plan.job_id, str(folder))  # the job's own 0700 folder: its log goes there
        else:
            Path(plan.log_path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.script(plan))
        # sbatch (root, with --uid) runs with the privileged allow-list only: the job's environment is
        # in the script, which runs as the job's user; nothing of it steers sbatch.
        self._check_reachable()
        before = time.time()
        try:
            out = self._call(["sbatch", "--parsable", *batch.sbatch, str(script)])
        except ExecutorUnreachable as exc:
            self._note_down(str(exc))
            raise
        slurm_id = out.strip().split(";")[0]
        if not slurm_id.isdigit():
            raise StoreError(f"Slurm: sbatch answered {out.strip()[:200]!r}, not a job id")
        single = len(plan.nodes) <= 1
        # Slurm's SubmitTime of this attempt lies in this window: a row outside it is another job.
        window = [round(before, 3), round(time.time(), 3)]
        return {
            **batch.to_extra(),
            "slurm_id": slurm_id,
            "log": plan.log_path,
            "launched": True,
            "single": single,
            "submit_window": window,
        }

    def stop(self, handle: dict[str, Any], kill: bool) -> None:
        """SIGTERM to the job's tasks (it checkpoints and exits), or with ``kill`` cancel it outright.

        Raises:
            ExecutorUnreachable: the controller did not answer (the stop was not delivered).
        """
        slurm_id = str(handle.get("slurm_id", ""))
        if not slurm_id:
            return
        self._check_reachable()  # at once while the controller is known not to answer
        if kill:
            argv = ["scancel", slurm_id]
        elif handle.get("single"):  # the batch step is the command itself (see script())
            argv = ["scancel", "--batch", "--signal=TERM", slurm_id]
        else:  # srun forwards it to every node's task
            argv = ["scancel", "--signal=TERM", slurm_id]
        # By name too: after a controller lost its state the id may be another job's now.
        name = handle.get("slurm_name")
        self._call([*argv[:-1], *([f"--name={name}"] if name else []), slurm_id], check=False)
