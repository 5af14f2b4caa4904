"""What the Slurm executor reads from Slurm's tools: GRES, scontrol lines, end states, its settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.scheduler.executors.slurm_config import SlurmConfig, instance_tag
from gpuyard.scheduler.executors.slurm_nodes import parse_gres_gpus
from gpuyard.scheduler.executors.slurm_states import exit_from_state, parse_kv_line

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("gres", "want"),
    [
        ("gpu:4", (4, "")),
        ("gpu:h100:8(S:0-1)", (8, "h100")),
        ("gpu:a100:2,gpu:a100:2", (4, "a100")),
        ("(null)", (0, "")),
        ("nic:2", (0, "")),
    ],
)
def test_gpus_and_type_from_gres(gres: str, want: tuple[int, str]) -> None:
    assert parse_gres_gpus(gres) == want


def test_scontrol_lines_keep_values_with_spaces() -> None:
    row = parse_kv_line("NodeName=n1 State=IDLE+DRAIN Reason=bad fan [root@2026-11-27T03:53:25] Gres=gpu:2")
    assert row["Reason"] == "bad fan [root@2026-11-27T03:53:25]" and row["Gres"] == "gpu:2"


def test_end_states_say_what_slurm_did() -> None:
    timeout = exit_from_state("TIMEOUT", "0:15", "2026-11-27T04:00:00")
    assert timeout.killed and "time limit" in timeout.describe() and timeout.ended_at is not None
    assert "out of memory" in exit_from_state("OUT_OF_MEMORY", "0:9").describe()
    assert exit_from_state("COMPLETED", "0:0").code == 0
    assert exit_from_state("FAILED", "3:0").describe() == "exit code 3"
    # An outside scancel: the job checkpointed on SIGTERM and exited 75, yet it was cancelled, not
    # preempted (only Slurm's PREEMPTED is a preemption).
    checkpointed = exit_from_state("CANCELLED by 0", "75:0")
    assert checkpointed.code == 75 and checkpointed.cancelled and not checkpointed.preempted
    assert checkpointed.describe() == "cancelled in Slurm by uid 0 (exit code 75)"
    assert exit_from_state("PREEMPTED", "0:15").preempted
    assert not exit_from_state("FAILED", "75:0").preempted
    cancelled = exit_from_state("CANCELLED", "0:15", reason="None")
    assert cancelled.killed and "cancelled in Slurm" in cancelled.describe()
    assert exit_from_state("FAILED", "0:9").code == -9


def test_settings_file_per_team_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "slurm.yaml"
    path.write_text("partition: gpu\naccount: lab\nteams: {vision: {qos: high, account: vis}}\n")
    cfg = SlurmConfig.load(str(path))
    assert cfg.for_team("vision") == {"partition": "gpu", "account": "vis", "qos": "high"}
    assert cfg.for_team("other") == {"partition": "gpu", "account": "lab"}
    assert SlurmConfig.load(str(path), partition="debug").for_team("x")["partition"] == "debug"
    path.write_text("partition: 'gpu; rm -rf /'\n")
    with pytest.raises(ConfigError, match="not a Slurm name"):
        SlurmConfig.load(str(path))
    path.write_text("partitions: gpu\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        SlurmConfig.load(str(path))


def test_instance_tags_differ_per_store_and_stay_put() -> None:
    assert instance_tag("sqlite:///a/state.db") == instance_tag("sqlite:///a/state.db")
    assert instance_tag("sqlite:///a/state.db") != instance_tag("sqlite:///b/state.db")


def test_a_slurm_server_refuses_gpu_shares_and_time_limits_elsewhere(gpuyard_home: Path) -> None:
    from gpuyard.errors import CapacityError
    from gpuyard.scheduler.executors.local import LocalExecutor
    from gpuyard.scheduler.executors.slurm import SlurmExecutor
    from gpuyard.scheduler.placement import NodeSpec
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.scheduler.spec import parse_spec
    from gpuyard.store import get_store

    nodes = [NodeSpec("n1", 2, "gpu", "n1", "s1", cpus=2)]
    slurm = object.__new__(SlurmExecutor)  # no cluster needed: only its name and capabilities are read
    service = JobService(get_store(), nodes, slurm, ServiceConfig())
    with pytest.raises(CapacityError, match="not on Slurm"):
        service.check(parse_spec({"name": "s", "command": ["true"], "resources": {"gpus": 0.5}}))
    service.check(
        parse_spec({"name": "t", "command": ["true"], "time_limit_min": 5, "resources": {"gpus": 1}})
    )
    local = JobService(get_store(), nodes, LocalExecutor(gpuyard_home / "jobs"), ServiceConfig())
    with pytest.raises(ConfigError, match="enforced on a Slurm cluster only"):
        local.check(parse_spec({"name": "t", "command": ["true"], "time_limit_min": 5}))


def test_polling_many_running_jobs_asks_squeue_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduling loop polls every running job each tick: one squeue answers them all."""
    from gpuyard.scheduler.executors.slurm import SlurmExecutor

    ex = object.__new__(SlurmExecutor)
    ex.prefix, ex._states, ex._states_at, ex._seen = "gpuyard-abc-", {}, float("-inf"), {}
    ex._held = {}
    calls: list[list[str]] = []
    rows = "".join(f"{i}|RUNNING|None|n1|now|N/A|gpuyard-abc-{i}-1\n" for i in range(1, 51))
    rows += "99|RUNNING|None|n1|now|N/A|someone-else\n"

    def call(argv: list[str], check: bool = True, **_: object) -> str:
        calls.append(argv)
        return rows if "-j" not in argv else ""

    monkeypatch.setattr(ex, "_call", call)
    monkeypatch.setattr(ex, "_ended", lambda sid, handle: exit_from_state("COMPLETED", "0:0"))
    assert all(ex.poll({"slurm_id": str(i)}) is None for i in range(1, 51))
    assert len(calls) == 1 and "99" not in ex._states  # another user's job is not this server's
    assert ex.poll({"slurm_id": "77"}) is not None  # not in the list: asked alone, then ended
    assert len(calls) == 2 and calls[1][calls[1].index("-j") + 1] == "77"
