"""`gpuyard train` with in-memory checkpoints on 2 CPU ranks (gloo): a SIGKILLed rank resumes from host
memory, a lost node's rank from its peer's replica; both end bit-equal to a run never interrupted."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from gpuyard.tracking.files import read_metrics

from .conftest import env_for, final_weights, finish, start_train, wait_for_file, write_spec

pytestmark = pytest.mark.multiproc

# Snapshots every 2 steps, persisted every 4 (no other periodic storage checkpoint). Rank 1 is
# killed at step 11: memory holds step 10, storage step 8 (the epoch end).
MEMORY = {"every_steps": 0, "memory_every": 2, "persist_every": 4, "keep": 2}


def _killed_run(tmp_path: Path, mode: str) -> list[dict[str, object]]:
    spec = write_spec(tmp_path, checkpoint=MEMORY, callbacks=["memory_hooks:kill_rank1"])
    proc = start_train(spec, env_for(tmp_path, mode=mode, step="11"))
    wait_for_file(tmp_path / "victim.pid", proc)
    snapshots = Path((tmp_path / "snapshot_dir").read_text())
    # The launcher's private folder: a random name (not its pid), mode 0700, the ranks' snapshots inside.
    private = snapshots.parent
    assert private.parent == Path("/dev/shm") and private.name.startswith("gpuyard-launch-")
    assert str(proc.pid) not in private.name and (private.stat().st_mode & 0o777) == 0o700
    os.kill(int((tmp_path / "victim.pid").read_text()), signal.SIGKILL)
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    assert json.loads(out)["status"] == "completed"
    assert not private.exists()  # the launcher removed the node's snapshots when torchrun ended
    return [e for e in read_metrics(tmp_path / "run") if e["event"] == "resume"]


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_killed_rank_resumes_from_host_memory(tmp_path: Path, reference) -> None:
    [resume] = _killed_run(tmp_path, "kill")
    assert resume["source"] == "memory" and resume["step"] == 10 and resume["storage_step"] == 8
    assert resume["ranks"] == {"0": "memory", "1": "memory"}
    _assert_bit_equal(final_weights(tmp_path / "run"), reference)


def test_lost_node_resumes_from_the_peer_replica(tmp_path: Path, reference) -> None:
    [resume] = _killed_run(tmp_path, "lose_node")
    # Rank 1's own snapshots went with its node: rank 0 sent the replica it keeps.
    assert resume["source"] == "memory" and resume["step"] == 10
    assert resume["ranks"] == {"0": "memory", "1": "peer 0"}
    _assert_bit_equal(final_weights(tmp_path / "run"), reference)


def test_fsdp_shards_resume_from_memory_bit_equal(tmp_path: Path) -> None:
    """FSDP2: snapshots hold each rank's shards (DTensor local parts), persisted as sharded DCP."""
    fsdp = {"data_parallel": "fsdp"}
    ref_dir = tmp_path / "reference"
    code, _, err = finish(start_train(write_spec(ref_dir, parallel=fsdp), env_for(ref_dir)))
    assert code == 0, err[-3000:]
    run = tmp_path / "killed"
    spec = write_spec(run, parallel=fsdp, checkpoint=MEMORY, callbacks=["memory_hooks:kill_rank1"])
    proc = start_train(spec, env_for(run, mode="lose_node", step="11"))
    wait_for_file(run / "victim.pid", proc)
    os.kill(int((run / "victim.pid").read_text()), signal.SIGKILL)
    code, _, err = finish(proc)
    assert code == 0, err[-3000:]
    [resume] = [e for e in read_metrics(run / "run") if e["event"] == "resume"]
    assert resume["source"] == "memory" and resume["step"] == 10
    assert resume["ranks"] == {"0": "memory", "1": "peer 0"}
    _assert_bit_equal(final_weights(run / "run"), final_weights(ref_dir / "run"))
