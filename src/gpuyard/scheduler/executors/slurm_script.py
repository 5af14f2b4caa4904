"""One attempt as a Slurm batch job: its sbatch options (nodes, GPUs, heterogeneous components, the job's
user) and its batch script (environment, private temp space, the srun step and its rendezvous)."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuyard import privileged
from gpuyard.scheduler.executors.base import LaunchPlan, NodeSlots, gang_world_size, job_argv, job_env
from gpuyard.scheduler.executors.isolation import PRIVATE_TMP_VARS
from gpuyard.scheduler.executors.slurm_batch import HetGroup, SlurmBatch
from gpuyard.scheduler.executors.slurm_nodes import SlurmNodes
from gpuyard.scheduler.spec import JobSpec
from gpuyard.settings import NODE_ENV

# A multi-node job's rendezvous in its command line, replaced in each task by the batch host's ADDR:PORT.
RDZV_PLACEHOLDER = "@GPUYARD_RDZV@"
_FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
# Variables bash will not take from an export line (set by the shell itself).
_SHELL_READONLY = frozenset({"SHELLOPTS", "BASHOPTS", "EUID", "UID", "PPID", "GROUPS", "SHLVL", "_"})


class SlurmScripts(SlurmNodes):
    """The Slurm executor's batch jobs: what ``plan()`` decides and ``script()`` writes."""

    name: str

    # -- jobs -----------------------------------------------------------------------------------------
    def plan(self, job_id: int, spec: JobSpec, nodes: list[NodeSlots], attempt: int) -> LaunchPlan:
        """The batch job of one attempt: sbatch options, the script, its environment (nothing runs)."""
        folder = self.jobs_dir / str(job_id)
        name = f"{self.prefix}{job_id}-{attempt}"
        env = job_env(job_id, spec, attempt, ())
        env.pop("CUDA_VISIBLE_DEVICES")  # Slurm gives each node's GPUs (--gpus-per-node)
        nnodes = max(1, len(nodes))
        if not self._addr and nodes:
            self.nodes()
        first = nodes[0].node if nodes else ""
        master = self._addr.get(first, first) or "127.0.0.1"
        port = self.config.port_base + job_id % 1000
        # One group of nodes per GPU count, the first node's group first (the batch script and the
        # rendezvous are there): one group is a plain job, several are a heterogeneous job.
        groups: dict[int, list[NodeSlots]] = {}
        for n in nodes:
            groups.setdefault(len(n.gpus), []).append(n)
        rdzv = f"{master}:{port}"
        world = gang_world_size(spec, nodes)  # the ranks of all groups: each runs its own --nproc
        argvs = [
            job_argv(spec, nproc=gpus or None, nnodes=nnodes, rdzv=rdzv, world_size=world) for gpus in groups
        ]
        argv = argvs[0] if argvs else job_argv(spec, nnodes=nnodes, rdzv=rdzv)
        env.update({"MASTER_ADDR": master, "MASTER_PORT": str(port), "NNODES": str(nnodes)})
        user: str | None = None
        uid: int | None = None  # the job's user, when isolated
        gid: int | None = None
        user_name: str | None = None
        iso = self.isolation
        if iso is not None:
            iso = iso.for_job(spec.team, spec.user)
            cwd = spec.workdir or str(iso.workdir(job_id))
            env = iso.environment(env, cwd)
            if iso.switch:
                user = iso.user
            uid, gid, user_name = iso.uid, iso.gid, iso.user
            # slurmd opens the log as the job's user: in the job's own 0700 folder, which the server
            # (root) reads too.
            log_path = str(iso.workdir(job_id) / "output.log")
        else:
            cwd = spec.workdir or os.getcwd()
            log_path = str(folder / "output.log")
        res = spec.resources
        opts = [
            f"--job-name={name}",
            f"--output={log_path}",
            "--open-mode=append",
            f"--chdir={cwd}",
            # sbatch runs with the privileged allow-list (see launch), which the batch step starts
            # with; the script then sets the job's own environment. --export=NONE would have slurmd
            # load the user's login environment instead (measured: about 3 s more before the job
            # starts).
            "--export=ALL",
            "--no-requeue",  # gpuyard requeues (a new attempt), never Slurm behind its back
            "--kill-on-invalid-dep=yes",
        ]
        if user is not None:
            opts.append(f"--uid={user}")
        # What each part of the job asks for; sbatch separates a heterogeneous job's components by
        # ":" and each gets its own nodes and GPUs per node (and, to be explicit, the same limits).
        shared = []
        if res.memory_gb:
            shared.append(f"--mem={max(1, int(res.memory_gb * 1024))}M")
        limit = getattr(spec, "time_limit_min", None)
        if limit:
            shared.append(f"--time={int(limit)}")
        shared += [f"--{key}={value}" for key, value in self.config.for_team(spec.team).items()]
        parts = list(groups.items()) or [(0, [])]
        for i, (gpus, members) in enumerate(parts):
            if i:
                opts.append(":")
            opts += [
                f"--nodes={len(members) or 1}",
                "--ntasks-per-node=1",
                f"--cpus-per-task={max(1, res.cpus)}",
            ]
            if members:
                opts.append(f"--nodelist={','.join(n.node for n in members)}")
            if gpus:
                opts.append(f"--gpus-per-node={gpus}")
            opts += shared
        het = len(parts) > 1
        batch = SlurmBatch(
            slurm_name=name,
            sbatch=tuple(opts),
            script=str(folder / f"attempt-{attempt}.sbatch"),
            rdzv=rdzv,
            addrs={n.node: self._addr.get(n.node, n.node) for n in nodes},
            user=user,
            isolated=iso is not None,
            uid=uid,
            gid=gid,
            user_name=user_name,
            het_groups=tuple(HetGroup(tuple(n.node for n in m), g) for g, m in parts) if het else (),
            het_argv=tuple(tuple(a) for a in argvs) if het else (),
        )
        return LaunchPlan(
            job_id=job_id,
            attempt=attempt,
            argv=argv,
            env=env,
            cwd=cwd,
            log_path=log_path,
            nodes=nodes,
            executor=self.name,
            extra=batch.to_extra(),
        )

    def script(self, plan: LaunchPlan) -> str:
        """The batch script: the job's environment, then its command.

        On one node the batch step runs the command itself (``exec``: no job step to set up, which
        costs a step launch, about a second); on several nodes it runs it once per node under srun.
        """
        batch = SlurmBatch.of(plan.extra)
        lines = ["#!/bin/bash", f"# gpuyard job {plan.job_id}, attempt {plan.attempt}"]
        # The first line that is not a comment (an export: GPUYARD_JOB_ID at least) ends sbatch's
        # reading of #SBATCH lines, so no value of the job's (one may hold a newline) is an option.
        for key, value in sorted(self._script_env(plan, batch).items()):
            lines.append(f"export {key}={shlex.quote(value)}")
        # Private temp space and compiler caches in the job's own folder (0700), a fresh one per
        # attempt, the earlier attempts' removed (as the job's user): a shared /tmp never holds them.
        tmp = shlex.quote(str(Path(plan.log_path).parent / ".tmp"))
        lines.append(f'rm -rf {tmp}-*; GPUYARD_TMP={tmp}-"$SLURM_JOB_ID"; mkdir -m 700 -p "$GPUYARD_TMP"')
        for key, sub in PRIVATE_TMP_VARS.items():
            if key not in plan.env:  # the job's own choice, if it made one
                lines.append(f'export {key}="$GPUYARD_TMP{"/" + sub if sub else ""}"')
        if len(plan.nodes) <= 1:
            lines.append(f'export {NODE_ENV}="$SLURMD_NODENAME"')
            lines.append("exec " + " ".join(shlex.quote(x) for x in plan.argv))
            return "\n".join(lines) + "\n"
        # The rendezvous is on the node running this script (Slurm's batch host: the first node of the
        # allocation in Slurm's node order, not necessarily the first one placed), at a port free there
        # when the job starts. A port derived from the job id would collide with any other job on the
        # same first node whose id differs by 1000, and with whatever else listens there. The batch
        # host's address is its NodeAddr, as for every node (SLURMD_NODENAME names it); each task puts
        # ADDR:PORT where the command has the placeholder. If no Python can pick a port, the id-derived
        # one is used.
        if batch.addrs:
            lines.append('case "$SLURMD_NODENAME" in')
            for node, addr in sorted(batch.addrs.items()):
                lines.append(f"  {shlex.quote(node)}) MASTER_ADDR={shlex.quote(addr)} ;;")
            lines.append("esac")
            lines.append("export MASTER_ADDR")
        fallback = plan.env.get("MASTER_PORT", "29500")
        pick = f"{shlex.quote(sys.executable)} -c {shlex.quote(_FREE_PORT)}"
        lines.append(f"MASTER_PORT=$({pick}) || MASTER_PORT={fallback}")
        lines.append("export MASTER_PORT")
        # Each node's task learns its node's scheduler name from Slurm (straggler reports name it).
        inner = (
            f'export {NODE_ENV}="$SLURMD_NODENAME"; '
            f'a=(); for x in "$@"; do a+=("${{x//{RDZV_PLACEHOLDER}/$MASTER_ADDR:$MASTER_PORT}}"); done; '
            'exec "${a[@]}"'
        )
        task = ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL", "bash", "-c", inner, "gpuyard"]
        rdzv = batch.rdzv

        def placed(argv: Sequence[str]) -> list[str]:
            return [RDZV_PLACEHOLDER if rdzv and x == rdzv else x for x in argv]

        het_argv = batch.het_argv
        if not het_argv:
            srun = ["srun", *task, *placed(plan.argv)]
        else:
            # A heterogeneous job: one step over all its components (srun's "A : B"), each component's
            # nodes running their own command (a training job's --nproc is that node's GPUs). Slurm
            # numbers the step's nodes and tasks across components (SLURM_NODEID, SLURM_PROCID).
            srun = ["srun"]
            for group, argv in enumerate(het_argv):
                srun += [*([":"] if group else []), f"--het-group={group}", *task, *placed(argv)]
        lines.append("exec " + " ".join(shlex.quote(x) for x in srun))
        return "\n".join(lines) + "\n"

    @staticmethod
    def _script_env(plan: LaunchPlan, batch: SlurmBatch) -> dict[str, str]:
        """What the script exports: the job's environment (isolated: all of it, allow-listed), or in a
        user's own command the user's environment with the job's on top, as the local executor does."""
        if batch.isolated:
            return dict(plan.env)
        own = {
            k: v
            for k, v in os.environ.items()
            if privileged.ENV_NAME.fullmatch(k)
            and not k.startswith(("BASH", *privileged.SLURM_INPUT_PREFIXES))
            and k not in _SHELL_READONLY
        }
        return {**own, **plan.env}
