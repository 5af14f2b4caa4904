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
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from gpuyard import privileged
from gpuyard.errors import ConfigError, StoreError
from gpuyard.scheduler.executors.base import (
    Executor,
    ExecutorUnreachable,
    ExitStatus,
    LaunchPlan,
    NodeSlots,
    gang_world_size,
    job_argv,
    job_env,
)
from gpuyard.scheduler.executors.isolation import PRIVATE_TMP_VARS, JobIsolation
from gpuyard.scheduler.executors.slurm_batch import HetGroup, SlurmBatch
from gpuyard.scheduler.nodes import DRAINED, HEALTHY, NodeHealthMonitor
from gpuyard.scheduler.placement import NodeSpec
from gpuyard.scheduler.spec import JobSpec
from gpuyard.settings import NODE_ENV

log = logging.getLogger(__name__)

BASE_PORT = 29500  # torch.distributed's customary rendezvous port, offset per job
# A multi-node job's rendezvous in its command line, replaced in each task by the batch host's ADDR:PORT.
RDZV_PLACEHOLDER = "@GPUYARD_RDZV@"
_FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
CALL_TIMEOUT_S = 30.0
STATES_TTL_S = 1.0  # how old the one squeue of all this server's jobs may be when a job is polled
NAME_PREFIX = "gpuyard-"
# While the controller does not answer, how often gpuyard asks again (one squeue for all jobs).
UNREACHABLE_RETRY_S = 5.0
# How far Slurm's SubmitTime of an attempt may be from the moments gpuyard's sbatch began and returned
# (the controller's clock against the server's): a row outside that is another job under a reused id.
SUBMIT_SKEW_S = 60.0
# How long the end of an attempt that did not succeed is held back while a node of it does not answer
# (its slurmd may still run the attempt's tasks there, and a retry would run beside them).
SILENT_NODE_WAIT_S = 120.0  # well inside MinJobAge (300 s by default), while scontrol still has the end
# A Slurm tool's error that means the controller did not answer, not that a job is gone.
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|Connection reset|"
    r"Zero Bytes were transmitted|Communication connection failure|Transport endpoint|"
    r"standby mode|not responding|Resource temporarily unavailable|persistent connection",
    re.IGNORECASE,
)
# ... and those that mean it did answer: no such job (any more), or no accounting to ask.
_NO_TRACE = ("Invalid job id specified", "accounting storage is disabled")
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
# Variables bash will not take from an export line (set by the shell itself).
_SHELL_READONLY = frozenset({"SHELLOPTS", "BASHOPTS", "EUID", "UID", "PPID", "GROUPS", "SHLVL", "_"})
_NODE_STATE_DOWN = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "INVAL", "POWERED_DOWN", "FUTURE")


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


