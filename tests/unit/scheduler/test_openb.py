"""The openb reader (Alibaba's GPU-sharing traces) and `gpuyard sim` on a slice of them.

The three openb files the tests read are in the repository (tests/unit/scheduler/data/openb, with their
source and terms in the README there), so every test runs in a fresh clone; the others write small
files of the same format.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.scheduler.openb import (
    NODE_LIST,
    POD_LISTS,
    is_openb_nodes,
    is_openb_pods,
    load_openb_nodes,
    load_openb_tasks,
    traces_dir,
)
from gpuyard.scheduler.trace import load_trace

pytestmark = pytest.mark.unit

TRACES = Path(__file__).parent / "data" / "openb"
POD_HEADER = ",".join(
    [
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec",
        "qos,pod_phase,creation_time,deletion_time,scheduled_time",
    ]
)


def _write(path: Path, header: str, rows: list[str]) -> Path:
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_traces_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUYARD_TRACES", str(tmp_path))
    assert traces_dir() == tmp_path
    monkeypatch.delenv("GPUYARD_TRACES")
    assert traces_dir().parts[-2:] == ("shared", "traces")


def test_pods_shares_multi_gpu_models_and_times(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "pods.csv",
        POD_HEADER,
        [
            "p0,8000,30517,0,0,,BE,Running,100,200,100",
            "p1,6000,12288,1,460,,LS,Running,150,1150,151",
            "p2,12000,24576,8,1000,V100M16|V100M32,LS,Failed,160,160,",
            "p3,4000,1024,1,250,nan,BE,Pending,170,,",
        ],
    )
    assert is_openb_pods(path) and not is_openb_nodes(path)
    cpu_only, share, multi, pending = load_openb_tasks(path)
    assert (cpu_only.num_gpu, cpu_only.gpu_milli, cpu_only.gpu, cpu_only.duration) == (0, 0, 0.0, 100.0)
    assert (share.num_gpu, share.gpu_milli, share.gpu, share.creation, share.duration) == (
        1,
        460,
        0.46,
        150.0,
        1000.0,
    )
    assert (multi.gpu, multi.gpu_spec, multi.duration) == (8.0, ("V100M16", "V100M32"), 0.0)
    assert (pending.gpu_spec, pending.creation, pending.duration) == ((), None, None)
    assert load_openb_tasks(path, limit=2)[-1].name == "p1"
    with pytest.raises(ConfigError, match="openb pod list"):
        load_trace(path)  # the job-trace reader points to this one


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("p,1000,1024,1,abc,,LS,Running,1,2,1", "line 2: column 'gpu_milli' is 'abc', not an integer"),
        ("p,1000,1024,1,1200,,LS,Running,1,2,1", "line 2: gpu_milli 1200 with num_gpu 1"),
        ("p,1000,1024,2,500,,LS,Running,1,2,1", "line 2: a share of a GPU (gpu_milli 500) with num_gpu 2"),
        ("p,-5,1024,0,0,,LS,Running,1,2,1", "line 2: column 'cpu_milli' is -5, must be >= 0"),
        ("p,1000,1024,1,500,,LS,Running,9,2,1", "line 2: deletion_time 2 before creation_time 9"),
    ],
)
def test_bad_pod_rows_are_named(tmp_path: Path, row: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_openb_tasks(_write(tmp_path / "pods.csv", POD_HEADER, [row]))


def test_nodes_and_wrong_files(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "nodes.csv",
        "sn,cpu_milli,memory_mib,gpu,model",
        ["n0,64000,262144,2,P100", "n1,96000,1,0,"],
    )
    assert [(n.gpus, n.model) for n in load_openb_nodes(path)] == [(2, "P100"), (0, "")]
    with pytest.raises(ConfigError, match="lacks the openb columns"):
        load_openb_nodes(_write(tmp_path / "x.csv", "a,b", ["1,2"]))
    with pytest.raises(ConfigError, match="lacks the openb columns"):
        load_openb_tasks(path)
    with pytest.raises(NotFoundError, match="no such file"):
        load_openb_nodes(tmp_path / "missing.csv")
    with pytest.raises(ConfigError, match="no pods"):
        load_openb_tasks(_write(tmp_path / "empty.csv", POD_HEADER, []))


def test_the_openb_files_in_the_repository() -> None:
    nodes = load_openb_nodes(TRACES / NODE_LIST)
    assert (len(nodes), sum(n.gpus for n in nodes)) == (1213, 6212)  # as the README says
    share40, multi50 = (load_openb_tasks(TRACES / name) for name in POD_LISTS)
    assert len(share40) == 8152 and all(t.duration is not None for t in share40)
    assert all(t.duration is None for t in multi50)  # that file has no times
    shares = [t for t in share40 if 0 < t.gpu_milli < 1000]
    assert len(shares) / sum(1 for t in share40 if t.num_gpu) > 0.3
    assert {t.num_gpu for t in multi50} == {0, 1, 2, 4, 8}


def _slice(tmp_path: Path, pod_stride: int, node_stride: int) -> tuple[Path, Path]:
    """Every ``pod_stride``-th pod of gpushare40 (the file lists CPU-only pods first) and every
    ``node_stride``-th node, written to tmp_path."""
    lines = (TRACES / POD_LISTS[0]).read_text().splitlines()
    trace = tmp_path / "slice.csv"
    trace.write_text("\n".join([lines[0], *lines[1::pod_stride]]) + "\n")
    node_lines = (TRACES / NODE_LIST).read_text().splitlines()
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("\n".join([node_lines[0], *node_lines[1::node_stride]]) + "\n")
    return trace, nodes


def _sim(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from gpuyard.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["sim", *args])
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out, out.err


def test_sim_fills_a_slice_of_the_openb_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, nodes = _slice(tmp_path, pod_stride=14, node_stride=40)
    args = ["--trace", str(trace), "--node-list", str(nodes), "--packing", "fgd,bestfit,firstfit", "--json"]
    code, out, err = _sim(args, capsys)
    assert code == 0, err
    doc = json.loads(out)
    gpus = doc["gpus"]
    assert gpus == sum(int(line.split(",")[3]) for line in nodes.read_text().splitlines()[1:])
    for r in doc["results"]:
        assert r["points"][-1] == 1.3 and 1.0 in r["points"]
        assert r["placed"] + r["failed"] == doc["arrivals"]
        unalloc = r["unallocated"]
        assert all(a >= b - 1e-12 for a, b in itertools.pairwise(unalloc))  # nothing leaves
        # Early on everything fits: the unallocated share is what has not arrived, to within one task.
        assert unalloc[0] == pytest.approx(1 - r["points"][0], abs=8 / gpus)
        assert 0.0 <= unalloc[-1] < 0.5
    code, out, _ = _sim(["--trace", str(trace), "--node-list", str(nodes), "--packing", "fgd"], capsys)
    assert code == 0 and "unallocated GPU %" in out and "fgd:" in out and "at 100%" in out


def test_sim_replays_a_slice_for_jct(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, nodes = _slice(tmp_path, pod_stride=27, node_stride=40)
    tasks = load_openb_tasks(trace)
    base = ["--trace", str(trace), "--node-list", str(nodes), "--mode", "replay", "--json"]
    code, out, err = _sim([*base, "--packing", "bestfit"], capsys)
    assert code == 0, err
    (r,) = json.loads(out)["results"]
    if r["waited"] == 0:  # at the trace's own pace nothing waits: JCT is the run time
        assert r["avg_jct_s"] == pytest.approx(sum(t.duration or 0 for t in tasks) / len(tasks))
    code, out, _ = _sim([*base, "--packing", "bestfit,fgd", "--time-scale", "0.0001"], capsys)
    rushed = json.loads(out)["results"]
    assert all(x["waited"] > 0 and x["avg_jct_s"] > r["avg_jct_s"] for x in rushed)


def test_sim_refuses_bad_openb_options_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write(tmp_path / "pods.csv", POD_HEADER, ["p1,6000,12288,1,460,,LS,Running,150,1150,151"])
    nodes = _write(tmp_path / "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model", ["n0,64000,262144,2,T4"])
    for args, message in (
        (["--packing", "worstfit"], "--packing 'worstfit'"),
        (["--mode", "drain"], "--mode 'drain'"),
        (["--node-list", str(tmp_path / "none.csv")], "no such file"),
    ):
        full = (
            ["--trace", str(trace), *args]
            if "--node-list" in args
            else ["--trace", str(trace), "--node-list", str(nodes), *args]
        )
        code, _, err = _sim(full, capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    philly = _write(tmp_path / "jobs.csv", "submit_time,duration,num_gpus", ["0,10,1"])
    code, _, err = _sim(["--trace", str(philly)], capsys)
    assert code == 2 and "--nodes is needed" in err


def test_a_generic_trace_with_gpu_shares_is_placed_gpu_by_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.scheduler.trace import has_gpu_shares, load_share_trace

    trace = _write(
        tmp_path / "jobs.csv", "submit_time,duration,num_gpus", ["0,10,0.5", "0,10,0.5", "0,5,0.25", "0,1,1"]
    )
    assert has_gpu_shares(trace)
    assert [(t.num_gpu, t.gpu_milli, t.duration) for t in load_share_trace(trace)] == [
        (1, 500, 10.0),
        (1, 500, 10.0),
        (1, 250, 5.0),
        (1, 1000, 1.0),
    ]
    with pytest.raises(ConfigError, match=r"num_gpus 0\.5 is a share of a GPU"):
        load_trace(trace)  # the whole-GPU simulator does not round a share away
    # One GPU: the two halves share it; the quarter waits for them (10 s), the whole GPU for the
    # quarter too (15 s): JCTs 10, 10, 15, 16.
    code, out, err = _sim(["--trace", str(trace), "--nodes", "1", "--gpus-per-node", "1", "--json"], capsys)
    assert code == 0, err
    results = json.loads(out)["results"]
    assert [r["policy"] for r in results] == ["fgd", "bestfit"]
    assert all(
        r["avg_jct_s"] == pytest.approx(12.75) and r["avg_wait_s"] == pytest.approx(6.25) for r in results
    )
    code, _, err = _sim(["--trace", str(trace), "--nodes", "1", "--policy", "las"], capsys)
    assert code == 2 and "replayed in arrival order" in err
    bad = _write(tmp_path / "bad.csv", "submit_time,duration,num_gpus", ["0,10,1.5"])
    code, _, err = _sim(["--trace", str(bad), "--nodes", "1"], capsys)
    assert code == 2 and "num_gpus 1.5: a share of one GPU (< 1) or whole GPUs" in err
    assert not has_gpu_shares(_write(tmp_path / "whole.csv", "submit_time,duration,num_gpus", ["0,10,2"]))
