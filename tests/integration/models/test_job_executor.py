"""Folds and trials as jobs of the gpuyard scheduler (a JobService on this machine's local executor)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuyard.models.cv import cross_validate
from gpuyard.models.spec import parse_spec
from gpuyard.scheduler.executors.tasks import JobExecutor, Task, TaskFailed

pytestmark = pytest.mark.integration


@pytest.fixture
def job_service(home: Path) -> Iterator[object]:
    from gpuyard.scheduler.executors.local import LocalExecutor
    from gpuyard.scheduler.placement import NodeSpec
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    node = NodeSpec("local", 0, "", "local", "local", cpus=2)
    service = JobService(
        get_store(),
        [node],
        LocalExecutor(home / "jobs"),
        ServiceConfig(tick_s=0.05, grace_s=2.0, min_run_s=0.0),
    )  # type: ignore[call-arg]
    stop = threading.Event()
    loop = threading.Thread(target=service.run, args=(stop,), daemon=True)
    loop.start()
    yield service
    stop.set()
    loop.join(10)


def test_each_fold_is_a_scheduled_job(job_service, home: Path) -> None:
    spec = parse_spec(
        {
            "name": "t",
            "dataset": "sklearn:iris",
            "trainer": "gpuyard.models.builtin:train_sklearn",
            "params": {"estimator": "sklearn.tree.DecisionTreeClassifier", "max_depth": 3},
        }
    )
    ex = JobExecutor(job_service, home / "tasks")
    result = cross_validate(spec, folds=2, executor=ex)
    assert len(result.fold_runs) == 2 and 0.5 < result.summary["accuracy"][0] <= 1.0
    jobs = job_service.list_jobs()
    assert len(jobs) == 2 and {j["state"] for j in jobs} == {"succeeded"}
    assert all("gpuyard.scheduler.executors.worker" in " ".join(j["spec"]["command"]) for j in jobs)
    with pytest.raises(TaskFailed, match=r"job .* failed"):
        ex.submit(Task("gpuyard.models.nope:missing", {}, name="ghost")).result(timeout=120)
    ex.shutdown()
