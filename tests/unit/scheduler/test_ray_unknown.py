"""The Ray executor's poll with Ray stood in for: a worker is gone only when Ray says so; a head or
actor that does not answer is unknown (the job keeps its state), never taken for an ended job."""

from __future__ import annotations

from typing import Any

import pytest

ray = pytest.importorskip("ray")

from gpuyard.scheduler.executors import ray as ray_mod  # noqa: E402
from gpuyard.scheduler.executors.ray import RayExecutor  # noqa: E402

pytestmark = pytest.mark.unit


class FakeRay:
    """Answers ray.get_actor / ray.get / ray.cluster_resources as a cluster in a given condition."""

    def __init__(self) -> None:
        self.codes: dict[str, int | None] = {"w0": None, "w1": None}
        self.failure: BaseException | None = None  # raised by every ray.get
        self.head_up = True
        self.cleaned: list[str] = []

    def get_actor(self, name: str, **_: Any) -> Any:
        if name not in self.codes:
            raise ValueError(f"Failed to look up actor with name '{name}'")

        class Handle:
            class poll:
                @staticmethod
                def remote() -> str:
                    return name

        return Handle()

    def get(self, ref: str, timeout: float | None = None) -> int | None:
        if self.failure is not None:
            raise self.failure
        return self.codes[ref]

    def cluster_resources(self) -> dict[str, float]:
        if not self.head_up:
            raise ConnectionError("GCS unreachable")
        return {"CPU": 4.0}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    stand_in = FakeRay()
    for name in ("get_actor", "get", "cluster_resources"):
        monkeypatch.setattr(ray_mod.ray, name, getattr(stand_in, name))
    monkeypatch.setattr(RayExecutor, "_cleanup", lambda self, handle: stand_in.cleaned.append(handle["pg"]))
    return stand_in


def test_ray_unanswered_is_unknown_and_only_ray_saying_so_is_gone(fake: FakeRay) -> None:
    ex = object.__new__(RayExecutor)
    handle = {"actors": ["w0", "w1"], "pg": "pg-1"}
    assert ex.poll(handle) is None  # running
    for failure in (
        ray.exceptions.GetTimeoutError("timed out"),
        ray.exceptions.ActorUnavailableError("unavailable", b"0" * 16),
        ray.exceptions.RaySystemError("GCS connection lost"),
        ConnectionError("refused"),
    ):
        fake.failure = failure
        assert ex.poll(handle) is None, failure  # unknown: not ended, not cleaned up
    fake.failure = None
    del fake.codes["w1"]  # no such actor, but the head does not answer: still unknown
    fake.head_up = False
    assert ex.poll(handle) is None and not fake.cleaned
    fake.head_up = True  # the head answers that there is no such actor: the worker is gone
    status = ex.poll(handle)
    assert status is not None and status.killed and status.code is None and fake.cleaned == ["pg-1"]


def test_ray_an_actor_ray_reports_dead_is_gone_and_codes_end_the_job(fake: FakeRay) -> None:
    ex = object.__new__(RayExecutor)
    handle = {"actors": ["w0", "w1"], "pg": "pg-2"}
    fake.failure = ray.exceptions.ActorDiedError()
    status = ex.poll(handle)
    assert status is not None and status.killed
    fake.failure = None
    fake.codes.update(w0=0, w1=3)
    assert ex.poll(handle).code == 3  # type: ignore[union-attr]
