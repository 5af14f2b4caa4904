"""The Slurm cluster's nodes as gpuyard sees them (GPUs from GRES, leaf switches, down or drained), and
gpuyard's drains carried into Slurm."""

from __future__ import annotations

import contextlib
import re

from gpuyard.errors import StoreError
from gpuyard.scheduler.executors.slurm_states import parse_kv_line
from gpuyard.scheduler.executors.slurm_tools import SlurmTools
from gpuyard.scheduler.placement import NodeSpec

_NODE_STATE_DOWN = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "INVAL", "POWERED_DOWN", "FUTURE")


def parse_gres_gpus(gres: str) -> tuple[int, str]:
    """GPUs and their type from a node's Gres string: ``gpu:4`` -> (4, ""), ``gpu:h100:8(S:0-1)`` ->
    (8, "h100"); several entries are summed (the first type named wins)."""
    total, kind = 0, ""
    for entry in (gres or "").split(","):
        entry = re.sub(r"\(.*?\)", "", entry.strip())
        parts = entry.split(":")
        if not parts or parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        if not count.isdigit():
            continue
        total += int(count)
        if len(parts) >= 3 and not kind:
            kind = parts[1]
    return total, kind


class SlurmNodes(SlurmTools):
    """The Slurm executor's view of the cluster's nodes."""

    # -- nodes ----------------------------------------------------------------------------------------
    def node_info(self) -> list[dict[str, str]]:
        """Every node as ``scontrol show node -o`` describes it (name, address, GRES, state...)."""
        rows = [parse_kv_line(line) for line in self._call(["scontrol", "show", "node", "-o"]).splitlines()]
        return [r for r in rows if r.get("NodeName")]

    def switches(self) -> dict[str, str]:
        """node -> its leaf switch, from the cluster's topology/tree (empty without one)."""
        out: dict[str, str] = {}
        text = self._call(["scontrol", "show", "topology"], check=False)
        for line in text.splitlines():
            row = parse_kv_line(line)
            if row.get("Level") == "0" and row.get("Nodes"):
                for node in self.hostnames(row["Nodes"]):
                    out.setdefault(node, row.get("SwitchName", "leaf0"))
        return out

    def hostnames(self, nodelist: str) -> list[str]:
        """Expand a Slurm node list (``n[1-3],gpu7``) with ``scontrol show hostnames``."""
        if not nodelist or nodelist in ("(null)", "None"):
            return []
        return self._call(["scontrol", "show", "hostnames", nodelist]).split()

    def nodes(self) -> list[NodeSpec]:
        """The cluster's nodes as scheduler nodes: GPUs and their type from GRES, CPUs, leaf switch."""
        leaves = self.switches()
        out = []
        for row in sorted(self.node_info(), key=lambda r: r["NodeName"]):
            name = row["NodeName"]
            gpus, kind = parse_gres_gpus(row.get("Gres", ""))
            self._addr[name] = row.get("NodeAddr") or name
            out.append(
                NodeSpec(
                    name=name,
                    gpus=gpus,
                    gpu_type=kind or ("gpu" if gpus else ""),
                    nvlink_domain=name,
                    leaf=leaves.get(name, "leaf0"),
                    cpus=int(row.get("CPUTot") or row.get("CPUEfctv") or 0),
                )
            )
        return out

    def unavailable_nodes(self) -> dict[str, str]:
        """Nodes Slurm will not run jobs on now (down, drained, failing) -> its state and reason."""
        out = {}
        for row in self.node_info():
            state = row.get("State", "")
            if any(word in state for word in _NODE_STATE_DOWN):
                why = row.get("Reason", "")
                out[row["NodeName"]] = f"{state}" + (f": {why}" if why and why != "(null)" else "")
        return out

    def drain(self, node: str, reason: str) -> None:
        """Drain a node in Slurm (no new jobs; running ones finish), with gpuyard's reason."""
        reason = re.sub(r"\s+", " ", f"gpuyard: {reason}")[:200]
        self._call(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])
        self._drained_by_us.add(node)

    def undrain(self, node: str) -> None:
        """Return a node gpuyard drained to service (``State=RESUME``)."""
        self._call(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        self._drained_by_us.discard(node)

    def sync_drains(self, drained: dict[str, str]) -> None:
        """Make Slurm's drains follow gpuyard's: drain the nodes gpuyard drained (node -> reason), and
        resume those gpuyard drained before and no longer does. Nodes drained by the cluster's admin
        in Slurm are left alone."""
        current = self.unavailable_nodes()
        for node, reason in drained.items():
            if "DRAIN" not in current.get(node, ""):
                self.drain(node, reason)
            elif "gpuyard:" in current[node]:
                self._drained_by_us.add(node)  # drained by an earlier server: ours to resume
        for node in sorted(self._drained_by_us - set(drained)):
            if "gpuyard:" in current.get(node, "") or node not in current:
                with contextlib.suppress(StoreError):
                    self.undrain(node)
            self._drained_by_us.discard(node)
