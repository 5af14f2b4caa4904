"""Hardware inventory of the node gpuyard runs on.

Submodules:

* ``probe``: :func:`gpuyard.hardware.probe.probe_node` builds a :class:`NodeInventory`
  (CPU, accelerators, topology, NICs) for this machine.
* ``nvml``: a small seam around NVIDIA's NVML (nvidia-ml-py) so tests can inject a fake.
* ``topology``: the GPU/NIC matrix in the vocabulary of ``nvidia-smi topo -m``.
* ``health``: pass / warn / fail per GPU.
* ``cpu`` and ``nics``: CPU, memory, NUMA and InfiniBand/RoCE devices from procfs/sysfs.
* ``catalog``: published figures per accelerator model.

This package imports nothing heavy at import time: submodules are imported on use.
"""
