"""Elastic jobs on the live scheduler (local executor, real processes): start at the best size, shrink
to let a waiting job start, grow back into idle GPUs, each resize a checkpoint and a resume."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuyard.errors import ConfigError
from gpuyard.scheduler.elastic import ElasticConfig
from gpuyard.scheduler.spec import parse_spec
from gpuyard.train.resize import allowed_world_sizes

from .conftest import wait_for

pytestmark = pytest.mark.integration


def _tick_until(service: Any, cond: Callable[[], Any], timeout: float = 30.0) -> Any:
    def check() -> Any:
        service.tick()
        return cond()

    return wait_for(check, timeout)


def _elastic_job(job_script: Path, ckpt: Path, steps: int, low: int, high: int) -> Any:
    # Says how many GPUs it got, then counts from its checkpoint (SIGTERM: checkpoint, exit 75).
    cmd = f'echo "gpus=$CUDA_VISIBLE_DEVICES"; exec {sys.executable} {job_script} {ckpt} {steps}'
    return parse_spec(
        {"name": "elastic", "command": ["sh", "-c", cmd], "resources": {"gpus": {"min": low, "max": high}}}
    )


def test_shrink_for_a_waiting_job_then_grow_back_resuming_each_time(
    make_service: Callable[..., Any], job_script: Path, tmp_path: Path
) -> None:
    # Restarts here take a fraction of a second: a grow pays once the job has run a little.
    service = make_service(gpus=4, elastic=ElasticConfig(interval_s=0.0, restart_cost_s=0.2))
    ckpt = tmp_path / "ckpt"
    el = service.submit(_elastic_job(job_script, ckpt, 100_000, 1, 4))["id"]
    # Nothing else waits: it starts on all 4 GPUs, one rank per GPU.
    doc = _tick_until(service, lambda: (d := service.get(el))["state"] == "running" and d)
    assert doc["gpus"] == 4 and doc["placement"]["nodes"][0]["gpus"] == [0, 1, 2, 3]
    _tick_until(service, lambda: "start at 0" in service.read_log(el)["text"])
    wait_for(lambda: "step 5" in service.read_log(el)["text"])

    # A rigid 3-GPU job arrives: the elastic job shrinks to 1 (checkpoint, requeue), the rigid one starts.
    rigid = service.submit(parse_spec({"name": "rigid", "command": ["sleep", "1"], "resources": {"gpus": 3}}))
    _tick_until(service, lambda: service.get(rigid["id"])["state"] in ("running", "succeeded"))
    doc = _tick_until(service, lambda: (d := service.get(el))["state"] == "running" and d["gpus"] == 1 and d)
    assert doc["attempts"] == 2 and doc["preemptions"] == 0
    reasons = [e["reason"] for e in service.events(el)]
    assert any(
        r and r.startswith(f"shrink to let job {rigid['id']} start: from 4 to 1 GPUs") for r in reasons
    )
    assert any(r and r.startswith("resized (exit code 75") for r in reasons)

    # The rigid job ends; nothing waits: it grows back to 4 and resumes from its checkpoint each time.
    _tick_until(service, lambda: service.get(rigid["id"])["state"] == "succeeded")
    doc = _tick_until(service, lambda: (d := service.get(el))["state"] == "running" and d["gpus"] == 4 and d)
    assert doc["attempts"] == 3
    log = _tick_until(service, lambda: (t := service.read_log(el)["text"]).count("start at") == 3 and t)
    assert [len(g.split(",")) for g in re.findall(r"gpus=([\d,]+)", log)] == [4, 1, 4]
    starts = [int(n) for n in re.findall(r"start at (\d+)", log)]
    saved = [int(n) for n in re.findall(r"checkpointed at (\d+)", log)]
    assert starts[0] == 0 and starts[1:] == saved and saved[0] > 0  # resumed where it stopped
    assert any(
        r and r.startswith("grow into idle GPUs: from 1 to 4 GPUs")
        for r in reasons + [e["reason"] for e in service.events(el)]
    )


def test_elastic_job_waits_at_its_minimum_behind_others_and_never_resizes_without_it(
    make_service: Callable[..., Any], job_script: Path, tmp_path: Path
) -> None:
    service = make_service(gpus=4, elastic=ElasticConfig(enabled=False))
    first = service.submit(parse_spec({"name": "a", "command": ["sleep", "30"], "resources": {"gpus": 2}}))
    el = service.submit(_elastic_job(job_script, tmp_path / "c", 100_000, 2, 4))["id"]
    # Two GPUs free: it starts at its minimum (the maximum does not fit); with resizing off, the other
    # job's end leaves it at 2.
    doc = _tick_until(service, lambda: (d := service.get(el))["state"] == "running" and d)
    assert doc["gpus"] == 2 and doc["reason"] is not None
    service.cancel(first["id"])
    _tick_until(service, lambda: service.get(first["id"])["state"] == "cancelled")
    for _ in range(5):
        service.tick()
    assert service.get(el)["gpus"] == 2 and service.get(el)["attempts"] == 1


def test_elastic_training_job_without_global_batch_is_refused_at_submit(
    make_service: Callable[..., Any], tmp_path: Path
) -> None:
    service = make_service(gpus=2)
    service.train_sizes = allowed_world_sizes  # as gpuyard server sets it
    train = tmp_path / "train.yaml"
    train.write_text(
        "model: {entrypoint: pkg.mod:model}\ndata: {train: {entrypoint: pkg.mod:data}, batch_size: 8}\n"
    )
    spec = parse_spec({"name": "t", "train": str(train), "resources": {"gpus": {"min": 1, "max": 2}}})
    with pytest.raises(ConfigError, match=r"needs data\.global_batch_size"):
        service.submit(spec)
    assert service.list_jobs() == []


def test_an_elastic_training_job_starts_only_at_a_size_that_splits_its_global_batch(
    make_service: Callable[..., Any], tmp_path: Path
) -> None:
    service = make_service(gpus=4, elastic=ElasticConfig(enabled=False))
    service.train_sizes = allowed_world_sizes
    blocker = service.submit(parse_spec({"name": "b", "command": ["sleep", "30"], "resources": {"gpus": 1}}))
    _tick_until(service, lambda: service.get(blocker["id"])["state"] == "running")
    train = tmp_path / "train.yaml"
    train.write_text(
        "model: {entrypoint: pkg.mod:model}\n"
        "data: {train: {entrypoint: pkg.mod:data}, global_batch_size: 16}\n"
    )
    # 3 GPUs are free and 3 is its minimum, but 16 does not split over 3: it waits for 4.
    spec = {"name": "t", "train": str(train), "resources": {"gpus": {"min": 3, "max": 4}}}
    job = service.submit(parse_spec(spec))["id"]
    for _ in range(3):
        service.tick()
    assert service.get(job)["state"] == "queued"
    service.cancel(blocker["id"])
    _tick_until(service, lambda: service.get(job)["attempts"] == 1)
    assert any((e["reason"] or "").endswith("4 GPUs of 3-4") for e in service.events(job))
