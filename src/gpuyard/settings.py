"""Where gpuyard keeps its state: GPUYARD_HOME, the database URL and the artifact root."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpuyard.errors import ConfigError

HOME_ENV = "GPUYARD_HOME"
DATABASE_ENV = "GPUYARD_DATABASE_URL"
ARTIFACTS_ENV = "GPUYARD_ARTIFACTS"
SERVER_ENV = "GPUYARD_SERVER"
# The team of a job's work: `gpuyard server` sets it for each job; runs the job tracks belong to it.
TEAM_ENV = "GPUYARD_TEAM"
# Set by the scheduler for every job: the scheduler's name of the node a process runs on.
NODE_ENV = "GPUYARD_NODE"


@dataclass(frozen=True)
class Settings:
    """Resolved locations of gpuyard's state.

    Attributes:
        home: folder for the embedded default (SQLite file, artifacts, logs, tokens).
        database_url: SQLAlchemy URL of the state store (sqlite:/// or postgresql+psycopg://).
        artifact_root: fsspec URL or local folder where artifacts are written.
        server_url: base URL of the gpuyard server that CLI clients talk to.
    """

    home: Path
    database_url: str
    artifact_root: str
    server_url: str

    @property
    def is_sqlite(self) -> bool:
        """True when the state store is the embedded SQLite file."""
        return self.database_url.startswith("sqlite")

    def ensure_home(self) -> Path:
        """Create the home folder (mode 0700: it holds tokens) and return it."""
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.home


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Read settings from the environment, filling the embedded defaults.

    Args:
        env: mapping to read instead of ``os.environ`` (tests).

    Raises:
        ConfigError: when a URL has a scheme gpuyard cannot use.
    """
    env = dict(os.environ if env is None else env)
    home = Path(env.get(HOME_ENV) or Path.home() / ".gpuyard").expanduser().resolve()
    db_url = env.get(DATABASE_ENV) or f"sqlite:///{home / 'gpuyard.db'}"
    if not db_url.startswith(("sqlite", "postgresql")):
        raise ConfigError(
            f"{DATABASE_ENV}={db_url.split('://')[0]}://...: unsupported database; "
            "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        )
    if db_url.startswith("postgresql://"):
        db_url = "postgresql+psycopg://" + db_url[len("postgresql://") :]
    artifacts = env.get(ARTIFACTS_ENV) or str(home / "artifacts")
    server = env.get(SERVER_ENV) or "http://127.0.0.1:8765"
    return Settings(home=home, database_url=db_url, artifact_root=artifacts, server_url=server.rstrip("/"))
