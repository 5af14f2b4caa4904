"""`gpuyard hw` in-process: JSON contract, tables, replayed fixtures, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.cli.main import main

pytestmark = pytest.mark.unit


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_json_is_one_document_with_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["hw", "--json", "--no-record"], capsys)
    assert code == 0
    node = json.loads(out)["node"]
    assert {"hostname", "cpu", "accelerators", "topology", "nics"} <= set(node)
    assert {"model", "cores", "memory_bytes", "isa"} <= set(node["cpu"])


def test_replayed_h100_json_has_the_nv18_matrix(
    fixtures_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(["hw", "--json", "--replay", str(fixtures_dir / "h100_hgx.json")], capsys)
    assert code == 0
    node = json.loads(out)["node"]
    assert node["hostname"] == "h100_hgx" and len(node["accelerators"]) == 8
    assert node["topology"]["matrix"][0][1:8] == ["NV18"] * 7


def test_tables_show_devices_topology_nics_and_health(
    fixtures_dir: Path, description, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    desc = description("l40s_pcie")
    desc["nvml"]["gpus"][2]["ecc"] = {
        "volatile_corrected": 0,
        "volatile_uncorrected": 3,
        "aggregate_corrected": 0,
        "aggregate_uncorrected": 3,
    }
    path = tmp_path / "l40s_bad.json"
    path.write_text(json.dumps(desc))
    code, out, _ = _run(["hw", "--replay", str(path)], capsys)
    assert code == 0
    for text in (
        "accelerators",
        "L40S",
        "Gen4 x16",
        "topology",
        "NIC1",
        "PIX",
        "RDMA NICs",
        "RoCE",
        "health",
    ):
        assert text in out, text
    assert "3 uncorrectable ECC errors" in out and "fail" in out


def test_cpu_only_tables(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)
    code, out, _ = _run(["hw", "--no-record"], capsys)
    assert code == 0
    assert "no accelerator found" in out and "CPU" in out and "no NVML" in out


def test_bad_replay_file_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "node.json"
    bad.write_text("[1, 2]")
    code, _out, err = _run(["hw", "--replay", str(bad)], capsys)
    assert code == 2 and "expected a JSON object" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
