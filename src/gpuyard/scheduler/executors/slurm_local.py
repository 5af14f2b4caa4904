"""A private Slurm cluster on this machine: munged, slurmctld and one slurmd per node, all real.

For the Slurm executor's tests and benchmark, and to try ``gpuyard server --slurm`` without a cluster
(as Ray's ``cluster_utils.Cluster`` does for Ray). Needs root (slurmd runs jobs as their users) and
Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` packages. Several slurmd on one host
use ``NodeHostname=localhost`` with a port each and ``slurmd -N NAME`` (Debian's build allows it).
GPUs are GRES backed by plain files (no device is opened), so a node can declare GPUs it lacks.

Everything lives in one folder: configuration, munge key and socket, state, logs; nothing is written
to /etc. ``SLURM_CONF`` (in :attr:`LocalSlurm.env`) points the Slurm tools at it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuyard import privileged
from gpuyard.errors import ConfigError, StoreError

TOOLS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged")


def missing_tools() -> list[str]:
    """The Slurm and munge programs this machine lacks (empty: a local cluster can start)."""
    return [t for t in TOOLS if shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _which(tool: str) -> str:
    found = shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise ConfigError(f"{tool} is not installed (apt-get install slurmctld slurmd slurm-client munge)")
    return found


@dataclass
class LocalSlurm:
    """A running private cluster. Use as a context manager, or call :meth:`start` and :meth:`stop`.

    Attributes:
        folder: where everything of the cluster lives.
        nodes: node name -> GPUs it declares.
        cpus: CPUs of each node.
        memory_mb: RealMemory of each node.
        switches: switch name -> its nodes (a topology/tree; empty: one flat switch).
        extra_conf: more slurm.conf lines.
    """

    folder: Path
    nodes: dict[str, int] = field(default_factory=lambda: {"n1": 2, "n2": 2})
    cpus: int = 2
    memory_mb: int = 2000
    switches: dict[str, list[str]] = field(default_factory=dict)
    extra_conf: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The variables that point Slurm's tools at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 30.0) -> LocalSlurm:
        """Write the configuration, start munged, slurmctld and the slurmds; wait until nodes are idle.

        Raises:
            ConfigError: not root, or a program is missing.
            StoreError: a daemon did not come up (its log's last line).
        """
        if os.geteuid() != 0:
            raise ConfigError("a local Slurm cluster needs root (slurmd runs jobs as their users)")
        missing = missing_tools()
        if missing:
            raise ConfigError(
                f"missing {', '.join(missing)}: apt-get install slurmctld slurmd slurm-client munge"
            )
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o755)
        for sub in ("state", "log", "dev", "munge"):
            (self.folder / sub).mkdir(exist_ok=True)
        for node in self.nodes:
            (self.folder / "spool" / node).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        ports = _free_ports(2 + len(self.nodes))
        self._write_conf(ports)
        env = privileged.environment(self.env)  # root's daemons: the allow-list and SLURM_CONF only
        self.procs.append(
            subprocess.Popen(
                [_which("slurmctld"), "-D", "-i"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        for node in self.nodes:
            self.procs.append(
                subprocess.Popen(
                    [_which("slurmd"), "-D", "-N", node],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        self.wait_idle(timeout_s)
        return self

    def _start_munge(self) -> None:
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        try:
            entry = pwd.getpwnam("munge")
            uid, gid = entry.pw_uid, entry.pw_gid
        except KeyError:
            uid, gid = 0, 0
        for path in (self.folder / "munge", key):
            os.chown(path, uid, gid)
        os.chmod(key, 0o400)
        os.chmod(self.folder / "munge", 0o700 if uid == 0 else 0o755)
        argv = [
            _which("munged"),
            "-F",
            f"--socket={self.folder / 'munge' / 'munge.sock'}",
            f"--key-file={key}",
            f"--pid-file={self.folder / 'munge' / 'munged.pid'}",
            f"--log-file={self.folder / 'munge' / 'munged.log'}",
            f"--seed-file={self.folder / 'munge' / 'seed'}",
        ]
        if uid == 0:
            argv.append("--force")

        def demote() -> None:
            if uid:
                os.setgid(gid)
                os.setuid(uid)

        self.procs.append(
            subprocess.Popen(
                argv,
                preexec_fn=demote,
                env=privileged.environment(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        sock = self.folder / "munge" / "munge.sock"
        deadline = time.monotonic() + 10
        while not sock.exists():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise StoreError(f"munged did not start: {_tail(self.folder / 'munge' / 'munged.log')}")
            time.sleep(0.05)

    def _write_conf(self, ports: list[int]) -> None:
        f = self.folder
        lines = [
            "ClusterName=gpuyard-local",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={f / 'munge' / 'munge.sock'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool' / '%n'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "GresTypes=gpu",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_min_interval=0",
            "MinJobAge=600",
            "KillWait=5",
            f"JobCompType=jobcomp/filetxt\nJobCompLoc={f / 'log' / 'jobcomp.txt'}",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            f"TopologyPlugin=topology/{'tree' if self.switches else 'none'}",
            *self.extra_conf,
        ]
        gres = []
        index = 0
        for (node, gpus), port in zip(self.nodes.items(), ports[2:], strict=True):
            line = (
                f"NodeName={node} NodeHostname=localhost Port={port} CPUs={self.cpus} "
                f"RealMemory={self.memory_mb}"
            )
            if gpus:
                line += f" Gres=gpu:{gpus}"
                files = []
                for _ in range(gpus):
                    dev = f / "dev" / f"gpu{index}"
                    dev.touch()
                    files.append(str(dev))
                    index += 1
                gres.append(f"NodeName={node} Name=gpu File={','.join(files)}")
            lines.append(line)
        lines.append(f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (f / "gres.conf").write_text("\n".join(gres) + "\n")
        topo = [f"SwitchName={sw} Nodes={','.join(nodes)}" for sw, nodes in self.switches.items()]
        if self.switches:
            topo.append(f"SwitchName=spine Switches={','.join(self.switches)}")
        (f / "topology.conf").write_text("\n".join(topo) + "\n")

    def _controller(self) -> subprocess.Popen[bytes] | None:
        return next((p for p in self.procs if Path(str(p.args[0])).name == "slurmctld"), None)  # type: ignore[index]

    def stop_controller(self, sig: int = signal.SIGTERM) -> None:
        """Stop slurmctld alone (the slurmds and their jobs run on): SIGTERM saves its state first,
        SIGKILL does not; ``signal.SIGSTOP`` freezes it instead (its port accepts, nothing answers)."""
        proc = self._controller()
        if proc is None:
            raise StoreError("slurmctld is not running")
        os.killpg(proc.pid, sig)
        if sig == signal.SIGSTOP:
            return
        proc.wait(timeout=30)
        self.procs.remove(proc)

    def start_controller(self, lose_state: bool = False, timeout_s: float = 30.0) -> None:
        """Start slurmctld again (or SIGCONT a frozen one). ``lose_state``: from an empty state, as a
        controller whose state was lost: it forgets every job and numbers new ones from 1 again."""
        proc = self._controller()
        if proc is not None:
            os.killpg(proc.pid, signal.SIGCONT)
            return
        argv = [_which("slurmctld"), "-D", "-i"]
        if lose_state:
            for entry in (self.folder / "state").iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            argv.append("-c")
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **self.env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.insert(1, proc)  # after munged, before the slurmds (stop() ends them in reverse)
        deadline = time.monotonic() + timeout_s
        while self.run("sinfo", "-h", "-o", "%P", check=False).strip() == "":
            if proc.poll() is not None or time.monotonic() > deadline:
                log = _tail(self.folder / "log" / "slurmctld.log")
                raise StoreError(f"slurmctld did not come back: {log}")
            time.sleep(0.1)

    def _slurmd(self, node: str) -> subprocess.Popen[bytes] | None:
        return next((p for p in self.procs if list(p.args)[-2:] == ["-N", node]), None)  # type: ignore[arg-type]

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL one node's slurmd alone, as a crash: the job steps it started (slurmstepd and their
        tasks) run on without it."""
        proc = self._slurmd(node)
        if proc is None:
            raise StoreError(f"no slurmd of {node} is running")
        proc.kill()
        proc.wait(timeout=30)
        self.procs.remove(proc)

    def start_slurmd(self, node: str) -> None:
        """Start one node's slurmd again (after :meth:`kill_slurmd`)."""
        self.procs.append(
            subprocess.Popen(
                [_which("slurmd"), "-D", "-N", node],
                env={**os.environ, **self.env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    def run(self, *argv: str, check: bool = True) -> str:
        """Run a Slurm tool against this cluster; its stdout."""
        proc = subprocess.run(
            [privileged.program(argv[0]), *argv[1:]],
            capture_output=True,
            text=True,
            env=privileged.environment(self.env),
            timeout=30,
        )
        if check and proc.returncode != 0:
            raise StoreError(f"{' '.join(argv[:2])}: {proc.stderr.strip() or proc.returncode}")
        return proc.stdout

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until every node is idle (or allocated), resuming nodes that registered late."""
        deadline = time.monotonic() + timeout_s
        resumed = False
        while True:
            for proc in self.procs:
                if proc.poll() is not None:
                    name = Path(str(proc.args[0])).name  # type: ignore[index]
                    log = _tail(self.folder / "log" / "slurmctld.log")
                    raise StoreError(f"a Slurm daemon exited ({name}): {log}")
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            if len(states) == len(self.nodes) and all(
                s.rstrip("*~#") in ("idle", "allocated", "mixed") for s in states.values()
            ):
                return
            if (
                not resumed
                and states
                and any(s.startswith(("inval", "drain", "down")) for s in states.values())
            ):
                self.run(
                    "scontrol", "update", f"NodeName={','.join(self.nodes)}", "State=RESUME", check=False
                )
                resumed = True
            if time.monotonic() > deadline:
                raise StoreError(
                    f"Slurm nodes not idle after {timeout_s:g} s: {states}; "
                    f"{_tail(self.folder / 'log' / 'slurmctld.log')}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (SIGTERM, then SIGKILL)."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "-u", "root", check=False)
            for line in self.run("squeue", "-h", "-o", "%i", check=False).split():
                self.run("scancel", line, check=False)
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"({path} not written)"
    return " | ".join(text[-lines:]) if text else f"({path} empty)"
