"""Idempotent submission over real HTTP: a retry with the same Idempotency-Key returns the first job."""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from tests.waiting import wait_for

from .conftest import LiveApi

pytestmark = pytest.mark.integration


def _spec(name: str = "once", team: str = "research") -> dict[str, Any]:
    return {"name": name, "team": team, "command": [sys.executable, "-c", "pass"]}


def _submit(live: LiveApi, token: str, key: str | None, spec: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(live.url + "/jobs", json=spec, headers=headers, timeout=30)


def _user(live: LiveApi, name: str, team: str) -> str:
    live.post("/users", live.admin_token, json={"name": name, "team": team, "role": "member"})
    return str(live.post(f"/users/{name}/tokens", live.admin_token, json={}).json()["token"])


def _all_jobs(live: LiveApi) -> list[dict[str, Any]]:
    return list(live.get("/jobs", live.admin_token).json())


def test_a_retry_with_the_key_returns_the_first_job(live_api: LiveApi) -> None:
    token = live_api.admin_token
    first = _submit(live_api, token, "k-1", _spec())
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = _submit(live_api, token, "k-1", _spec())
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    # Once the job has run, the key still answers with it (its current state).
    wait_for(lambda: live_api.get(f"/jobs/{first.json()['id']}", token).json()["state"] == "succeeded")
    late = _submit(live_api, token, "k-1", _spec())
    assert late.status_code == 200 and late.json()["id"] == first.json()["id"]
    assert late.json()["state"] == "succeeded"
    # Without a key, or with another one, each submission is a new job.
    assert _submit(live_api, token, None, _spec()).status_code == 201
    assert _submit(live_api, token, "k-2", _spec()).status_code == 201
    assert len(_all_jobs(live_api)) == 3


def test_the_key_with_another_spec_is_refused(live_api: LiveApi) -> None:
    token = live_api.admin_token
    first = _submit(live_api, token, "k", _spec("a"))
    other = _submit(live_api, token, "k", _spec("b"))
    assert other.status_code == 422
    assert other.json()["detail"] == (
        f"Idempotency-Key: already used for job {first.json()['id']} with a different spec; "
        "a new job needs a new key"
    )
    assert len(_all_jobs(live_api)) == 1


@pytest.mark.parametrize("key", ["", "a b", "k" * 201, "caf\u00e9"])
def test_a_malformed_key_is_422_naming_the_header(live_api: LiveApi, key: str) -> None:
    resp = httpx.post(
        live_api.url + "/jobs",
        json=_spec(),
        headers={"Authorization": f"Bearer {live_api.admin_token}", "Idempotency-Key": key.encode("utf-8")},
        timeout=10,
    )
    assert resp.status_code == 422
    assert ["header", "Idempotency-Key"] in [d["loc"] for d in resp.json()["detail"]]
    assert _all_jobs(live_api) == []


def test_keys_belong_to_their_user(live_api: LiveApi) -> None:
    alice, bob = _user(live_api, "alice", "research"), _user(live_api, "bob", "research")
    a = _submit(live_api, alice, "shared", _spec())
    b = _submit(live_api, bob, "shared", _spec())
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"] and b.json()["user"] == "bob"


def test_concurrent_submissions_with_one_key_queue_one_job(live_api: LiveApi) -> None:
    n = 6
    barrier = threading.Barrier(n)
    answers: list[httpx.Response] = []

    def go() -> None:
        barrier.wait(timeout=30)
        answers.append(_submit(live_api, live_api.admin_token, "race", _spec()))

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(r.status_code for r in answers) == [200] * (n - 1) + [201]
    assert len({r.json()["id"] for r in answers}) == 1
    assert len(_all_jobs(live_api)) == 1


def test_a_client_whose_connection_dropped_retries_safely(live_api: LiveApi) -> None:
    # The request reaches the server, then the client goes away before reading the answer.
    url = urlsplit(live_api.url)
    body = httpx.Request("POST", live_api.url, json=_spec()).read()
    head = (
        f"POST /jobs HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {live_api.admin_token}\r\n"
        f"Idempotency-Key: dropped\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
    jobs = wait_for(lambda: _all_jobs(live_api))  # the server queued it all the same
    retry = _submit(live_api, live_api.admin_token, "dropped", _spec())
    assert retry.status_code == 200 and retry.json()["id"] == jobs[0]["id"]
    assert len(_all_jobs(live_api)) == 1


def test_the_job_client_resends_with_its_key_when_the_answer_is_lost(live_api: LiveApi) -> None:
    from gpuyard.scheduler.client import JobClient
    from gpuyard.scheduler.spec import parse_spec

    client = JobClient(live_api.url)
    real = client._http._transport
    sent: list[str] = []

    class LoseFirstAnswer(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            response = real.handle_request(request)  # the server gets it and queues the job
            sent.append(request.headers["Idempotency-Key"])
            if len(sent) == 1:
                response.close()
                raise httpx.ReadError("connection reset by peer", request=request)
            return response

    client._http._transport = LoseFirstAnswer()
    try:
        doc = client.submit(parse_spec({**_spec(), "user": "admin"}))
    finally:
        client.close()
    assert len(sent) == 2 and sent[0] == sent[1]
    assert [j["id"] for j in _all_jobs(live_api)] == [doc["id"]]
