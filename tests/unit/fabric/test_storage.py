"""Storage in the plan: loader reads and checkpoint writes against a tier; `gpuyard plan --storage`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.planner import CHECKPOINT_BYTES_PER_PARAM
from gpuyard.fabric.storage import (
    MAX_TIER_FILE_BYTES,
    TIERS,
    StorageTier,
    bytes_per_token,
    check_storage,
    checkpoint_write_s,
    load_tier,
)

pytestmark = pytest.mark.unit

L405 = PRESETS["llama3-405b"]


def _tier(**kw: object) -> StorageTier:
    return StorageTier(**{"name": "t", "kind": "parallel-fs", "source": "test", **kw})  # type: ignore[arg-type]


def test_every_preset_tier_names_its_source_and_states_only_some_figures() -> None:
    for tier in TIERS.values():
        assert len(tier.source) > 40
    # Llama 3's Tectonic: 2 TB/s sustained, no per-node figure.
    assert TIERS["meta-tectonic"].write_GBps_aggregate == 2000.0
    assert TIERS["meta-tectonic"].write_GBps_per_node is None
    assert TIERS["superpod-gds"].gpudirect


def test_checkpoint_write_is_the_state_over_the_tighter_of_node_and_aggregate_bandwidth() -> None:
    state = L405.params * CHECKPOINT_BYTES_PER_PARAM
    # 2,048 nodes at 2 GB/s would be 4 TB/s: Tectonic's 2 TB/s aggregate is the limit.
    assert checkpoint_write_s(TIERS["meta-tectonic"], L405, 16384, 8) == pytest.approx(state / 2000e9)
    # One node of 8 GPUs at 5 GB/s per node, plus 50 ms of first-byte latency.
    slow = _tier(write_GBps_per_node=5.0, latency_ms=50.0)
    assert checkpoint_write_s(slow, L405, 8, 8) == pytest.approx(state / 5e9 + 0.05)
    assert checkpoint_write_s(TIERS["s3-c5n"], L405, 8, 8) is None  # no write figure stated


def test_a_tier_too_slow_for_the_checkpoint_interval_is_flagged() -> None:
    slow = _tier(write_GBps_per_node=1.0, read_GBps_per_node=2.0)
    check = check_storage(slow, L405, 20_000, 64, 8, interval_s=600)
    # 5.7 TB from 8 nodes at 1 GB/s each: about 710 s, longer than the 10 min interval.
    assert check.write_s is not None and check.write_s > 600
    assert check.async_keeps_up is False
    assert "even an asynchronous save STALLS" in check.lines()[1]
    fast = check_storage(TIERS["meta-tectonic"], L405, 20_000, 16384, 8, interval_s=600)
    assert fast.async_keeps_up is True and fast.stall_share is not None and fast.stall_share < 0.01


def test_loader_stalls_when_its_bytes_exceed_the_tiers_read_bandwidth() -> None:
    tier = _tier(read_GBps_per_node=1.0, read_GBps_aggregate=4.0)
    assert bytes_per_token(L405) == 4 and bytes_per_token(PRESETS["mixtral-8x7b"]) == 2
    # 4 MB/s of token IDs: 0.5 MB/s per node of 1 GB/s, 4 MB/s of the 4 GB/s aggregate (the tighter).
    tokens = check_storage(tier, L405, 1e6, 64, 8, 3600)
    assert tokens.loader_stalls is False and tokens.read_share == pytest.approx(1e-3)
    # Images, 600 KB per 4,096-token sample at 100M tokens/s: 14.6 GB/s, over both limits.
    images = check_storage(tier, L405, 1e8, 64, 8, 3600, seq_len=4096, sample_bytes=600_000)
    assert images.loader_stalls is True and images.read_share == pytest.approx(1e8 / 4096 * 6e5 / 4e9)
    assert "STALLS the GPUs" in images.lines()[0]
    unstated = check_storage(_tier(write_GBps_aggregate=10.0), L405, 1e6, 8, 8, 3600)
    assert unstated.loader_stalls is None and "not checked" in unstated.lines()[0]


def test_bad_inputs_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokens/s > 0"):
        check_storage(TIERS["meta-tectonic"], L405, 0, 8, 8, 600)
    with pytest.raises(ConfigError, match="finite"):
        check_storage(TIERS["meta-tectonic"], L405, 1e6, 8, 8, float("inf"))
    with pytest.raises(ConfigError, match="sequence length"):
        check_storage(TIERS["meta-tectonic"], L405, 1e6, 8, 8, 600, sample_bytes=100)
    with pytest.raises(NotFoundError, match="meta-tectonic"):
        load_tier("no-such-tier")
    for body, match in (
        ("kind: tape\nsource: x\n", "kind"),
        ("kind: parallel-fs\nsource: x\nread_GBps_per_node: -1\n", "read_GBps_per_node"),
        ("kind: parallel-fs\nsource: x\nwrite_GBps_aggregate: .nan\n", "write_GBps_aggregate"),
        ("kind: parallel-fs\nsource: x\nsurprise: 1\n", "surprise"),
        ("kind: parallel-fs\n", "source"),
        ("- a list\n", "mapping"),
    ):
        f = tmp_path / "tier.yaml"
        f.write_text(body)
        with pytest.raises(ConfigError, match=match) as info:
            load_tier(str(f))
        assert "\n" not in str(info.value)
    big = tmp_path / "big.yaml"
    big.write_text("kind: parallel-fs\nsource: x\n" + "#" * MAX_TIER_FILE_BYTES)
    with pytest.raises(ConfigError, match="at most"):
        load_tier(str(big))
    good = tmp_path / "lustre.yaml"
    good.write_text(
        "kind: parallel-fs\nsource: our measurement\nwrite_GBps_per_node: 3\nread_GBps_per_node: 6\n"
    )
    assert load_tier(str(good)).name == "lustre"


def test_plan_prints_and_returns_the_storage_check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tier = tmp_path / "slow.yaml"
    tier.write_text("kind: parallel-fs\nsource: test\nwrite_GBps_per_node: 0.2\nread_GBps_per_node: 1\n")
    args = ["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "64"]
    args += ["--seq-len", "4096", "--top", "1", "--storage", str(tier), "--checkpoint-interval-min", "5"]
    with pytest.raises(SystemExit) as info:
        main([*args, "--json"])
    assert info.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    got = doc["storage"]
    state = PRESETS["llama3-70b"].params * CHECKPOINT_BYTES_PER_PARAM
    assert got["checkpoint_write_s"] == pytest.approx(state / (8 * 0.2e9))
    assert got["async_checkpoint_keeps_up"] is False and got["checkpoint_interval_s"] == 300
    # The tier's write time is the stall the goodput estimate uses.
    assert doc["ettr"]["checkpoint_s"] == pytest.approx(got["checkpoint_write_s"])
    with pytest.raises(SystemExit):
        main(args)
    out = capsys.readouterr().out
    assert "storage slow (parallel-fs): loading needs" in out
    assert "even an asynchronous save STALLS" in out
