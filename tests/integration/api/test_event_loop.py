"""Heavy work stays off the event loop: while a job spec is validated, /health and other routes answer."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

import gpuyard.scheduler.spec as spec_module
from gpuyard.scheduler.spec import MAX_COMMAND_CHARS

from .conftest import LiveApi

pytestmark = pytest.mark.integration


def test_health_answers_while_a_spec_is_being_validated(
    live_api: LiveApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The command's splitter (run while the spec is validated) is held until the test lets it go: if
    # validation ran on the event loop, nothing else could be answered meanwhile.
    entered, release = threading.Event(), threading.Event()
    real_split = spec_module.split_command

    def held_split(text: str) -> list[str]:
        entered.set()
        assert release.wait(30), "the test never released the submission"
        return real_split(text)

    monkeypatch.setattr(spec_module, "split_command", held_split)
    results: dict[str, Any] = {}

    def submit(key: str, path: str) -> None:
        results[key] = live_api.post(path, live_api.admin_token, json={"name": key, "command": "echo hi"})

    threads = [
        threading.Thread(target=submit, args=("held", "/jobs")),
        threading.Thread(target=submit, args=("dry", "/jobs/dry-run")),
    ]
    try:
        threads[0].start()
        assert entered.wait(30), "the submission never reached validation"
        threads[1].start()
        # Both are now inside validation (or queued behind it); the loop must still serve everyone.
        health = httpx.get(live_api.url + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        listed = live_api.get("/jobs", live_api.admin_token)
        assert listed.status_code == 200 and listed.json() == []  # the held job is not in yet
        assert "held" not in results
    finally:
        release.set()
        for t in threads:
            if t.ident is not None:
                t.join(timeout=30)
    assert results["held"].status_code == 201 and results["held"].json()["name"] == "held"
    assert results["dry"].status_code == 200 and results["dry"].json()["plan"]["argv"] == ["echo", "hi"]


def test_a_large_allowed_command_is_taken_whole(live_api: LiveApi) -> None:
    # 1 MiB of command given as one string: 4000 words of 255 characters and a quoted one. shlex took
    # about 30 s on a 2 MB word; the splitter is linear, and all of it runs in a worker thread.
    words = ["w" * 255] * 4000
    command = " ".join(words) + " 'a b'"
    assert len(command) < MAX_COMMAND_CHARS
    done = threading.Event()
    answered: list[int] = []

    def poll_health() -> None:
        while not done.is_set():
            answered.append(httpx.get(live_api.url + "/health", timeout=5).status_code)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        resp = live_api.post("/jobs", live_api.admin_token, json={"name": "big", "command": command})
    finally:
        done.set()
        poller.join(timeout=10)
    assert resp.status_code == 201, resp.text[:300]
    job = live_api.get(f"/jobs/{resp.json()['id']}", live_api.admin_token).json()
    assert job["spec"]["command"] == [*words, "a b"]
    assert answered and set(answered) == {200}
