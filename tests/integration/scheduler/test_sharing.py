"""Shares and MIG slices end to end: a job service on fake H100s (one whole, one in MIG mode) runs real
processes through the local executor."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from gpuyard.errors import CapacityError
from gpuyard.hardware.fake import FakeNvml, load_description, set_mig, write_host_tree
from gpuyard.hardware.probe import probe_node
from gpuyard.hardware.sysfs import HostRoots
from gpuyard.scheduler.spec import parse_spec

from .conftest import ServerStarter, wait_for

pytestmark = pytest.mark.integration

H100 = Path(__file__).parents[2] / "unit" / "hardware" / "fixtures" / "h100_hgx.json"

# Says what it got, marks that it started, then runs until the test releases it.
HOLD = (
    'echo "visible=$CUDA_VISIBLE_DEVICES share=$GPUYARD_GPU_SHARE sharing=$GPUYARD_GPU_SHARING"; '
    'touch "{dir}/started-$GPUYARD_JOB_ID"; while [ ! -e "{dir}/release" ]; do sleep 0.02; done'
)


@pytest.fixture
def mig_service(gpuyard_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A job service on one fake node: GPU 0 an ordinary H100, GPU 1 in MIG mode with two 3g.40gb."""
    from gpuyard.scheduler.executors.local import LocalExecutor
    from gpuyard.scheduler.nodes import node_from_inventory
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    monkeypatch.delenv("GPUYARD_MPS_PIPE_DIRECTORY", raising=False)  # no MPS daemon: time-slicing
    desc = copy.deepcopy(load_description(H100))
    desc["nvml"]["gpus"] = desc["nvml"]["gpus"][:2]
    set_mig(desc, 1, ["3g.40gb", "3g.40gb"])
    roots = HostRoots.under(write_host_tree(desc, tmp_path / "host"))
    inventory = probe_node(FakeNvml(desc), roots=roots, frameworks=False, hostname="local")
    node = node_from_inventory(inventory.to_dict(), cpus=2)
    config = ServiceConfig(tick_s=0.05, grace_s=2.0, min_run_s=0.0)
    service = JobService(get_store(), [node], LocalExecutor(gpuyard_home / "jobs"), config)
    yield service
    (tmp_path / "release").touch()
    for doc in service.list_jobs():
        if doc["state"] in ("running", "scheduled"):
            with contextlib.suppress(Exception):
                service.cancel(doc["id"])
    for doc in service.list_jobs():
        handle = service.executor._resolve(
            {"pid_file": str(gpuyard_home / "jobs" / str(doc["id"]) / "attempt-1.pid")}
        )
        if handle.get("pid"):
            service.executor.stop(handle, kill=True)


def _whole_service(gpuyard_home: Path, tmp_path: Path, packing: str) -> Any:
    """A job service on one fake node of two whole H100s, placing shares with ``packing``."""
    from gpuyard.scheduler.executors.local import LocalExecutor
    from gpuyard.scheduler.nodes import node_from_inventory
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    desc = copy.deepcopy(load_description(H100))
    desc["nvml"]["gpus"] = desc["nvml"]["gpus"][:2]
    roots = HostRoots.under(write_host_tree(desc, tmp_path / "host"))
    inventory = probe_node(FakeNvml(desc), roots=roots, frameworks=False, hostname="local")
    node = node_from_inventory(inventory.to_dict(), cpus=2)
    config = ServiceConfig(tick_s=0.05, grace_s=2.0, min_run_s=0.0, packing=packing)
    return JobService(get_store(), [node], LocalExecutor(gpuyard_home / "jobs"), config)


