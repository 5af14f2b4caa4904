"""Catalog of accelerator specs (peak dense TFLOP/s, memory, links) from vendor datasheets.

Conventions used by every entry:

* TFLOP/s figures are **dense** peaks (NVIDIA datasheets print sparse figures with an asterisk; the
  dense figure is half of it). ``None`` means the dtype has no tensor-core/matrix path on that part.
* ``memory_bytes`` is the marketed capacity in decimal gigabytes (80 GB = 80e9 bytes), as on the
  datasheet; NVML reports a little less usable memory.
* ``interconnect_GBps`` is the **bidirectional** per-accelerator scale-up bandwidth the vendor
  quotes (NVLink for NVIDIA, Infinity Fabric for AMD, ICI for TPU); use
  :attr:`AcceleratorSpec.interconnect_unidir_GBps` for the per-direction figure that collectives see.
  Google's TPU pages quote "bidirectional inter-chip interconnect (ICI) bandwidth (per chip)" in GB/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuyard.errors import NotFoundError

GB = 1_000_000_000
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

# Public sources, named once and referenced by key from each entry.
SOURCES = {
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-nvidia-us-2188504-web.pdf, 2021)",
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (h100-datasheet, 2023; SXM and PCIe columns)",
    "h200": "NVIDIA H200 Tensor Core GPU product page / datasheet (nvidia.com/en-us/data-center/h200, 2024)",
    "b200": "NVIDIA HGX B200 spec table, individual Blackwell GPU column (nvidia.com/en-us/data-center/hgx; "
    "sparse figures / 2)",
    "gb200": "NVIDIA GB200 NVL72 spec table, individual Blackwell GPU column "
    "(nvidia.com/en-us/data-center/gb200-nvl72; sparse figures / 2)",
    "l40s": "NVIDIA L40S datasheet (l40s-datasheet, 2023)",
    "mi300x": "AMD Instinct MI300X accelerator data sheet (amd.com, 2023)",
    "tpu_v4": "Google Cloud TPU v4 documentation (cloud.google.com/tpu/docs/v4, system architecture); "
    "Jouppi et al., TPU v4: An Optically Reconfigurable Supercomputer for Machine Learning with Hardware "
    "Support for Embeddings, ISCA 2023 (six ICI links per chip, 3D torus)",
    "tpu_v5e": "Google Cloud TPU v5e documentation (cloud.google.com/tpu/docs/v5e, system architecture)",
    "tpu_v5p": "Google Cloud TPU v5p documentation (cloud.google.com/tpu/docs/v5p, system architecture)",
    "tpu_v6e": "Google Cloud TPU v6e (Trillium) documentation (cloud.google.com/tpu/docs/v6e)",
}


@dataclass(frozen=True)
class AcceleratorSpec:
    """One accelerator model and its datasheet figures.

    Attributes:
        name: canonical catalog name, e.g. ``"H100-SXM5-80GB"``.
        vendor: ``"nvidia"``, ``"amd"`` or ``"google"``.
        kind: ``"gpu"`` or ``"tpu"``.
        memory_bytes: device memory capacity (decimal bytes as marketed).
        memory_bw_GBps: peak device memory bandwidth in GB/s (1e9 bytes/s).
        fp32_tflops: peak FP32 (non-tensor) TFLOP/s.
        tf32_tflops: peak dense TF32 tensor TFLOP/s, or None.
        bf16_tflops: peak dense BF16 tensor TFLOP/s, or None.
        fp16_tflops: peak dense FP16 tensor TFLOP/s, or None.
        fp8_tflops: peak dense FP8 tensor TFLOP/s, or None.
        interconnect: scale-up link name (``"nvlink"``, ``"infinity-fabric"``, ``"ici"``) or None.
        interconnect_GBps: scale-up bandwidth per accelerator, bidirectional (both directions summed), GB/s.
        nvlink_generation: NVLink generation (3 for A100, 4 for H100/H200, 5 for B200), None otherwise.
        pcie_gen: host PCIe generation, None when not attached over PCIe (TPU).
        tdp_w: maximum board power in watts, None when the vendor does not publish it.
        sources: datasheets the figures come from.
        aliases: other names accepted by :func:`get_spec`.
    """

    name: str
    vendor: str
    kind: str
    memory_bytes: int
    memory_bw_GBps: float
    fp32_tflops: float | None
    tf32_tflops: float | None
    bf16_tflops: float | None
    fp16_tflops: float | None
    fp8_tflops: float | None
    interconnect: str | None
    interconnect_GBps: float
    nvlink_generation: int | None
    pcie_gen: int | None
    tdp_w: float | None
    sources: tuple[str, ...]
    aliases: tuple[str, ...] = field(default=())

    @property
    def nvlink_GBps(self) -> float:
        """NVLink bandwidth per GPU, bidirectional, GB/s (0 when the part has no NVLink)."""
        return self.interconnect_GBps if self.interconnect == "nvlink" else 0.0

    @property
    def interconnect_unidir_GBps(self) -> float:
        """Scale-up bandwidth per accelerator in one direction, GB/s (what a ring step can send)."""
        return self.interconnect_GBps / 2

    def peak_tflops(self, dtype: str) -> float:
        """Peak dense TFLOP/s for ``dtype`` (one of fp32, tf32, bf16, fp16, fp8).

        Raises:
            NotFoundError: the dtype is unknown or the part has no tensor path for it.
        """
        if dtype not in DTYPES:
            raise NotFoundError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        value = getattr(self, f"{dtype}_tflops")
        if value is None:
            raise NotFoundError(f"{self.name} has no published dense {dtype} peak")
        return float(value)

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form; adds ``peak_tflops`` by dtype and the unidirectional interconnect figure."""
        out: dict[str, object] = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["sources"] = [SOURCES[s] for s in self.sources]
        out["aliases"] = list(self.aliases)
        out["interconnect_unidir_GBps"] = self.interconnect_unidir_GBps
        out["nvlink_GBps"] = self.nvlink_GBps
        out["peak_tflops"] = {d: getattr(self, f"{d}_tflops") for d in DTYPES}
        return out


