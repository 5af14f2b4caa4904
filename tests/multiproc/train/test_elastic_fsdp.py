"""An FSDP2 run checkpointed on 2 ranks resumes on 4: DCP reshards the model and optimizer shards
(2 shard files at the stop, 4 at the end) and the run trains on the same samples per step as an
uninterrupted one, loss and weights within float tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.train.checkpoint import list_checkpoints

from .elastic_common import STOP, compare, resume_events, run_here, run_torchrun, write_elastic_spec

pytestmark = pytest.mark.multiproc


def test_fsdp_two_ranks_resume_on_four(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    done = run_here(write_elastic_spec(reference), reference, stop=None)
    assert (done.status, done.step) == ("completed", 24)

    folder = tmp_path / "elastic"
    spec = write_elastic_spec(folder, parallel={"data_parallel": "fsdp"})
    first = run_torchrun(spec, folder, nproc=2, stop=STOP)
    assert (first["status"], first["step"]) == ("preempted", STOP + 1)
    stopped = list_checkpoints(folder / "run" / "checkpoints")[-1]
    assert stopped.name.endswith(str(STOP + 1)) and len(list(stopped.glob("*.distcp"))) == 2  # a file a rank

    result = run_torchrun(spec, folder, nproc=4, stop=None)
    assert (result["status"], result["step"]) == ("completed", 24)
    [event] = resume_events(folder / "run")
    assert (event["step"], event["world_size"]) == (STOP + 1, 2)
    last = list_checkpoints(folder / "run" / "checkpoints")[-1]
    assert last.name.endswith("24") and len(list(last.glob("*.distcp"))) == 4
    compare(folder, reference, "fsdp 2 -> 4", worlds=(2, 4))
