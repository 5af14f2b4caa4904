"""A job's own API token: it reaches its own job only, and dies with the job.

`gpuyard server` gives each job attempt a token in GPUYARD_TOKEN (and the API's URL in
GPUYARD_SERVER). The job below uses it the way an attacker would: on its own job, on another job,
on every listing and on the admin routes; then the test uses it after the job has ended.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from tests.waiting import wait_for

from gpuyard.auth import add_user, create_token, token_path
from gpuyard.scheduler.client import JobClient
from gpuyard.scheduler.spec import parse_spec

pytestmark = pytest.mark.security

# The job: calls each path with its own token, writes {path: status} and the token to its folder.
PROBE = r"""
import json, os, sys, httpx
url, token, me = os.environ["GPUYARD_SERVER"], os.environ["GPUYARD_TOKEN"], os.environ["GPUYARD_JOB_ID"]
other, out = sys.argv[1], sys.argv[2]
auth = {"Authorization": "Bearer " + token}
calls = [("GET", f"/jobs/{me}"), ("GET", f"/jobs/{me}/events"), ("GET", f"/jobs/{me}/logs"), ("GET", "/me"),
         ("GET", f"/jobs/{other}"), ("GET", f"/jobs/{other}/logs"), ("POST", f"/jobs/{other}/cancel"),
         ("GET", "/jobs"), ("POST", "/jobs"), ("GET", "/users"), ("POST", "/users"), ("GET", "/tokens"),
         ("GET", "/datasets"), ("GET", "/models"), ("GET", "/runs"), ("GET", "/deployments"),
         ("POST", "/users/admin/tokens"), ("POST", f"/jobs/{me}/stragglers"),
         ("POST", f"/jobs/{other}/stragglers")]
report = {"rank": 1, "node": "elsewhere", "cause": "compute", "slowdown": 1.8, "step": 40}
status = {f"{m} {p}": httpx.request(m, url + p, headers=auth, timeout=10,
                                    json=report if p.endswith("/stragglers") else {}).status_code
          for m, p in calls}
json.dump({"status": status, "token": token}, open(out, "w"))
"""


def test_a_jobs_token_reaches_only_its_own_job_and_ends_with_it(server, tmp_path: Path) -> None:
    _, url = server("--cpus", "2", "--team", "research")
    admin = JobClient(url)
    other = admin.submit(parse_spec({"name": "other", "command": ["sleep", "30"]}))
    script, out = tmp_path / "probe.py", tmp_path / "probe.json"
    script.write_text(PROBE)
    # A member of research submits the probe with their own token.
    add_user("alice", team="research")
    alice_token, _ = create_token("alice")
    alice = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice_token}"}, timeout=10)
    spec = {
        "name": "probe",
        "team": "research",
        "command": [sys.executable, str(script), str(other["id"]), str(out)],
    }
    job = alice.post("/jobs", json=spec).json()
    wait_for(lambda: alice.get(f"/jobs/{job['id']}").json()["state"] in ("succeeded", "failed"), timeout=60)
    assert alice.get(f"/jobs/{job['id']}").json()["state"] == "succeeded", alice.get(
        f"/jobs/{job['id']}/logs"
    ).text
    found = json.loads(out.read_text())
    status, token = found["status"], found["token"]
    me = job["id"]
    assert {k: v for k, v in status.items() if v == 200} == {
        f"GET /jobs/{me}": 200,
        f"GET /jobs/{me}/events": 200,
        f"GET /jobs/{me}/logs": 200,
        "GET /me": 200,
        f"POST /jobs/{me}/stragglers": 200,  # its launcher reports a slow rank of its own
    }
    # The report is an event on the job (reported only: the job did not ask for a restart).
    reasons = [e["reason"] or "" for e in alice.get(f"/jobs/{me}/events").json()]
    named = "straggler: rank 1 on node elsewhere is 1.80x slower"
    assert any(r.startswith(named) and "reported" in r for r in reasons), reasons
    assert all(v == 403 for k, v in status.items() if str(me) not in k and k != "GET /me"), status
    assert token not in (alice_token, token_path().read_text().strip())  # the job's own, not its submitter's
    # The attempt is over: the token is refused from now on, even where it reached before.
    resp = httpx.get(f"{url}/jobs/{me}", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert resp.status_code == 401 and "job" in resp.json()["detail"]
    assert admin.get(other["id"])["state"] == "running"  # the probe could not cancel it
    admin.cancel(other["id"])
