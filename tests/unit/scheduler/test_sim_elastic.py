"""Elastic jobs in the simulator, by the server's rules (the scheduling core): they start at their
best size, grow into idle GPUs, shrink for queued jobs, and lose no work."""

from __future__ import annotations

import pytest

from gpuyard.scheduler.placement import uniform_cluster
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.simulator import SimConfig, simulate
from gpuyard.scheduler.trace import TraceJob

pytestmark = pytest.mark.unit

LINEAR = SimConfig(elastic_alpha=1.0, restart_overhead_s=60.0)


def test_an_elastic_job_alone_starts_at_its_maximum() -> None:
    # 10,000 s of work on the 4 GPUs asked for; elastic 2..8 on an idle 8-GPU node. Nothing else
    # waits, so the core starts it at its maximum at once (the server's start rule): no restart.
    trace = [TraceJob(0, submit=0.0, duration=10_000.0, gpus=4)]
    result = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR, elastic={0: (2, 8)})
    assert result.resizes == 0 and result.elastic_jobs == 1
    assert result.avg_jct_s == pytest.approx(10_000.0 / 2)
    assert result.ettr == pytest.approx(1.0) and result.lost_gpu_hours == pytest.approx(0.0)
    rigid = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR)
    assert rigid.avg_jct_s == pytest.approx(10_000.0) and rigid.resizes == 0


def test_an_elastic_job_grows_once_its_interval_since_start_is_over() -> None:
    # Elastic 2..8 and a rigid 6-GPU job arrive together: both start, the elastic one on the 2 GPUs
    # left. The rigid one ends at 100 s, but a job is resized at most once per 300 s from its start:
    # the replay wakes at 300 s (the server's next tick past the interval) and grows it to 8.
    trace = [
        TraceJob(0, submit=0.0, duration=10_000.0, gpus=4),
        TraceJob(1, submit=0.0, duration=100.0, gpus=6),
    ]
    result = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR, elastic={0: (2, 8)})
    assert result.resizes == 1
    # 0-300 s on 2 GPUs: 150 s of work; a 60 s restart; the rest at twice the asked-for speed.
    assert result.makespan_s == pytest.approx(300.0 + 60.0 + (10_000.0 - 150.0) / 2)
    assert result.lost_gpu_hours == pytest.approx(60.0 * 8 / 3600.0)


def test_an_elastic_job_shrinks_so_a_queued_job_starts_at_once() -> None:
    trace = [
        TraceJob(0, submit=0.0, duration=40_000.0, gpus=4),  # elastic 2..8: starts on all 8 GPUs
        TraceJob(1, submit=1_000.0, duration=2_000.0, gpus=4),  # rigid: needs 4 of them
    ]
    result = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR, elastic={0: (2, 8)})
    # The rigid job waits for nothing: the elastic one shrank to 4 (as little as lets it start) at
    # its arrival and restarted at once, then grew again when the rigid job ended: 2 resizes.
    assert result.resizes == 2
    assert result.avg_queue_s == pytest.approx(0.0, abs=1e-6)
    # Work is kept across resizes: the elastic job's end is its work at each size plus 2 restarts.
    # 0-1000 s on 8 GPUs: 2,000 s of work; 1000-3000 s on 4 (60 s restart): 1,940; from 3,000 s on
    # 8 GPUs again after a restart: (40,000 - 3,940) / 2.
    elastic_end = 3_000.0 + 60.0 + (40_000.0 - 2_000.0 - 1_940.0) / 2
    assert result.makespan_s == pytest.approx(elastic_end)


def test_without_room_to_gain_nothing_is_resized() -> None:
    # Every job asks for the whole node and the queue is never empty with idle GPUs: no resizes.
    trace = [TraceJob(i, submit=0.0, duration=1_000.0, gpus=8) for i in range(3)]
    elastic = {i: (8, 8) for i in range(3)}
    result = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR, elastic=elastic)
    assert result.resizes == 0 and result.makespan_s == pytest.approx(3_000.0)