def _nv(name: str, **kw: object) -> AcceleratorSpec:
    return AcceleratorSpec(name=name, vendor="nvidia", kind="gpu", **kw)  # type: ignore[arg-type]


_SPECS: tuple[AcceleratorSpec, ...] = (
    # A100 SXM4: FP32 19.5, TF32 156, BF16/FP16 312 (dense; 312/624 sparse), no FP8; NVLink3 600 GB/s;
    # 40GB HBM2 1,555 GB/s, 80GB HBM2e 2,039 GB/s; 400 W.
    _nv("A100-SXM4-40GB", memory_bytes=40 * GB, memory_bw_GBps=1555, fp32_tflops=19.5, tf32_tflops=156,
        bf16_tflops=312, fp16_tflops=312, fp8_tflops=None, interconnect="nvlink", interconnect_GBps=600,
        nvlink_generation=3, pcie_gen=4, tdp_w=400, sources=("a100",), aliases=("a100-40gb",)),
    _nv("A100-SXM4-80GB", memory_bytes=80 * GB, memory_bw_GBps=2039, fp32_tflops=19.5, tf32_tflops=156,
        bf16_tflops=312, fp16_tflops=312, fp8_tflops=None, interconnect="nvlink", interconnect_GBps=600,
        nvlink_generation=3, pcie_gen=4, tdp_w=400, sources=("a100",), aliases=("a100", "a100-80gb")),
    # H100 SXM5: FP32 67, TF32 989 / BF16 1,979 / FP8 3,958 sparse -> 494.5 / 989.5 / 1,979 dense;
    # 80 GB HBM3 3.35 TB/s; NVLink4 900 GB/s; up to 700 W.
    _nv("H100-SXM5-80GB", memory_bytes=80 * GB, memory_bw_GBps=3350, fp32_tflops=67, tf32_tflops=494.5,
        bf16_tflops=989.5, fp16_tflops=989.5, fp8_tflops=1979, interconnect="nvlink", interconnect_GBps=900,
        nvlink_generation=4, pcie_gen=5, tdp_w=700, sources=("h100",), aliases=("h100", "h100-sxm")),
    # H100 PCIe: FP32 51, TF32 756 / BF16 1,513 / FP8 3,026 sparse; 80 GB HBM2e 2 TB/s;
    # NVLink bridge 600 GB/s; 300-350 W.
    _nv("H100-PCIe-80GB", memory_bytes=80 * GB, memory_bw_GBps=2000, fp32_tflops=51, tf32_tflops=378,
        bf16_tflops=756.5, fp16_tflops=756.5, fp8_tflops=1513, interconnect="nvlink", interconnect_GBps=600,
        nvlink_generation=4, pcie_gen=5, tdp_w=350, sources=("h100",), aliases=("h100-pcie",)),
    # H200 SXM: the H100 SXM compute with 141 GB HBM3e at 4.8 TB/s; NVLink4 900 GB/s; up to 700 W.
    _nv("H200-SXM-141GB", memory_bytes=141 * GB, memory_bw_GBps=4800, fp32_tflops=67, tf32_tflops=494.5,
        bf16_tflops=989.5, fp16_tflops=989.5, fp8_tflops=1979, interconnect="nvlink", interconnect_GBps=900,
        nvlink_generation=4, pcie_gen=5, tdp_w=700, sources=("h200",), aliases=("h200",)),
    # B200 (HGX): FP32 75 TF; TF32 2.2 / BF16 4.5 / FP8 9 PF sparse -> 1,100 / 2,250 / 4,500 dense;
    # 180 GB HBM3e at 7.7 TB/s; NVLink5 1.8 TB/s; configurable up to 1,000 W.
    _nv("B200-SXM-180GB", memory_bytes=180 * GB, memory_bw_GBps=7700, fp32_tflops=75, tf32_tflops=1100,
        bf16_tflops=2250, fp16_tflops=2250, fp8_tflops=4500, interconnect="nvlink", interconnect_GBps=1800,
        nvlink_generation=5, pcie_gen=5, tdp_w=1000, sources=("b200",), aliases=("b200",)),
    # GB200 (NVL72): FP32 80 TF; TF32 2.5 / BF16 5 / FP8 10 PF sparse -> 1,250 / 2,500 / 5,000 dense;
    # 186 GB HBM3e at 8 TB/s; NVLink5 1.8 TB/s; configurable up to 1,200 W.
    _nv("GB200-186GB", memory_bytes=186 * GB, memory_bw_GBps=8000, fp32_tflops=80, tf32_tflops=1250,
        bf16_tflops=2500, fp16_tflops=2500, fp8_tflops=5000, interconnect="nvlink", interconnect_GBps=1800,
        nvlink_generation=5, pcie_gen=None, tdp_w=1200, sources=("gb200",), aliases=("gb200",)),
    # L40S: FP32 91.6, TF32 183, BF16/FP16 362.05, FP8 733 (dense); 48 GB GDDR6 864 GB/s; no NVLink;
    # PCIe Gen4 x16; 350 W.
    _nv("L40S-48GB", memory_bytes=48 * GB, memory_bw_GBps=864, fp32_tflops=91.6, tf32_tflops=183,
        bf16_tflops=362.05, fp16_tflops=362.05, fp8_tflops=733, interconnect=None, interconnect_GBps=0,
        nvlink_generation=None, pcie_gen=4, tdp_w=350, sources=("l40s",), aliases=("l40s",)),
    # MI300X: FP32 vector 163.4, TF32 653.7, BF16/FP16 1,307.4, FP8 2,614.9 (dense); 192 GB HBM3 5.3 TB/s;
    # 7 Infinity Fabric links x 128 GB/s = 896 GB/s peak aggregate; PCIe Gen5; 750 W.
    AcceleratorSpec(
        name="MI300X-192GB", vendor="amd", kind="gpu", memory_bytes=192 * GB, memory_bw_GBps=5300,
        fp32_tflops=163.4, tf32_tflops=653.7, bf16_tflops=1307.4, fp16_tflops=1307.4, fp8_tflops=2614.9,
        interconnect="infinity-fabric", interconnect_GBps=896, nvlink_generation=None, pcie_gen=5, tdp_w=750,
        sources=("mi300x",), aliases=("mi300x",)),
    # TPU v4: 275 TF BF16 (bf16 or int8); 32 GiB HBM2 at 1,200 GB/s; 3D torus (cubes of 4x4x4, 4,096-chip
    # pod). ICI: six links per chip (ISCA 2023 paper), each 50 GB/s per direction (400 Gb/s, as the paper's
    # summaries quote it): 600 GB/s bidirectional per chip. Measured max power 192 W (docs).
    AcceleratorSpec(
        name="TPU-v4", vendor="google", kind="tpu", memory_bytes=32 * 1024**3, memory_bw_GBps=1200,
        fp32_tflops=None, tf32_tflops=None, bf16_tflops=275, fp16_tflops=None, fp8_tflops=None,
        interconnect="ici", interconnect_GBps=600, nvlink_generation=None, pcie_gen=None, tdp_w=192,
        sources=("tpu_v4",), aliases=("v4", "tpu-v4")),
    # TPU v5e: 197 TF BF16, 393 TOPS INT8 (no FP8/FP32 figure); 16 GB HBM2 819 GB/s; ICI 400 GB/s bidir.
    AcceleratorSpec(
        name="TPU-v5e", vendor="google", kind="tpu", memory_bytes=16 * GB, memory_bw_GBps=819,
        fp32_tflops=None, tf32_tflops=None, bf16_tflops=197, fp16_tflops=None, fp8_tflops=None,
        interconnect="ici", interconnect_GBps=400, nvlink_generation=None, pcie_gen=None, tdp_w=None,
        sources=("tpu_v5e",), aliases=("v5e", "v5litepod", "tpu-v5-lite")),
    # TPU v5p: 459 TF BF16 (Google lists FP8 at the same 459: no faster FP8 path, so left None);
    # 95 GB HBM2e 2,765 GB/s; ICI 1,200 GB/s bidirectional.
    AcceleratorSpec(
        name="TPU-v5p", vendor="google", kind="tpu", memory_bytes=95 * GB, memory_bw_GBps=2765,
        fp32_tflops=None, tf32_tflops=None, bf16_tflops=459, fp16_tflops=None, fp8_tflops=None,
        interconnect="ici", interconnect_GBps=1200, nvlink_generation=None, pcie_gen=None, tdp_w=None,
        sources=("tpu_v5p",), aliases=("v5p",)),
    # TPU v6e (Trillium): 918 TF BF16, 1,836 TOPS INT8; 32 GB HBM 1,638 GB/s; ICI 800 GB/s bidirectional.
    AcceleratorSpec(
        name="TPU-v6e", vendor="google", kind="tpu", memory_bytes=32 * GB, memory_bw_GBps=1638,
        fp32_tflops=None, tf32_tflops=None, bf16_tflops=918, fp16_tflops=None, fp8_tflops=None,
        interconnect="ici", interconnect_GBps=800, nvlink_generation=None, pcie_gen=None, tdp_w=None,
        sources=("tpu_v6e",), aliases=("v6e", "trillium", "tpu-v6-lite")),
)  # fmt: skip

