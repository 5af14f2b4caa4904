"""The straggler rule on synthetic step times: who is named, with which cause, and who is not."""

from __future__ import annotations

import random
import socket
import statistics

import pytest

from gpuyard.errors import ConfigError
from gpuyard.train.spec import parse_spec
from gpuyard.train.straggler import (
    SchedulerReporter,
    StepTimes,
    Straggler,
    StragglerDetector,
    node_name,
    others_medians,
    slower_at_step,
)

pytestmark = pytest.mark.unit

NORMAL = StepTimes(data_s=0.010, compute_s=0.100, collective_s=0.020)


def _run(detector: StragglerDetector, steps: int, make: object) -> list:
    found = []
    for step in range(1, steps + 1):
        found += detector.observe(step, make(step))  # type: ignore[operator]
    return found


def test_a_rank_slower_in_compute_is_named_once_with_its_cause() -> None:
    slow = StepTimes(0.010, 0.200, 0.001)  # the others wait for it in the all-reduce
    waiting = StepTimes(0.010, 0.100, 0.110)
    detector = StragglerDetector(4, window=10, min_fraction=0.8)
    found = _run(detector, 30, lambda s: [waiting, waiting, slow, waiting])
    assert len(found) == 1
    [s] = found
    assert (s.rank, s.cause, s.step, s.slow_steps) == (2, "compute", 10, 10)
    assert s.slowdown == pytest.approx(0.21 / 0.11, rel=1e-3)
    assert "rank 2 is a straggler (compute)" in s.message()


def test_a_rank_waiting_for_its_data_is_named_with_cause_data() -> None:
    slow = StepTimes(0.080, 0.100, 0.001)
    detector = StragglerDetector(2, window=10)
    [s] = _run(detector, 12, lambda s: [StepTimes(0.010, 0.100, 0.070), slow])
    assert (s.rank, s.cause) == (1, "data")


def test_occasional_or_small_slowness_is_not_named() -> None:
    rng = random.Random(0)
    # Every rank within +-10% each step: nobody is 1.2x the others' median.
    noisy = StragglerDetector(8, window=20)
    assert (
        _run(noisy, 200, lambda s: [StepTimes(0.01, 0.1 * rng.uniform(0.9, 1.1), 0.02) for _ in range(8)])
        == []
    )
    # Rank 1 twice as slow at every other step: 50% of the window, below min_fraction 0.75.
    half = StragglerDetector(2, window=20)
    assert _run(half, 100, lambda s: [NORMAL, StepTimes(0.01, 0.2 if s % 2 else 0.1, 0.0)]) == []
    # 2x slower, but by 4 ms only: below min_seconds (5 ms).
    tiny = StragglerDetector(2, window=10)
    assert _run(tiny, 30, lambda s: [StepTimes(0.0, 0.004, 0.0), StepTimes(0.0, 0.008, 0.0)]) == []


def test_named_again_only_after_recovering() -> None:
    detector = StragglerDetector(2, window=10, min_fraction=0.8)
    slow = [NORMAL, StepTimes(0.01, 0.3, 0.0)]
    fine = [NORMAL, NORMAL]
    phases = [slow] * 20 + [fine] * 20 + [slow] * 20
    found = _run(detector, len(phases), lambda s: phases[s - 1])
    # Named at step 10 (10 of 10 slow), cleared in the fine phase, named again at step 48 (41-48: 8 of 10).
    assert [(f.rank, f.step) for f in found] == [(1, 10), (1, 48)]


def test_collective_wait_without_a_slower_rank_is_a_link() -> None:
    times = [NORMAL, NORMAL, StepTimes(0.010, 0.100, 0.090), NORMAL]
    assert slower_at_step(times, 1.2, 0.005) == {2: ("link", pytest.approx(4.5))}
    # When a rank is slower in its own work, the others' waiting is its doing, not their links'.
    times = [StepTimes(0.01, 0.1, 0.09), StepTimes(0.01, 0.19, 0.0)]
    assert slower_at_step(times, 1.2, 0.005) == {1: ("compute", pytest.approx(2.0 / 1.1))}
    assert slower_at_step([NORMAL], 1.2, 0.005) == {}


def test_a_link_straggler_says_it_waits_rather_than_that_it_is_slower() -> None:
    waits = StepTimes(0.010, 0.100, 0.095)  # its own work as the others', 4.75x their collective wait
    detector = StragglerDetector(4, window=10)
    [s] = _run(detector, 12, lambda step: [NORMAL, NORMAL, waits, NORMAL])
    assert (s.rank, s.cause) == (2, "link") and s.slowdown == pytest.approx(4.75)
    line = s.message()
    assert "it waits 4.75x as long in collectives as the other ranks' median" in line
    assert "no rank is slower at its own work" in line and "4.75x the other ranks at" not in line
    compute = Straggler(1, "compute", 20, 2.5, 20, 20, 0.0, 0.2, 0.0).message()
    assert "its own work (compute the larger excess) takes 2.50x the other ranks' median" in compute


def test_spec_thresholds_are_checked() -> None:
    assert parse_spec({}).straggler.window == 20
    with pytest.raises(ConfigError, match=r"straggler\.slowdown"):
        parse_spec({"straggler": {"slowdown": 1.0}})


def test_others_medians_match_the_slow_way() -> None:
    rng = random.Random(1)
    for n in (2, 3, 4, 7, 10):
        values = [rng.choice([0.1, 0.2, rng.random()]) for _ in range(n)]
        slow = [statistics.median(v for j, v in enumerate(values) if j != i) for i in range(n)]
        assert others_medians(values) == pytest.approx(slow)


def _found(rank: int) -> Straggler:
    return Straggler(rank, "data", 42, 2.5, 9, 10, 0.2, 0.1, 0.0)


def test_the_launcher_reports_a_straggler_to_its_scheduler_with_the_jobs_token() -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    got: list[tuple[str, str, dict[str, object]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, self.headers["Authorization"], body))
            reply = json.dumps({"restarting": False, "reason": "reported"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {
            "GPUYARD_SERVER": f"http://127.0.0.1:{server.server_port}/",
            "GPUYARD_TOKEN": "job-token",
            "GPUYARD_JOB_ID": "7",
        }
        reporter = SchedulerReporter(["n0", "n0", "n1"], env)
        assert reporter.active
        reporter.report(_found(2))
        for thread in reporter.sent:
            thread.join(10)
        assert got == [
            (
                "/jobs/7/stragglers",
                "Bearer job-token",
                {"rank": 2, "node": "n1", "cause": "data", "slowdown": 2.5, "step": 42},
            )
        ]
    finally:
        server.shutdown()


def test_outside_a_scheduler_job_nothing_is_sent_and_the_node_is_the_host() -> None:
    reporter = SchedulerReporter(["n0"], {"GPUYARD_SERVER": "http://127.0.0.1:1"})
    assert not reporter.active
    reporter.report(_found(0))
    assert reporter.sent == []
    assert node_name({"GPUYARD_NODE": "gpu-07"}) == "gpu-07"
    assert node_name({}) == socket.gethostname()


def test_a_scheduler_that_does_not_answer_is_one_line_and_training_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {"GPUYARD_SERVER": "http://127.0.0.1:1", "GPUYARD_TOKEN": "t", "GPUYARD_JOB_ID": "3"}
    reporter = SchedulerReporter(["n0", "n1"], env)
    reporter.report(_found(1))
    reporter.sent[0].join(10)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "gpuyard train: could not report the straggler to http://127.0.0.1:1/jobs/3/stragglers"
    )
