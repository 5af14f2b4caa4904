"""The Ray executor: a job's placement becomes a placement group, one bundle per node it was given.

Each bundle is pinned to the node the scheduler chose (``bundle_label_selector`` on Ray's
``ray.io/node-id`` label) and holds that node's GPUs. One detached worker actor per bundle runs the
job's command in its own process group, with the torch.distributed rendezvous in its environment
(MASTER_ADDR/MASTER_PORT of the first node, NODE_RANK/NNODES, RANK/WORLD_SIZE of one process per
node). Placement group and actors are detached and named after the job, so a restarted server finds
them again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from gpuyard.errors import StoreError
from gpuyard.scheduler.executors.base import (
    Executor,
    ExitStatus,
    LaunchPlan,
    NodeSlots,
    gang_world_size,
    job_argv,
    job_env,
)
from gpuyard.scheduler.executors.limits import GIB, JobLimits, LimitDefaults
from gpuyard.scheduler.placement import NodeSpec
from gpuyard.scheduler.spec import JobSpec
from gpuyard.settings import NODE_ENV

log = logging.getLogger(__name__)

NAMESPACE = "gpuyard"
READY_TIMEOUT_S = 60.0
BASE_PORT = 29500  # torch.distributed's customary rendezvous port, offset per job


@ray.remote(num_cpus=0)
class _Worker:
    """Runs one node's share of a job as a process group; reports its exit code."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        log_path: str,
        rlimits: dict[str, int] | None = None,
    ) -> None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        gpu_ids = ray.get_gpu_ids()
        # Ray decides which devices of the node this bundle holds: that, not the scheduler's index guess.
        full_env = {**os.environ, **env, "CUDA_VISIBLE_DEVICES": ",".join(str(int(g)) for g in gpu_ids)}
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=cwd if os.path.isdir(cwd) else None,
                start_new_session=True,
                preexec_fn=_set_rlimits(rlimits) if rlimits else None,
            )

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, kill: bool) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)


@ray.remote(num_cpus=0, max_restarts=0)
class _HealthAgent:
    """Keeps one node's health checker (NVML open between checks: Xid events arrive on it) and runs it."""

    def __init__(self, config: Any, fake: str | None) -> None:
        from gpuyard.hardware.checker import NodeChecker

        self.checker = NodeChecker.from_description(fake, config) if fake else NodeChecker(config)

    def check(self, busy: frozenset[int], selftest: bool) -> tuple[str, Any]:
        """The node this ran on (Ray's NodeID) and its :class:`gpuyard.hardware.health.NodeCheck`."""
        return ray.get_runtime_context().get_node_id(), self.checker.run(busy, selftest)


@ray.remote(num_cpus=0)
def _free_port() -> int:
    """A TCP port free on the node this runs on (the rendezvous node: bundle 0 of the job's group)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _set_rlimits(rlimits: dict[str, int]) -> Any:
    """A preexec_fn setting ``rlimits`` (resource name without ``RLIMIT_`` -> soft and hard limit),
    never above the worker's own hard limit."""
    import resource

    def apply() -> None:
        for name, value in rlimits.items():
            which = getattr(resource, f"RLIMIT_{name}")
            _, hard = resource.getrlimit(which)
            limit = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(which, (limit, limit))

    return apply


