"""A member's model file never runs code: a skops file whose node calls ``builtins.eval`` is refused
by `gpuyard models register` before anything is stored, and by every command that loads a registered
model (serve, deploy, promote, the registry's load) even when it got into the registry somehow; its
payload never runs. (Issue 26: before, `gpuyard deploy` ran it as root.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sklearn.datasets import load_iris
from tests.unit.models.test_model_safety import evil_skops

pytestmark = pytest.mark.security


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from gpuyard.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    _, err = capsys.readouterr()
    return int(exit_.value.code or 0), err.strip()


def test_register_refuses_the_file_before_anything_is_stored(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.models.registry import list_models

    marker = tmp_path / "marker"
    path = evil_skops(tmp_path, marker)
    code, err = _run(["models", "register", "evil", "--file", str(path)], capsys)
    assert code == 2 and "\n" not in err and "builtins.eval" in err, err
    folder = tmp_path / "dir"
    folder.mkdir()
    path.rename(folder / "model.skops")
    (folder / "config.json").write_text(json.dumps({"flavor": "sklearn", "task": "classification"}))
    code, err = _run(["models", "register", "evil", "--dir", str(folder)], capsys)
    assert code == 2 and "\n" not in err and "builtins.eval" in err, err
    assert list_models() == []
    blobs = gpuyard_home / "artifacts"
    assert not blobs.exists() or not [p for p in blobs.rglob("*") if p.is_file()]
    assert not marker.exists()


def test_every_loading_command_refuses_a_planted_model(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version that reached the registry before the check (or past it) is refused at each load."""
    import gpuyard.models.registry as registry
    from gpuyard.models.safety import UnsafeModelError
    from gpuyard.models.signature import infer_signature

    marker = tmp_path / "marker"
    folder = tmp_path / "m"
    folder.mkdir()
    evil_skops(tmp_path, marker).rename(folder / "model.skops")
    (folder / "config.json").write_text(json.dumps({"flavor": "sklearn", "task": "classification"}))
    X, y = load_iris(return_X_y=True)
    with monkeypatch.context() as m:  # as an older gpuyard would have stored it
        m.setattr(registry, "check_model_safety", lambda *a, **k: [])
        registry.register_folder("evil", folder, signature=infer_signature(X, y, "classification"))

    with pytest.raises(UnsafeModelError, match=r"builtins\.eval"):
        registry.load("evil:1")
    deploy = ["deploy", "evil:1", "--device", "cpu", "--port", "0", "--timeout", "120"]
    for argv in (
        ["serve", "evil:1", "--port", "0"],
        ["models", "promote", "evil:1", "--holdout", "sklearn:iris"],
        deploy,  # refused by deploy itself, before any record or server
    ):
        code, err = _run(argv, capsys)
        assert code == 2 and "\n" not in err and "builtins.eval" in err, (argv, err)
        assert not marker.exists(), argv
    assert deployments() == []
    # Past deploy's own check, the `gpuyard serve` it starts refuses the model too (exit 2, logged).
    monkeypatch.setattr("gpuyard.serve.deploy.check_files", lambda ref: None)
    code, err = _run(deploy, capsys)
    assert code == 2 and "exited with code 2" in err and "builtins.eval" in err, err
    assert not marker.exists()


def deployments() -> list[object]:
    from gpuyard.serve.deploy import list_deployments

    return list_deployments(all_=True)
