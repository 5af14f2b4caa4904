"""Where the scheduler's node list comes from: this machine's inventory, or a fabric cluster description."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Collection, Mapping
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.scheduler.placement import MigSlice, NodeSpec

FAKE_GPU_TYPE = "fake-gpu"
# A node description (JSON, as `gpuyard hw --replay` reads) whose GPUs the local node pretends to have.
FAKE_NODE_ENV = "GPUYARD_FAKE_NODE"
log = logging.getLogger(__name__)


def node_from_inventory(
    doc: dict[str, Any], fake_gpus: int | None = None, cpus: int | None = None
) -> NodeSpec:
    """One node from a `gpuyard hw --json` document; GPUs whose health is "fail" are excluded.

    Args:
        doc: the inventory (``probe_node().to_dict()``).
        fake_gpus: pretend the node has this many GPUs of type ``fake-gpu`` (to try placement on a
            GPU-less machine; the jobs get ``CUDA_VISIBLE_DEVICES`` but there is no device behind it).
        cpus: CPU slots for CPU-only jobs (default: the node's cores).
    """
    node = doc.get("node", doc)
    cores = (node.get("cpu") or {}).get("cores") or os.cpu_count() or 1
    name = node.get("hostname") or socket.gethostname()
    if fake_gpus is not None:
        if fake_gpus < 0:
            raise ConfigError(f"--gpus {fake_gpus}: must be >= 0")
        return NodeSpec(
            name=name,
            gpus=fake_gpus,
            gpu_type=FAKE_GPU_TYPE if fake_gpus else "",
            nvlink_domain=name,
            leaf="local",
            cpus=cpus or cores,
        )
    accels = node.get("accelerators") or []
    excluded = frozenset(i for i, a in enumerate(accels) if a.get("health") == "fail")
    gpu_type = str(accels[0].get("name") or accels[0].get("kind") or "gpu") if accels else ""
    memory = [a["memory_bytes"] for a in accels if a.get("memory_bytes")]
    mig_mode = tuple(i for i, a in enumerate(accels) if (a.get("mig") or {}).get("enabled"))
    slices = tuple(
        MigSlice(i, str(d["profile"]), str(d["uuid"]))
        for i, a in enumerate(accels)
        for d in (a.get("mig") or {}).get("devices") or []
        if d.get("profile") and d.get("uuid")
    )
    return NodeSpec(
        name=name,
        gpus=len(accels),
        gpu_type=gpu_type,
        nvlink_domain=name,
        leaf="local",
        excluded=excluded,
        cpus=cpus or cores,
        gpu_memory_gb=min(memory) / 2**30 if memory else 0.0,
        mig_mode=mig_mode,
        mig=slices,
        gpu_uuids=tuple(str(a.get("uuid") or "") for a in accels),
    )


def local_node(fake_gpus: int | None = None, cpus: int | None = None, record: bool = False) -> NodeSpec:
    """This machine as one node, from the hardware probe.

    Args:
        fake_gpus: GPU slots to pretend this node has (testing placement on a GPU-less machine).
        cpus: CPU slots (default: the usable cores).
        record: also store the probed inventory in the state store's ``nodes`` table (the server does,
            so the dashboard and API show the machine it schedules on).
    """
    from gpuyard.hardware.probe import probe_node

    replay = os.environ.get(FAKE_NODE_ENV)
    if replay and fake_gpus is None:
        # Pretended GPUs, as --gpus N but with a recorded node's models, memory and MIG slices; the
        # jobs run on this machine (never recorded as its inventory, never health-checked).
        from pathlib import Path

        from gpuyard.hardware.fake import replay_inventory

        doc = replay_inventory(Path(replay), socket.gethostname()).to_dict()
        return node_from_inventory(doc, cpus=cpus or os.cpu_count() or 1)
    inventory = probe_node()
    if record:
        from gpuyard.hardware.record import record_inventory

        record_inventory(inventory)
    return node_from_inventory(inventory.to_dict(), fake_gpus=fake_gpus, cpus=cpus)


def nodes_from_fabric(cluster: Any, nodes: int | None = None) -> list[NodeSpec]:
    """Nodes of a :class:`gpuyard.fabric.cluster.Cluster`: NVLink domains and leaf switches from its model.

    Args:
        cluster: the fabric cluster (``gpuyard.fabric.cluster.load_cluster(name)``).
        nodes: node count when the description leaves it open.

    Raises:
        ConfigError: the description has no node count and none was given.
    """
    count = nodes or cluster.nodes
    if not count:
        raise ConfigError(f"cluster {cluster.name!r} does not fix its node count; give --nodes")
    per_domain = max(1, cluster.domain // cluster.gpus_per_node)
    per_leaf = max(1, cluster.network.leaf_size)
    return [
        NodeSpec(
            name=f"{cluster.name}-{i:04d}",
            gpus=cluster.gpus_per_node,
            gpu_type=cluster.accelerator,
            nvlink_domain=f"nvl{i // per_domain}",
            leaf=f"leaf{i // per_leaf}",
        )
        for i in range(count)
    ]


def with_network(cluster: Any, leaf_size: int | None = None, oversubscription: float | None = None) -> Any:
    """A fabric cluster with its leaf size (nodes per leaf switch) and spine oversubscription replaced.

    Args:
        cluster: a :class:`gpuyard.fabric.cluster.Cluster`.
        leaf_size: nodes under one leaf switch (None: keep the cluster's).
        oversubscription: leaf downlink : uplink ratio (None: keep the cluster's).
    """
    update: dict[str, Any] = {}
    if leaf_size is not None:
        update["leaf_size"] = leaf_size
    if oversubscription is not None:
        if oversubscription < 1:
            raise ConfigError(f"oversubscription {oversubscription}: must be at least 1")
        update["oversubscription"] = float(oversubscription)
    if not update:
        return cluster
    return cluster.model_copy(update={"network": cluster.network.model_copy(update=update)})


def check_fabric_nodes(cluster: Any, nodes: list[NodeSpec]) -> None:
    """Refuse a fabric cluster that does not describe the scheduler's nodes.

    The fabric model costs a job by how its GPUs sit in NVLink domains, with each GPU's share of its
    node's NICs (``gpus_per_node``); the scheduler takes each node as one NVLink domain. So every node
    with GPUs must have ``gpus_per_node`` GPUs (unhealthy ones count: they are still in the box), and
    the cluster's domains must be whole nodes (or, on a single node, larger). The node count is not
    compared: a placement is costed on the job's own GPUs, whatever the cluster's size; nor is the GPU
    type (fake GPUs are costed as the cluster's accelerator).

    Args:
        cluster: the fabric cluster (:class:`gpuyard.fabric.cluster.Cluster`).
        nodes: the scheduler's nodes.

    Raises:
        ConfigError: no node has GPUs, a node's GPU count is not the cluster's, or the cluster's NVLink
            domains are not whole nodes (the message says which and what to give instead).
    """
    per_node, domain, name = cluster.gpus_per_node, cluster.domain, cluster.name
    gpu_nodes = [n for n in nodes if n.gpus]
    if not gpu_nodes:
        raise ConfigError("fabric placement places GPU jobs, and no node here has GPUs (--gpus N pretends)")
    for n in gpu_nodes:
        if n.gpus != per_node:
            hint = (
                f"give --gpus {per_node}"
                if n.gpu_type == FAKE_GPU_TYPE
                else f"describe the nodes in a cluster file with gpus_per_node: {n.gpus}"
            )
            raise ConfigError(
                f"cluster {name!r} has {per_node} GPUs per node, but node {n.name!r} has {n.gpus}: "
                f"its jobs would be costed on other hardware; {hint}"
            )
    if domain < per_node:
        raise ConfigError(
            f"cluster {name!r} splits a node into NVLink domains of {domain} GPUs; the scheduler "
            "takes each node as one domain"
        )
    if domain > per_node and len(gpu_nodes) > 1:
        raise ConfigError(
            f"cluster {name!r} has NVLink domains of {domain} GPUs across nodes, but these nodes do not "
            "say which of them share one (each would be costed as a domain of its own)"
        )


# -- node health: states, history, drain/undrain, the periodic check ----------------------------------

HEALTHY, DEGRADED, DRAINED = "healthy", "degraded", "drained"
NODE_STATES = (HEALTHY, DEGRADED, DRAINED)


def preemptible(spec: dict[str, Any]) -> bool:
    """Whether a job can be moved off a drained node without losing its work: a ``train`` job (the
    trainer checkpoints on SIGTERM) or one that names a ``checkpoint_dir``. Others run to their end."""
    return bool(spec.get("train") or spec.get("checkpoint_dir"))


def _state_doc(name: str, row: Any) -> dict[str, Any]:
    if row is None:
        return {
            "node": name,
            "state": HEALTHY,
            "reason": None,
            "source": None,
            "by": None,
            "since": None,
            "checked_at": None,
            "last_check": None,
        }
    return {
        "node": name,
        "state": row.state,
        "reason": row.reason,
        "source": row.source,
        "by": row.by,
        "since": row.since.isoformat(),
        "checked_at": row.checked_at.isoformat() if row.checked_at else None,
        "last_check": row.last_check,
    }


def _findings(check: dict[str, Any] | None) -> list[str]:
    """What a stored check found, as sorted ``GPU:code`` strings (empty for a clean or no check)."""
    if not check:
        return []
    gpus = check.get("gpus") or {}
    return sorted(f"{gpu}:{r['code']}" for gpu, doc in gpus.items() for r in doc.get("reasons", []))


class NodeStates:
    """Node health states in the state store (tables ``node_states`` and ``node_state_events``).

    A node without a row is healthy. The rules (:meth:`record_check`): a failing check drains the node
    (or, with ``drain_on_fail`` off, degrades it); a warning degrades a healthy node; a passing check
    makes a degraded node healthy again. A drained node stays drained until an admin undrains it,
    whatever later checks say: what drains a node (an Xid 79, a pending row remap) needs a person (a
    GPU reset, a reboot, an RMA). Every change is an event with its reason, source and user.
    """

    def __init__(self, store: Any) -> None:
        self.store = store

    def get(self, name: str) -> dict[str, Any]:
        """One node's state document (healthy when never recorded)."""
        from gpuyard.store.tables.health import NodeStateRow

        with self.store.read() as s:
            return _state_doc(name, s.get(NodeStateRow, name))

    def states(self, names: list[str]) -> list[dict[str, Any]]:
        """The state documents of ``names``, in that order."""
        from sqlalchemy import select

        from gpuyard.store.tables.health import NodeStateRow

        with self.store.read() as s:
            rows = {r.hostname: r for r in s.scalars(select(NodeStateRow))}
            return [_state_doc(n, rows.get(n)) for n in names]

    def drained(self) -> set[str]:
        """Names of the drained nodes."""
        from sqlalchemy import select

        from gpuyard.store.tables.health import NodeStateRow

        with self.store.read() as s:
            return set(s.scalars(select(NodeStateRow.hostname).where(NodeStateRow.state == DRAINED)))

    def history(self, name: str, limit: int = 100) -> list[dict[str, Any]]:
        """A node's state changes, oldest first (the last ``limit``)."""
        from sqlalchemy import select

        from gpuyard.store.tables.health import NodeStateEventRow

        q = (
            select(NodeStateEventRow)
            .where(NodeStateEventRow.hostname == name)
            .order_by(NodeStateEventRow.id.desc())
            .limit(limit)
        )
        with self.store.read() as s:
            rows = list(s.scalars(q))
            return [
                {
                    "at": e.at.isoformat(),
                    "from": e.from_state,
                    "to": e.to_state,
                    "reason": e.reason,
                    "source": e.source,
                    "by": e.by,
                    "data": e.data,
                }
                for e in reversed(rows)
            ]

    def drain(self, name: str, reason: str, by: str) -> dict[str, Any]:
        """Drain a node by hand: nothing new is placed on it, its preemptible jobs move off.

        Raises:
            ConfigError: no reason given.
        """
        if not reason.strip():
            raise ConfigError("drain needs a reason (--reason TEXT)")
        return self._change(name, DRAINED, reason.strip(), "admin", by, keep_same=False)

    def undrain(self, name: str, by: str, reason: str = "") -> dict[str, Any]:
        """Put a node back into service (healthy; the next check grades it again).

        Raises:
            ConflictError: the node is not drained.
        """
        from gpuyard.errors import ConflictError

        current = self.get(name)
        if current["state"] != DRAINED:
            raise ConflictError(f"node {name!r} is {current['state']}, not drained")
        return self._change(name, HEALTHY, reason.strip() or "undrained", "admin", by, keep_same=False)

    def record_check(self, name: str, check: Any, drain_on_fail: bool = True) -> dict[str, Any]:
        """Store a :class:`gpuyard.hardware.health.NodeCheck` of ``name`` and move its state by the rules
        above; returns the state document."""
        reasons = check.reasons
        reason = "; ".join(reasons[:3]) + (f" (+{len(reasons) - 3} more)" if len(reasons) > 3 else "")
        current = self.get(name)["state"]
        if check.verdict == "fail":
            target = DRAINED if drain_on_fail or current == DRAINED else DEGRADED
        elif check.verdict == "warn":
            target = DRAINED if current == DRAINED else DEGRADED
        else:
            target = current if current == DRAINED else HEALTHY
        # A drained node keeps its drain reason; a failing check of it is still recorded (an event
        # when what it finds changes).
        return self._change(
            name, target, reason or "checks pass", "check", None, keep_same=True, check=check.to_dict()
        )

    def record_unchecked(self, name: str, why: str) -> dict[str, Any]:
        """Record that ``name``'s check could not run or did not answer (``why``): a healthy node becomes
        degraded (not drained: nothing is known about its GPUs, and its jobs stay); a drained node stays
        drained. The next check that answers grades it again. Returns the state document."""
        current = self.get(name)["state"]
        reason = f"health check did not run: {why}"
        check = {"verdict": "unknown", "gpus": {}, "xids": [], "nvlink_errors": {}, "selftests": {}}
        return self._change(
            name,
            DRAINED if current == DRAINED else DEGRADED,
            reason,
            "check",
            None,
            keep_same=True,
            check={**check, "note": reason},
        )

    def _change(
        self,
        name: str,
        to: str,
        reason: str,
        source: str,
        by: str | None,
        keep_same: bool,
        check: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        from sqlalchemy.exc import IntegrityError

        from gpuyard.store.base import utcnow
        from gpuyard.store.tables.health import NodeStateEventRow, NodeStateRow

        for attempt in range(2):
            try:
                with self.store.session() as s:
                    row = s.get(NodeStateRow, name, with_for_update=True)
                    now = utcnow()
                    if row is None:
                        row = NodeStateRow(hostname=name, state=HEALTHY, source=source, since=now)
                        s.add(row)
                    frm, before = row.state, row.last_check
                    if check is not None:
                        row.checked_at, row.last_check = now, check
                    moved = frm != to or not keep_same
                    if moved:
                        row.state, row.reason, row.source, row.by, row.since = to, reason, source, by, now
                    elif check is not None:
                        if frm != DRAINED:
                            row.reason = reason  # a drained node keeps why it was drained
                        # An event when what the checks find changes (which GPUs, which rules), not
                        # when a number in the same finding moves (a temperature, a count).
                        found = _findings(check)
                        moved = bool(found) and found != _findings(before)
                    if moved:
                        s.add(
                            NodeStateEventRow(
                                hostname=name,
                                at=now,
                                from_state=frm,
                                to_state=to,
                                reason=reason,
                                source=source,
                                by=by,
                                data={"check": check} if check is not None else None,
                            )
                        )
                    s.flush()
                    return _state_doc(name, row)
            except IntegrityError:
                if attempt:  # another writer created the row between our read and insert: once more
                    raise
        raise AssertionError("unreachable")


class NodeHealthMonitor:
    """Runs the periodic health check of one node (the one the server runs on) and records the result.

    The scheduling loop calls :meth:`maybe_check_nodes` every tick; when a check is due it runs in a
    thread of its own (a self-test takes seconds), so scheduling never waits for it. The check itself
    is a :class:`gpuyard.hardware.checker.NodeChecker`, the same that runs on each node of a Ray cluster
    (:class:`RayHealthMonitor`).

    Args:
        states: where states are recorded.
        node: the scheduler's name of the node checked.
        config: what to check, how often, the limits.
        nvml: the node's NVML (a :class:`gpuyard.hardware.nvml.HealthNvmlBackend`; default: opened on
            the first check, and when it cannot be opened every check says why and passes).
        selftest: runs the self-test of one GPU (default:
            :func:`gpuyard.hardware.selftest.selftest_gpu` with the config's size and timeout).
        clock: seconds, monotonic (tests).
    """

    def __init__(
        self,
        states: NodeStates,
        node: str,
        config: Any = None,
        nvml: Any = None,
        selftest: Any = None,
        clock: Any = None,
    ) -> None:
        import threading
        import time

        from gpuyard.hardware.checker import NodeChecker
        from gpuyard.hardware.health import NodeCheckConfig

        self.states, self.node = states, node
        self.config = config or NodeCheckConfig()
        self._clock = clock or time.monotonic
        self.checker = NodeChecker(self.config, nvml, selftest, self._clock)
        self._next = 0.0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.last: Any = None  # the last NodeCheck

    def describe(self) -> str:
        """What is checked, for the server's startup line."""
        return f"node health of {self.node} checked every {self.config.interval_s:g} s"

    def check_once(self, busy: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        """Check the node now (GPUs in ``busy`` are not self-tested) and record it; returns the state."""
        with self._lock:
            self._next = self._clock() + self.config.interval_s
            check = self.checker.run(frozenset(busy))
            self.last = check
            return self.states.record_check(self.node, check, self.config.drain_on_fail)

    def check_nodes(self, used: Mapping[str, Collection[int]]) -> dict[str, dict[str, Any]]:
        """Check now, given the GPUs busy on each node (``{node: indices}``); the states by node."""
        return {self.node: self.check_once(frozenset(used.get(self.node, ())))}

    def due(self) -> bool:
        """Whether the next check's time has come."""
        return self._clock() >= self._next

    def maybe_check(self, busy: set[int] | frozenset[int] = frozenset()) -> bool:
        """Start a check in a thread when one is due and none is running; True when one started."""
        return self.maybe_check_nodes({self.node: frozenset(busy)})

    def maybe_check_nodes(self, used: Mapping[str, Collection[int]]) -> bool:
        """:meth:`maybe_check` given the GPUs busy on each node (``{node: indices}``, the job placements);
        the scheduling loop calls it every tick."""
        import threading

        if not self.due() or (self._thread is not None and self._thread.is_alive()):
            return False
        self._next = self._clock() + self.config.interval_s  # not again while this one runs
        snapshot = {n: frozenset(g) for n, g in used.items()}

        def run() -> None:
            try:
                self.check_nodes(snapshot)
            except Exception:  # the next check tries again; the error is logged
                log.exception("node health check of %s failed", self.node)

        self._thread = threading.Thread(target=run, name="gpuyard-health", daemon=True)
        self._thread.start()
        return True

    def join(self, timeout: float | None = None) -> None:
        """Wait for a running check (tests, shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        """Shut NVML down if this monitor opened it."""
        self.join(5)
        self.checker.close()


class RayHealthMonitor(NodeHealthMonitor):
    """The periodic health check of every node of a Ray cluster, each node's run on that node.

    Each round (every ``interval_s``, in a thread, as :class:`NodeHealthMonitor`) asks the executor to
    run :class:`gpuyard.hardware.checker.NodeChecker` on every node at once, each by an actor pinned to
    its node that keeps the node's checker between rounds
    (:meth:`gpuyard.scheduler.executors.ray.RayExecutor.check_nodes_health`), waits at most
    ``remote_timeout_s`` (plus ``selftest_timeout_s`` per GPU when self-tests may run), and records
    each node's check under its scheduler name (the Ray NodeID). A node whose check could not run (its
    node is dead, the actor could not start or crashed) or did not answer in time is recorded
    degraded with why (:meth:`NodeStates.record_unchecked`), not drained: that says nothing about its
    GPUs.

    Ray chooses which of a node's devices a job's bundle holds, so the scheduler's GPU indices do not
    name the devices in use: a node with any busy GPU is not self-tested this round.

    Args:
        states: where states are recorded.
        executor: runs the checks (a :class:`gpuyard.scheduler.executors.ray.RayExecutor`, or anything
            with its ``check_nodes_health``).
        nodes: the scheduler's nodes (``NodeSpec``) checked.
        config: what to check, how often, the limits.
        fakes: node name -> a node description file whose fake NVML and self-tests stand in for that
            node's (tests, what-if: :meth:`gpuyard.hardware.checker.NodeChecker.from_description`).
        clock: seconds, monotonic (tests).
    """

    def __init__(
        self,
        states: NodeStates,
        executor: Any,
        nodes: list[NodeSpec],
        config: Any = None,
        fakes: Mapping[str, str] | None = None,
        clock: Any = None,
    ) -> None:
        super().__init__(states, f"{len(nodes)} Ray nodes", config, clock=clock)
        self.executor, self.nodes = executor, list(nodes)
        self.fakes = dict(fakes or {})
        self.results: dict[str, Any] = {}  # node -> its last NodeCheck, or why it was not checked

    def describe(self) -> str:
        return (
            f"node health of {len(self.nodes)} Ray nodes checked every {self.config.interval_s:g} s, "
            "each on its node"
        )

    def timeout_s(self, selftest: Mapping[str, bool]) -> float:
        """How long a round waits for the nodes' answers: ``remote_timeout_s``, plus the self-test limit
        for each GPU of the largest node that may self-test."""
        c = self.config
        gpus = max((n.gpus for n in self.nodes if selftest.get(n.name)), default=0)
        return float(c.remote_timeout_s + (c.selftest_timeout_s * gpus if "selftest" in c.checks else 0))

    def check_once(self, busy: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        """Not for a cluster (which node would ``busy`` be?): use :meth:`check_nodes`.

        Raises:
            TypeError: always.
        """
        raise TypeError("a Ray cluster's nodes are checked with check_nodes({node: busy GPUs})")

    def check_nodes(self, used: Mapping[str, Collection[int]]) -> dict[str, dict[str, Any]]:
        """Check every node now on its node (a node with busy GPUs is not self-tested); record each
        result; the states by node."""
        with self._lock:
            self._next = self._clock() + self.config.interval_s
            busy = {n.name: frozenset(used.get(n.name, ())) for n in self.nodes}
            selftest = {name: not gpus for name, gpus in busy.items()}
            timeout = self.timeout_s(selftest)
            try:
                results = self.executor.check_nodes_health(self.config, busy, selftest, timeout, self.fakes)
            except Exception as exc:  # the cluster itself did not answer: every node unchecked
                log.warning("node health checks on Ray could not run: %s", exc)
                results = {name: f"the checks could not be started: {exc}" for name in busy}
            out: dict[str, dict[str, Any]] = {}
            for name in busy:
                result = results.get(name, "no answer")
                self.results[name] = result
                if isinstance(result, str):
                    out[name] = self.states.record_unchecked(name, result)
                else:
                    out[name] = self.states.record_check(name, result, self.config.drain_on_fail)
            return out

    def close(self) -> None:
        """Wait for a running round; stop the check actors (they also end with the server's Ray
        connection)."""
        self.join(5)
        stop = getattr(self.executor, "stop_health_checks", None)
        if stop is not None:
            try:
                stop()
            except Exception:  # Ray is already shut down: the actors went with it
                log.debug("stopping the health check actors", exc_info=True)


def load_health_config(path: str | None) -> Any:
    """The health check config of a YAML file (its top level, or its ``health:`` section); the
    defaults without a file.

    Raises:
        ConfigError: the file is unreadable or has an unknown key or a bad value.
    """
    from gpuyard.hardware.health import NodeCheckConfig, load_check_config

    if not path:
        return NodeCheckConfig()
    from gpuyard.textfiles import load_yaml

    data = load_yaml(path, "health config") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"health config {path}: expected a mapping")
    try:
        return load_check_config(dict(data.get("health", data)))
    except ConfigError as exc:
        raise ConfigError(f"health config {path}: {exc}") from None


def local_health_monitor(service: Any, config_path: str | None = None) -> NodeHealthMonitor | None:
    """The health monitor of the machine a local-executor server runs on, to set as ``service.health``.

    None when there is nothing real to check: more than one node (a Ray cluster's nodes are checked
    by :func:`ray_health_monitor`), or a node of pretended GPUs (``--gpus N``).

    Args:
        service: the :class:`gpuyard.scheduler.service.JobService`.
        config_path: a YAML file of :class:`gpuyard.hardware.health.NodeCheckConfig` fields (or with
            them under ``health:``); None: the defaults.

    Raises:
        ConfigError: the config file is unreadable or wrong (checked even when no monitor results).
    """
    config = load_health_config(config_path)
    nodes = service.nodes
    if len(nodes) != 1 or not nodes[0].gpus or nodes[0].gpu_type == FAKE_GPU_TYPE:
        return None
    if os.environ.get(FAKE_NODE_ENV):  # pretended GPUs of a recorded node: nothing real to check
        return None
    return NodeHealthMonitor(service.node_states, nodes[0].name, config)


def ray_health_monitor(service: Any, config: Any = None) -> RayHealthMonitor:
    """The health monitor of every node of a Ray-executor server, to set as ``service.health``.

    Args:
        service: the :class:`gpuyard.scheduler.service.JobService` (its executor a ``RayExecutor``).
        config: a :class:`gpuyard.hardware.health.NodeCheckConfig` (:func:`load_health_config`); None:
            the defaults.
    """
    return RayHealthMonitor(service.node_states, service.executor, service.nodes, config)
