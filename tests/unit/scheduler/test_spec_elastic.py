"""Elastic job specs: gpus: {min, max} is accepted, checked in one line per field, and stored."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.scheduler.spec import JobSpec, load_spec, parse_spec

pytestmark = pytest.mark.unit


def _job(**fields: object) -> dict[str, object]:
    return {"name": "x", "train": "train.yaml", **fields}


def test_a_range_is_stored_as_its_minimum_and_maximum(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: el\ntrain: spec.yaml\nresources: {gpus: {min: 2, max: 8}}\n")
    res = load_spec(f).resources
    assert (res.gpus, res.gpus_max, res.elastic) == (2, 8, True)
    # What the job table keeps (spec JSON) validates back to the same range.
    spec = load_spec(f)
    again = JobSpec.model_validate(spec.model_dump(mode="json"))
    assert again.resources == res and again.resources.elastic
    rigid = parse_spec(_job(resources={"gpus": 4})).resources
    assert (rigid.gpus_max, rigid.elastic) == (None, False)
    # A range of one size is a rigid job.
    one = parse_spec(_job(resources={"gpus": {"min": 4, "max": 4}})).resources
    assert (one.gpus, one.gpus_max, one.elastic) == (4, None, False)


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"gpus": {"min": 4, "max": 2}}, r"resources\.gpus: .*elastic range is \{min: N, max: M\}.*'min': 4"),
        ({"gpus": {"min": 2}}, r"resources\.gpus: .*elastic range"),
        ({"gpus": {"min": 2, "max": 8, "step": 2}}, r"resources\.gpus: .*'step'"),
        ({"gpus": {"min": 0, "max": 2}}, r"resources\.gpus: .*1 <= N"),
        ({"gpus": {"min": 1.5, "max": 2}}, r"resources\.gpus: .*whole numbers"),
        ({"gpus": {"min": True, "max": 2}}, r"resources\.gpus: .*whole numbers"),
        ({"gpus": {"min": 2, "max": 70000}}, r"resources\.gpus: .*<= 65536"),
        ({"gpus": 4, "gpus_max": 2}, r"resources\.gpus_max: .*2 is below the minimum gpus: 4"),
        ({"gpus_max": 4}, r"resources\.gpus_max: .*needs whole GPUs"),
        ({"gpus": {"min": 2, "max": 8}, "gpus_max": 4}, r"resources: .*give the range once"),
        ({"gpus": {"min": 2, "max": 8}, "mig": "1g.10gb"}, r"resources\.mig: .*MIG slices go alone"),
        ({"gpus": {"min": 2, "max": 8}, "gpu_fraction": 0.5}, r"resources\.gpu_fraction: .*part of one GPU"),
    ],
)
def test_bad_ranges_are_one_line_naming_the_field(resources: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_spec(_job(resources=resources))
    assert "\n" not in str(info.value)


def test_an_elastic_job_leaves_its_process_count_and_dp_to_the_scheduler() -> None:
    elastic = {"gpus": {"min": 2, "max": 8}}
    with pytest.raises(ConfigError, match="nproc: an elastic job runs one process per GPU"):
        parse_spec(_job(resources=elastic, nproc=2))
    workload = {"model": "llama3-8b", "global_batch": 64, "seq_len": 2048, "layout": {"dp": 2}}
    with pytest.raises(ConfigError, match=r"workload\.layout\.dp: an elastic job changes"):
        parse_spec(_job(resources=elastic, workload=workload))
