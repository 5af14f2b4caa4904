"""`gpuyard fabric calibrate`'s memory figures on a real GPU: the reserve outside the caching allocator
and the allocator's fragmentation are measured, plausible, and change a layout's memory need."""

from __future__ import annotations

import pytest
import torch

from gpuyard.fabric.calibrate import measure_fragmentation, measure_memory_reserve
from gpuyard.fabric.cluster import Cluster, Compute, Device, IntraNode, Nic
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.step import GIB, ParallelConfig, estimate_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_reserve_and_fragmentation_are_measured_and_plausible() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.matmul(torch.ones(256, 256, device=device), torch.ones(256, 256, device=device))  # cuBLAS up
    fragmentation = measure_fragmentation(device, quick=True)
    reserve = measure_memory_reserve(device)
    total = torch.cuda.mem_get_info(device)[1]
    assert fragmentation is not None and 1.0 <= fragmentation < 3.0
    # A CUDA context alone holds hundreds of MiB; nothing measured may exceed what the device has.
    assert reserve is not None and 64 << 20 < reserve < total
    print(f"calibrate memory: reserve {reserve / 2**20:.0f} MiB, fragmentation {fragmentation:.3f}")
    cluster = Cluster(
        name="measured",
        accelerator="custom",
        device=Device(name="gpu", memory_bytes=total, memory_bw_GBps=2000, bf16_tflops=500),
        gpus_per_node=1,
        intra=IntraNode(kind="loopback", bw_GBps=100, latency_us=5),
        nic=Nic(count=0, gbps=1, kind="loopback", latency_us=10),
        compute=Compute(memory_reserved_bytes=reserve, memory_fragmentation=fragmentation),
    )
    est = estimate_step(PRESETS["llama3-8b"], cluster, 1, 1, 2048, ParallelConfig(recompute="full"))
    tensors = sum(est.memory_gib.values()) * GIB
    assert est.memory_gib_per_gpu * GIB == pytest.approx(tensors * fragmentation + reserve)
