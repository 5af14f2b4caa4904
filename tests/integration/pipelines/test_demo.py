"""The demo pipeline on small settings, every stage a job of the in-process scheduler; then a re-run."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.pipelines.demo import demo_spec
from gpuyard.pipelines.runner import run_pipeline

pytestmark = pytest.mark.integration


def test_demo_pipeline_end_to_end_then_cached(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.models.registry import get_version
    from gpuyard.models.runs import get_run, metric_series
    from gpuyard.scheduler.setup import build_service
    from gpuyard.serve.deploy import list_deployments

    events: list[dict] = []
    result = run_pipeline(demo_spec(quick=True), tmp_path, executor="jobs", on_event=events.append)
    out = {st.name: st.outputs for st in result.stages}

    # Every stage ran as its own scheduler job, and each succeeded.
    jobs = build_service().list_jobs()
    assert sorted(j["id"] for j in jobs) == sorted(st.job_id for st in result.stages)
    assert {j["state"] for j in jobs} == {"succeeded"}
    assert any(e["type"] == "log" and e["stage"] == "train" for e in events)  # logs streamed live

    assert out["ingest"]["quarantined"] == 3 and out["ingest"]["by_reason"] == {"label": 3}
    splits = out["prepare"]["splits"]
    assert sum(splits.values()) == out["ingest"]["rows"] and splits["test"] == out["test"]["rows"]
    assert out["search"]["trials"] == 4
    assert out["train"]["nproc"] == 2 and Path(out["train"]["model_dir"], "model.safetensors").is_file()
    # The DDP training recorded itself as it ran (rank 0), with the dataset version and split it trained on.
    trained = get_run(out["train"]["run"])
    selected = f"{out['prepare']['dataset']}#split=train"
    assert trained.status == "finished" and trained.dataset_version == out["train"]["dataset"] == selected
    assert trained.tags["validation"] == f"{out['prepare']['dataset']}#split=val"
    logged = [step for step, _ in metric_series(trained.id, ["loss"])["loss"]]
    assert logged == sorted(set(logged)) and out["train"]["steps"] - 10 < logged[-1] <= out["train"]["steps"]
    test = out["test"]["metrics"]
    assert test["accuracy"] >= 0.85 and 0 < test["f1_macro"] <= 1
    mv = get_version("digits@production")
    assert out["register"]["promoted"] and mv.version == out["register"]["version"]
    # The server answers with the very model that was tested: same rows, same accuracy.
    assert out["serve"]["served_accuracy"] == pytest.approx(test["accuracy"], abs=1e-9)
    assert out["serve"]["drift_after"]["features_drifted"] > out["serve"]["drift_before"]["features_drifted"]
    assert out["serve"]["alerts"] > 0  # the shifted window's alerts reached the store
    assert not [d for d in list_deployments(all_=True) if d["status"] == "running"]
    rows = out["plan"]["rows"]
    assert [r["gpus"] for r in rows] == [8, 16, 64, 256] and out["plan"]["params"] > 0

    again = run_pipeline(demo_spec(quick=True), tmp_path, executor="jobs")
    cached = {st.name: st.cached for st in again.stages}
    assert cached == {name: name != "serve" for name in cached}  # the live server always runs
    assert again.outputs("test") == out["test"] and again.outputs("register") == out["register"]
