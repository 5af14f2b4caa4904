"""Job goodput over the store: the job's own timeline, and its training run's causes once recorded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuyard.scheduler.goodput import add_goodput
from gpuyard.scheduler.spec import parse_spec
from gpuyard.store import get_store
from gpuyard.train.goodput import record

from .conftest import wait_for

pytestmark = pytest.mark.integration


def _finished(service: Any, job_id: int) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        service.tick()
        doc = service.get(job_id)
        return doc if doc["state"] in ("succeeded", "failed") else None

    return wait_for(done, 30)  # type: ignore[return-value]


def test_job_documents_get_their_goodput_and_the_runs_split_once_recorded(
    make_service: Callable[..., Any],
) -> None:
    from gpuyard.tracking.store import start_run

    service = make_service(gpus=1)
    ok = service.submit(parse_spec({"name": "ok", "command": ["true"]}))["id"]
    bad = service.submit(parse_spec({"name": "bad", "command": ["false"], "max_restarts": 1}))["id"]
    _finished(service, ok), _finished(service, bad)

    docs = add_goodput(service.store, service.list_jobs())
    by_id = {d["id"]: d["goodput"] for d in docs}
    for gp in by_id.values():
        assert gp["source"] == "job"
        assert gp["productive_s"] + sum(gp["lost_s"].values()) == pytest.approx(gp["wall_s"], abs=0.01)
    # Both attempts of the failing job ran and failed: nothing productive, their time is restart.
    assert by_id[bad]["productive_s"] == 0.0 and by_id[bad]["lost_s"]["restart"] > 0
    assert by_id[bad]["ettr"] == 0.0
    assert by_id[ok]["productive_s"] > 0

    # The job's training run (tagged with the job's id by the trainer) records its goodput at the
    # end of a launch: the job's running time is then split by the run's causes.
    tracker = start_run("trained", tags={"job_id": str(ok)}, system_interval_s=None, store=get_store())
    tracker.finish()
    run = {"ettr": 0.5, "wall_s": 0.0, "productive_s": 0.25, "lost_s": {"startup": 0.1, "straggler": 0.15}}
    record(tracker.run_id, run)
    [doc] = add_goodput(service.store, [service.get(ok)])
    gp = doc["goodput"]
    assert gp["source"] == "job+run"
    assert gp["productive_s"] == 0.25 and gp["lost_s"]["straggler"] == 0.15

    from gpuyard.scheduler.goodput import prometheus_text

    text = prometheus_text(add_goodput(service.store, service.list_jobs())).decode()
    # Labels come out sorted by name.
    ok_labels = f'job="{ok}",name="ok",state="succeeded",team="default"'
    assert f"gpuyard_job_productive_seconds{{{ok_labels}}} 0.25" in text
    assert f'gpuyard_job_lost_seconds{{cause="straggler",{ok_labels}}} 0.15' in text
    assert f'gpuyard_job_ettr{{job="{bad}",name="bad",state="failed",team="default"}} 0.0' in text


def test_over_http_jobs_carry_goodput_and_prometheus_gets_gauges(server: Any) -> None:
    import httpx

    from gpuyard.auth import TokenAuth
    from gpuyard.scheduler.client import JobClient

    _, url = server()
    client = JobClient(url)
    job = client.submit(parse_spec({"name": "tick", "command": ["true"]}))
    wait_for(lambda: client.get(job["id"])["state"] == "succeeded", 60)
    gp = client.get(job["id"])["goodput"]
    assert gp["source"] == "job" and gp["productive_s"] > 0 and 0 < gp["ettr"] <= 1
    assert [d["goodput"] for d in client.list_jobs() if d["id"] == job["id"]] == [gp]

    resp = httpx.get(f"{url}/jobs/metrics", auth=TokenAuth(), timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    labels = f'job="{job["id"]}",name="tick",state="succeeded",team="{job["team"]}"'
    assert f"gpuyard_job_ettr{{{labels}}} {gp['ettr']}" in resp.text
    assert httpx.get(f"{url}/jobs/metrics", timeout=30).status_code == 401  # the API token is needed


def test_more_jobs_than_a_query_batch_all_get_their_goodput(make_service: Callable[..., Any]) -> None:
    service = make_service(gpus=1)
    first = service.submit(parse_spec({"name": "ran", "command": ["true"]}))["id"]
    _finished(service, first)
    for i in range(500):  # queued, never ticked: all of their time is queueing
        service.submit(parse_spec({"name": f"q{i}", "command": ["true"]}))
    docs = add_goodput(service.store, service.list_jobs(limit=1000))  # newest first: `first` is last
    assert len(docs) == 501 and docs[-1]["id"] == first
    # The oldest job is in the second batch of ids: its events (it ran) are found all the same.
    assert docs[-1]["goodput"]["productive_s"] > 0
    assert all(d["goodput"]["lost_s"]["queueing"] == d["goodput"]["wall_s"] for d in docs[:-1])
