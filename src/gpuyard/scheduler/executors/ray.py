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
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gpuyard.errors import StoreError
from gpuyard.scheduler.executors.base import Executor, ExitStatus, LaunchPlan, NodeSlots, job_argv, job_env
from gpuyard.scheduler.placement import NodeSpec
from gpuyard.scheduler.spec import JobSpec
from gpuyard.settings import NODE_ENV

NAMESPACE = "gpuyard"
READY_TIMEOUT_S = 60.0
BASE_PORT = 29500  # torch.distributed's customary rendezvous port, offset per job


@ray.remote(num_cpus=0)
class _Worker:
    """Runs one node's share of a job as a process group; reports its exit code."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
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
            )

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, kill: bool) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)


class RayExecutor(Executor):
    """Runs jobs on the Ray cluster at ``address``; logs go to ``jobs_dir`` on each worker's node."""

    name = "ray"
    multi_node = True

    def __init__(self, address: str, jobs_dir: Path) -> None:
        self.jobs_dir = Path(jobs_dir)
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
        bundles = [
            {"GPU": float(len(n.gpus)), "CPU": 1.0} if n.gpus else {"CPU": float(max(n.cpus, 1))}
            for n in nodes
        ]
        master = self._ips.get(nodes[0].node, "127.0.0.1") if nodes else "127.0.0.1"
        env = job_env(job_id, spec, attempt, ())
        env.pop("CUDA_VISIBLE_DEVICES")  # set by each worker from Ray's assignment
        port = BASE_PORT + job_id % 1000
        rank_argv = [
            job_argv(spec, nproc=len(n.gpus) or None, nnodes=len(nodes), rdzv=f"{master}:{port}")
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
        for rank, (name, bundle) in enumerate(zip(extra["actors"], extra["bundles"], strict=True)):
            env = {**plan.env, "NODE_RANK": str(rank), "RANK": str(rank), "LOCAL_RANK": "0"}
            env[NODE_ENV] = plan.nodes[rank].node  # the scheduler's name of this worker's node
            log = plan.log_path if rank == 0 else plan.log_path.replace(".log", f"-rank{rank}.log")
            _Worker.options(  # type: ignore[attr-defined]
                name=name,
                lifetime="detached",
                num_gpus=bundle.get("GPU", 0),
                num_cpus=bundle.get("CPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(extra["rank_argv"][rank], env, plan.cwd, log)
        return {**extra, "launched": True, "log": plan.log_path}

    def poll(self, handle: dict[str, Any]) -> ExitStatus | None:
        """None while any worker runs; then rank 0's code, or the first failure among the ranks."""
        codes: list[int | None] = []
        lost = False
        for name in handle.get("actors", []):
            try:
                code: Any = ray.get(ray.get_actor(name).poll.remote(), timeout=30)
                codes.append(None if code is None else int(code))
            except (ValueError, ray.exceptions.RayError):
                lost = True  # the actor (or its node) is gone
        if not lost and any(c is None for c in codes):
            return None
        self._cleanup(handle)
        if lost:
            return ExitStatus(code=None, killed=True)
        failed = [c for c in codes if c]
        code = failed[0] if failed else 0
        return ExitStatus(code=code, killed=code < 0)

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

    def close(self) -> None:
        """Disconnect from the cluster (jobs keep running: they are detached)."""
        ray.shutdown()
