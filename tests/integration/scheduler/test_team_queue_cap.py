"""One team's submissions cannot grow the queue without end: past --max-queued-per-team waiting jobs its
next submission is refused (429, naming the option), while another team still submits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuyard.scheduler.service import QueueFullError
from gpuyard.scheduler.spec import parse_spec

pytestmark = pytest.mark.integration


def _spec(team: str) -> Any:
    return parse_spec({"name": "wait", "team": team, "command": ["true"], "resources": {"gpus": 0}})


def test_a_team_at_its_waiting_bound_is_refused_and_another_team_is_not(
    make_service: Callable[..., Any],
) -> None:
    service = make_service(gpus=0, cpus=1, teams={"alpha": 1.0, "beta": 1.0})
    service.max_queued_per_team = 3
    alpha = [service.submit(_spec("alpha"))["id"] for _ in range(3)]  # no tick: all stay queued
    with pytest.raises(QueueFullError) as refused:
        service.submit(_spec("alpha"))
    assert refused.value.http_status == 429
    assert str(refused.value) == (
        "team alpha has 3 jobs waiting, at most 3 (gpuyard server --max-queued-per-team); "
        "submit more once some have started, or cancel some"
    )
    assert service.submit(_spec("beta"))["state"] == "queued"
    service.cancel(alpha[0])  # one fewer waiting: alpha submits again
    assert service.submit(_spec("alpha"))["state"] == "queued"
