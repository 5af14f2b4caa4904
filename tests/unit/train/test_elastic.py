"""Resuming at another world size: the global-batch sampler's arithmetic, position checks, RNG."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuyard.errors import ConfigError
from gpuyard.train import examples as ex
from gpuyard.train.data import (
    GlobalBatchSampler,
    LoaderSource,
    MapSource,
    check_loader_position,
    check_position,
    make_source,
    rank_batch_size,
)
from gpuyard.train.elastic import adapt_rank_state, resized
from gpuyard.train.spec import parse_spec

pytestmark = pytest.mark.unit

DATA = list(range(50))


def global_batches(n: int, g: int, dp: int, epoch: int, drop_last: bool, seed: int = 7) -> list[list[int]]:
    """The global batches of an epoch as `dp` ranks see them: rank slices joined in rank order."""
    ranks = []
    for r in range(dp):
        s = GlobalBatchSampler(list(range(n)), g, r, dp, shuffle=True, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        ranks.append(list(s))
    per = g // dp
    steps = len(ranks[0]) // per
    assert all(len(x) == steps * per for x in ranks)
    return [
        list(itertools.chain.from_iterable(ranks[r][k * per : (k + 1) * per] for r in range(dp)))
        for k in range(steps)
    ]


@pytest.mark.parametrize("drop_last", [True, False])
def test_global_batches_are_the_same_at_every_world_size(drop_last: bool) -> None:
    for epoch in (0, 3):
        one = global_batches(50, 12, 1, epoch, drop_last)
        for dp in (2, 3, 4, 6, 12):
            assert global_batches(50, 12, dp, epoch, drop_last) == one
    assert global_batches(50, 12, 2, 0, drop_last) != global_batches(50, 12, 2, 1, drop_last)


def test_epoch_tail_dropped_or_wrapped_never_dependent_on_ranks() -> None:
    dropped = list(itertools.chain.from_iterable(global_batches(50, 12, 4, 0, drop_last=True)))
    assert len(dropped) == 48 and len(set(dropped)) == 48  # 2 samples left out, none twice
    kept = list(itertools.chain.from_iterable(global_batches(50, 12, 4, 0, drop_last=False)))
    assert len(kept) == 60 and set(kept) == set(range(50))
    counts = Counter(kept)
    order = GlobalBatchSampler(DATA, 12, 0, 4, shuffle=True, seed=7, drop_last=False).epoch_order(0)
    # The 10 samples of padding are the first 10 of the epoch's order, as DistributedSampler pads.
    assert sorted(k for k, c in counts.items() if c == 2) == sorted(order[:10].tolist())
    # Fewer samples than a global batch: wrapped around more than once.
    tiny = GlobalBatchSampler(list(range(5)), 12, 1, 2, shuffle=False, seed=0, drop_last=False)
    assert list(tiny) == [1, 2, 3, 4, 0, 1]
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        GlobalBatchSampler(list(range(5)), 12, 0, 2, shuffle=False, seed=0, drop_last=True)
    with pytest.raises(ConfigError, match="do not split evenly over 5"):
        GlobalBatchSampler(DATA, 12, 0, 5, shuffle=False, seed=0, drop_last=True)


def test_unshuffled_rank_slices_are_contiguous() -> None:
    s = GlobalBatchSampler(list(range(16)), 8, 1, 2, shuffle=False, seed=0, drop_last=True)
    assert list(s) == [4, 5, 6, 7, 12, 13, 14, 15] and len(s) == 8
    s.set_start(4)
    assert len(s) == 4 and list(s) == [12, 13, 14, 15]
    assert list(s) == [4, 5, 6, 7, 12, 13, 14, 15]  # the start applies to one iteration only


def _consume(dp: int, g: int, epoch: int, batches: int | None, state: dict | None = None):
    """Run `dp` MapSources in step; returns (global batches of sample ids, each rank's state)."""
    ds = torch.utils.data.TensorDataset(torch.arange(50))
    sources = [MapSource(ds, g // dp, r, dp, True, 7, False, global_batch=g) for r in range(dp)]
    for s in sources:
        if state is not None:
            s.load_state_dict(state)
        else:
            s.set_epoch(epoch)
    its = [iter(s) for s in sources]
    out: list[list[int]] = []
    while batches is None or len(out) < batches:
        try:
            parts = [next(it)[0].tolist() for it in its]
        except StopIteration:
            break
        out.append(list(itertools.chain.from_iterable(parts)))
    return out, [s.state_dict() for s in sources]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4), (4, 3), (3, 6)])
