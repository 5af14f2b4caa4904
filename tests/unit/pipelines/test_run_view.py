"""`gpuyard run`'s live table: the latest-output column shows while a stage runs or failed, not after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpuyard.cli.run import _View

pytestmark = pytest.mark.unit


def _headers(view: _View) -> list[str]:
    return [str(c.header) for c in view.table().columns]


def test_latest_output_column_only_while_it_has_something_to_say() -> None:
    view = _View([SimpleNamespace(name="a", uses="ingest"), SimpleNamespace(name="b", uses="train")])
    assert "latest output" not in _headers(view)  # nothing started yet
    view.event({"stage": "a", "type": "start"})
    view.event({"stage": "a", "type": "log", "line": "epoch 1 loss 0.5\n"})
    assert _headers(view)[-1] == "latest output"
    assert list(view.table().columns[-1].cells) == ["epoch 1 loss 0.5", ""]
    view.event({"stage": "a", "type": "done", "cached": False, "seconds": 1.0, "job_id": 3})
    view.event({"stage": "b", "type": "start"})
    view.event({"stage": "b", "type": "done", "cached": True, "seconds": 0.1, "job_id": 1})
    assert "latest output" not in _headers(view)  # all done: an empty column would only confuse
    assert list(view.table().columns[3].cells) == ["3", "(1)"]
    view.event({"stage": "b", "type": "failed", "error": "boom: the data is gone\ntraceback..."})
    assert list(view.table().columns[-1].cells) == ["", "boom: the data is gone"]
