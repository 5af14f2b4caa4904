"""`gpuyard deploy` offers every server option `gpuyard serve` has, and both build the same ServeOptions."""

from __future__ import annotations

from typing import Any

import pytest
import typer

from gpuyard.cli.main import app

pytestmark = pytest.mark.unit

# Options of `serve` that a deployment sets itself (the record names the deployment; deploy picks a free
# port by default because it runs in the background).
_DEPLOY_OWN = {"deployment_id", "api_key"}
_DEFAULTS_DIFFER = {"port"}


def _params(name: str) -> dict[str, Any]:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params if p.name}


def test_deploy_has_every_serve_option_with_the_same_flag_and_default() -> None:
    serve, deploy = _params("serve"), _params("deploy")
    missing = sorted(set(serve) - set(deploy) - _DEPLOY_OWN)
    assert not missing, f"gpuyard deploy lacks {missing}"
    for name, param in serve.items():
        if name in _DEPLOY_OWN:
            continue
        assert deploy[name].opts == param.opts, name
        if name not in _DEFAULTS_DIFFER:
            assert deploy[name].default == param.default, name


def test_the_batching_flag_reaches_the_options_and_a_wrong_mode_is_named() -> None:
    from gpuyard.cli.serve import serve_options
    from gpuyard.errors import ConfigError

    flags = {
        "host": "127.0.0.1",
        "port": 0,
        "replicas": 1,
        "device": "cpu",
        "max_batch": 5,
        "max_wait_ms": 1.5,
        "threads": 1,
        "max_body": 5000,
        "no_drift": True,
        "drift_window": 50,
        "drift_interval": 0.5,
    }
    opts = serve_options(batching="thread", **flags)  # type: ignore[arg-type]
    assert (opts.batch.mode, opts.batch.max_batch, opts.batch.threads) == ("thread", 5, 1)
    assert (opts.max_body_bytes, opts.drift, opts.drift_config.window) == (5000, False, 50)
    assert opts.to_json()["batch"]["mode"] == "thread"  # what a deployment's record holds
    with pytest.raises(ConfigError, match="--batching 'threads': use one of inline, thread"):
        serve_options(batching="threads", **flags)  # type: ignore[arg-type]


def test_the_flags_defaults_are_the_config_classes() -> None:
    from gpuyard.serve.options import BatchConfig, DriftConfig, ServeOptions

    serve_opts, batch, drift = ServeOptions(), BatchConfig(), DriftConfig()
    expected = {
        "host": serve_opts.host,
        "port": serve_opts.port,
        "replicas": serve_opts.replicas,
        "device": serve_opts.device,
        "max_batch": batch.max_batch,
        "max_wait_ms": batch.max_wait_ms,
        "batching": batch.mode,
        "threads": batch.threads,
        "max_body": serve_opts.max_body_bytes,
        "no_drift": not serve_opts.drift,
        "drift_window": drift.window,
        "drift_interval": drift.interval_s,
        "drain_s": serve_opts.drain_s,
        "max_prompt_tokens": serve_opts.max_prompt_tokens,
        "special_tokens": serve_opts.special_tokens,
    }
    serve = _params("serve")
    assert {name: serve[name].default for name in expected} == expected
    assert _params("deploy")["port"].default == 0


def test_serve_hands_the_flags_to_the_server_as_one_options_object(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from gpuyard.serve import runner

    seen: list[Any] = []
    monkeypatch.setattr(runner, "serve_with_record", lambda ref, opts: seen.append((ref, opts)))
    args = ["serve", "m@production", "--port", "0", "--max-batch", "7", "--no-drift", "--deployment-id", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    ref, opts = seen[0]
    assert ref == "m@production" and (opts.port, opts.batch.max_batch, opts.drift) == (0, 7, False)
    assert opts.deployment_id == 3 and opts.drift_config.min_rows == 200