@pytest.mark.parametrize(("packing", "second_gpu"), [("fgd-online", 1), ("bestfit", 0)])
def test_the_server_places_shares_with_its_packing_policy(
    gpuyard_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packing: str, second_gpu: int
) -> None:
    # A 0.5 share runs on GPU 0; then a 0.25 comes. FGD, its task mix the jobs known (0.5 and 0.25),
    # opens GPU 1: beside the half it would leave 0.25 that no 0.5 can use. Best-fit packs it onto
    # GPU 0, the tightest. Both land where the policy's launch puts them: the record and the job's env.
    monkeypatch.delenv("GPUYARD_MPS_PIPE_DIRECTORY", raising=False)
    service = _whole_service(gpuyard_home, tmp_path, packing)
    hold = HOLD.format(dir=tmp_path)
    try:
        half = _submit(service, "half", {"gpus": 0.5}, hold)
        _tick_until(service, lambda: (tmp_path / f"started-{half}").exists())
        quarter = _submit(service, "quarter", {"gpus": 0.25}, hold)
        _tick_until(service, lambda: (tmp_path / f"started-{quarter}").exists())
        placed = {j: service.get(j)["placement"]["nodes"][0] for j in (half, quarter)}
        assert placed[half]["gpus"] == [0] and placed[quarter]["gpus"] == [second_gpu]
        assert placed[quarter]["share"]["fraction"] == 0.25
        assert f"visible={second_gpu} share=0.25" in service.read_log(quarter)["text"]
        how = service.get(quarter)["placement"]["how"]
        assert how == ("0.25 GPU: a free GPU (1), shared" if second_gpu else "0.25 GPU: shares GPU 0")
        # A whole-GPU job now waits (FGD left no whole GPU) or runs on GPU 1 (best-fit kept it whole).
        whole = _submit(service, "whole", {"gpus": 1}, "true")
        service.tick()
        if second_gpu:
            assert service.get(whole)["state"] == "queued"
            assert service.get(whole)["reason"].endswith("0 whole free (2 shared)")
        else:
            _tick_until(service, lambda: service.get(whole)["state"] == "succeeded")
            assert service.get(whole)["placement"]["nodes"][0]["gpus"] == [1]
    finally:
        (tmp_path / "release").touch()
        for jid in (doc["id"] for doc in service.list_jobs()):
            _tick_until(service, lambda jid=jid: service.get(jid)["state"] in ("succeeded", "failed"))


def _submit(service: Any, name: str, resources: dict[str, Any], command: str) -> int:
    spec = parse_spec({"name": name, "command": ["sh", "-c", command], "resources": resources})
    return int(service.submit(spec)["id"])


def _tick_until(service: Any, cond: Any, timeout: float = 30.0) -> Any:
    def check() -> Any:
        service.tick()
        return cond()

    return wait_for(check, timeout)


