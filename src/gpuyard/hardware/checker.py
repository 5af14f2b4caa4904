"""The health check of one node kept from one run to the next: :class:`NodeChecker`.

It holds the node's NVML open (Xid events reach only the process that registered for them), the
NVLink error baselines and when each GPU was last self-tested. The checks themselves are in
:mod:`gpuyard.hardware.health` (:func:`~gpuyard.hardware.health.check_node`).
"""

from __future__ import annotations

from collections.abc import Callable

from gpuyard.hardware.health import NodeCheck, NodeCheckConfig, SelfTestResult, check_node
from gpuyard.hardware.nvml import HealthNvmlBackend


class NodeChecker:
    """The health check of the node this process runs on, with what it keeps from one run to the next.

    NVML is opened on the first run and kept open (Xid events are delivered to the process that
    registered for them, from then on); each GPU's NVLink error total is the baseline of the next run;
    a GPU is self-tested at most every ``selftest_interval_s``. The server's
    :class:`gpuyard.scheduler.nodes.NodeHealthMonitor` holds one for its own machine; on a Ray cluster
    an actor pinned to each node holds that node's
    (:meth:`gpuyard.scheduler.executors.ray.RayExecutor.check_nodes_health`).

    Args:
        config: what to check and the limits.
        nvml: the node's NVML (default: opened on the first run; when it cannot be, every run passes
            with a note saying why).
        selftest: runs the self-test of one GPU (default: :func:`gpuyard.hardware.selftest.selftest_gpu`
            with the config's size and timeout).
        clock: seconds, monotonic (tests).
    """

    def __init__(
        self,
        config: NodeCheckConfig | None = None,
        nvml: HealthNvmlBackend | None = None,
        selftest: Callable[[int], SelfTestResult] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import time

        self.config = config or NodeCheckConfig()
        self._nvml, self._nvml_note = nvml, ""
        self._selftest = selftest
        self._clock = clock or time.monotonic
        self._last_selftest: dict[int, float] = {}
        self._nvlink: dict[int, int] | None = None

    @classmethod
    def from_description(cls, path: str, config: NodeCheckConfig | None = None) -> NodeChecker:
        """A checker of a fake node: NVML and self-tests answered from a node description file
        (:class:`gpuyard.hardware.fake.FakeNvml`, faults written in it included)."""
        from pathlib import Path

        from gpuyard.hardware.fake import FakeNvml, fake_selftest

        fake = FakeNvml.from_file(Path(path))
        return cls(config, nvml=fake, selftest=fake_selftest(fake))

    def _backend(self) -> HealthNvmlBackend | None:
        if self._nvml is None and not self._nvml_note:
            from gpuyard.hardware.nvml import open_nvml

            nv, note = open_nvml()
            self._nvml = nv  # type: ignore[assignment]  # the real backend also counts Xids and NVLink errors
            self._nvml_note = note or ("" if nv is not None else "no NVML")
        return self._nvml

    def _run_selftest(self, gpu: int) -> SelfTestResult:
        if self._selftest is not None:
            return self._selftest(gpu)
        from gpuyard.hardware.selftest import selftest_gpu

        c = self.config
        return selftest_gpu(gpu, c.selftest_size, c.selftest_memory_mb, c.selftest_timeout_s)

    def run(self, busy: frozenset[int] | set[int] = frozenset(), selftest: bool = True) -> NodeCheck:
        """Check the node now: GPUs in ``busy`` (and all of them when ``selftest`` is False) are not
        self-tested; the others are when their last self-test is ``selftest_interval_s`` old."""
        now = self._clock()
        nv = self._backend()
        if nv is None:
            return NodeCheck("pass", {}, note=self._nvml_note or "no NVML")
        try:
            count = nv.device_count()
        except Exception:  # check_node says why
            count = 0
        interval = self.config.selftest_interval_s
        idle = {
            i
            for i in range(count)
            if selftest and i not in busy and now - self._last_selftest.get(i, -float("inf")) >= interval
        }
        check = check_node(nv, self.config, idle, self._run_selftest, self._nvlink)
        for i in check.selftests:
            self._last_selftest[i] = now
        self._nvlink = {**(self._nvlink or {}), **check.nvlink_errors}
        return check

    def close(self) -> None:
        """Shut NVML down (a no-op for a fake or when it never opened)."""
        from gpuyard.hardware.nvml import close_nvml

        close_nvml(self._nvml)