_BY_NAME = {key: s for s in _SPECS for key in (s.name.lower(), *s.aliases)}

# NVML / torch / JAX device names -> catalog name. Order matters: the first pattern that matches wins,
# so the PCIe and NVL variants come before the generic names.
_MATCH_RULES: tuple[tuple[str, str | None], ...] = (
    (r"a100.*pcie", None),  # A100 PCIe has other clocks and power: not in the catalog
    (r"a100.*(80\s*gb|80g)", "A100-SXM4-80GB"),
    (r"a100.*(40\s*gb|40g)", "A100-SXM4-40GB"),
    (r"a100", "A100-SXM4-80GB"),
    (r"h100.*pcie", "H100-PCIe-80GB"),
    (r"h100.*nvl", None),  # H100 NVL (94 GB) is a different board
    (r"h100", "H100-SXM5-80GB"),
    (r"gh200", None),  # Grace Hopper superchip: its own memory and power figures
    (r"h200.*nvl", None),
    (r"h200", "H200-SXM-141GB"),
    (r"gb200", "GB200-186GB"),
    (r"b200", "B200-SXM-180GB"),
    (r"l40s", "L40S-48GB"),
    (r"mi300x", "MI300X-192GB"),
    (r"tpu\s*v4\b|tpu-v4", "TPU-v4"),
    (r"tpu\s*v5\s*(lite|e\b)|tpu-v5e|v5litepod", "TPU-v5e"),
    (r"tpu\s*v5p?\b|tpu-v5p", "TPU-v5p"),
    (r"tpu\s*v6|trillium", "TPU-v6e"),
)


