"""The live scheduler's elastic rules: allowed sizes from the train spec, when to grow, when to shrink."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.scheduler.elastic import ElasticConfig, ElasticJob, allowed_sizes, plan_grows, plan_shrinks
from gpuyard.scheduler.placement import ClusterState, Placement, uniform_cluster
from gpuyard.scheduler.spec import JobSpec, parse_spec
from gpuyard.train.resize import allowed_world_sizes

pytestmark = pytest.mark.unit

NOW = 10_000.0
CFG = ElasticConfig(interval_s=300.0, restart_cost_s=60.0, alpha=0.8)


def _train_spec(tmp_path: Path, data: str, extra: str = "") -> str:
    path = tmp_path / "train.yaml"
    entry = "{entrypoint: pkg.mod:data}"
    path.write_text(f"model: {{entrypoint: pkg.mod:model}}\ndata: {{train: {entry}, {data}}}\n{extra}")
    return str(path)


def _elastic(train: str | None, low: int, high: int, workdir: str | None = None) -> JobSpec:
    job: dict[str, object] = {
        "name": "el",
        "resources": {"gpus": {"min": low, "max": high}},
        "workdir": workdir,
    }
    job.update({"train": train} if train else {"command": ["true"]})
    return parse_spec(job)


def _sizes(train: str | None, low: int, high: int, workdir: str | None = None) -> tuple[int, ...]:
    return allowed_sizes(_elastic(train, low, high, workdir), allowed_world_sizes)


def test_sizes_are_those_that_split_the_global_batch(tmp_path: Path) -> None:
    assert _sizes(None, 2, 5) == (2, 3, 4, 5)
    spec = _train_spec(tmp_path, "global_batch_size: 12")
    assert _sizes(spec, 1, 8) == (1, 2, 3, 4, 6)
    # grad_accum divides it further; tensor parallel takes 2 ranks of every size.
    spec = _train_spec(tmp_path, "global_batch_size: 12", "grad_accum: 2\n")
    assert _sizes(spec, 1, 8) == (1, 2, 3, 6)
    spec = _train_spec(tmp_path, "global_batch_size: 8", "parallel: {tp: 2, data_parallel: fsdp}\n")
    assert _sizes(spec, 2, 8) == (2, 4, 8)
    # A relative path is read from the job's workdir.
    _train_spec(tmp_path, "global_batch_size: 6")
    assert _sizes("train.yaml", 1, 4, workdir=str(tmp_path)) == (1, 2, 3)


def test_a_training_job_without_a_global_batch_or_any_size_is_refused(tmp_path: Path) -> None:
    spec = _train_spec(tmp_path, "batch_size: 8")
    with pytest.raises(ConfigError, match=r"needs data\.global_batch_size") as err:
        _sizes(spec, 1, 4)
    assert "\n" not in str(err.value)
    spec = _train_spec(tmp_path, "global_batch_size: 7")
    with pytest.raises(ConfigError, match=r"no size from 2 to 6 GPUs splits data\.global_batch_size 7"):
        _sizes(spec, 2, 6)


def test_without_the_training_package_every_size_of_the_range_is_allowed(tmp_path: Path) -> None:
    spec = _train_spec(tmp_path, "global_batch_size: 7")
    assert allowed_sizes(_elastic(spec, 2, 4)) == (2, 3, 4)  # the trainer checks when it starts


def test_a_train_spec_not_on_the_server_allows_the_whole_range_an_invalid_one_is_refused(
    tmp_path: Path,
) -> None:
    assert _sizes(str(tmp_path / "elsewhere.yaml"), 2, 4) == (2, 3, 4)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [pkg.mod, model]\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: model: Input should be a valid dictionary"):
        _sizes(str(bad), 2, 4)


def _state(nodes: int, gpus: int, held: list[tuple[int, int]]) -> ClusterState:
    state = ClusterState(uniform_cluster(nodes, gpus))
    for node, n in held:
        state.take(Placement(((node, n),), "held"))
    return state


def _job(jid: int, gpus: int, sizes: range | tuple[int, ...], node: int = 0, **kw: float) -> ElasticJob:
    return ElasticJob(
        id=jid,
        gpus=gpus,
        sizes=tuple(sizes),
        placement=Placement(((node, gpus),), "running"),
        started_at=kw.get("started_at", NOW - 1000),
        remaining_s=kw.get("remaining_s", 3600.0),
    )


def test_grow_into_idle_gpus_to_the_largest_allowed_size() -> None:
    # 8 GPUs: the elastic job holds 2, another job 3; 3 idle: 5 would fit, 4 is the largest allowed.
    state = _state(1, 8, [(0, 2), (0, 3)])
    assert plan_grows(state, [_job(1, 2, (2, 4, 8))], NOW, CFG, multi_node=False) == [(1, 4)]
    assert plan_grows(state, [_job(1, 2, range(2, 9))], NOW, CFG, multi_node=False) == [(1, 5)]
    # Two jobs: the one with more work left grows first, the other gets what is left.
    state = _state(1, 8, [(0, 2), (0, 2)])
    jobs = [_job(1, 2, range(1, 9), remaining_s=1000), _job(2, 2, range(1, 9), remaining_s=5000)]
    assert plan_grows(state, jobs, NOW, CFG, multi_node=False) == [(2, 6)]


def test_no_grow_when_it_does_not_pay_or_too_soon_or_at_the_maximum() -> None:
    state = _state(1, 8, [(0, 4)])
    # 4 -> 8 at alpha 0.8 saves 1 - 0.5**0.8 = 43% of the work left: 200 s saves 85 s < 2 restarts.
    assert plan_grows(state, [_job(1, 4, range(1, 9), remaining_s=200)], NOW, CFG, False) == []
    assert plan_grows(state, [_job(1, 4, range(1, 9), remaining_s=400)], NOW, CFG, False) == [(1, 8)]
    assert plan_grows(state, [_job(1, 4, range(1, 9), started_at=NOW - 299)], NOW, CFG, False) == []
    assert plan_grows(state, [_job(1, 4, (1, 2, 4))], NOW, CFG, False) == []


def test_shrink_as_little_as_lets_the_first_job_start() -> None:
    # 8 GPUs: elastic job 1 holds 6, a rigid job 2; nothing is free.
    state = _state(1, 8, [(0, 6), (0, 2)])
    assert plan_shrinks(state, 4, None, [_job(1, 6, range(2, 9))], NOW, CFG, False) == [(1, 2)]
    assert plan_shrinks(state, 2, None, [_job(1, 6, range(2, 9))], NOW, CFG, False) == [(1, 4)]
    # Only allowed sizes: from 6, to let 3 GPUs start, 3 is not allowed, 2 is.
    assert plan_shrinks(state, 3, None, [_job(1, 6, (2, 4, 6))], NOW, CFG, False) == [(1, 2)]


def test_shrink_the_largest_first_and_several_when_one_is_not_enough() -> None:
    state = _state(1, 8, [(0, 5), (0, 3)])
    jobs = [_job(1, 5, range(1, 9)), _job(2, 3, range(1, 9))]
    assert plan_shrinks(state, 3, None, jobs, NOW, CFG, False) == [(1, 2)]
    state = _state(1, 8, [(0, 4), (0, 4)])
    jobs = [_job(1, 4, range(2, 9)), _job(2, 4, range(2, 9))]
    plans = dict(plan_shrinks(state, 4, None, jobs, NOW, CFG, False))
    assert plans == {1: 2, 2: 2}  # each gives 2; together they make room for 4


def test_no_shrink_when_it_fits_or_shrinking_all_is_not_enough_or_too_soon() -> None:
    free = _state(1, 8, [(0, 4)])
    assert plan_shrinks(free, 4, None, [_job(1, 4, range(1, 9))], NOW, CFG, False) == []
    full = _state(1, 8, [(0, 6), (0, 2)])
    assert plan_shrinks(full, 8, None, [_job(1, 6, range(2, 9))], NOW, CFG, False) == []
    recent = [_job(1, 6, range(2, 9), started_at=NOW - 10)]
    assert plan_shrinks(full, 4, None, recent, NOW, CFG, False) == []


def test_shrink_across_nodes_only_where_the_waiting_job_fits() -> None:
    # Two 4-GPU nodes; the local executor keeps each job on one node. Job 1 holds 3 on node 0, job 2
    # 4 on node 1. A job of 2 fits on node 1 once job 2 gives 2 back.
    state = _state(2, 4, [(0, 3), (1, 4)])
    jobs = [_job(1, 3, range(1, 5), node=0), _job(2, 4, range(2, 5), node=1)]
    assert plan_shrinks(state, 2, None, jobs, NOW, CFG, multi_node=False) == [(2, 2)]
    # A job of 4 needs a whole node: job 2 alone cannot free one (min 2), so both shrink and restart
    # side by side on one node (3 + 1), as the restart order (waiting job first) places them.
    assert plan_shrinks(state, 4, None, jobs, NOW, CFG, multi_node=False) == [(2, 3), (1, 1)]
    # Job 2 rigid at its 4 (min 4): job 1 alone frees no node; nothing shrinks.
    jobs = [_job(1, 3, range(1, 5), node=0), _job(2, 4, (4,), node=1)]
    assert plan_shrinks(state, 4, None, jobs, NOW, CFG, multi_node=False) == []


def test_the_cli_shows_what_an_elastic_job_holds_and_its_range() -> None:
    from gpuyard.cli.jobs import resources_text

    spec = {"resources": {"gpus": 1, "gpus_max": 4}}
    assert resources_text({"gpus": 4, "spec": spec}) == "4 (elastic 1-4)"
    assert resources_text({"gpus": 4, "resize_to": 1, "spec": spec}) == "4 (elastic 1-4, restarts on 1)"
    assert resources_text({"gpus": 2, "spec": {"resources": {"gpus": 2}}}) == "2"
