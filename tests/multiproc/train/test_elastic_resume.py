"""A DDP run checkpointed at one world size resumes at another (2 -> 1, 1 -> 2) exactly in the samples
it trains on: each step takes the same global batch as an uninterrupted run, no sample repeated or
skipped, the same step count; loss and final weights match within float tolerance (the all-reduce
sums gradients in another order at another world size, so bit-equality is not expected)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .elastic_common import STOP, compare, resume_events, run_here, run_torchrun, write_elastic_spec

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run in one process (the same global batch of 16 per step)."""
    folder = tmp_path_factory.mktemp("reference")
    result = run_here(write_elastic_spec(folder), folder, stop=None)
    assert (result.status, result.step) == ("completed", 24)
    return folder


def test_two_ranks_resume_on_one(tmp_path: Path, reference: Path) -> None:
    spec = write_elastic_spec(tmp_path)
    first = run_torchrun(spec, tmp_path, nproc=2, stop=STOP)
    assert (first["status"], first["step"]) == ("preempted", STOP + 1)
    result = run_here(spec, tmp_path, stop=None)
    assert (result.status, result.step) == ("completed", 24)
    [event] = resume_events(tmp_path / "run")
    assert (event["step"], event["world_size"]) == (STOP + 1, 2)
    compare(tmp_path, reference, "ddp 2 -> 1", worlds=(2, 1))


def test_one_rank_resumes_on_two(tmp_path: Path, reference: Path) -> None:
    spec = write_elastic_spec(tmp_path)
    first = run_here(spec, tmp_path, stop=STOP)
    assert (first.status, first.step) == ("preempted", STOP + 1)
    result = run_torchrun(spec, tmp_path, nproc=2, stop=None)
    assert (result["status"], result["step"]) == ("completed", 24)
    [event] = resume_events(tmp_path / "run")
    assert (event["step"], event["world_size"]) == (STOP + 1, 1)
    compare(tmp_path, reference, "ddp 1 -> 2", worlds=(1, 2))
