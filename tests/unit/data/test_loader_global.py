"""The loader's global-batch mode: one world-size independent order, resumed at another world size
(and worker count) with exactly the next unseen rows, within an epoch and across epochs."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuyard.data import IngestOptions, ingest, load_recipe, transform
from gpuyard.data.dataset import DatasetVersion
from gpuyard.data.loader import LoaderConfig, ShardLoader
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit
N = 500


@pytest.fixture
def ids_version(gpuyard_home: Path, tmp_path: Path) -> DatasetVersion:
    """500 rows (id, 4x4 image, label) in about 8 shards."""
    rng = np.random.default_rng(0)
    path = tmp_path / "ids.npz"
    np.savez(
        path, id=np.arange(N), image=rng.integers(0, 255, (N, 4, 4), dtype=np.uint8), label=np.arange(N) % 4
    )
    return ingest(path, "ids", IngestOptions(shard_bytes=2000))


def _config(g: int, **kw: Any) -> LoaderConfig:
    return LoaderConfig(**{"global_batch_size": g, "shuffle_buffer": 64, "seed": 3, **kw})


def run(
    version: DatasetVersion,
    cfg: LoaderConfig,
    world: int,
    *,
    epochs: tuple[int, ...] = (0,),
    state: dict[str, Any] | None = None,
    steps: int | None = None,
    **loader_kw: Any,
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """`world` ranks in step over `epochs` (from `state` when given, then the later epochs): the
    global batches as the ranks' slices joined in rank order, and each rank's state after `steps`."""
    loaders = [ShardLoader(version, cfg, rank=r, world_size=world, **loader_kw) for r in range(world)]
    out: list[list[int]] = []
    for n, epoch in enumerate(epochs):
        for loader in loaders:
            if state is not None and n == 0:
                loader.load_state_dict(state)
            else:
                loader.set_epoch(epoch)
        its = [iter(loader) for loader in loaders]
        while steps is None or len(out) < steps:
            try:
                parts = [next(it)["id"].tolist() for it in its]
            except StopIteration:
                break
            assert len({len(p) for p in parts}) == 1  # every rank its equal share
            out.append(list(itertools.chain.from_iterable(parts)))
        if steps is not None and len(out) >= steps:
            break
    return out, [loader.state_dict() for loader in loaders]


@pytest.mark.parametrize("kw", [{}, {"drop_last": True}, {"whole": True}, {"shuffle": False}])
def test_global_batches_do_not_depend_on_the_world_size(ids_version: DatasetVersion, kw: dict) -> None:
    cfg = _config(24, **kw)
    one, _ = run(ids_version, cfg, 1, epochs=(2,))
    flat = list(itertools.chain.from_iterable(one))
    assert all(len(b) == 24 for b in one) and len(ShardLoader(ids_version, cfg)) == len(one)
    if kw.get("drop_last"):
        assert len(one) == N // 24 and len(set(flat)) == len(flat)  # the tail dropped, nothing twice
    else:  # the tail filled by wrapping to the start of the epoch's order: once each, the first 4 twice
        assert len(one) == 21 and set(flat) == set(range(N))
        assert sorted(k for k, c in Counter(flat).items() if c == 2) == sorted(flat[:4])
    if kw.get("shuffle") is False:
        assert flat[:N] == list(range(N))
    for world in (2, 3, 4, 12):
        assert run(ids_version, cfg, world, epochs=(2,))[0] == one, world
    other_epoch, _ = run(ids_version, cfg, 1, epochs=(3,))
    assert (other_epoch != one) == (kw.get("shuffle") is not False)


def test_resume_at_another_world_size_continues_with_the_next_unseen_rows(
    ids_version: DatasetVersion,
) -> None:
    cfg = _config(24)
    whole, _ = run(ids_version, cfg, 1, epochs=(0, 1))
    assert len(whole) == 42
    for before, after, step in [(2, 1, 5), (1, 2, 7), (2, 4, 13), (4, 3, 1), (3, 6, 20), (2, 3, 30)]:
        head, states = run(ids_version, cfg, before, epochs=(0, 1), steps=step)
        assert all(s == {**states[0], "world_size": before} for s in states)  # one position on every rank
        assert states[0]["samples"] == (step % 21) * 24
        later = tuple(range(states[0]["epoch"], 2))
        tail, _ = run(ids_version, cfg, after, epochs=later, state=states[0])
        assert head + tail == whole, (before, after, step)


def test_resume_across_the_epoch_boundary(ids_version: DatasetVersion) -> None:
    cfg = _config(24, whole=False)
    whole, _ = run(ids_version, cfg, 1, epochs=(4, 5, 6))
    # After the last batch of epoch 4 (its iterator not yet exhausted): the epoch is over on resume.
    head, states = run(ids_version, cfg, 2, epochs=(4, 5, 6), steps=21)
    assert (states[0]["epoch"], states[0]["samples"]) == (4, 21 * 24)
    tail, _ = run(ids_version, cfg, 4, epochs=(4, 5, 6), state=states[0])
    assert head + tail == whole
    # Mid-epoch 5 (after the boundary) at W=3, resumed at W=8 through epoch 6.
    head, states = run(ids_version, cfg, 3, epochs=(4, 5, 6), steps=30)
    assert (states[0]["epoch"], states[0]["samples"]) == (5, 9 * 24)
    tail, _ = run(ids_version, cfg, 8, epochs=(5, 6), state=states[0])
    assert head + tail == whole


def test_any_world_sizes_and_steps(ids_version: DatasetVersion) -> None:
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        per=st.integers(1, 5),
        worlds=st.tuples(st.integers(1, 6), st.integers(1, 6)),
        buffer=st.sampled_from([16, 64, 1000]),
        step=st.integers(0, 40),
        drop_last=st.booleans(),
    )
    def check(per: int, worlds: tuple[int, int], buffer: int, step: int, drop_last: bool) -> None:
        g = per * worlds[0] * worlds[1]  # divisible by both world sizes
        cfg = _config(g, shuffle_buffer=buffer, drop_last=drop_last)
        whole, _ = run(ids_version, cfg, 1)
        step %= len(whole) + 1  # up to just after the last batch (a finished pass restarts the epoch)
        head, states = run(ids_version, cfg, worlds[0], steps=step)
        tail, _ = run(ids_version, cfg, worlds[1], state=states[0])
        assert head + tail == whole
        flat = list(itertools.chain.from_iterable(whole))
        assert len(flat) == len(whole) * g and set(flat) <= set(range(N))
        assert len(set(flat)) == (len(flat) if drop_last else N)

    check()


@pytest.mark.parametrize("buffer", [48, 50])  # shipments of whole blocks (48 = 4 global batches), or not
def test_workers_change_nothing_and_a_state_moves_between_worker_counts(
    ids_version: DatasetVersion, buffer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpuyard.data.loader as loader_module

    monkeypatch.setattr(loader_module, "SHIPMENT_ROWS", 24)  # a few batches per shipment: workers alternate
    cfg = _config(12, shuffle_buffer=buffer)
    plain, _ = run(ids_version, cfg, 2)
    threads, _ = run(ids_version, cfg, 2, num_workers=3, worker_mode="thread")
    assert threads == plain
    head, states = run(ids_version, cfg, 2, steps=9, num_workers=2, worker_mode="thread")
    tail, _ = run(ids_version, cfg, 3, state=states[0], num_workers=3, worker_mode="thread")
    assert head + tail == plain


def test_split_and_augmentation_in_global_mode(ids_version: DatasetVersion) -> None:
    out = transform(
        "ids", load_recipe("split: {seed: 0}\naugment: {column: image, hflip: 0.5}"), engine="serial"
    )
    train = set(out.to_numpy(["id"], split="train")["id"].tolist())
    cfg = _config(8, split="train", drop_last=True)
    one, _ = run(out, cfg, 1)
    assert run(out, cfg, 4)[0] == one and set(itertools.chain.from_iterable(one)) <= train
    assert len(one) == len(train) // 8
    # Augmentation is seeded per rank and batch: the same whatever the worker count.
    a = list(ShardLoader(out, cfg, rank=1, world_size=2))
    b = list(ShardLoader(out, cfg, rank=1, world_size=2, num_workers=2, worker_mode="thread"))
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(a, b, strict=True)) and len(a) == len(one)


def test_refusals_are_one_line(ids_version: DatasetVersion) -> None:
    cfg = _config(12)
    with pytest.raises(ConfigError, match="global_batch_size 12 does not split evenly over world size 5"):
        list(ShardLoader(ids_version, cfg, rank=0, world_size=5))
    with pytest.raises(ConfigError, match="over world size 5"):
        len(ShardLoader(ids_version, cfg, rank=0, world_size=5))
    _, states = run(ids_version, cfg, 2, steps=3)
    with pytest.raises(ConfigError, match="over world size 5"):
        ShardLoader(ids_version, cfg, rank=0, world_size=5).load_state_dict(states[0])
    with pytest.raises(ConfigError, match="global_batch_size=12, this loader has 24"):
        ShardLoader(ids_version, _config(24)).load_state_dict(states[0])
    with pytest.raises(
        ConfigError, match=r"saved in global-batch mode .* LoaderConfig\(global_batch_size=12\)"
    ):
        ShardLoader(ids_version, LoaderConfig(batch_size=6)).load_state_dict(states[0])
    # Per-rank states: refused at another world size, and in global-batch mode at any.
    per_rank = ShardLoader(ids_version, LoaderConfig(batch_size=6), rank=1, world_size=2)
    it = iter(per_rank)
    next(it)
    state = per_rank.state_dict()
    with pytest.raises(ConfigError, match="per-rank mode at world size 2, this loader has world size 1"):
        ShardLoader(ids_version, LoaderConfig(batch_size=6)).load_state_dict(state)
    with pytest.raises(
        ConfigError, match=r"per-rank mode \(world size 2\), this loader takes global batches"
    ):
        ShardLoader(ids_version, cfg, rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="global_batch_size must be >= 1"):
        LoaderConfig(global_batch_size=0)
    with pytest.raises(ConfigError, match="fewer than one global batch of 600"):
        list(ShardLoader(ids_version, _config(600, drop_last=True)))
    [wrapped], _ = run(ids_version, _config(1200), 2)  # without drop_last: the order, wrapped twice
    assert len(wrapped) == 1200 and sorted(Counter(Counter(wrapped).values()).items()) == [(2, 300), (3, 200)]
    # set_global_batch (what the trainer calls): sets the mode and the rank; refuses what cannot hold.
    loader = ShardLoader(ids_version, LoaderConfig(batch_size=6))
    loader.set_global_batch(12, 1, 3)
    assert loader.dataset.config.global_batch_size == 12 and len(loader) == -(-N // 12)
    assert [len(b["id"]) for b in itertools.islice(loader, 2)] == [4, 4]
    with pytest.raises(ConfigError, match="over world size 5"):
        ShardLoader(ids_version, LoaderConfig()).set_global_batch(12, 0, 5)
    with pytest.raises(ConfigError, match="made with 12, asked for 24"):
        ShardLoader(ids_version, cfg).set_global_batch(24, 0, 1)
