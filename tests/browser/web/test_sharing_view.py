"""The Cluster page shows GPU shares and MIG slices with the jobs holding them; Jobs says why one waits."""

from __future__ import annotations

import copy
import getpass
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.waiting import wait_for

from .conftest import H100_NODE, start_server

pytestmark = pytest.mark.browser

HOLD = "sleep 120"


@pytest.fixture
def mig_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`gpuyard server` pretending to have 2 H100s, GPU 1 in MIG mode (3g.40gb x2); (url, token)."""
    from gpuyard.hardware.fake import load_description, set_mig

    desc = copy.deepcopy(load_description(H100_NODE))
    desc["nvml"]["gpus"] = desc["nvml"]["gpus"][:2]
    set_mig(desc, 1, ["3g.40gb", "3g.40gb"])
    node_file = tmp_path / "mig_node.json"
    node_file.write_text(json.dumps(desc))
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("GPUYARD_TOKEN", "GPUYARD_MPS_PIPE_DIRECTORY")}
    env |= {"GPUYARD_HOME": str(home), "GPUYARD_FAKE_NODE": str(node_file)}
    options = ["--cpus", "4", "--grace", "1", "--job-user", getpass.getuser()]
    proc, url = start_server(options, env, tmp_path / "server.log")
    token = (home / "token").read_text().strip()
    try:
        yield url, token
    finally:
        headers = {"Authorization": f"Bearer {token}"}
        for job in httpx.get(f"{url}/jobs", headers=headers, timeout=10).json():
            if job["state"] in ("queued", "scheduled", "running"):
                httpx.post(f"{url}/jobs/{job['id']}/cancel", headers=headers, timeout=10)
        proc.terminate()
        proc.wait(timeout=30)


def test_cluster_page_shows_shares_and_mig_slices(
    mig_server: tuple[str, str], browser: object, artifacts_dir: Path
) -> None:
    url, token = mig_server
    headers = {"Authorization": f"Bearer {token}"}

    def submit(name: str, resources: dict[str, object]) -> int:
        spec = {"name": name, "command": ["sh", "-c", HOLD], "resources": resources}
        resp = httpx.post(f"{url}/jobs", json=spec, headers=headers, timeout=10)
        assert resp.status_code == 201, resp.text
        return int(resp.json()["id"])

    a, b = submit("half-a", {"gpus": 0.5}), submit("quarter-b", {"gpus": 0.25})
    m = submit("slice", {"mig": "3g.40gb"})
    waiting = submit("whole", {"gpus": 1})  # GPU 0 is shared and GPU 1 is MIG: it waits
    elastic = submit("stretchy", {"gpus": {"min": 1, "max": 2}})  # waits too, at its minimum
    states = lambda: {httpx.get(f"{url}/jobs/{i}", headers=headers).json()["state"] for i in (a, b, m)}  # noqa: E731
    wait_for(lambda: states() == {"running"}, timeout=60)
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()  # type: ignore[attr-defined]
    page.goto(url + "/")
    page.fill("#token-input", token)
    page.click("#login-form button")
    page.wait_for_selector("#who:has-text('admin')")
    page.goto(f"{url}/#/cluster")
    page.wait_for_selector(".slot.shared")
    shared = page.locator(".slot.shared").inner_text()
    assert (
        "GPU0 shared" in shared
        and "75%" in shared
        and f"job {a} (0.5)" in shared
        and f"job {b} (0.25)" in shared
    )
    assert "2 busy" in page.locator("#sched h3").inner_text().lower()  # the shared GPU and the MIG one
    mig = page.locator(".slot.mig-gpu").inner_text()
    assert "GPU1 MIG" in mig and f"3g.40gb: job {m}" in mig and "3g.40gb: free" in mig
    page.screenshot(path=str(artifacts_dir / "dashboard-cluster-sharing.png"), full_page=True)
    page.goto(f"{url}/#/jobs")
    row = page.locator(f"#jobs tr[data-id='{waiting}']")
    row.wait_for()
    assert "queued" in row.inner_text() and row.locator("td.muted").inner_text().strip() != ""
    # The GPUs column says what each job asks for: a share, a MIG profile, an elastic range.
    gpus = {i: page.locator(f"#jobs tr[data-id='{i}'] td").nth(5).inner_text() for i in (a, m, elastic)}
    assert gpus == {a: "0.5", m: "MIG 3g.40gb", elastic: "1 (elastic 1-2)"}
