"""The whole API fuzzed as an authenticated member: never a 5xx, and /health answers throughout.

schemathesis generates requests from the server's own OpenAPI document, valid ones and ones that
break every constraint (huge integers, long strings, wrong types), for every operation; then
hand-made extremes the generator does not reach: deeply nested JSON, a body over the cap, huge
integers and unicode in paths. The scheduling loop is not started: a generated job is queued,
never run.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.security


@pytest.fixture
def member_api(gpuyard_home: Path) -> Iterator[tuple[str, str]]:
    """The job API on uvicorn (no scheduling loop) and a member's token: (url, token)."""
    import uvicorn

    from gpuyard.api.app import create_app
    from gpuyard.auth import add_user, create_token
    from gpuyard.scheduler.setup import build_service

    service = build_service(teams={"research": 1.0, "vision": 1.0}, fake_gpus=1, cpus=2, grace_s=1.0)
    app = create_app(jobs=service, max_body_bytes=256 << 10)
    add_user("mallory", team="research")
    token, _ = create_token("mallory")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # log_config=None: uvicorn must not reconfigure logging for the tests that run after this one.
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", token
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        service.executor.close()


def test_schemathesis_as_a_member_finds_no_server_error(member_api: tuple[str, str]) -> None:
    import schemathesis
    from schemathesis import GenerationMode

    url, token = member_api
    headers = {"Authorization": f"Bearer {token}"}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 35  # the whole API (38 operations today), not a corner of it

    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(op, mode, url, headers, statuses.setdefault(op.label, set()), failures)
    assert failures == []
    assert 403 in statuses["GET /users"] <= {401, 403} and 200 in statuses["GET /jobs"] <= {
        200,
        401,
        403,
        404,
        422,
    }
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def _fuzz(
    op: object, mode: object, url: str, headers: dict[str, str], seen: set[int], failures: list[str]
) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(op.as_strategy(generation_mode=mode))  # type: ignore[attr-defined]
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, headers=headers, timeout=30)
        seen.add(response.status_code)
        if response.status_code >= 500:
            failures.append(
                f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:200]}"
            )

    try:
        check()
    except Unsatisfiable:  # negative mode, an operation with nothing to break (no parameter, no body)
        assert str(mode).lower().endswith("negative"), op


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/jobs", b"[" * 100_000 + b"]" * 100_000),  # deep JSON, under the body cap
        ("POST", "/jobs", b'{"name": "x", "command": ["' + b"a" * (300 << 10) + b'"]}'),  # over the cap
        ("POST", "/jobs", b'{"name": "x", "command": ["true"], "priority": ' + b"9" * 5000 + b"}"),
        (
            "POST",
            "/jobs/dry-run",
            b'{"name": "x", "command": "' + "\u00e9\u2603\U0001f600".encode() * 5000 + b'"}',
        ),
        ("GET", "/jobs/" + "9" * 400, b""),
        ("GET", "/jobs?limit=" + "9" * 400, b""),
        ("GET", "/jobs/1/logs?offset=-" + "9" * 30, b""),
        ("GET", "/runs/%00%2e%2e%2f%2e%2e%2fetc", b""),
        ("GET", "/datasets/" + "\U0001f600" * 300, b""),
        ("POST", "/fabric/plan", b'{"model": "gpt3-175b", "gpus": 1e308, "global_batch": -1e308}'),
        ("POST", "/models/m/versions/" + "9" * 100 + "/stage", b'{"stage": "production"}'),
    ],
)
def test_hand_made_extremes_are_4xx(member_api: tuple[str, str], method: str, path: str, body: bytes) -> None:
    url, token = member_api
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    resp = httpx.request(method, url + path, content=body, headers=headers, timeout=60)
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    assert len(resp.content) < 20_000  # the answer does not echo a huge input back
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
