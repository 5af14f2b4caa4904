"""`gpuyard serve MODEL` checks MODEL before it says it serves it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("ref", ["no-such-model", "no-such-model:3", "no-such-model@production"])
def test_unknown_model_is_refused_before_serving_is_announced(
    ref: str, gpuyard_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", ref, "--port", "0"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2
    assert "serving" not in out  # before: "serving no-such-model at http://..." and then the error
    assert err.strip().count("\n") == 0 and "no-such-model" in err and "not registered" in err, err
