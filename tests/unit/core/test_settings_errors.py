"""Settings resolution and the CLI's error contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.settings import load_settings

pytestmark = pytest.mark.unit


def test_defaults_live_in_home(tmp_path: Path) -> None:
    s = load_settings({"GPUYARD_HOME": str(tmp_path / "h")})
    assert s.home == (tmp_path / "h").resolve()
    assert s.database_url == f"sqlite:///{(tmp_path / 'h').resolve() / 'gpuyard.db'}"
    assert s.artifact_root == str((tmp_path / "h").resolve() / "artifacts")
    assert s.is_sqlite


def test_home_defaults_to_dot_gpuyard(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_settings({}).home == (tmp_path / ".gpuyard").resolve()


def test_postgres_url_gets_the_psycopg_driver() -> None:
    s = load_settings({"GPUYARD_DATABASE_URL": "postgresql://u@db.example/gy", "GPUYARD_HOME": "/tmp/x"})
    assert s.database_url == "postgresql+psycopg://u@db.example/gy"
    assert not s.is_sqlite


def test_unknown_database_scheme_is_refused() -> None:
    with pytest.raises(ConfigError, match="unsupported database"):
        load_settings({"GPUYARD_DATABASE_URL": "mysql://x/y"})


def test_cli_user_error_is_one_line_exit_2(tmp_path: Path) -> None:
    env = {"GPUYARD_DATABASE_URL": "mysql://x/y", "GPUYARD_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    code = "from gpuyard.cli.main import main; from gpuyard.settings import load_settings\n"
    code += "import gpuyard.cli.main as m\n@m.app.command('boom')\ndef boom():\n    load_settings()\nmain()"
    out = subprocess.run([sys.executable, "-c", code, "boom"], env=env, capture_output=True, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "unsupported database" in out.stderr
    dbg = subprocess.run(
        [sys.executable, "-c", code, "--debug", "boom"], env=env, capture_output=True, text=True
    )
    assert dbg.returncode == 2 and "Traceback" in dbg.stderr


def test_version_flag() -> None:
    import gpuyard

    out = subprocess.run(
        [sys.executable, "-m", "gpuyard.cli.main", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == f"gpuyard {gpuyard.__version__}"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["server", "--port", "99999"], "'--port'"),  # out of range: refused, not a random port
        (["server", "--port", "0"], "'--port'"),
        (["server", "--no-such-flag"], "--no-such-flag"),
        (["plan", "--gpus", "many"], "'--gpus'"),
        (["jobs", "show"], "job_id"),
    ],
)
def test_usage_errors_are_one_line_exit_2(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and said in err, err
    assert f"gpuyard {argv[0]}" in err  # and where to read more


def test_a_commands_exit_code_is_kept() -> None:
    # `gpuyard models promote` exits 1 when it does not promote: typer.Exit(code) must reach the shell.
    code = (
        "import typer\nimport gpuyard.cli.main as m\n@m.app.command('boom')\ndef boom() -> None:\n"
        "    raise typer.Exit(3)\nm.main()"
    )
    out = subprocess.run([sys.executable, "-c", code, "boom"], capture_output=True, text=True)
    assert out.returncode == 3 and out.stderr == "", out.stderr


def test_an_error_naming_a_user_path_prints_it_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Square brackets in a name (rich markup to the console) are printed as they are, not swallowed."""
    from gpuyard.cli.main import main

    spec = tmp_path / "spec[red][x].yaml"
    spec.write_text("[1, 2]\n")
    with pytest.raises(SystemExit) as done:
        main(["train", str(spec)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {spec}:" in " ".join(err.split()), err