@dataclass(frozen=True)
class SlurmConfig:
    """Where and under what account gpuyard's jobs go on the cluster.

    Attributes:
        partition, account, qos: defaults for every job ("" : the cluster's default).
        teams: team -> its own {partition, account, qos} (overrides the defaults).
        env: variables for the Slurm commands themselves (e.g. SLURM_CONF), not for jobs.
        port_base: rendezvous port of a multi-node job = port_base + job id % 1000.
    """

    partition: str = ""
    account: str = ""
    qos: str = ""
    teams: dict[str, dict[str, str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    port_base: int = BASE_PORT

    @classmethod
    def load(cls, path: str | None, partition: str = "", account: str = "") -> SlurmConfig:
        """Read a YAML file of ``partition``, ``account``, ``qos`` and ``teams: {team: {...}}``.

        Raises:
            ConfigError: unreadable file, unknown key or a value that is not a short name.
        """
        doc: dict[str, Any] = {}
        if path:
            try:
                loaded = yaml.safe_load(Path(path).read_text())
            except (OSError, yaml.YAMLError) as exc:
                raise ConfigError(f"--slurm-config {path}: {exc}") from None
            if loaded is not None and not isinstance(loaded, dict):
                raise ConfigError(f"--slurm-config {path}: expected a mapping of settings")
            doc = loaded or {}
        unknown = set(doc) - {"partition", "account", "qos", "teams", "port_base"}
        if unknown:
            raise ConfigError(f"--slurm-config {path}: unknown keys {sorted(unknown)}")
        teams_doc = doc.get("teams") or {}
        if not isinstance(teams_doc, dict):
            raise ConfigError(f"--slurm-config {path}: teams must map a team to its partition/account/qos")
        teams: dict[str, dict[str, str]] = {}
        for team, settings in teams_doc.items():
            if not isinstance(settings, dict) or set(settings) - {"partition", "account", "qos"}:
                raise ConfigError(
                    f"--slurm-config {path}: teams.{team} takes partition, account and qos, got {settings!r}"
                )
            teams[str(team)] = {k: _slurm_name(f"teams.{team}.{k}", v) for k, v in settings.items()}
        port_base = doc.get("port_base", BASE_PORT)
        if not isinstance(port_base, int) or not 1024 <= port_base <= 64535:
            raise ConfigError(f"--slurm-config {path}: port_base must be an integer in 1024-64535")
        return cls(
            partition=_slurm_name("partition", partition or doc.get("partition", "")),
            account=_slurm_name("account", account or doc.get("account", "")),
            qos=_slurm_name("qos", doc.get("qos", "")),
            teams=teams,
            port_base=port_base,
        )

    def for_team(self, team: str) -> dict[str, str]:
        """The partition, account and QoS of one team's jobs (empty ones left out)."""
        out = {"partition": self.partition, "account": self.account, "qos": self.qos}
        out.update(self.teams.get(team, {}))
        return {k: v for k, v in out.items() if v}


def _slurm_name(what: str, value: Any) -> str:
    text = "" if value is None else str(value)
    if text and not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", text):
        raise ConfigError(f"{what}: {text!r} is not a Slurm name (letters, digits, _ . -)")
    return text


def instance_tag(identity: str) -> str:
    """A short stable tag of a store's identity (its database URL) for Slurm job names."""
    import hashlib

    return hashlib.sha256(identity.encode()).hexdigest()[:8]


def parse_gres_gpus(gres: str) -> tuple[int, str]:
    """GPUs and their type from a node's Gres string: ``gpu:4`` -> (4, ""), ``gpu:h100:8(S:0-1)`` ->
    (8, "h100"); several entries are summed (the first type named wins)."""
    total, kind = 0, ""
    for entry in (gres or "").split(","):
        entry = re.sub(r"\(.*?\)", "", entry.strip())
        parts = entry.split(":")
        if not parts or parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        if not count.isdigit():
            continue
        total += int(count)
        if len(parts) >= 3 and not kind:
            kind = parts[1]
    return total, kind


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


class SlurmExecutor(Executor):
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
    # Whether the controller answered the last squeue ("" : it did; else why not) and since when.
    _down, _down_since = "", 0.0

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

    # -- nodes ----------------------------------------------------------------------------------------
    def node_info(self) -> list[dict[str, str]]:
        """Every node as ``scontrol show node -o`` describes it (name, address, GRES, state...)."""
        rows = [parse_kv_line(line) for line in self._call(["scontrol", "show", "node", "-o"]).splitlines()]
        return [r for r in rows if r.get("NodeName")]

    def switches(self) -> dict[str, str]:
        """node -> its leaf switch, from the cluster's topology/tree (empty without one)."""
        out: dict[str, str] = {}
        text = self._call(["scontrol", "show", "topology"], check=False)
        for line in text.splitlines():
            row = parse_kv_line(line)
            if row.get("Level") == "0" and row.get("Nodes"):
                for node in self.hostnames(row["Nodes"]):
                    out.setdefault(node, row.get("SwitchName", "leaf0"))
        return out

    def hostnames(self, nodelist: str) -> list[str]:
        """Expand a Slurm node list (``n[1-3],gpu7``) with ``scontrol show hostnames``."""
        if not nodelist or nodelist in ("(null)", "None"):
            return []
        return self._call(["scontrol", "show", "hostnames", nodelist]).split()

    def nodes(self) -> list[NodeSpec]:
        """The cluster's nodes as scheduler nodes: GPUs and their type from GRES, CPUs, leaf switch."""
        leaves = self.switches()
        out = []
        for row in sorted(self.node_info(), key=lambda r: r["NodeName"]):
            name = row["NodeName"]
            gpus, kind = parse_gres_gpus(row.get("Gres", ""))
            self._addr[name] = row.get("NodeAddr") or name
            out.append(
                NodeSpec(
                    name=name,
                    gpus=gpus,
                    gpu_type=kind or ("gpu" if gpus else ""),
                    nvlink_domain=name,
                    leaf=leaves.get(name, "leaf0"),
                    cpus=int(row.get("CPUTot") or row.get("CPUEfctv") or 0),
                )
            )
        return out

    def unavailable_nodes(self) -> dict[str, str]:
        """Nodes Slurm will not run jobs on now (down, drained, failing) -> its state and reason."""
        out = {}
        for row in self.node_info():
            state = row.get("State", "")
            if any(word in state for word in _NODE_STATE_DOWN):
                why = row.get("Reason", "")
                out[row["NodeName"]] = f"{state}" + (f": {why}" if why and why != "(null)" else "")
        return out

    def drain(self, node: str, reason: str) -> None:
        """Drain a node in Slurm (no new jobs; running ones finish), with gpuyard's reason."""
        reason = re.sub(r"\s+", " ", f"gpuyard: {reason}")[:200]
        self._call(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])
        self._drained_by_us.add(node)

    def undrain(self, node: str) -> None:
        """Return a node gpuyard drained to service (``State=RESUME``)."""
        self._call(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        self._drained_by_us.discard(node)

    def sync_drains(self, drained: dict[str, str]) -> None:
        """Make Slurm's drains follow gpuyard's: drain the nodes gpuyard drained (node -> reason), and
        resume those gpuyard drained before and no longer does. Nodes drained by the cluster's admin
        in Slurm are left alone."""
        current = self.unavailable_nodes()
        for node, reason in drained.items():
            if "DRAIN" not in current.get(node, ""):
                self.drain(node, reason)
            elif "gpuyard:" in current[node]:
                self._drained_by_us.add(node)  # drained by an earlier server: ours to resume
        for node in sorted(self._drained_by_us - set(drained)):
            if "gpuyard:" in current.get(node, "") or node not in current:
                with contextlib.suppress(StoreError):
                    self.undrain(node)
            self._drained_by_us.discard(node)

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

    def _squeue(self, ids: list[str] | None) -> dict[str, dict[str, str]]:
        """squeue rows of ``ids``, or (None) of every job of this server (by its name prefix); an id
        Slurm does not know is left out.

        Raises:
            ExecutorUnreachable: squeue got no answer.
        """
        if ids == []:
            return {}
        which = ["-j", ",".join(ids)] if ids else []
        text = self._ask(["squeue", "-h", *which, "-o", "%i|%T|%r|%N|%S|%V|%j"])
        out: dict[str, dict[str, str]] = {}
        for line in text.splitlines():
            parts = line.split("|", 6)
            if len(parts) == 7 and (ids or parts[6].startswith(self.prefix)):
                # A heterogeneous job is listed once per component (``123+0``, ``123+1``): it is
                # known by its first component's id, and that component's row stands for it.
                job, _, offset = parts[0].partition("+")
                if offset in ("", "0") or job not in out:
                    out[job] = {
                        "state": parts[1],
                        "reason": parts[2],
                        "nodes": parts[3],
                        "start": parts[4],
                        "submit": parts[5],
                        "name": parts[6],
                    }
        return out

    def _refresh_states(self) -> None:
        """One squeue of all this server's jobs; on no answer, remember why (and since when)."""
        self._states_at = time.monotonic()
        try:
            self._states = self._squeue(None)
        except ExecutorUnreachable as exc:
            self._note_down(str(exc))
            return
        if self._down:
            log.warning("Slurm's controller answers again after %.1f s", time.monotonic() - self._down_since)
        self._down = ""

    def _note_down(self, why: str) -> None:
        if not self._down:
            self._down_since = time.monotonic()
            log.warning("Slurm: %s; the states of gpuyard's Slurm jobs are unknown until it answers", why)
        self._down, self._states_at = why, time.monotonic()

    def unavailable(self) -> str | None:
        """Why nothing should be started or stopped on Slurm now (its controller does not answer), or
        None. Asks again every UNREACHABLE_RETRY_S while it does not."""
        if self._down and time.monotonic() - self._states_at >= UNREACHABLE_RETRY_S:
            self._refresh_states()
        if not self._down:
            return None
        return f"{self._down} (for {time.monotonic() - self._down_since:.0f} s)"

    def _check_reachable(self) -> None:
        """Raise at once, sending nothing, while the controller is known not to answer."""
        why = self.unavailable()
        if why is not None:
            raise ExecutorUnreachable(why, submitted=False)

    @staticmethod
    def _is_attempt(name: str, submit: str, handle: dict[str, Any]) -> bool:
        """Whether a Slurm row (its job name and submit time) is the attempt ``handle`` launched, not
        another job under the same id (Slurm reuses ids after its controller lost its state)."""
        want = handle.get("slurm_name")
        if want and name and name != want:
            return False
        window = handle.get("submit_window")
        when = parse_time(submit)
        if window and when is not None:
            at = when.timestamp()
            return float(window[0]) - SUBMIT_SKEW_S <= at <= float(window[1]) + SUBMIT_SKEW_S
        return True

    def describe_pending(self, handle: dict[str, Any]) -> str | None:
        """Why Slurm keeps a submitted job pending (its Reason), or None when it runs or ended."""
        row = self._squeue([str(handle.get("slurm_id", ""))]).get(str(handle.get("slurm_id")))
        return row["reason"] if row and row["state"] == "PENDING" else None

    def poll(self, handle: dict[str, Any]) -> ExitStatus | None:
        """None while Slurm has the job pending, running or still ending, and while Slurm does not
        answer (unknown: the job keeps its state); then how it ended (Slurm's reason too)."""
        slurm_id = str(handle.get("slurm_id", ""))
        if not slurm_id:
            return ExitStatus(code=None, lost=True)
        try:
            return self._poll(slurm_id, handle)
        except ExecutorUnreachable as exc:
            if not self._down:  # a single call failed while the controller otherwise answers
                log.warning("Slurm job %s: its state is unknown for now: %s", slurm_id, exc)
            return None

    def _poll(self, slurm_id: str, handle: dict[str, Any]) -> ExitStatus | None:
        now = time.monotonic()
        if now - self._states_at > (UNREACHABLE_RETRY_S if self._down else STATES_TTL_S):
            self._refresh_states()
        if self._down:
            raise ExecutorUnreachable(self._down)
        row = self._states.get(slurm_id)
        if row is not None and not self._is_attempt(row["name"], row["submit"], handle):
            row = None
        if row is None or row["state"] not in ACTIVE:
            row = self._squeue([slurm_id]).get(slurm_id)  # submitted since, or ended: ask for it alone
            if row is not None and not self._is_attempt(row["name"], row["submit"], handle):
                row = None
        if row is not None and row["state"] in ACTIVE:
            self._seen[slurm_id] = (row["state"], time.time())
            return None
        status = self._ended(slurm_id, handle)
        if status is not None:
            self._seen.pop(slurm_id, None)
        return status

    def _ended(self, slurm_id: str, handle: dict[str, Any] | None = None) -> ExitStatus | None:
        """How the attempt ended, from scontrol, else sacct; None while Slurm still ends it.

        Raises:
            ExecutorUnreachable: a tool got no answer.
        """
        handle = handle or {}
        text = self._ask(["scontrol", "show", "job", "-o", slurm_id])
        # One line per component of a heterogeneous job: the first component's (where the batch
        # script ran; its exit code is the job's) is the job's.
        rows = [parse_kv_line(line) for line in text.splitlines() if line.strip()]
        rows = [r for r in rows if self._is_attempt(r.get("JobName", ""), r.get("SubmitTime", ""), handle)]
        row = next((r for r in rows if r.get("JobId") == slurm_id), rows[0] if rows else {})
        if row.get("JobState"):
            if row["JobState"].split()[0] in ACTIVE:  # between squeue and scontrol: still ending
                return None
            status = exit_from_state(
                row["JobState"], row.get("ExitCode", "0:0"), row.get("EndTime", ""), row.get("Reason", "")
            )
            if status.code == 0:
                return status
            return self._when_nodes_answer(slurm_id, status, ",".join(r.get("NodeList", "") for r in rows))
        if shutil.which("sacct", path=self._env().get("PATH")):
            fields = "JobName,State,ExitCode,End,Submit"
            text = self._ask(["sacct", "-n", "-P", "-X", "-j", slurm_id, "-o", fields])
            for line in reversed(text.splitlines()):  # the newest record of that id first
                parts = line.split("|")
                if len(parts) == 5 and self._is_attempt(parts[0], parts[4], handle):
                    if parts[1].split()[0] in ACTIVE:
                        return None
                    return exit_from_state(parts[1], parts[2], parts[3])
        return SlurmExit(code=None, untraced=True, reason=self._no_trace(slurm_id, handle))

    def _when_nodes_answer(self, slurm_id: str, status: SlurmExit, nodelist: str) -> SlurmExit | None:
        """A failed attempt's end once every node of it answers Slurm again: a node whose slurmd does
        not answer (killed, hung) may still run the attempt's tasks, which Slurm cannot end there,
        and a retry would run beside them. When its slurmd is back it ends them itself (Slurm tells
        it the job is over). Held at most SILENT_NODE_WAIT_S; then the end carries a note naming
        the nodes."""
        names = [n for part in nodelist.split(",") for n in self.hostnames(part)] if nodelist else []
        states = {r["NodeName"]: r.get("State", "") for r in self.node_info()}
        silent = sorted(n for n in set(names) if "NOT_RESPONDING" in states.get(n, ""))
        if not silent:
            self._held.pop(slurm_id, None)
            return status
        first = slurm_id not in self._held
        now = time.monotonic()
        waited = now - self._held.setdefault(slurm_id, now)
        if waited < SILENT_NODE_WAIT_S:
            if first:
                log.warning(
                    "Slurm job %s ended (%s) but %s does not answer: its end waits for %s (at most %g s)",
                    slurm_id,
                    status.describe(),
                    ", ".join(silent),
                    "them" if len(silent) > 1 else "it",
                    SILENT_NODE_WAIT_S,
                )
            return None
        self._held.pop(slurm_id, None)
        note = (
            f"its tasks on {', '.join(silent)} may still run: Slurm has had no answer from "
            f"{'their' if len(silent) > 1 else 'its'} slurmd for {waited:.0f} s"
        )
        return replace(status, notes=(*status.notes, note))

    def _no_trace(self, slurm_id: str, handle: dict[str, Any]) -> str:
        """What is known of an attempt Slurm has no trace of (a controller that lost its state)."""
        facts = [f"Slurm job {slurm_id}"]
        if handle.get("slurm_name"):
            facts.append(f"named {handle['slurm_name']}")
        window = handle.get("submit_window")
        if window:
            at = datetime.fromtimestamp(float(window[0]), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            facts.append(f"submitted {at}")
        seen = self._seen.get(slurm_id)
        if seen is not None:
            ago = max(0.0, time.time() - seen[1])
            facts.append(f"last seen {seen[0]} {ago:.0f} s ago")
        return f"lost: Slurm has no trace of the attempt ({', '.join(facts)}; no accounting kept)"

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

    def recover(self, job_id: int, plan_hint: dict[str, Any] | None) -> dict[str, Any] | None:
        """The handle of a submission the server did not get to record: found by its job name, among
        the jobs Slurm has queued or ended recently.

        Raises:
            ExecutorUnreachable: Slurm did not answer (whether it was submitted is unknown).
        """
        if not plan_hint or not plan_hint.get("slurm_name"):
            return None
        name = plan_hint["slurm_name"]
        ids = self._ask(["squeue", "-h", "-n", name, "-o", "%i"]).split()
        if not ids:
            rows = [parse_kv_line(x) for x in self._ask(["scontrol", "show", "job", "-o"]).splitlines()]
            ids = [r["JobId"] for r in rows if r.get("JobName") == name and r.get("JobId")]
        if not ids:
            return None
        return {**plan_hint, "slurm_id": ids[0].partition("+")[0], "launched": True}

    def pending_reasons(self) -> dict[int, str]:
        """gpuyard job id -> Slurm's reason, for gpuyard's jobs Slurm keeps pending."""
        text = self._call(["squeue", "-h", "-t", "PENDING", "-o", "%j|%r"], check=False)
        out = {}
        for line in text.splitlines():
            name, _, reason = line.partition("|")
            match = re.fullmatch(rf"{re.escape(self.prefix)}(\d+)-\d+", name)
            if match:
                out[int(match.group(1))] = reason
        return out

    def adopt(self) -> dict[str, str]:
        """gpuyard's jobs Slurm has now: name -> Slurm id (what a restarted server can find)."""
        text = self._call(["squeue", "-h", "-o", "%j|%i"], check=False)
        out = {}
        for line in text.splitlines():
            name, _, sid = line.partition("|")
            if name.startswith(self.prefix):
                out[name] = sid.partition("+")[0]  # a heterogeneous job's first component
        return out


class SlurmNodeMonitor(NodeHealthMonitor):
    """Keeps gpuyard's node states and Slurm's in step, every ``interval_s`` (in a thread).

    - A node gpuyard drains (an admin's ``gpuyard nodes drain``, a failed check) is drained in Slurm
      with ``gpuyard: <reason>``, and resumed there when gpuyard undrains it.
    - A node Slurm reports down, drained or failing (by its admin, its HealthCheckProgram, a dead
      slurmd) is drained in gpuyard with Slurm's state and reason (source ``slurm``), so nothing new is
      placed there and preemptible jobs move off; it is undrained when Slurm has it back.
    - A gpuyard job Slurm keeps pending gets an event with Slurm's reason when that reason changes.

    gpuyard's own NVML checks do not run on Slurm nodes: Slurm's HealthCheckProgram is the place for
    them there.
    """

    def __init__(self, service: Any, executor: SlurmExecutor, interval_s: float = 5.0) -> None:
        from gpuyard.hardware.health import NodeCheckConfig

        super().__init__(service.node_states, "slurm", NodeCheckConfig(interval_s=interval_s))
        self.service, self.executor = service, executor
        self.names = {n.name for n in service.nodes}
        self._pending: dict[int, str] = {}
        self._unanswered = False  # Slurm did not answer the last check (said once per outage)

    def describe(self) -> str:
        return (
            f"node states of {len(self.names)} Slurm nodes kept in step with Slurm every "
            f"{self.config.interval_s:g} s"
        )

    def check_once(self, busy: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        return self.check_nodes({})

    def check_nodes(self, used: Mapping[str, Collection[int]]) -> dict[str, dict[str, Any]]:
        states = self.states
        docs = {d["node"]: d for d in states.states(sorted(self.names))}
        try:
            down = self.executor.unavailable_nodes()
        except ExecutorUnreachable as exc:  # unknown: every node keeps its state until Slurm answers
            if not self._unanswered:
                log.warning("node states not synced with Slurm: %s", exc)
            self._unanswered = True
            return docs
        self._unanswered = False
        slurm_down = {n: why for n, why in down.items() if n in self.names}
        for node, why in slurm_down.items():
            if "gpuyard:" in why:
                continue  # our own drain, seen from Slurm
            if docs[node]["state"] != DRAINED:
                docs[node] = states._change(node, DRAINED, f"Slurm: {why}", "slurm", "slurm", keep_same=False)
        for node, doc in docs.items():
            if doc["state"] == DRAINED and doc["source"] == "slurm" and node not in slurm_down:
                docs[node] = states._change(
                    node, HEALTHY, "Slurm has it back", "slurm", "slurm", keep_same=False
                )
        ours = {
            n: d["reason"] or "drained"
            for n, d in docs.items()
            if d["state"] == DRAINED and d["source"] != "slurm"
        }
        self.executor.sync_drains(ours)
        self._note_pending()
        return docs

    def _note_pending(self) -> None:
        from gpuyard.store.tables.jobs import JobEventRow

        try:
            waiting = self.executor.pending_reasons()
        except ExecutorUnreachable:
            return
        changed = {j: r for j, r in waiting.items() if self._pending.get(j) != r}
        self._pending = waiting
        if not changed:
            return
        with self.service.store.session() as s:
            for job_id, reason in changed.items():
                s.add(
                    JobEventRow(
                        job_id=job_id,
                        from_state="running",
                        to_state="running",
                        reason=f"pending in Slurm: {reason}",
                    )
                )
