"""The published nccl-tests corpus parses, covers what it claims, and the model predicts every row.

Each source in ``fabric/published/collectives.yaml`` carries a ``tolerance_pct``: the largest |busbw
error| accepted for its rows, set a few points above what the model achieves today
(``benchmarks/collective_accuracy.py`` prints the errors). A change that worsens any row past it fails.
"""

from __future__ import annotations

import pytest

from gpuyard.fabric.collectives import OPS, bus_factor, estimate
from gpuyard.fabric.presets import list_presets, load_cluster
from gpuyard.fabric.published.nccl import CollectiveRow, load_collectives

pytestmark = pytest.mark.unit

CORPUS = load_collectives()
ROWS = CORPUS.rows


def _id(row: CollectiveRow) -> str:
    return f"{row.source}-{row.op}-{row.gpus}-{row.size_bytes}"


def test_every_row_parses_with_its_source() -> None:
    assert len(CORPUS.sources) >= 5 and len(ROWS) == sum(len(s.rows) for s in CORPUS.sources)
    presets = set(list_presets())
    for s in CORPUS.sources:
        assert s.where and s.rows and s.system in presets
        assert s.gpus % s.gpus_per_node == 0 or s.gpus < s.gpus_per_node
    for r in ROWS:
        assert r.op in OPS and r.size_bytes > 0
        assert r.busbw_GBps is not None or r.time_us is not None


def test_corpus_covers_a100_h100_h200_one_node_and_several() -> None:
    systems = {r.system for r in ROWS}
    assert {"dgx-a100", "dgx-h100", "hgx-h200"} <= systems
    assert any(r.nodes > 1 for r in ROWS) and any(r.nodes == 1 for r in ROWS)
    assert {"all_reduce", "all_gather"} <= {r.op for r in ROWS}


def test_printed_times_agree_with_printed_busbw() -> None:
    # Guards against transcription slips: nccl-tests prints both, so they must agree to rounding.
    for r in ROWS:
        if r.time_us is None or r.busbw_GBps is None or r.busbw_GBps < 1:
            continue
        busbw = r.size_bytes / (r.time_us * 1e3) * bus_factor(r.op, r.gpus)
        assert busbw == pytest.approx(r.busbw_GBps, rel=0.01, abs=0.02), _id(r)


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_model_predicts_every_row_within_its_source_tolerance(row: CollectiveRow) -> None:
    est = estimate(load_cluster(row.system), row.op, row.gpus, row.size_bytes, algorithm=row.algorithm)
    measured_us = row.time_us
    if measured_us is None:
        assert row.busbw_GBps is not None
        measured_us = row.size_bytes / (row.busbw_GBps / bus_factor(row.op, row.gpus) * 1e3)
    error_pct = (measured_us / (est.time_s * 1e6) - 1) * 100
    assert abs(error_pct) <= row.tolerance_pct, f"{error_pct:+.1f}% ({est.algorithm}/{est.protocol})"
