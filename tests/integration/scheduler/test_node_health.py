"""Node health end to end on the job service: a fault injected into a fake node's NVML drains the node,
the scheduler stops placing there, a preemptible job checkpoints and moves to the healthy node, a
job that cannot checkpoint keeps running, and undraining puts the node back into service."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuyard.errors import ConfigError, ConflictError
from gpuyard.hardware.fake import FakeNvml, fake_selftest, load_description
from gpuyard.hardware.health import NodeCheckConfig
from gpuyard.scheduler.nodes import NodeHealthMonitor, load_health_config
from gpuyard.scheduler.spec import parse_spec

from .conftest import wait_for

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).parents[2] / "unit" / "hardware" / "fixtures" / "h100_hgx.json"


@pytest.fixture
def service(gpuyard_home: Path) -> Iterator[Any]:
    """A job service on two fake 2-GPU nodes, n1 and n2 (local processes)."""
    from gpuyard.scheduler.executors.local import LocalExecutor
    from gpuyard.scheduler.placement import NodeSpec
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    nodes = [NodeSpec(n, 2, "fake-gpu", n, "leaf0", cpus=2) for n in ("n1", "n2")]
    svc = JobService(
        get_store(), nodes, LocalExecutor(gpuyard_home / "jobs"), ServiceConfig(tick_s=0.05, grace_s=5.0)
    )
    yield svc
    # Cancelled jobs get SIGTERM, then SIGKILL after the grace period: none outlives the test.
    active = [d["id"] for d in svc.list_jobs() if d["state"] in ("queued", "scheduled", "running")]
    for job_id in active:
        with contextlib.suppress(ConflictError):
            svc.cancel(job_id)
    _until(svc, lambda: all(svc.get(j)["state"] not in ("scheduled", "running") for j in active), 20)
    if svc.health is not None:
        svc.health.join(10)


def _until(service: Any, cond: Any, timeout: float = 30.0) -> Any:
    def step() -> Any:
        service.tick()
        return cond()

    return wait_for(step, timeout)


def _node_of(service: Any, job_id: int) -> str | None:
    doc = service.get(job_id)
    if doc["state"] != "running":
        return None
    return str(doc["placement"]["nodes"][0]["node"])


def test_a_fault_drains_the_node_and_moves_the_preemptible_job(
    service: Any, job_script: Path, python: str, tmp_path: Path
) -> None:
    fake = FakeNvml(load_description(FIXTURE))
    now = [0.0]
    monitor = NodeHealthMonitor(
        service.node_states,
        "n1",
        NodeCheckConfig(interval_s=60),
        nvml=fake,
        selftest=fake_selftest(fake),
        clock=lambda: now[0],
    )
    service.health = monitor
    ckpt = tmp_path / "ckpt.txt"
    movable = service.submit(
        parse_spec(
            {
                "name": "train",
                "command": [python, str(job_script), str(ckpt), "100000"],
                "resources": {"gpus": 1},
                "checkpoint_dir": str(tmp_path),
            }
        )
    )["id"]
    fixed = service.submit(
        parse_spec({"name": "fixed", "command": ["sleep", "60"], "resources": {"gpus": 1}})
    )["id"]
    assert _until(service, lambda: _node_of(service, movable) == "n1" and _node_of(service, fixed) == "n1")
    monitor.join(10)  # the first check (due at once) ran on a clean node
    assert service.node_states.get("n1")["state"] == "healthy"
    wait_for(lambda: "step 5" in service.read_log(movable)["text"])

    fake.inject(0, "xid", xid=79)  # GPU 0 of n1 falls off the bus
    now[0] += 60
    drained = _until(service, lambda: service.node_states.get("n1")["state"] == "drained" or None)
    assert drained
    state = service.node_states.get("n1")
    assert "Xid 79" in state["reason"] and state["source"] == "check"
    assert state["last_check"]["gpus"]["0"]["status"] == "fail"

    # The preemptible job checkpoints (SIGTERM, exit 75), is requeued and resumes on n2.
    assert _until(service, lambda: _node_of(service, movable) == "n2")
    reasons = [e["reason"] for e in service.events(movable)]
    assert any("node n1 drained" in (r or "") for r in reasons)
    assert any((r or "").startswith("preempted") for r in reasons)
    assert "checkpointed at" in service.read_log(movable)["text"]
    assert int(ckpt.read_text()) >= 5
    # The job that cannot checkpoint keeps running where it was.
    assert _node_of(service, fixed) == "n1"

    # n2 has one GPU left; then n1's free GPU is refused: the next job waits.
    second = service.submit(parse_spec({"name": "s", "command": ["sleep", "60"], "resources": {"gpus": 1}}))
    assert _until(service, lambda: _node_of(service, second["id"]) == "n2")
    third = service.submit(parse_spec({"name": "t", "command": ["sleep", "60"], "resources": {"gpus": 1}}))
    for _ in range(5):
        service.tick()
    assert service.get(third["id"])["state"] == "queued"
    assert (
        service.dry_run(parse_spec({"name": "d", "command": ["true"], "resources": {"gpus": 1}}))["fits_now"]
        is False
    )

    # Later checks keep it drained (even once the GPU looks fine); an admin puts it back.
    fake.clear(0)
    now[0] += 60
    _until(service, lambda: monitor.last is not None and not monitor.last.xids and not monitor.due())
    monitor.join(10)
    assert service.node_states.get("n1")["state"] == "drained"
    service.node_states.undrain("n1", by="admin", reason="GPU reset")
    assert _until(service, lambda: _node_of(service, third["id"]) == "n1")
    history = service.node_states.history("n1")
    moves = [(h["from"], h["to"], h["source"]) for h in history if h["from"] != h["to"]]
    assert moves == [("healthy", "drained", "check"), ("drained", "healthy", "admin")]
    assert history[-1]["by"] == "admin" and history[-1]["reason"] == "GPU reset"


def test_warnings_degrade_and_a_passing_check_heals(service: Any) -> None:
    fake = FakeNvml(load_description(FIXTURE))
    monitor = NodeHealthMonitor(service.node_states, "n2", NodeCheckConfig(checks=("nvml",)), nvml=fake)
    fake.inject(1, "throttle", reason="sw_thermal_slowdown")
    state = monitor.check_once()
    assert state["state"] == "degraded" and "GPU 1: clocks held down" in state["reason"]
    service.tick()
    assert service.state.drained.tolist() == [False, False]  # degraded still takes jobs
    fake.clear(1)
    assert monitor.check_once()["state"] == "healthy"
    fake.inject(1, "ecc_uncorrectable")
    lenient = NodeHealthMonitor(
        service.node_states, "n2", NodeCheckConfig(checks=("nvml",), drain_on_fail=False), nvml=fake
    )
    assert lenient.check_once()["state"] == "degraded"  # drain_on_fail off: an admin decides


def test_drain_needs_a_reason_and_undrain_a_drained_node(service: Any) -> None:
    with pytest.raises(ConfigError, match="reason"):
        service.node_states.drain("n1", "  ", by="admin")
    with pytest.raises(ConflictError, match="healthy, not drained"):
        service.node_states.undrain("n1", by="admin")
    doc = service.node_states.drain("n1", "cable swap", by="root")
    assert (doc["state"], doc["reason"], doc["source"], doc["by"]) == (
        "drained",
        "cable swap",
        "admin",
        "root",
    )
    service.tick()
    assert service.state.drained.tolist() == [True, False]


def test_health_config_file(tmp_path: Path) -> None:
    path = tmp_path / "health.yaml"
    path.write_text("health:\n  interval_s: 15\n  checks: [nvml, xid]\n  gemm_min_tflops: 40\n")
    config = load_health_config(str(path))
    assert (config.interval_s, config.checks, config.gemm_min_tflops) == (15, ("nvml", "xid"), 40)
    path.write_text("interval: 15\n")
    with pytest.raises(ConfigError, match="unknown keys \\['interval'\\]"):
        load_health_config(str(path))


def test_the_server_checks_only_a_real_local_node(service: Any, gpuyard_home: Path) -> None:
    from dataclasses import replace

    from gpuyard.scheduler.nodes import local_health_monitor

    assert local_health_monitor(service) is None  # two nodes: not this machine alone
    service.nodes = [replace(service.nodes[0], gpu_type="H100")]
    monitor = local_health_monitor(service)
    assert monitor is not None and monitor.node == "n1" and monitor.config.interval_s == 60
    service.nodes = [replace(service.nodes[0], gpu_type="fake-gpu")]
    assert local_health_monitor(service) is None


def test_history_records_changes_of_findings_not_of_numbers(service: Any) -> None:
    fake = FakeNvml(load_description(FIXTURE))
    monitor = NodeHealthMonitor(service.node_states, "n1", NodeCheckConfig(checks=("nvml",)), nvml=fake)
    assert monitor.check_once()["state"] == "healthy"
    assert service.node_states.history("n1") == []  # a clean node has nothing to tell
    fake._gpus[2]["temperature_c"] = 90  # hot: within 5 C of its slowdown threshold
    assert "90 C" in monitor.check_once()["reason"]
    fake._gpus[2]["temperature_c"] = 91
    assert "91 C" in monitor.check_once()["reason"]  # the reason follows the numbers...
    assert len(service.node_states.history("n1")) == 1  # ...but the history does not
    fake.inject(3, "ecc_corrected", count=5000)
    monitor.check_once()
    history = service.node_states.history("n1")
    assert [(h["from"], h["to"]) for h in history] == [("healthy", "degraded"), ("degraded", "degraded")]
    assert "GPU 3" in history[-1]["reason"] and history[-1]["data"]["check"]["verdict"] == "warn"