def list_specs() -> list[AcceleratorSpec]:
    """Every catalog entry, in catalog order."""
    return list(_SPECS)


def get_spec(name: str) -> AcceleratorSpec:
    """Look up an entry by canonical name or alias (case-insensitive).

    Args:
        name: e.g. ``"H100-SXM5-80GB"``, ``"h100"``, ``"a100-40gb"``.

    Raises:
        NotFoundError: no entry has that name; the message lists the known names.
    """
    spec = _BY_NAME.get(name.strip().lower())
    if spec is not None:
        return spec
    known = ", ".join(s.name for s in _SPECS)
    raise NotFoundError(f"unknown accelerator {name!r}; known: {known}")


def match_spec(device_name: str) -> AcceleratorSpec | None:
    """Map a device name as a driver reports it to a catalog entry.

    Args:
        device_name: e.g. ``"NVIDIA H100 80GB HBM3"`` (NVML), ``"NVIDIA A100-SXM4-80GB"``,
            ``"AMD Instinct MI300X"`` (ROCm), ``"TPU v5 lite"`` (JAX device_kind).

    Returns:
        The entry, or None when the device is not in the catalog (a CPU, an A100 PCIe, ...).
    """
    text = device_name.strip().lower()
    try:
        return get_spec(text)
    except NotFoundError:
        pass
    for pattern, target in _MATCH_RULES:
        if re.search(pattern, text):
            return get_spec(target) if target else None
    return None
