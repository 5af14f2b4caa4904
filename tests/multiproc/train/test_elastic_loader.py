"""A run fed by gpuyard.data's loader (``ShardLoader`` over a dataset version) with
data.global_batch_size, checkpointed on 2 ranks, resumes on 1 with exactly the samples of an
uninterrupted run: every step the same global batch, none repeated or skipped, across the epoch
boundary too; loss and weights match within float tolerance (as for map-style data, see
test_elastic_resume.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuyard.errors import ConfigError
from gpuyard.train import examples as ex

from .elastic_common import STOP, compare, resume_events, run_here, run_torchrun, write_elastic_spec

pytestmark = pytest.mark.multiproc


def _version(folder: Path) -> str:
    """188 rows (id, x: 4x4 float32, y) in several shards; returns the version's ref."""
    from gpuyard.data import IngestOptions, ingest

    x, y = ex.classification_data(188).tensors
    path = folder / "rows.npz"
    np.savez(path, id=np.arange(188), x=x.numpy().reshape(-1, 4, 4), y=y.numpy())
    return ingest(path, "elastic-rows", IngestOptions(shard_bytes=4000)).ref


def _launcher_checks(spec_path: Path) -> None:
    """What the launcher accepts and refuses before starting workers, for the loader's global position."""
    from gpuyard.train.elastic import check_resume
    from gpuyard.train.parallel import MeshLayout
    from gpuyard.train.spec import load_spec

    spec = load_spec(spec_path)
    check_resume(spec, MeshLayout(1, 1, 1))
    check_resume(spec, MeshLayout(1, 4, 1))
    with pytest.raises(ConfigError, match="16 is not divisible by data-parallel size 3"):
        check_resume(spec, MeshLayout(1, 3, 1))
    other = spec.model_copy(update={"data": spec.data.model_copy(update={"global_batch_size": 32})})
    with pytest.raises(ConfigError, match="global batches of 8 samples per micro-batch, this run has 16"):
        check_resume(other, MeshLayout(1, 1, 1))


def test_two_ranks_resume_on_one_with_the_loader(tmp_path: Path, gpuyard_home: Path) -> None:
    ref = _version(tmp_path)
    data = {
        "train": {"entrypoint": "elastic_hooks:logged_loader", "kwargs": {"dataset": ref}},
        "global_batch_size": 16,
        "input_key": "x",
        "target_key": "y",
    }
    reference = tmp_path / "reference"
    result = run_here(write_elastic_spec(reference, data=data), reference, stop=None)
    assert (result.status, result.step) == ("completed", 24)  # 188 rows + 4 wrapped, 12 steps an epoch

    resized = tmp_path / "resized"
    spec = write_elastic_spec(resized, data=data)
    first = run_torchrun(spec, resized, nproc=2, stop=STOP)
    assert (first["status"], first["step"]) == ("preempted", STOP + 1)
    _launcher_checks(spec)
    result = run_here(spec, resized, stop=None)
    assert (result.status, result.step) == ("completed", 24)
    [event] = resume_events(resized / "run")
    assert (event["step"], event["world_size"]) == (STOP + 1, 2)
    compare(resized, reference, "loader ddp 2 -> 1", worlds=(2, 1))
