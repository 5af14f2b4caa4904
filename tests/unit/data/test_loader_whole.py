"""The loader's whole mode: decoded once, one global seeded permutation per epoch, exact and resumable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpuyard.data import IngestOptions, ingest, load_recipe, transform
from gpuyard.data.dataset import DatasetVersion
from gpuyard.data.loader import LoaderConfig, ShardLoader
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit
N = 1000


@pytest.fixture
def ids_version(gpuyard_home: Path, tmp_path: Path) -> DatasetVersion:
    """1000 rows (id, 6x6 image whose first pixel is id % 251, label) in several shards."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (N, 6, 6), dtype=np.uint8)
    images[:, 0, 0] = np.arange(N) % 251
    path = tmp_path / "ids.npz"
    np.savez(path, id=np.arange(N), image=images, label=np.arange(N) % 4)
    return ingest(path, "ids", IngestOptions(shard_bytes=5000))


def _ids(batches: list[dict]) -> list[int]:
    return [int(x) for b in batches for x in b["id"]]


def test_whole_mode_reads_every_row_once_per_rank_and_reshuffles_each_epoch(
    ids_version: DatasetVersion,
) -> None:
    assert len(ids_version.shards) > 3
    cfg = LoaderConfig(batch_size=64, seed=5, whole=True)
    loader = ShardLoader(ids_version, cfg, num_workers=2)  # workers are ignored in whole mode
    batches = list(loader)
    first = _ids(batches)
    assert sorted(first) == list(range(N)) and first != list(range(N))
    assert len(loader) == len(batches) == -(-N // 64) and len(batches[-1]["id"]) == N % 64
    for b in batches:  # the columns of a batch stay row-aligned after the gather
        ids = b["id"].numpy()
        assert b["image"].shape[1:] == (6, 6) and b["image"].dtype == torch.uint8
        np.testing.assert_array_equal(b["image"][:, 0, 0].numpy(), ids % 251)
        np.testing.assert_array_equal(b["label"].numpy(), ids % 4)
    assert _ids(list(ShardLoader(ids_version, cfg))) == first  # seeded
    loader.set_epoch(1)
    second = _ids(list(loader))
    assert sorted(second) == list(range(N)) and second != first
    plain = ShardLoader(ids_version, LoaderConfig(batch_size=64, shuffle=False, whole=True))
    assert _ids(list(plain)) == list(range(N))
    # Ranks: disjoint, the same count each (at most world - 1 rows left out), drop_last honoured.
    for world in (2, 3):
        parts = [_ids(list(ShardLoader(ids_version, cfg, rank=r, world_size=world))) for r in range(world)]
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)) == N // world * world and len({len(p) for p in parts}) == 1
    dropped = list(ShardLoader(ids_version, LoaderConfig(batch_size=64, whole=True, drop_last=True)))
    assert [len(b["id"]) for b in dropped] == [64] * (N // 64)


def test_whole_mode_resumes_exactly_and_refuses_a_streaming_state(ids_version: DatasetVersion) -> None:
    cfg = LoaderConfig(batch_size=50, seed=2, whole=True)
    full = ShardLoader(ids_version, cfg)
    full.set_epoch(3)
    expected = _ids(list(full))
    run = ShardLoader(ids_version, cfg)
    run.set_epoch(3)
    it = iter(run)
    head = [next(it) for _ in range(7)]
    state = run.state_dict()
    assert state["whole"] is True and state["epoch"] == 3 and state["positions"] == {"0": 350}
    resumed = ShardLoader(ids_version, cfg)
    resumed.load_state_dict(state)
    assert _ids(head) + _ids(list(resumed)) == expected
    streaming = ShardLoader(ids_version, LoaderConfig(batch_size=50, seed=2))
    with pytest.raises(ConfigError, match="whole"):
        streaming.load_state_dict(state)
    with pytest.raises(ConfigError, match="whole"):
        ShardLoader(ids_version, cfg).load_state_dict(streaming.state_dict())


def test_whole_mode_takes_one_split_and_text(gpuyard_home: Path, tmp_path: Path) -> None:
    src = tmp_path / "t.csv"
    src.write_text("x,word\n" + "".join(f"{i},w{i % 3}\n" for i in range(300)))
    ingest(src, "words", IngestOptions(shard_bytes=2000))
    out = transform("words", load_recipe("split: {seed: 4}"), engine="serial")
    split = out.to_numpy(["x", "split"])
    want = sorted(int(x) for x, s in zip(split["x"], split["split"], strict=True) if s == "val")
    cfg = LoaderConfig(batch_size=8, split="val", columns=("x", "word"), whole=True)
    batches = list(ShardLoader(out, cfg))
    assert sorted(int(x) for b in batches for x in b["x"]) == want and len(want) == 30
    assert all(w == f"w{int(x) % 3}" for b in batches for x, w in zip(b["x"], b["word"], strict=True))