def test_map_source_continues_at_another_world_size_without_repeats_or_gaps(before: int, after: int) -> None:
    whole, _ = _consume(1, 12, 1, None)
    head, states = _consume(before, 12, 1, 2)
    assert all(st == {**states[0], "dp_size": before} for st in states)  # one position on every rank
    tail, end = _consume(after, 12, 1, None, states[0])
    assert head + tail == whole and len(whole) == 5
    assert end[0]["batches_done"] == 5 and end[0]["dp_size"] == after


def test_position_checks_name_what_differs() -> None:
    per_rank = {"epoch": 0, "batches_done": 3, "dp_size": 2, "batch_size": 8, "global_batch": None}
    check_position(per_rank, 2, 8, None)  # same world: fine
    check_position({"epoch": 0, "batches_done": 3}, 4, 8, None)  # a state from before these keys
    with pytest.raises(ConfigError, match=r"size 2 .* this run has 4 .*data\.global_batch_size set"):
        check_position(per_rank, 4, 8, None)
    glob = {**per_rank, "global_batch": 16}
    check_position(glob, 4, 4, 16)
    with pytest.raises(ConfigError, match="written with 16, this run has 32"):
        check_position(glob, 4, 8, 32)
    with pytest.raises(ConfigError, match="written with None, this run has 16"):
        check_position(per_rank, 2, 8, 16)


def test_rank_batch_size_splits_the_global_batch_over_ranks_and_accumulation() -> None:
    assert rank_batch_size(32, None, 4, 2) == (32, None)
    assert rank_batch_size(32, 48, 4, 2) == (6, 24)
    assert rank_batch_size(32, 48, 1, 1) == (48, 48)
    with pytest.raises(ConfigError, match="48 is not divisible by data-parallel size 5 x grad_accum 2"):
        rank_batch_size(32, 48, 5, 2)


def test_spec_takes_one_batch_size() -> None:
    spec = parse_spec({"data": {"global_batch_size": 64}})
    assert spec.data.global_batch_size == 64
    with pytest.raises(ConfigError, match=r"data\.batch_size .* or data\.global_batch_size, not both"):
        parse_spec({"data": {"batch_size": 8, "global_batch_size": 64}})
    with pytest.raises(ConfigError, match="global_batch_size"):
        parse_spec({"data": {"global_batch_size": 0}})


def test_a_loader_refuses_a_global_batch() -> None:
    with pytest.raises(
        ConfigError, match="global_batch_size needs a map-style Dataset or a loader with set_"
    ):
        make_source(ex.classification_loader(32, batch_size=4), "data.train", 4, 0, 1, True, 0, True, 0, 8)


