"""The periodic node health check on a fake H100 node: each injected fault gives its verdict and reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuyard.errors import ConfigError
from gpuyard.hardware.fake import FakeNvml, fake_selftest
from gpuyard.hardware.health import NodeCheckConfig, check_node, load_check_config

pytestmark = pytest.mark.unit


@pytest.fixture
def fake(description: Callable[[str], dict[str, Any]]) -> FakeNvml:
    return FakeNvml(description("h100_hgx"))


def _codes(check: Any, gpu: int) -> list[str]:
    return [r.code for r in check.gpus[gpu].reasons]


def test_a_clean_node_passes(fake: FakeNvml) -> None:
    check = check_node(fake, idle={0, 1}, selftest=fake_selftest(fake))
    assert check.verdict == "pass" and check.reasons == []
    assert sorted(check.selftests) == [0, 1] and check.selftests[0].ok


@pytest.mark.parametrize(
    ("fault", "kwargs", "verdict", "code"),
    [
        ("ecc_uncorrectable", {}, "fail", "ecc_uncorrectable"),
        ("ecc_corrected", {"count": 5000}, "warn", "ecc_corrected"),
        ("row_remap_pending", {}, "fail", "row_remap_pending"),
        ("xid", {"xid": 79}, "fail", "xid_79"),
        ("xid", {"xid": 94}, "warn", "xid_94"),
        ("throttle", {"reason": "hw_slowdown"}, "fail", "hw_slowdown"),
        ("throttle", {"reason": "sw_power_cap"}, "warn", "sw_power_cap"),
        ("lost", {}, "fail", "unreachable"),
    ],
)
def test_each_fault_grades_its_gpu(
    fake: FakeNvml, fault: str, kwargs: dict[str, Any], verdict: str, code: str
) -> None:
    fake.inject(3, fault, **kwargs)
    check = check_node(fake)
    assert check.verdict == verdict
    assert code in _codes(check, 3)
    assert all(check.gpus[i].status == "pass" for i in check.gpus if i != 3)
    assert check.reasons[0].startswith("GPU 3: ")


def test_xid_is_seen_once_and_application_xids_are_not_held_against_the_node(fake: FakeNvml) -> None:
    fake.inject(2, "xid", xid=13)  # an illegal address in the application's kernel
    assert check_node(fake).verdict == "pass"
    fake.inject(2, "xid", xid=79)
    first = check_node(fake)
    assert first.verdict == "fail" and "fallen off the bus" in first.reasons[0]
    assert first.xids == ((2, 79),)
    assert check_node(fake).verdict == "pass"  # an event is delivered once; the node state keeps it


def test_nvlink_errors_warn_on_growth_between_checks(fake: FakeNvml) -> None:
    fake.inject(5, "nvlink_errors", count=50)
    first = check_node(fake)  # no previous totals: recorded, not judged
    assert first.verdict == "pass" and first.nvlink_errors[5] == 50
    fake.inject(5, "nvlink_errors", count=40)
    assert check_node(fake, nvlink_before=first.nvlink_errors).verdict == "pass"  # +40 < 100
    fake.inject(5, "nvlink_errors", count=500)
    grown = check_node(fake, nvlink_before=first.nvlink_errors)
    assert grown.verdict == "warn" and _codes(grown, 5) == ["nvlink_errors"]
    assert "540 NVLink" in grown.reasons[0]


def test_selftest_runs_on_idle_gpus_only_and_its_failure_fails_the_gpu(fake: FakeNvml) -> None:
    fake.inject(1, "selftest")
    fake.inject(6, "selftest")
    check = check_node(fake, idle={1, 2}, selftest=fake_selftest(fake))  # GPU 6 holds a job
    assert sorted(check.selftests) == [1, 2]
    assert check.verdict == "fail" and _codes(check, 1) == ["selftest_failed"]
    assert check.gpus[6].status == "pass"


def test_selftest_figures_are_held_to_the_limits(fake: FakeNvml) -> None:
    desc_gpu = fake._gpus[0]
    desc_gpu["selftest"] = {"gemm_rel_err": 0.02, "gemm_tflops": 20.0}
    config = NodeCheckConfig(gemm_min_tflops=40.0)
    check = check_node(fake, config, idle={0}, selftest=fake_selftest(fake))
    assert _codes(check, 0) == ["gemm_wrong", "gemm_slow"]
    desc_gpu["selftest"] = {"ok": None, "error": "CUDA is not available"}  # could not run: not held
    assert check_node(fake, config, idle={0}, selftest=fake_selftest(fake)).verdict == "pass"


def test_checks_can_be_switched_off(fake: FakeNvml) -> None:
    fake.inject(0, "xid", xid=79)
    fake.inject(1, "ecc_uncorrectable")
    only_xid = check_node(fake, NodeCheckConfig(checks=("xid",)))
    assert only_xid.verdict == "fail" and only_xid.gpus[1].status == "pass"
    assert check_node(fake, NodeCheckConfig(checks=("nvml",))).gpus[1].status == "fail"


def test_clear_is_a_gpu_reset(fake: FakeNvml) -> None:
    fake.inject(4, "ecc_uncorrectable")
    fake.inject(4, "throttle")
    fake.inject(4, "xid", xid=48)
    fake.clear(4)
    check = check_node(fake)
    assert check.verdict == "warn"  # the lifetime counter keeps the uncorrectable error
    assert _codes(check, 4) == ["ecc_uncorrectable_history"]


def test_no_nvml_passes_with_a_note() -> None:
    check = check_node(FakeNvml({"nvml": {"unavailable": "Driver Not Loaded"}}))
    assert check.verdict == "pass" and "Driver Not Loaded" in check.note


def test_config_from_a_mapping_names_bad_keys() -> None:
    config = load_check_config(
        {"interval_s": 30, "checks": ["nvml", "xid"], "xid_fail": [79], "thresholds": {"corrected_warn": 10}}
    )
    assert config.interval_s == 30 and config.checks == ("nvml", "xid")
    assert config.xid_fail == frozenset({79}) and config.thresholds.corrected_warn == 10
    with pytest.raises(ConfigError, match="unknown keys \\['intervall'\\]"):
        load_check_config({"intervall": 3})
    with pytest.raises(ConfigError, match="'gemm'"):
        load_check_config({"checks": ["gemm"]})
    with pytest.raises(ConfigError, match="fault 'fire' is unknown"):
        FakeNvml({"nvml": {"gpus": [{}]}}).inject(0, "fire")
