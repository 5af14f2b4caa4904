"""The loader with real DataLoader worker processes: disjoint ranks and workers, exact resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpuyard.data import IngestOptions, ingest, load_recipe, transform
from gpuyard.data.dataset import DatasetVersion
from gpuyard.data.loader import LoaderConfig, ShardLoader

pytestmark = pytest.mark.integration
N = 3000


@pytest.fixture
def version(gpuyard_home: Path, tmp_path: Path) -> DatasetVersion:
    rng = np.random.default_rng(1)
    path = tmp_path / "ids.npz"
    np.savez(
        path, id=np.arange(N), image=rng.integers(0, 255, (N, 8, 8), dtype=np.uint8), label=np.arange(N) % 3
    )
    ingest(path, "ids", IngestOptions(shard_bytes=20_000))
    return transform("ids", load_recipe("augment: {column: image, hflip: 0.5, rotate: 10}"), engine="serial")


def _ids(batches: list[dict]) -> list[int]:
    return [int(x) for b in batches for x in b["id"]]


def test_two_ranks_with_two_workers_each_are_disjoint(version: DatasetVersion) -> None:
    cfg = LoaderConfig(batch_size=32, shuffle_buffer=500, seed=4)
    per_rank = [_ids(list(ShardLoader(version, cfg, num_workers=2, rank=r, world_size=2))) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == N // 2
    assert not set(per_rank[0]) & set(per_rank[1]) and len(set(per_rank[0]) | set(per_rank[1])) == N
    # Workers change how rows are split, not which rows a rank sees.
    single = _ids(list(ShardLoader(version, cfg, num_workers=0, rank=0, world_size=2)))
    assert len(single) == N // 2


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_with_workers_is_exact(version: DatasetVersion, persistent: bool) -> None:
    cfg = LoaderConfig(batch_size=16, shuffle_buffer=300, seed=2)
    reference = ShardLoader(version, cfg, num_workers=2)
    reference.set_epoch(3)
    full = [(b["id"].clone(), b["image"].clone()) for b in reference]
    for stop in (5, 60, len(full) - 1):  # inside the first shipment, later, and at the very end
        loader = ShardLoader(version, cfg, num_workers=2, persistent_workers=persistent)
        loader.set_epoch(3)
        it = iter(loader)
        head = [next(it) for _ in range(stop)]
        state = loader.state_dict()
        del it
        resumed = ShardLoader(version, cfg, num_workers=2, persistent_workers=persistent)
        resumed.load_state_dict(state)
        rest = list(resumed)
        got = [(b["id"], b["image"]) for b in head + rest]
        assert len(got) == len(full)
        for (ia, xa), (ib, xb) in zip(full, got, strict=True):
            assert torch.equal(ia, ib) and torch.equal(xa, xb)  # same rows, same augmentation


def test_persistent_workers_follow_set_epoch(version: DatasetVersion) -> None:
    cfg = LoaderConfig(batch_size=64, seed=8)
    loader = ShardLoader(version, cfg, num_workers=2, persistent_workers=True)
    fresh = ShardLoader(version, cfg, num_workers=2)
    orders = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        fresh.set_epoch(epoch)
        orders.append(_ids(list(loader)))
        assert orders[-1] == _ids(list(fresh))
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == list(range(N))


def test_thread_workers_yield_what_worker_processes_yield(version: DatasetVersion) -> None:
    cfg = LoaderConfig(batch_size=16, shuffle_buffer=300, seed=2)
    procs = ShardLoader(version, cfg, num_workers=2)
    threads = ShardLoader(version, cfg, num_workers=2, worker_mode="thread")
    procs.set_epoch(1)
    threads.set_epoch(1)
    a = [(b["id"].clone(), b["image"].clone()) for b in procs]
    b = [(x["id"], x["image"]) for x in threads]
    assert len(a) == len(b)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b, strict=True))
    # A position taken with thread workers resumes with worker processes (and the other way round).
    half = ShardLoader(version, cfg, num_workers=2, worker_mode="thread")
    half.set_epoch(1)
    it = iter(half)
    head = [next(it)["id"].clone() for _ in range(40)]
    it.close()
    resumed = ShardLoader(version, cfg, num_workers=2)
    resumed.load_state_dict(half.state_dict())
    rest = [x["id"] for x in resumed]
    assert all(torch.equal(p[0], q) for p, q in zip(a, head + rest, strict=True))


def test_global_batches_with_worker_processes_resume_at_another_world_size(
    version: DatasetVersion, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Global-batch mode: 2 ranks with 2 persistent worker processes each yield the same global batches
    # (and augmentation) as 2 ranks without workers; their state resumes on 3 ranks with thread workers.
    import gpuyard.data.loader as loader_module

    monkeypatch.setattr(loader_module, "SHIPMENT_ROWS", 96)  # shipments of 2 batches: workers alternate
    cfg = LoaderConfig(global_batch_size=96, shuffle_buffer=300, seed=2)

    def ranks(world: int, **kw: object) -> list[ShardLoader]:
        return [ShardLoader(version, cfg, rank=r, world_size=world, **kw) for r in range(world)]  # type: ignore[arg-type]

    plain = [[(b["id"], b["image"]) for b in loader] for loader in ranks(2)]
    procs = ranks(2, num_workers=2, persistent_workers=True)
    its = [iter(loader) for loader in procs]
    head = [[next(it) for _ in range(17)] for it in its]  # inside the ninth shipment
    state = procs[0].state_dict()
    assert state == {**procs[1].state_dict(), "world_size": 2} and state["samples"] == 17 * 96
    for r in range(2):
        got = [(b["id"], b["image"]) for b in head[r]]
        assert all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            for a, b in zip(plain[r][:17], got, strict=True)
        )
    del its
    whole = [torch.cat([plain[0][k][0], plain[1][k][0]]) for k in range(len(plain[0]))]
    resumed = ranks(3, num_workers=2, worker_mode="thread")
    for loader in resumed:
        loader.load_state_dict(state)
    tail = [
        torch.cat(parts) for parts in zip(*[[b["id"] for b in loader] for loader in resumed], strict=True)
    ]
    assert len(tail) == len(whole) - 17 and all(
        torch.equal(a, b) for a, b in zip(whole[17:], tail, strict=True)
    )