def test_two_half_shares_run_at_once_on_one_gpu_and_a_mig_job_sees_its_slice(
    mig_service: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = mig_service
    node = service.nodes[0]
    hold = HOLD.format(dir=tmp_path)
    a = _submit(service, "half-a", {"gpus": 0.5}, hold)
    b = _submit(service, "half-b", {"gpus": 0.5}, hold)
    # Both run together: each waits for the test's release, so both started files mean concurrency.
    _tick_until(
        service, lambda: (tmp_path / f"started-{a}").exists() and (tmp_path / f"started-{b}").exists()
    )
    docs = [service.get(a), service.get(b)]
    assert [d["state"] for d in docs] == ["running", "running"]
    for d in docs:
        assert d["placement"]["nodes"] == [
            {
                "node": "local",
                "gpus": [0],
                "cpus": 0,
                "share": {"fraction": 0.5, "memory_gb": pytest.approx(39.8, abs=0.1)},
            }
        ]
        assert "visible=0 share=0.5 sharing=time-slicing" in service.read_log(d["id"])["text"]

    # A MIG job gets its slice's UUID in CUDA_VISIBLE_DEVICES, while the shares run.
    mig = _submit(service, "slice", {"mig": "3g.40gb"}, hold)
    _tick_until(service, lambda: (tmp_path / f"started-{mig}").exists())
    first = node.mig[0]
    assert service.read_log(mig)["text"].startswith(f"visible={first.uuid} ")
    assert service.get(mig)["placement"]["nodes"] == [
        {
            "node": "local",
            "gpus": [1],
            "cpus": 0,
            "mig": [{"gpu": 1, "profile": "3g.40gb", "uuid": first.uuid}],
        }
    ]

    # GPU 0 is full of shares and GPU 1 is in MIG mode: a third share and a whole-GPU job wait, saying why.
    c = _submit(service, "half-c", {"gpus": 0.5}, "true")
    whole = _submit(service, "whole", {"gpus": 1}, "true")
    service.tick()
    assert service.get(c)["state"] == "queued"
    waiting = "waiting for 0.5 GPU: no shared GPU has room (local:0 1/1.0 held) and 0 whole GPUs free"
    assert service.get(c)["reason"] == waiting
    assert (
        service.get(whole)["reason"]
        == "waiting for 1 GPU on one node: 0 whole free (1 shared, 1 in MIG mode)"
    )

    # Under fifo a job that fits waits behind the blocked ones, and says so.
    later = _submit(service, "slice-2", {"mig": "3g.40gb"}, "true")
    service.tick()
    assert service.get(later)["reason"] == (
        "waiting for its turn: it fits now, but jobs before it in policy order go first"
    )

    # What the CLI shows: per GPU (gpuyard hw --jobs), per job (gpuyard jobs ls / show).
    _check_cli(service, monkeypatch, a, b, mig, c)

    # Released, the shares end; the GPU is whole again and the waiting jobs run.
    (tmp_path / "release").touch()
    for jid in (a, b, mig, c, whole, later):
        _tick_until(service, lambda jid=jid: service.get(jid)["state"] == "succeeded")


class _Client:
    """The CLI's JobClient, answered by the job service itself (the same documents the API returns)."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def list_jobs(self, state: str | None = None, team: str | None = None) -> list[dict[str, Any]]:
        return list(self.service.list_jobs(state=state, team=team))

    def get(self, job_id: int) -> dict[str, Any]:
        return dict(self.service.get(job_id))

    def events(self, job_id: int) -> list[dict[str, Any]]:
        return list(self.service.events(job_id))

    def scheduler_view(self) -> dict[str, Any]:  # as /cluster/scheduler builds it
        active = [*self.service.list_jobs(state="running"), *self.service.list_jobs(state="scheduled")]
        nodes = [asdict(n) | {"excluded": sorted(n.excluded)} for n in self.service.nodes]
        return json.loads(json.dumps({"nodes": nodes, "active": active}))

    def close(self) -> None:
        pass


def _check_cli(service: Any, monkeypatch: pytest.MonkeyPatch, a: int, b: int, mig: int, c: int) -> None:
    from typer.testing import CliRunner

    from gpuyard.cli.main import app

    monkeypatch.setattr("gpuyard.scheduler.client.JobClient", lambda url: _Client(service))
    runner = CliRunner()
    result = runner.invoke(app, ["hw", "--jobs", "--json"])
    assert result.exit_code == 0, result.output
    rows = {(r["gpu"], r["use"].split(" ")[0]): r for r in json.loads(result.output)}
    gpu0 = rows[(0, "1/1.0")]
    assert gpu0["kind"] == "shared" and gpu0["use"] == "1/1.0 of compute, 80/80 GB"
    assert gpu0["jobs"] == [f"{a} half-a (0.5)", f"{b} half-b (0.5)"]
    first, second = service.nodes[0].mig
    assert rows[(1, first.uuid)]["kind"] == "MIG 3g.40gb" and rows[(1, first.uuid)]["jobs"] == [
        f"{mig} slice"
    ]
    assert rows[(1, second.uuid)]["use"].endswith(" free") and rows[(1, second.uuid)]["jobs"] == []
    table = runner.invoke(app, ["hw", "--jobs"]).output
    assert "shared" in table and "MIG 3g.40gb" in table and f"{a} half-a (0.5)" in table

    listing = runner.invoke(app, ["jobs", "ls"], env={"COLUMNS": "300"}).output
    assert "local:0 (0.5 of the GPU, 39.8 GB)" in listing and "MIG 3g.40gb" in listing
    shown = runner.invoke(app, ["jobs", "show", str(c)]).output
    assert "gpus  0.5" in shown and "waiting  waiting for 0.5 GPU: no shared GPU has room" in shown
    shown = runner.invoke(app, ["jobs", "show", str(mig)]).output
    assert f"placement  local:1 MIG 3g.40gb {first.uuid[:13]}" in shown


def test_what_can_never_fit_is_refused_at_submit_in_one_line(mig_service: Any) -> None:
    service = mig_service
    cases = [
        ({"mig": "1g.10gb"}, "resources.mig: no GPU here has a 1g.10gb slice; MIG slices here: 3g.40gb x2"),
        (
            {"mig": "3g.40gb", "slices": 3},
            "resources.slices: 3 3g.40gb slices asked, a node here has at most 2",
        ),
        ({"gpu_memory_gb": 100}, "resources.gpu_memory_gb: 100 GB asked, the largest GPU here has 79.6 GB"),
        ({"gpus": 2}, "resources.gpus: 2 GPUs asked, but one node (the local executor does not span nodes)"),
    ]
    for resources, message in cases:
        with pytest.raises(CapacityError) as err:
            _submit(service, "never", resources, "true")
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert service.list_jobs() == []


def test_a_server_on_fake_mig_gpus_over_http(
    server: ServerStarter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx
    from typer.testing import CliRunner

    from gpuyard.auth import TokenAuth
    from gpuyard.cli.main import app
    from gpuyard.scheduler.client import JobClient

    desc = copy.deepcopy(load_description(H100))
    desc["nvml"]["gpus"] = desc["nvml"]["gpus"][:2]
    uuids = set_mig(desc, 1, ["3g.40gb", "3g.40gb"])
    node_file = tmp_path / "mig_node.json"
    node_file.write_text(json.dumps(desc))
    monkeypatch.setenv("GPUYARD_FAKE_NODE", str(node_file))  # the server pretends to have these GPUs
    monkeypatch.delenv("GPUYARD_MPS_PIPE_DIRECTORY", raising=False)
    _, url = server("--cpus", "2", "--grace", "2")
    client = JobClient(url)
    hold = HOLD.format(dir=tmp_path)

    def submit(name: str, resources: dict[str, Any]) -> int:
        spec = {"name": name, "command": ["sh", "-c", hold], "resources": resources}
        return int(client.submit(parse_spec(spec))["id"])

    ids = [
        submit("half-a", {"gpus": 0.5}),
        submit("half-b", {"gpus": 0.5}),
        submit("slice", {"mig": "3g.40gb"}),
    ]
    wait_for(lambda: all((tmp_path / f"started-{i}").exists() for i in ids), timeout=60)
    assert [client.get(i)["state"] for i in ids] == ["running"] * 3  # the two halves at once, on GPU 0
    logs = ["".join(client.logs(i)) for i in ids]
    assert logs[0].startswith("visible=0 share=0.5") and logs[1].startswith("visible=0 share=0.5")
    assert logs[2].startswith(f"visible={uuids[0]} ")

    # Over HTTP: a fractional gpus above 1 and a slice no GPU has are refused in one line (422).
    auth = TokenAuth()
    bad = httpx.post(
        f"{url}/jobs", json={"name": "x", "command": ["true"], "resources": {"gpus": 1.5}}, auth=auth
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "resources", "gpus"]
    never = httpx.post(
        f"{url}/jobs", json={"name": "x", "command": ["true"], "resources": {"mig": "1g.10gb"}}, auth=auth
    )
    assert never.status_code == 422 and never.json()["detail"].startswith("resources.mig: no GPU here has")

    result = CliRunner().invoke(app, ["hw", "--jobs", "--json", "--server", url])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["gpu"], r["kind"], len(r["jobs"])) for r in rows] == [
        (0, "shared", 2),
        (1, "MIG 3g.40gb", 1),
        (1, "MIG 3g.40gb", 0),
    ]
    (tmp_path / "release").touch()
    wait_for(lambda: all(client.get(i)["state"] == "succeeded" for i in ids), timeout=60)
