"""Where gpuyard's jobs go on a Slurm cluster: partition, account and QoS per team, and job names."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuyard.errors import ConfigError

BASE_PORT = 29500  # torch.distributed's customary rendezvous port, offset per job
NAME_PREFIX = "gpuyard-"


@dataclass(frozen=True)
class SlurmConfig:
    """Where and under what account gpuyard's jobs go on the cluster.

    Attributes:
        partition, account, qos: defaults for every job ("" : the cluster's default).
        teams: team -> its own {partition, account, qos} (overrides the defaults).
        env: variables for the Slurm commands themselves (e.g. SLURM_CONF), not for jobs.
        port_base: rendezvous port of a multi-node job = port_base + job id % 1000.
    """

    partition: str = ""
    account: str = ""
    qos: str = ""
    teams: dict[str, dict[str, str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    port_base: int = BASE_PORT

    @classmethod
    def load(cls, path: str | None, partition: str = "", account: str = "") -> SlurmConfig:
        """Read a YAML file of ``partition``, ``account``, ``qos`` and ``teams: {team: {...}}``.

        Raises:
            ConfigError: unreadable file, unknown key or a value that is not a short name.
        """
        doc: dict[str, Any] = {}
        if path:
            try:
                loaded = yaml.safe_load(Path(path).read_text())
            except (OSError, yaml.YAMLError) as exc:
                raise ConfigError(f"--slurm-config {path}: {exc}") from None
            if loaded is not None and not isinstance(loaded, dict):
                raise ConfigError(f"--slurm-config {path}: expected a mapping of settings")
            doc = loaded or {}
        unknown = set(doc) - {"partition", "account", "qos", "teams", "port_base"}
        if unknown:
            raise ConfigError(f"--slurm-config {path}: unknown keys {sorted(unknown)}")
        teams_doc = doc.get("teams") or {}
        if not isinstance(teams_doc, dict):
            raise ConfigError(f"--slurm-config {path}: teams must map a team to its partition/account/qos")
        teams: dict[str, dict[str, str]] = {}
        for team, settings in teams_doc.items():
            if not isinstance(settings, dict) or set(settings) - {"partition", "account", "qos"}:
                raise ConfigError(
                    f"--slurm-config {path}: teams.{team} takes partition, account and qos, got {settings!r}"
                )
            teams[str(team)] = {k: _slurm_name(f"teams.{team}.{k}", v) for k, v in settings.items()}
        port_base = doc.get("port_base", BASE_PORT)
        if not isinstance(port_base, int) or not 1024 <= port_base <= 64535:
            raise ConfigError(f"--slurm-config {path}: port_base must be an integer in 1024-64535")
        return cls(
            partition=_slurm_name("partition", partition or doc.get("partition", "")),
            account=_slurm_name("account", account or doc.get("account", "")),
            qos=_slurm_name("qos", doc.get("qos", "")),
            teams=teams,
            port_base=port_base,
        )

    def for_team(self, team: str) -> dict[str, str]:
        """The partition, account and QoS of one team's jobs (empty ones left out)."""
        out = {"partition": self.partition, "account": self.account, "qos": self.qos}
        out.update(self.teams.get(team, {}))
        return {k: v for k, v in out.items() if v}


def _slurm_name(what: str, value: Any) -> str:
    text = "" if value is None else str(value)
    if text and not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", text):
        raise ConfigError(f"{what}: {text!r} is not a Slurm name (letters, digits, _ . -)")
    return text


def instance_tag(identity: str) -> str:
    """A short stable tag of a store's identity (its database URL) for Slurm job names."""
    import hashlib

    return hashlib.sha256(identity.encode()).hexdigest()[:8]
