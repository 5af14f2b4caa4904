"""Users' text files: binary, undecodable and malformed YAML files are refused in one line naming where."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.textfiles import load_yaml, read_text

pytestmark = pytest.mark.unit


def test_malformed_yaml_names_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("name: x\ncommand: [a, b\nresources: {gpus: 1}\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(bad, "job spec")
    message = str(err.value)
    assert message.startswith(f"{bad}:3:10: not valid YAML: ") and "\n" not in message
    tab = tmp_path / "tab.yaml"
    tab.write_text("a: 1\n\tb: 2\n")
    with pytest.raises(ConfigError, match=rf"^{tab}:2:1: not valid YAML"):
        load_yaml(tab)


def test_binary_and_non_utf8_files_are_refused(tmp_path: Path) -> None:
    png = tmp_path / "spec.yaml"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    with pytest.raises(ConfigError, match=r"spec\.yaml: a binary file, not a job spec$"):
        load_yaml(png, "job spec")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.yaml: not UTF-8 text \(byte 9\)"):
        read_text(latin)
    with pytest.raises(ConfigError, match="a folder"):
        read_text(tmp_path)
    with pytest.raises(NotFoundError, match="no such file"):
        read_text(tmp_path / "missing.yaml")


def test_good_yaml_reads(tmp_path: Path) -> None:
    good = tmp_path / "ok.yaml"
    good.write_text("name: caf\u00e9\nn: [1, 2]\n", encoding="utf-8")
    assert load_yaml(good) == {"name": "caf\u00e9", "n": [1, 2]}


@pytest.mark.parametrize("command", [["jobs", "submit", "--dry-run"], ["train"], ["run"], ["models", "fit"]])
def test_every_spec_command_says_it_in_one_line(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.cli.main import main

    blob = tmp_path / "blob.yaml"
    blob.write_bytes(b"\x7fELF\x02\x01\x01\x00" * 64)
    argv = [*command[:2], str(blob), *command[2:]] if command[0] == "jobs" else [*command, str(blob)]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.count("\n") == 0 and "a binary file" in err, err


def test_sim_refuses_a_binary_or_latin1_trace_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.cli.main import main

    blob = tmp_path / "trace.csv"
    blob.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 8)  # a gzip file named .csv
    latin = tmp_path / "latin.csv"
    latin.write_bytes("submit_time,duration,num_gpus,team\n0,10,1,\u00e9quipe\n".encode("latin-1"))
    for path, said in ((blob, "a binary file, not a trace CSV"), (latin, "not UTF-8 text")):
        with pytest.raises(SystemExit) as exit_:
            main(["sim", "--trace", str(path), "--nodes", "2"])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and err.count("\n") == 0 and said in err, err
