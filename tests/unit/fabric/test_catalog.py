"""The accelerator catalog: lookups, NVML name matching and the internal consistency of its figures."""

from __future__ import annotations

import pytest

from gpuyard.errors import NotFoundError
from gpuyard.hardware.catalog import DTYPES, get_spec, list_specs, match_spec

pytestmark = pytest.mark.unit

REQUIRED = [
    "A100-SXM4-40GB",
    "A100-SXM4-80GB",
    "H100-SXM5-80GB",
    "H100-PCIe-80GB",
    "H200-SXM-141GB",
    "B200-SXM-180GB",
    "L40S-48GB",
    "MI300X-192GB",
    "TPU-v5e",
    "TPU-v5p",
    "TPU-v6e",
]


def test_every_required_part_is_listed_with_a_source() -> None:
    names = [s.name for s in list_specs()]
    for name in REQUIRED:
        assert name in names
    for spec in list_specs():
        assert spec.sources, spec.name
        assert spec.memory_bytes > 0 and spec.memory_bw_GBps > 0
        assert spec.bf16_tflops and spec.bf16_tflops > 0


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("NVIDIA L40S", "L40S-48GB"),
        ("NVIDIA H100 PCIe", "H100-PCIe-80GB"),
        ("NVIDIA H200", "H200-SXM-141GB"),
        ("NVIDIA B200", "B200-SXM-180GB"),
        ("NVIDIA GB200", "GB200-186GB"),
        ("AMD Instinct MI300X", "MI300X-192GB"),
        ("TPU v5 lite", "TPU-v5e"),
        ("TPU v5", "TPU-v5p"),
        ("TPU v6 lite", "TPU-v6e"),
    ],
)
def test_match_spec_maps_driver_names(device: str, expected: str) -> None:
    spec = match_spec(device)
    assert spec is not None and spec.name == expected


@pytest.mark.parametrize(
    "device",
    ["NVIDIA A100-PCIE-40GB", "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "NVIDIA L40", "Intel Xeon", "cpu", ""],
)
def test_match_spec_returns_none_for_parts_not_in_catalog(device: str) -> None:
    assert match_spec(device) is None


def test_get_spec_accepts_aliases_case_insensitively() -> None:
    assert get_spec("h100").name == "H100-SXM5-80GB"
    assert get_spec("A100-40GB").name == "A100-SXM4-40GB"
    assert get_spec("a100-sxm4-80gb").name == "A100-SXM4-80GB"


def test_get_spec_unknown_lists_known_names() -> None:
    with pytest.raises(NotFoundError) as info:
        get_spec("V100")
    assert "V100" in str(info.value) and "H100-SXM5-80GB" in str(info.value)


def test_dense_peaks_are_ordered_as_the_hardware_doubles_them() -> None:
    # Tensor-core generations double throughput as precision halves; a typo in one figure breaks this.
    for spec in list_specs():
        if spec.tf32_tflops and spec.bf16_tflops:
            # 3%: NVIDIA rounds B200's TF32 to 2.2 PF sparse against 4.5 PF BF16
            assert spec.bf16_tflops == pytest.approx(2 * spec.tf32_tflops, rel=0.03), spec.name
        if spec.fp8_tflops and spec.bf16_tflops:
            assert spec.fp8_tflops == pytest.approx(2 * spec.bf16_tflops, rel=0.02), spec.name


def test_peak_tflops_and_nvlink_conventions() -> None:
    h100 = get_spec("h100")
    assert h100.peak_tflops("bf16") == 989.5
    assert h100.nvlink_GBps == 900 and h100.interconnect_unidir_GBps == 450
    assert get_spec("l40s").nvlink_GBps == 0
    with pytest.raises(NotFoundError):
        get_spec("a100").peak_tflops("fp8")
    with pytest.raises(NotFoundError):
        h100.peak_tflops("int3")
    as_dict = h100.to_dict()
    assert set(as_dict["peak_tflops"]) == set(DTYPES)  # type: ignore[arg-type]
    assert as_dict["peak_tflops"]["fp8"] == 1979  # type: ignore[index]
