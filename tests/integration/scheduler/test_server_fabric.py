"""`gpuyard server --placement fabric --cluster ...` as a real process, and the options' one-line errors."""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.scheduler.client import JobClient

from .conftest import ServerStarter, free_port, wait_for

pytestmark = pytest.mark.integration

FABRIC_SERVER = ("--gpus", "8", "--cpus", "1", "--placement", "fabric", "--cluster", "dgx-a100")
TRAIN = "name: llama-8b\ncommand: 'true'\nresources: {{gpus: {gpus}}}\n" + (
    "workload: {{model: llama3-8b, global_batch: 32, seq_len: 2048}}\n"
)


def _jobs(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUYARD_SERVER": url}
    cmd = [sys.executable, "-m", "gpuyard.cli.main", "jobs", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_server_places_a_workload_by_the_fabric_model(server: ServerStarter, tmp_path: Path) -> None:
    _, url = server(*FABRIC_SERVER)
    spec = tmp_path / "train.yaml"
    spec.write_text(TRAIN.format(gpus=8))
    dry = json.loads(_jobs(url, "submit", str(spec), "--dry-run").stdout)
    assert dry["fabric"]["decision"] == "start" and dry["fabric"]["choice"] == "consolidated"
    assert dry["fabric"]["step_s"] > 0
    job = json.loads(_jobs(url, "submit", str(spec), "--json").stdout)
    plain = json.loads(_jobs(url, "submit", "--json", str(_plain(tmp_path))).stdout)
    client = JobClient(url)
    for jid in (job["id"], plain["id"]):
        wait_for(lambda j=jid: client.get(j)["state"] == "succeeded", timeout=60, every=0.1)
    shown = _jobs(url, "show", str(job["id"])).stdout
    fabric = _fabric_lines(shown)
    assert len(fabric) == 1, shown
    step = r"(\d+(?:\.\d+)?) s"
    line = re.fullmatch(
        rf"fabric  one node: predicted step {step} vs {step} on one node \(\+0%\); consolidated", fabric[0]
    )
    assert line is not None, fabric[0]
    assert float(line.group(1)) == pytest.approx(dry["fabric"]["step_s"], rel=0.01)
    assert client.get(job["id"])["placement"]["predicted"]["choice"] == "consolidated"
    # A job without a workload is placed by topology only: no prediction, no fabric line.
    assert _fabric_lines(_jobs(url, "show", str(plain["id"])).stdout) == []
    assert "predicted" not in client.get(plain["id"])["placement"]
    # A workload that fits no layout on its GPUs is refused at submit, in one line.
    spec.write_text(TRAIN.format(gpus=1))
    refused = _jobs(url, "submit", str(spec))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "workload: on 1 GPUs" in lines[0]


def _fabric_lines(shown: str) -> list[str]:
    return [ln.strip() for ln in shown.splitlines() if ln.strip().startswith("fabric ")]


def _plain(tmp_path: Path) -> Path:
    spec = tmp_path / "plain.yaml"
    spec.write_text("name: plain\ncommand: 'true'\nresources: {gpus: 4}\n")
    return spec


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--placement", "fabric", "--gpus", "8"],
            "--placement fabric needs the fabric of the nodes: --cluster",
        ),
        (["--placement", "fabric", "--cluster", "nope"], "unknown cluster 'nope': not a preset (dgx-a100"),
        (
            ["--placement", "fabric", "--cluster", "dgx-a100", "--gpus", "4"],
            "has 8 GPUs per node, but node '{host}' has 4: its jobs would be costed on other hardware; "
            "give --gpus 8",
        ),
        (["--placement", "fabric", "--cluster", "dgx-a100"], "no node here has GPUs"),
        (["--cluster", "dgx-a100", "--gpus", "8"], "used by fabric placement only; add --placement fabric"),
        (["--placement", "tree"], "--placement 'tree' is unknown; choose topology or fabric"),
        (
            ["--placement", "fabric", "--cluster", "dgx-a100", "--max-wait", "-1"],
            "--max-wait -1: must be >= 0",
        ),
    ],
)
def test_server_option_errors_are_one_line_exit_2(
    gpuyard_home: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        # refused before it listens; as the server's own job user, so the root server's check that
        # its job user can run Python (which comes first) does not answer instead
        main(["server", "--port", str(free_port()), "--job-user", getpass.getuser(), *options])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert message.format(host=socket.gethostname()) in err[0]
