"""The Ray executor on a simulated cluster of two nodes x 4 GPUs (one module-scoped cluster)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.waiting import free_port

from gpuyard.scheduler.spec import parse_spec

from .conftest import wait_for

pytestmark = pytest.mark.integration
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """Two Ray nodes with 4 fake GPUs each, on 127.0.0.1; yields the address."""
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray turns a loopback address into the host's own address unless clusters are "disabled" (its
    # macOS default); this sandbox only lets 127.0.0.1 through, so keep every connection on loopback.
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "num_gpus": 4,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=2, num_gpus=4, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()
    ray_constants.ENABLE_RAY_CLUSTER = saved


@pytest.fixture
def ray_service(ray_cluster: str, gpuyard_home: Path) -> Iterator[Any]:
    from gpuyard.scheduler.executors.ray import RayExecutor
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    executor = RayExecutor(ray_cluster, gpuyard_home / "jobs")
    service = JobService(get_store(), executor.nodes(), executor, ServiceConfig(tick_s=0.1, grace_s=2.0))
    yield service


def _wait_state(service: Any, job_id: int, states: set[str], timeout: float = 90.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        service.tick()
        doc = service.get(job_id)
        return doc if doc["state"] in states else None

    return wait_for(check, timeout=timeout, every=0.2)  # type: ignore[return-value]


PRINT_ENV = (
    "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'master', "
    "os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], 'gpus', os.environ['CUDA_VISIBLE_DEVICES'], "
    "flush=True)"
)


def test_nodes_come_from_the_ray_cluster(ray_service: Any) -> None:
    assert [n.gpus for n in ray_service.nodes] == [4, 4]
    assert len({n.name for n in ray_service.nodes}) == 2


def test_eight_gpu_job_spans_both_nodes_with_a_rendezvous(ray_service: Any, python: str) -> None:
    import sys

    spec = parse_spec(
        {"name": "dist", "command": [sys.executable, "-c", PRINT_ENV], "resources": {"gpus": 8}}
    )
    job = ray_service.submit(spec)
    ray_service.tick()
    doc = ray_service.get(job["id"])
    assert doc["state"] in ("running", "succeeded")
    assert sorted(len(p["gpus"]) for p in doc["placement"]["nodes"]) == [4, 4]
    assert {p["node"] for p in doc["placement"]["nodes"]} == {n.name for n in ray_service.nodes}
    doc = _wait_state(ray_service, job["id"], {"succeeded", "failed"})
    assert doc["state"] == "succeeded", ray_service.read_log(job["id"])["text"]
    rank0 = Path(doc["log_path"]).read_text().split()
    rank1 = Path(doc["log_path"].replace(".log", "-rank1.log")).read_text().split()
    assert rank0[:4] == ["rank", "0", "of", "2"] and rank1[:4] == ["rank", "1", "of", "2"]
    assert rank0[5:7] == rank1[5:7]  # the same MASTER_ADDR and MASTER_PORT
    # The port was picked free on the first node when the job started, not 29500 + id mod 1000 (which
    # two jobs on one first node whose ids differ by 1000 would share).
    assert int(rank0[6]) != 29500 + job["id"] % 1000
    assert len(rank0[8].split(",")) == 4 and len(rank1[8].split(",")) == 4  # 4 GPUs per worker, from Ray


def test_placement_group_follows_the_placement_and_cancel_stops_it(ray_service: Any, python: str) -> None:
    from ray.util import placement_group_table
    from ray.util.placement_group import get_placement_group

    spec = parse_spec(
        {"name": "one", "command": [python, "-c", "import time; time.sleep(60)"], "resources": {"gpus": 3}}
    )
    job = ray_service.submit(spec)
    doc = _wait_state(ray_service, job["id"], {"running"})
    chosen = doc["placement"]["nodes"]
    assert len(chosen) == 1 and len(chosen[0]["gpus"]) == 3  # fits one node: stays on one node
    table = placement_group_table(get_placement_group(f"gpuyard-job-{job['id']}-1"))
    assert table["bundles"] == {0: {"GPU": 3.0, "CPU": 1.0}}
    assert table["bundles_to_node_id"][0] == chosen[0]["node"]
    ray_service.cancel(job["id"])
    assert _wait_state(ray_service, job["id"], {"cancelled"})["state"] == "cancelled"


def test_gpuyard_server_ray_as_a_command(ray_cluster: str, gpuyard_home: Path, tmp_path: Path) -> None:
    """`gpuyard server --ray ADDRESS`: the CLI's scheduler runs jobs on the Ray cluster's GPUs."""
    import subprocess
    import sys

    import httpx

    from gpuyard.scheduler.client import JobClient

    port = free_port()  # below the ephemeral range (tests.waiting)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuyard.cli.main", "server", "--ray", ray_cluster, "--port", str(port)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            # The fixture's cluster lives on loopback only (see ray_cluster): the server's Ray client too.
            env={
                **os.environ,
                "GPUYARD_HOME": str(gpuyard_home),
                "RAY_AUTH_MODE": "disabled",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            },
        )

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(healthy, 90)
        # Every Ray node's health is checked on that node (no NVML here: each check passes with a note).
        assert "node health of 2 Ray nodes checked every 60 s, each on its node" in log.read_text()
        client = JobClient(url)
        view = client.scheduler_view()
        assert view["executor"] == "ray" and sum(n["gpus"] for n in view["nodes"]) == 8
        code = "import os; print('visible', os.environ['CUDA_VISIBLE_DEVICES'])"
        job = client.submit(
            parse_spec({"name": "ray-cmd", "command": [sys.executable, "-c", code], "resources": {"gpus": 2}})
        )
        done = wait_for(lambda: (j := client.get(job["id"]))["state"] in ("succeeded", "failed") and j, 90)
        assert done["state"] == "succeeded", "".join(client.logs(job["id"]))  # type: ignore[index]
        out = "".join(client.logs(job["id"]))
        visible = out.split("visible", 1)[1].split()[0].split(",")
        assert len(set(visible)) == 2  # Ray gave the job two GPUs of one node
        client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_fault_on_one_ray_node_drains_it_and_only_it(ray_service: Any, python: str, tmp_path: Path) -> None:
    """Each Ray node is checked on that node (an actor pinned there reads its fake NVML): a fault on one
    drains that node only, and the scheduler places nothing there any more."""
    import json

    from gpuyard.hardware.fake import FakeNvml, load_description
    from gpuyard.hardware.health import NodeCheckConfig
    from gpuyard.scheduler.nodes import RayHealthMonitor

    fixture = Path(__file__).parents[2] / "unit" / "hardware" / "fixtures" / "h100_hgx.json"
    desc = load_description(fixture)
    fake = FakeNvml(desc)
    fake.inject(1, "ecc_uncorrectable")  # GPU 1 of the second node: memory returned bad data
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**desc, "nvml": {**desc["nvml"], "gpus": fake._gpus}}))
    good, bad = (n.name for n in ray_service.nodes)
    monitor = RayHealthMonitor(
        ray_service.node_states,
        ray_service.executor,
        ray_service.nodes,
        NodeCheckConfig(interval_s=3600),
        fakes={good: str(fixture), bad: str(broken)},
    )
    ray_service.health = monitor
    jobs = []
    try:
        ray_service.tick()  # starts the round in a thread: the tick does not wait for it
        monitor.join(60)
        states = {d["node"]: d for d in ray_service.node_states.states([good, bad])}
        assert states[good]["state"] == "healthy", states[good]
        assert states[bad]["state"] == "drained" and "GPU 1: 1 uncorrectable ECC" in states[bad]["reason"]
        assert sorted(monitor.results[bad].selftests) == list(range(8))  # idle: self-tested (fake)
        # Nothing new on the drained node: a 4-GPU job takes the healthy one, the next waits.
        sleep = {"command": [python, "-c", "import time; time.sleep(60)"], "resources": {"gpus": 4}}
        jobs = [ray_service.submit(parse_spec({"name": f"j{i}", **sleep}))["id"] for i in range(2)]
        first = _wait_state(ray_service, jobs[0], {"running"})
        assert [p["node"] for p in first["placement"]["nodes"]] == [good]
        for _ in range(3):
            ray_service.tick()
        assert ray_service.get(jobs[1])["state"] == "queued"
        # A check that cannot run says why (recorded as degraded by the monitor): its actor failed to
        # start (here: a description file that is not there), or Ray knows no such live node.
        ray_service.executor.stop_health_checks()
        gone = "f" * 56
        out = ray_service.executor.check_nodes_health(
            monitor.config,
            {good: frozenset(), gone: frozenset()},
            {good: False, gone: False},
            30,
            {good: str(tmp_path / "missing.json")},
        )
        assert out[gone] == "Ray reports the node is not alive"
        assert out[good].startswith("the check failed there:") and "missing.json" in out[good], out
    finally:
        monitor.close()
        for job in jobs:
            ray_service.cancel(job)
        for job in jobs:
            _wait_state(ray_service, job, {"cancelled"})
