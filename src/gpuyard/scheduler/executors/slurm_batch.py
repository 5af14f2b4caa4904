"""The Slurm executor's batch request: what ``plan()`` decided and ``script()`` / ``launch()`` carry out.

It travels in :attr:`LaunchPlan.extra` (the dry run's JSON) and, after ``sbatch``, in the job's handle
(the database), both as a plain dict with the keys the handle has always had. :meth:`SlurmBatch.of`
reads such a dict back into typed fields and refuses one that is malformed in one line, so a handle
damaged in the database never becomes an ``sbatch`` option or a user to run as.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuyard.errors import StoreError


@dataclass(frozen=True)
class HetGroup:
    """One component of a heterogeneous job: its nodes, each with the same GPU count."""

    nodes: tuple[str, ...]
    gpus_per_node: int


@dataclass(frozen=True)
class SlurmBatch:
    """One attempt's batch job.

    Attributes:
        slurm_name: the job name (the server's prefix, the job id, the attempt).
        sbatch: sbatch's options, heterogeneous components separated by ``":"``.
        script: where the batch script is written.
        rdzv: the rendezvous ``HOST:PORT`` placed in the command (replaced per node on several nodes).
        addrs: each node's address (its NodeAddr), by Slurm node name.
        user: the user sbatch submits as (``--uid``), None when the server's own.
        isolated: the job runs isolated as its team's user (its environment is its own, allow-listed).
        uid, gid, user_name: that user, when isolated.
        het_groups: a heterogeneous job's components; empty for a plain job.
        het_argv: each component's command, in het_groups' order.
    """

    slurm_name: str
    sbatch: tuple[str, ...]
    script: str
    rdzv: str
    addrs: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    isolated: bool = False
    uid: int | None = None
    gid: int | None = None
    user_name: str | None = None
    het_groups: tuple[HetGroup, ...] = ()
    het_argv: tuple[tuple[str, ...], ...] = ()

    def to_extra(self) -> dict[str, Any]:
        """The JSON-ready dict of :attr:`LaunchPlan.extra` and the handle (their historical keys)."""
        out: dict[str, Any] = {
            "slurm_name": self.slurm_name,
            "sbatch": list(self.sbatch),
            "script": self.script,
            "rdzv": self.rdzv,
            "addrs": dict(self.addrs),
            "user": self.user,
            "isolated": self.isolated,
        }
        if self.uid is not None:
            out.update(uid=self.uid, gid=self.gid, user_name=self.user_name)
        if self.het_groups:
            out["het_groups"] = [
                {"nodes": list(g.nodes), "gpus_per_node": g.gpus_per_node} for g in self.het_groups
            ]
            out["het_argv"] = [list(a) for a in self.het_argv]
        return out

    @classmethod
    def of(cls, extra: Mapping[str, Any]) -> SlurmBatch:
        """Read a plan's ``extra`` or a handle back.

        Raises:
            StoreError: a field missing or of the wrong type (one line naming it).
        """
        try:
            uid = extra.get("uid")
            batch = cls(
                slurm_name=_str(extra, "slurm_name"),
                sbatch=_strs(extra.get("sbatch"), "sbatch"),
                script=_str(extra, "script"),
                rdzv=str(extra.get("rdzv") or ""),
                addrs={_s(k, "addrs"): _s(v, "addrs") for k, v in _map(extra.get("addrs"), "addrs").items()},
                user=_opt_str(extra.get("user"), "user"),
                isolated=_bool(extra.get("isolated", False), "isolated"),
                uid=None if uid is None else _int(uid, "uid"),
                gid=None if uid is None else _int(extra.get("gid"), "gid"),
                user_name=None if uid is None else _s(extra.get("user_name"), "user_name"),
                het_groups=tuple(_group(g) for g in _list(extra.get("het_groups"), "het_groups")),
                het_argv=tuple(_strs(a, "het_argv") for a in _list(extra.get("het_argv"), "het_argv")),
            )
        except _Bad as exc:
            raise StoreError(f"Slurm batch request: {exc}") from None
        if len(batch.het_argv) != len(batch.het_groups):
            raise StoreError(
                f"Slurm batch request: {len(batch.het_groups)} heterogeneous groups but "
                f"{len(batch.het_argv)} commands"
            )
        if batch.isolated and batch.uid is None:
            raise StoreError("Slurm batch request: isolated, but no uid, gid and user_name")
        return batch


class _Bad(Exception):
    """A field of the wrong shape (the message names it)."""


def _s(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{name}: expected a string, got {type(value).__name__}")
    return value


def _str(extra: Mapping[str, Any], name: str) -> str:
    if name not in extra:
        raise _Bad(f"{name}: missing")
    return _s(extra[name], name)


def _opt_str(value: Any, name: str) -> str | None:
    return None if value is None else _s(value, name)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Bad(f"{name}: expected a non-negative integer, got {value!r:.40}")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"{name}: expected true or false, got {value!r:.40}")
    return value


def _list(value: Any, name: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise _Bad(f"{name}: expected a list, got {type(value).__name__}")
    return list(value)


def _map(value: Any, name: str) -> Mapping[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _Bad(f"{name}: expected an object, got {type(value).__name__}")
    return value


def _strs(value: Any, name: str) -> tuple[str, ...]:
    return tuple(_s(x, name) for x in _list(value, name))


def _group(value: Any) -> HetGroup:
    group = _map(value, "het_groups")
    return HetGroup(
        nodes=_strs(group.get("nodes"), "het_groups.nodes"),
        gpus_per_node=_int(group.get("gpus_per_node"), "het_groups.gpus_per_node"),
    )