def _why(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


class RayExecutor(Executor):
    """Runs jobs on the Ray cluster at ``address``; logs go to ``jobs_dir`` on each worker's node."""

    name = "ray"
    multi_node = True

    def __init__(self, address: str, jobs_dir: Path, limits: LimitDefaults | None = None) -> None:
        self.jobs_dir = Path(jobs_dir)
        # Ray gives no cgroup per task: a declared memory_gb is reserved as Ray's ``memory`` resource
        # (scheduling only) and set as RLIMIT_DATA in each worker's command, with RLIMIT_NOFILE.
        self.limits = limits
        # A cluster on loopback (tests, one machine): join it on loopback too, not on the host's address.
        local = address.split("://")[-1].rsplit(":", 1)[0] in ("127.0.0.1", "localhost")
        extra: dict[str, Any] = {"_node_ip_address": "127.0.0.1"} if local else {}
        try:
            ray.init(
                address=address,
                namespace=NAMESPACE,
                ignore_reinit_error=True,
                logging_level=logging.WARNING,
                log_to_driver=False,
                **extra,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise StoreError(f"cannot reach the Ray cluster at {address}: {exc}") from None
        self._ips: dict[str, str] = {}
        self._health_agents: dict[str, Any] = {}  # node -> the actor that checks it (check_nodes_health)

    def nodes(self) -> list[NodeSpec]:
        """The alive Ray nodes as scheduler nodes (GPUs, CPUs, accelerator type)."""
        out = []
        alive = ray.nodes()  # type: ignore[no-untyped-call]  # ray's nodes() has no annotations
        for n in sorted(alive, key=lambda n: n["NodeID"]):
            if not n.get("Alive"):
                continue
            res = n.get("Resources", {})
            kinds = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            self._ips[n["NodeID"]] = n.get("NodeManagerAddress", "127.0.0.1")
            out.append(
                NodeSpec(
                    name=n["NodeID"],
                    gpus=int(res.get("GPU", 0)),
                    gpu_type=kinds[0] if kinds else "gpu",
                    nvlink_domain=n["NodeID"],
                    leaf="ray",
                    cpus=int(res.get("CPU", 0)),
                )
            )
        return out

    def plan(self, job_id: int, spec: JobSpec, nodes: list[NodeSlots], attempt: int) -> LaunchPlan:
        """Bundles pinned to the chosen nodes, one worker per bundle with its rendezvous environment."""
        folder = self.jobs_dir / str(job_id)
        tag = f"gpuyard-job-{job_id}-{attempt}"
        bundles: list[dict[str, float]] = [
            {"GPU": float(len(n.gpus)), "CPU": 1.0} if n.gpus else {"CPU": float(max(n.cpus, 1))}
            for n in nodes
        ]
        limits = self.limits.for_spec(spec) if self.limits is not None else JobLimits()
        if spec.resources.memory_gb:  # reserved on each node (Ray's memory resource, in bytes)
            for bundle in bundles:
                bundle["memory"] = float(int(spec.resources.memory_gb * GIB))
        rlimits = {"NOFILE": limits.nofile} if limits.nofile else {}
        if limits.memory_bytes:
            rlimits["DATA"] = limits.memory_bytes
        master = self._ips.get(nodes[0].node, "127.0.0.1") if nodes else "127.0.0.1"
        env = job_env(job_id, spec, attempt, ())
        env.pop("CUDA_VISIBLE_DEVICES")  # set by each worker from Ray's assignment
        port = BASE_PORT + job_id % 1000  # launch() replaces it by a port free on the first node
        world = gang_world_size(spec, nodes)  # each node's --nproc may differ (a gang placed 8 + 4)
        rank_argv = [
            job_argv(
                spec, nproc=len(n.gpus) or None, nnodes=len(nodes), rdzv=f"{master}:{port}", world_size=world
            )
            for n in nodes
        ]
        env.update(
            {
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "NNODES": str(len(nodes)),
                "WORLD_SIZE": str(len(nodes)),
            }
        )
        return LaunchPlan(
            job_id=job_id,
            attempt=attempt,
            argv=rank_argv[0] if rank_argv else job_argv(spec),
            env=env,
            cwd=spec.workdir or os.getcwd(),
            log_path=str(folder / "output.log"),
            nodes=nodes,
            executor=self.name,
            extra={
                "pg": tag,
                "actors": [f"{tag}-rank{r}" for r in range(len(nodes))],
                "bundles": bundles,
                "label_selectors": [{"ray.io/node-id": n.node} for n in nodes],
                "rank_argv": rank_argv,  # a training job runs `--nproc <its node's GPUs>` on each node
                "rdzv": f"{master}:{port}",
                "rlimits": rlimits,
            },
        )

    def launch(self, plan: LaunchPlan) -> dict[str, Any]:
        """Create the placement group, wait until it is reserved, start one worker per bundle."""
        extra = plan.extra
        pg = placement_group(
            extra["bundles"],
            strategy="PACK",
            name=extra["pg"],
            lifetime="detached",
            bundle_label_selector=extra["label_selectors"],
        )
        if not pg.wait(timeout_seconds=READY_TIMEOUT_S):
            remove_placement_group(pg)
            raise RuntimeError(f"placement group {extra['pg']} not ready after {READY_TIMEOUT_S:g} s")
        env0, rank_argv = dict(plan.env), extra["rank_argv"]
        if len(extra["bundles"]) > 1 and extra.get("rdzv"):
            # The rendezvous port, picked free on the first node now: 29500 + id mod 1000 collides with
            # any job on the same first node whose id differs by 1000 (and whatever else listens there).
            on_first = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
            port = ray.get(_free_port.options(scheduling_strategy=on_first).remote(), timeout=READY_TIMEOUT_S)
            master = env0["MASTER_ADDR"]
            env0["MASTER_PORT"] = str(port)
            rank_argv = [[f"{master}:{port}" if x == extra["rdzv"] else x for x in a] for a in rank_argv]
        for rank, (name, bundle) in enumerate(zip(extra["actors"], extra["bundles"], strict=True)):
            env = {**env0, "NODE_RANK": str(rank), "RANK": str(rank), "LOCAL_RANK": "0"}
            env[NODE_ENV] = plan.nodes[rank].node  # the scheduler's name of this worker's node
            log = plan.log_path if rank == 0 else plan.log_path.replace(".log", f"-rank{rank}.log")
            _Worker.options(  # type: ignore[attr-defined]
                name=name,
                lifetime="detached",
                num_gpus=bundle.get("GPU", 0),
                num_cpus=bundle.get("CPU", 0),
                memory=bundle.get("memory") or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(rank_argv[rank], env, plan.cwd, log, extra.get("rlimits") or None)
        return {**extra, "launched": True, "log": plan.log_path}

    def poll(self, handle: dict[str, Any]) -> ExitStatus | None:
        """None while any worker runs, and while Ray does not answer (unknown is not gone: the job
        keeps its state and GPUs); then rank 0's code, or the first failure among the ranks. A worker
        is gone only when Ray says so: its actor died (or its node), or the head, answering, has no
        actor of that name."""
        codes: list[int | None] = []
        lost = False
        for name in handle.get("actors", []):
            try:
                code: Any = ray.get(ray.get_actor(name).poll.remote(), timeout=30)
                codes.append(None if code is None else int(code))
            except (ray.exceptions.ActorDiedError, ray.exceptions.NodeDiedError):
                lost = True  # Ray says the actor, or its node, is dead
            except ValueError:  # no actor of that name: gone, if the head itself answers
                if not self._head_answers():
                    log.warning("Ray job %s: its state is unknown: Ray's head does not answer", name)
                    return None
                lost = True
            except (ray.exceptions.RayError, ConnectionError) as exc:
                log.warning("Ray job %s: its state is unknown for now: %s", name, str(exc).splitlines()[0])
                return None  # unavailable, timed out, the head unreachable: unknown, not gone
        if not lost and any(c is None for c in codes):
            return None
        self._cleanup(handle)
        if lost:
            return ExitStatus(code=None, killed=True)
        failed = [c for c in codes if c]
        code = failed[0] if failed else 0
        return ExitStatus(code=code, killed=code < 0)

    @staticmethod
    def _head_answers() -> bool:
        """Whether Ray's head (its GCS) answers a question now."""
        try:
            ray.cluster_resources()  # type: ignore[no-untyped-call]
        except Exception:  # any failure to get an answer is no answer
            return False
        return True

    def stop(self, handle: dict[str, Any], kill: bool) -> None:
        """SIGTERM (or SIGKILL) every worker's process group."""
        for name in handle.get("actors", []):
            with contextlib.suppress(ValueError, ray.exceptions.RayError):
                ray.get(ray.get_actor(name).stop.remote(kill), timeout=30)

    def recover(self, job_id: int, plan_hint: dict[str, Any] | None) -> dict[str, Any] | None:
        """The handle of a launch that was not recorded, if all its workers exist; else clean up."""
        if not plan_hint or "actors" not in plan_hint:
            return None
        try:
            for name in plan_hint["actors"]:
                ray.get_actor(name)
        except ValueError:
            self._cleanup(plan_hint)
            return None
        return {**plan_hint, "launched": True}

    def _cleanup(self, handle: dict[str, Any]) -> None:
        for name in handle.get("actors", []):
            with contextlib.suppress(ValueError, ray.exceptions.RayError):
                ray.kill(ray.get_actor(name))
        with contextlib.suppress(Exception):  # already gone is fine
            remove_placement_group(ray.util.get_placement_group(handle["pg"]))

    def check_nodes_health(
        self,
        config: Any,
        busy: Mapping[str, frozenset[int]],
        selftest: Mapping[str, bool],
        timeout_s: float,
        fakes: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Run the health check of each node of ``busy`` on that node, all at once.

        Each node's check (:class:`gpuyard.hardware.checker.NodeChecker`) runs in an actor pinned to
        the node (``NodeAffinitySchedulingStrategy``, not soft; no CPU or GPU reserved), started on the
        first call and kept, so NVML stays open between checks (Xid events arrive on it), NVLink error
        totals have a baseline and self-tests keep their interval. Not detached: the actors end with
        this connection.

        Args:
            config: the :class:`gpuyard.hardware.health.NodeCheckConfig` (given to a new actor).
            busy: node -> its busy GPU indices (not self-tested).
            selftest: node -> whether its idle GPUs may be self-tested this time.
            timeout_s: how long to wait for all the answers.
            fakes: node -> a node description file whose fake NVML the node's actor reads instead
                of NVML (tests; given when the actor starts).

        Returns:
            node -> its :class:`gpuyard.hardware.health.NodeCheck`, or why there is none (Ray reports
            the node dead, the actor could not start or failed, no answer within ``timeout_s``). An
            actor that failed or did not answer is killed: the next call starts a fresh one.
        """
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}  # type: ignore[no-untyped-call]
        out: dict[str, Any] = {}
        pending: dict[Any, str] = {}
        for node in busy:
            if node not in alive:
                out[node] = "Ray reports the node is not alive"
                self._drop_health_agent(node)
                continue
            agent = self._health_agents.get(node)
            if agent is None:
                agent = _HealthAgent.options(  # type: ignore[attr-defined]
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote(config, (fakes or {}).get(node))
                self._health_agents[node] = agent
            pending[agent.check.remote(frozenset(busy[node]), bool(selftest.get(node)))] = node
        ready, late = (
            ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s) if pending else ([], [])
        )
        for ref in ready:
            node = pending[ref]
            try:
                ran_on, check = ray.get(ref)
            except ray.exceptions.RayError as exc:
                out[node] = f"the check failed there: {_why(exc)}"
                self._drop_health_agent(node)
                continue
            out[node] = check if ran_on == node else f"the check ran on node {ran_on} instead"
        for ref in late:
            out[pending[ref]] = f"no answer within {timeout_s:g} s"
            self._drop_health_agent(pending[ref])
        return out

    def _drop_health_agent(self, node: str) -> None:
        agent = self._health_agents.pop(node, None)
        if agent is not None:
            with contextlib.suppress(Exception):  # already gone with its node
                ray.kill(agent)

    def stop_health_checks(self) -> None:
        """Stop the health check actors (:meth:`check_nodes_health` starts them again when called)."""
        for node in list(self._health_agents):
            self._drop_health_agent(node)

    def close(self) -> None:
        """Disconnect from the cluster (jobs keep running: they are detached)."""
        ray.shutdown()
