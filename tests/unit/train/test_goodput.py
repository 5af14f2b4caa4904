"""Goodput of a run from its metrics.jsonl events: every second of the wall time in exactly one bucket."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuyard.train.goodput import CAUSES, compute, describe, step_waits

pytestmark = pytest.mark.unit


def step(t_end: float, n: int, seconds: float, data: float = 0.0, straggler: float = 0.0) -> dict[str, Any]:
    return {
        "time": t_end,
        "event": "metrics",
        "step": n,
        "step_time": seconds,
        "data_wait_s": data,
        "straggler_wait_s": straggler,
    }


def attempt(t: float, started: float, resumed: int = 0) -> dict[str, Any]:
    return {"time": t, "event": "attempt", "started": started, "step": resumed}


def balanced(gp: Any) -> None:
    assert set(gp.lost_s) == set(CAUSES)
    assert gp.productive_s + sum(gp.lost_s.values()) == pytest.approx(gp.wall_s)


def test_one_clean_launch() -> None:
    events = [
        {"time": 100.0, "event": "launch"},
        {"time": 102.0, "event": "params"},
        attempt(102.0, 101.0),
        step(103.0, 1, 1.0),  # startup 100 -> 102
        step(104.0, 2, 1.0),
        {"time": 104.5, "event": "checkpoint", "step": 2, "seconds": 0.4},
        step(105.6, 3, 1.0),  # gap 104 -> 104.6: 0.4 checkpoint, 0.2 other
        {"time": 105.8, "event": "finish", "status": "completed"},
        {"time": 106.0, "event": "launch_end", "exit_code": 0},
    ]
    gp = compute(events)
    assert gp.wall_s == pytest.approx(6.0)
    assert gp.productive_s == pytest.approx(3.0)
    assert gp.lost_s["startup"] == pytest.approx(2.0)
    assert gp.lost_s["checkpoint"] == pytest.approx(0.4)
    assert gp.lost_s["other"] == pytest.approx(0.6)  # 0.2 between steps, 0.4 after the last
    assert gp.lost_s["restart"] == gp.lost_s["recomputed"] == 0.0
    assert gp.ettr == pytest.approx(0.5)
    balanced(gp)


def test_a_killed_attempt_loses_the_steps_past_the_checkpoint_and_the_restart() -> None:
    events = [
        {"time": 0.0, "event": "launch"},
        attempt(1.0, 0.5),
        step(2.0, 1, 1.0),  # startup 0 -> 1
        step(3.0, 2, 1.0),
        {"time": 3.2, "event": "memory_snapshot", "step": 2, "stall_s": 0.2},
        step(4.2, 3, 1.0),
        step(5.2, 4, 1.5 - 0.5),  # a peer killed after this line: this rank raises and says so
        {"time": 5.5, "event": "finish", "status": "failed"},
        attempt(9.0, 8.0, resumed=2),  # the new processes resumed from step 2
        step(10.0, 3, 1.0),  # restart: 5.2 -> 9.0
        step(11.0, 4, 1.0),
        step(12.0, 5, 1.0),
        {"time": 12.0, "event": "finish", "status": "completed"},
        {"time": 12.5, "event": "launch_end", "exit_code": 0},
    ]
    gp = compute(events)
    assert gp.wall_s == pytest.approx(12.5)
    assert gp.lost_s["recomputed"] == pytest.approx(2.0)  # steps 3 and 4 of the first attempt
    assert gp.lost_s["restart"] == pytest.approx(3.8)  # 5.2 -> 9.0
    assert gp.lost_s["startup"] == pytest.approx(1.0)
    assert gp.lost_s["checkpoint"] == pytest.approx(0.2)
    assert gp.productive_s == pytest.approx(5.0)  # steps 1, 2 (first attempt), 3, 4, 5 (second)
    balanced(gp)


def test_data_straggler_and_snapshot_waits_come_out_of_the_kept_steps() -> None:
    events = [
        {"time": 0.0, "event": "launch"},
        attempt(0.0, 0.0),
        step(1.0, 1, 1.0, data=0.1, straggler=0.3),
        {"time": 1.1, "event": "memory_snapshot_wait", "step": 1, "seconds": 0.05},
        step(2.0, 2, 1.0, data=0.2),
        {"time": 2.0, "event": "finish", "status": "completed"},
        {"time": 2.0, "event": "launch_end"},
    ]
    gp = compute(events)
    assert gp.lost_s["data"] == pytest.approx(0.3)
    assert gp.lost_s["straggler"] == pytest.approx(0.3)
    assert gp.lost_s["checkpoint"] == pytest.approx(0.05)  # the wait inside step 2
    assert gp.productive_s == pytest.approx(2.0 - 0.3 - 0.3 - 0.05)
    balanced(gp)


def test_a_second_launch_after_preemption_counts_as_restart_and_keeps_the_first_steps() -> None:
    events = [
        {"time": 0.0, "event": "launch"},
        attempt(1.0, 0.5),
        step(2.0, 1, 1.0),
        step(3.0, 2, 1.0),
        {"time": 3.5, "event": "checkpoint", "step": 2, "reason": "preempted", "seconds": 0.5},
        {"time": 3.5, "event": "finish", "status": "preempted"},
        {"time": 4.0, "event": "launch_end", "exit_code": 75},
        # queued in the scheduler 4 -> 100: not part of the run's wall time
        {"time": 100.0, "event": "launch"},
        attempt(102.0, 101.0, resumed=2),
        step(103.0, 3, 1.0),
        {"time": 103.0, "event": "finish", "status": "completed"},
        {"time": 103.0, "event": "launch_end", "exit_code": 0},
    ]
    gp = compute(events)
    assert gp.wall_s == pytest.approx(7.0)
    assert gp.productive_s == pytest.approx(3.0)
    assert gp.lost_s["restart"] == pytest.approx(2.0)
    assert gp.lost_s["startup"] == pytest.approx(1.0)
    assert gp.lost_s["checkpoint"] == pytest.approx(0.5)
    assert gp.lost_s["recomputed"] == 0.0
    balanced(gp)


def test_a_fresh_restart_before_any_checkpoint_recomputes_everything() -> None:
    events = [
        {"time": 0.0, "event": "launch"},
        attempt(0.0, 0.0),
        step(1.0, 1, 1.0),
        step(2.0, 2, 1.0),
        attempt(4.0, 3.0, resumed=0),
        step(5.0, 1, 1.0),
        {"time": 5.0, "event": "finish", "status": "completed"},
    ]
    gp = compute(events)
    assert gp.lost_s["recomputed"] == pytest.approx(2.0)
    assert gp.productive_s == pytest.approx(1.0)
    assert gp.wall_s == pytest.approx(5.0)  # no launch end: up to the last event
    balanced(gp)


def test_lines_every_n_steps_carry_the_summed_step_times() -> None:
    line = {**step(4.0, 4, 1.0), "steps_time_s": 4.0, "data_wait_s": 0.4}
    events = [{"time": 0.0, "event": "launch"}, attempt(0.0, 0.0), line, {"time": 4.0, "event": "finish"}]
    gp = compute(events)
    assert gp.productive_s == pytest.approx(3.6) and gp.lost_s["data"] == pytest.approx(0.4)
    balanced(gp)


def test_step_waits_median_data_and_the_slow_rank_excess() -> None:
    # 4 ranks; rank 2's own time 0.30 s against the others' median 0.10 s.
    data = [0.01, 0.02, 0.01, 0.03]
    own = [0.10, 0.11, 0.30, 0.09]
    wait, straggler = step_waits(data, own, slowdown=1.2, min_seconds=0.005)
    assert wait == pytest.approx(0.015)
    assert straggler == pytest.approx(0.20)
    # Within the rule's slack: no straggler wait.
    assert step_waits(data, [0.10, 0.11, 0.115, 0.09], 1.2, 0.005)[1] == 0.0
    assert step_waits([0.2], [1.0], 1.2, 0.005) == (0.2, 0.0)


def test_describe_names_the_biggest_losses_first() -> None:
    doc = {"ettr": 0.5, "wall_s": 120.0, "productive_s": 60.0, "lost_s": dict.fromkeys(CAUSES, 0.0)}
    doc["lost_s"].update(restart=40.0, data=20.0)
    assert describe(doc) == "ETTR 50.0% of 2m00s (lost: restart 40s, data 20s)"
    assert describe(None) == "-"


def test_a_stall_inside_a_collective_is_straggler_wait() -> None:
    # Every rank's own time is small at step 4; the step took 1.05 s: all waited in a collective.
    lines = [step(float(n), n, 0.05) for n in (1, 2, 3)] + [step(4.05, 4, 1.05)]
    lines += [step(4.05 + 0.05 * k, 4 + k, 0.05) for k in (1, 2, 3)]
    events = [{"time": 0.0, "event": "launch"}, attempt(0.0, 0.0), *lines, {"time": 5.0, "event": "finish"}]
    gp = compute(events)
    assert gp.lost_s["straggler"] == pytest.approx(1.0)
    assert gp.productive_s == pytest.approx(7 * 0.05)
    balanced(gp)
    # The first step of an attempt (warm-up) is never taken for a stall.
    first = [{"time": 0.0, "event": "launch"}, attempt(0.0, 0.0), step(1.0, 1, 1.0)]
    first += [step(1.0 + 0.05 * k, 1 + k, 0.05) for k in (1, 2, 3)]
    assert compute(first).lost_s["straggler"] == 0.0


def test_a_running_launch_ends_now_and_an_earlier_killed_one_at_its_last_event(tmp_path: Any) -> None:
    from gpuyard.train.goodput import run_goodput

    lines = [
        {"time": 0.0, "event": "launch"},
        attempt(0.0, 0.0),
        step(1.0, 1, 1.0),  # the launcher was killed after this: no launch_end
        {"time": 10.0, "event": "launch"},
        {"time": 10.5, "event": "params", "params": {"big": "x" * 100}},
        attempt(11.0, 10.5, resumed=0),
        step(12.0, 1, 1.0),
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in lines) + "\n{torn")
    gp = run_goodput(tmp_path, now=20.0)
    assert gp is not None and gp["as_of"] == 20.0
    assert gp["wall_s"] == pytest.approx(1.0 + 10.0)  # 0 -> 1, then 10 -> now
    assert gp["lost_s"]["recomputed"] == pytest.approx(1.0)  # step 1 of the first launch, redone
    assert gp["lost_s"]["other"] == pytest.approx(8.0)  # still running after its last step
    assert gp["productive_s"] + sum(gp["lost_s"].values()) == pytest.approx(gp["wall_s"], abs=0.01)
    # A first launch still setting up: all of it is startup so far.
    starting = [{"time": 0.0, "event": "launch"}, {"time": 2.0, "event": "params"}]
    assert compute(starting, now=5.0).lost_s["startup"] == pytest.approx(5.0)


def test_the_launcher_records_the_goodput_while_torchrun_runs(tmp_path: Any, monkeypatch: Any) -> None:
    import threading
    from types import SimpleNamespace

    from tests.waiting import wait_for

    from gpuyard.train import goodput, launch

    seen: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(goodput, "record", lambda run_id, gp: seen.append((run_id, gp)))
    monkeypatch.setattr(launch, "GOODPUT_EVERY_S", 0.01)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"time": 1.0, "event": "launch"}) + "\n")
    (tmp_path / "tracking.json").write_text(json.dumps({"run_id": "abc"}))
    spec = SimpleNamespace(tracking=SimpleNamespace(backend="db"))
    stop = threading.Event()
    meter = threading.Thread(target=launch._goodput_loop, args=(spec, tmp_path, stop))
    meter.start()
    try:
        wait_for(lambda: seen)
    finally:
        stop.set()
        meter.join()
    run_id, gp = seen[0]
    # Still starting up (no attempt yet): launch to now is startup, and as_of says when.
    assert run_id == "abc" and gp["as_of"] > 1.0
    assert gp["lost_s"]["startup"] == pytest.approx(gp["wall_s"]) and gp["wall_s"] > 0