def test_gpuyard_loader_takes_the_global_batch_and_resumes_resized(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    import numpy as np

    from gpuyard.data import IngestOptions, ingest
    from gpuyard.data.loader import LoaderConfig, ShardLoader

    np.savez(tmp_path / "rows.npz", id=np.arange(40), label=np.arange(40) % 4)
    version = ingest(tmp_path / "rows.npz", "rows", IngestOptions())
    loader = ShardLoader(version, LoaderConfig(batch_size=3, seed=1))  # gives way to the global batch
    source = make_source(loader, "data.train", 4, 1, 2, True, 0, False, 0, 8)
    assert isinstance(source, LoaderSource) and source.global_batch == 8
    ds = loader.dataset
    assert ds.config.global_batch_size == 8 and (ds.rank, ds.world_size) == (1, 2)
    batches = list(source)
    assert len(batches) == len(loader) == 5 and all(len(b["id"]) == 4 for b in batches)
    # Resized: a loader in global-batch mode is accepted (it checks its own state when loading) ...
    meta = {"world_size": 2, "layout": [1, 2, 1]}
    kw = {"seed": 0, "dp_rank": 0, "stage": 0, "world_size": 1, "layout": [1, 1, 1]}
    assert adapt_rank_state(_state(), meta, source=source, **kw)["step"] == 5
    # ... and the launcher refuses another global batch before starting workers.
    state = source.state_dict()
    check_loader_position(state, 8)
    check_loader_position({"positions": {}}, 16)  # a per-rank state: refused elsewhere, by world size
    with pytest.raises(ConfigError, match="global batches of 8 samples per micro-batch, this run has 16"):
        check_loader_position(state, 16)
    with pytest.raises(ConfigError, match="global batches of 8 samples per micro-batch, this run has None"):
        check_loader_position(state, None)


def _state(step: int = 5) -> dict:
    return {"step": step, "rng": {"marker": True}, "data": {}}


def test_adapt_rank_state_keeps_a_same_world_state_and_reseeds_a_resized_one() -> None:
    meta = {"world_size": 2, "layout": [1, 2, 1]}
    source = object()
    kw = {"seed": 3, "stage": 0, "source": source}
    same = adapt_rank_state(_state(), meta, world_size=2, layout=[1, 2, 1], dp_rank=1, **kw)
    assert same["rng"] == {"marker": True}
    assert not resized(meta, 2, [1, 2, 1]) and resized(meta, 4, [1, 4, 1])
    a = adapt_rank_state(_state(), meta, world_size=4, layout=[1, 4, 1], dp_rank=0, **kw)
    b = adapt_rank_state(_state(), meta, world_size=4, layout=[1, 4, 1], dp_rank=1, **kw)
    again = adapt_rank_state(_state(), meta, world_size=4, layout=[1, 4, 1], dp_rank=1, **kw)
    assert a["step"] == 5 and "marker" not in a["rng"]
    assert not torch.equal(a["rng"]["torch"], b["rng"]["torch"])  # ranks draw different dropout masks
    assert torch.equal(b["rng"]["torch"], again["rng"]["torch"])  # and reproducibly


def test_adapt_rank_state_refuses_what_cannot_change() -> None:
    meta = {"world_size": 4, "layout": [2, 2, 1]}
    with pytest.raises(ConfigError, match=r"parallel\.pp: .* pp=2, this run has pp=1"):
        adapt_rank_state(
            _state(), meta, world_size=2, layout=[1, 2, 1], seed=0, dp_rank=0, stage=0, source=None
        )
    loader = LoaderSource(ex.classification_loader(32, batch_size=4))
    with pytest.raises(ConfigError, match="world size 2, this run has 1, and a loader keeps its own"):
        adapt_rank_state(
            _state(),
            {"world_size": 2, "layout": [1, 2, 1]},
            world_size=1,
            layout=[1, 1, 1],
            seed=0,
            dp_rank=0,
            stage=0,
            source=loader,
        )


def test_the_launcher_refuses_before_start_what_the_workers_would_refuse(tmp_path: Path) -> None:
    from gpuyard.train.elastic import check_resume
    from gpuyard.train.parallel import MeshLayout
    from gpuyard.train.spec import TrainSpec

    from .conftest import make_spec, run

    per_rank = make_spec(tmp_path / "per-rank", max_steps=3, grad_accum=1)
    run(per_rank, model=ex.mlp)
    check_resume(per_rank, MeshLayout(1, 1, 1))  # the same world: nothing to check
    with pytest.raises(ConfigError, match=r"size 1 \(batch 16 per rank\), this run has 2"):
        check_resume(per_rank, MeshLayout(1, 2, 1))
    with pytest.raises(ConfigError, match=r"parallel\.tp: .* tp=1, this run has tp=2"):
        check_resume(per_rank, MeshLayout(1, 1, 2))

    doc = make_spec(tmp_path / "global", max_steps=3, grad_accum=1).model_dump()
    doc["data"].pop("batch_size")
    doc["data"]["global_batch_size"] = 16
    glob = TrainSpec.model_validate(doc)
    run(glob, model=ex.mlp)
    check_resume(glob, MeshLayout(1, 2, 1))
    check_resume(glob, MeshLayout(1, 4, 1))
    with pytest.raises(ConfigError, match="16 is not divisible by data-parallel size 3"):
        check_resume(glob, MeshLayout(1, 3, 1))


def test_a_global_batch_skips_the_per_rank_pipeline_check() -> None:
    # batch_size keeps its default (32) when global_batch_size is given: not checked against microbatches
    spec = parse_spec({"data": {"global_batch_size": 48}, "parallel": {"pp": 2, "microbatches": 3}})
    assert spec.data.global_batch_size == 48
    with pytest.raises(ConfigError, match="batch_size=32 must be a multiple"):
        parse_spec({"parallel": {"pp": 2, "microbatches": 3}})


def test_a_global_batch_resumes_bit_exactly_at_the_same_world_size(tmp_path: Path) -> None:
    from gpuyard.train.spec import TrainSpec

    from .conftest import make_spec, run, weights

    def spec(name: str) -> TrainSpec:
        doc = make_spec(tmp_path / name).model_dump()  # 2 epochs, grad_accum 2, dropout model
        doc["data"].pop("batch_size")
        doc["data"]["global_batch_size"] = 32
        return TrainSpec.model_validate(doc)

    def stop_after_4(trainer: Any, event: str) -> None:
        if event == "step" and trainer.step == 4:
            trainer.request_stop()

    whole_t, whole = run(spec("whole"))
    stopped = spec("stopped")
    _, first = run(stopped, callbacks=[stop_after_4])
    assert (first.status, first.step) == ("preempted", 5)
    resumed, second = run(stopped)
    assert (second.status, second.step) == ("completed", whole.step) and whole.step == 16
    a, b = weights(resumed), weights(whole_t)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # dropout RNG restored too
