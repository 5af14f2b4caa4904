"""`gpuyard train --nproc 2` with rank 1 made slow in its compute or its data: the job names rank 1
as the straggler, with the cause, in an event and in the outcome; rank 0 is never named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.tracking.files import read_metrics

from .conftest import env_for, finish, start_train, write_spec

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("cause", ["compute", "data"])
def test_slow_rank_is_named_with_its_cause(tmp_path: Path, cause: str) -> None:
    spec = write_spec(
        tmp_path,
        loss="straggler_hooks:slow_loss",
        data={"train": {"entrypoint": "straggler_hooks:slow_data", "kwargs": {"n": 768}}, "batch_size": 16},
        epochs=1,  # 24 steps
        checkpoint={"every_steps": 0},
        straggler={"window": 10, "min_fraction": 0.8},
    )
    env = {**env_for(tmp_path), "GPUYARD_TEST_SLOW": cause}
    code, out, err = finish(start_train(spec, env))
    assert code == 0, err[-3000:]
    named = json.loads(out)["stragglers"]
    assert [(s["rank"], s["cause"]) for s in named] == [(1, cause)]
    assert named[0]["slowdown"] > 1.2 and named[0]["slow_steps"] >= 8
    events = [e for e in read_metrics(tmp_path / "run") if e["event"] == "straggler"]
    assert [(e["rank"], e["cause"]) for e in events] == [(1, cause)]
    assert f"rank 1 is a straggler ({cause})" in err
