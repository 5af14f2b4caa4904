"""Elastic jobs in the simulator: they grow into idle GPUs, shrink for queued jobs, and lose no work."""

from __future__ import annotations

import pytest

from gpuyard.scheduler.placement import uniform_cluster
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.simulator import SimConfig, simulate
from gpuyard.scheduler.trace import TraceJob

pytestmark = pytest.mark.unit

LINEAR = SimConfig(elastic_alpha=1.0, restart_overhead_s=60.0)


def test_an_elastic_job_alone_grows_to_its_maximum_and_keeps_all_its_work() -> None:
    # 10,000 s of work on the 4 GPUs asked for; elastic 2..8 on an idle 8-GPU node. Queued at its
    # minimum, it starts on 2 GPUs and at once grows to 8: one restart, then twice the speed.
    trace = [TraceJob(0, submit=0.0, duration=10_000.0, gpus=4)]
    result = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR, elastic={0: (2, 8)})
    assert result.resizes == 1 and result.elastic_jobs == 1
    assert result.avg_jct_s == pytest.approx(60.0 + 10_000.0 / 2)
    # Faster on more GPUs is still productive time, never more than the wall time: only the restart
    # (60 s on 8 GPUs) is lost.
    assert result.ettr == pytest.approx(5_000.0 / 5_060.0)
    assert result.lost_gpu_hours == pytest.approx(60.0 * 8 / 3600.0)
    rigid = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR)
    assert rigid.avg_jct_s == pytest.approx(10_000.0) and rigid.resizes == 0


def test_an_elastic_job_shrinks_so_a_queued_job_starts_at_once() -> None:
    trace = [
        TraceJob(0, submit=0.0, duration=40_000.0, gpus=4),  # elastic 2..8: grows to all 8 GPUs
        TraceJob(1, submit=1_000.0, duration=2_000.0, gpus=4),  # rigid: needs 4 of them
    ]
    result = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR, elastic={0: (2, 8)})
    # The rigid job waits for nothing: the elastic one gave 4 GPUs back at its arrival (2 resizes so
    # far), then grew again when the rigid job ended (3).
    assert result.resizes == 3
    assert result.avg_queue_s == pytest.approx(0.0, abs=1e-6)
    # Work is kept across resizes: the elastic job's end is its work at each size plus 3 restarts.
    # 0-1000 s on 8 GPUs (60 s restart): 940 s x 2 = 1,880 of work; 1000-3000 s on 4 (60 s restart):
    # 1,940; from 3,000 s on 8 GPUs again after a restart: (40,000 - 3,820) / 2.
    elastic_end = 3_000.0 + 60.0 + (40_000.0 - 1_880.0 - 1_940.0) / 2
    assert result.makespan_s == pytest.approx(elastic_end)


def test_without_room_to_gain_nothing_is_resized() -> None:
    # Every job asks for the whole node and the queue is never empty with idle GPUs: no resizes.
    trace = [TraceJob(i, submit=0.0, duration=1_000.0, gpus=8) for i in range(3)]
    elastic = {i: (8, 8) for i in range(3)}
    result = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=LINEAR, elastic=elastic)
    assert result.resizes == 0 and result.makespan_s == pytest.approx(3_000.0)
