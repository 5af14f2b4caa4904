"""Load and bad input: 64 clients for a bounded time with no errors and flat memory; fuzzing with no 5xx."""

from __future__ import annotations

import json
import os
import threading

import httpx
import numpy as np
import psutil
import pytest

from gpuyard.serve.codec import TENSOR_MEDIA
from gpuyard.serve.loadgen import LoadSpec, run

from .conftest import AUTH, SERVE_KEY, Server, kget

pytestmark = pytest.mark.integration

# The suite's bound; the benchmark (benchmarks/serve.py) runs the full 60 s.
LOAD_SECONDS = float(os.environ.get("GPUYARD_SERVE_LOAD_S", "12"))


def _bodies(n: int = 32) -> tuple[bytes, ...]:
    rng = np.random.default_rng(0)
    return tuple(json.dumps({"inputs": rng.normal(size=(1 + i % 4, 8)).tolist()}).encode() for i in range(n))


def test_64_clients_get_no_errors_and_memory_stays_flat(mlp_server: Server) -> None:
    proc = psutil.Process(mlp_server.proc.pid)
    rss: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            rss.append(proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = run(
            LoadSpec(
                f"{mlp_server.url}/v1/models/mlp/predict",
                _bodies(),
                concurrency=64,
                duration_s=LOAD_SECONDS,
                warmup_s=2.0,
                api_key=SERVE_KEY,
            )
        )
    finally:
        stop.set()
        sampler.join()
    assert result["errors"] == 0 and result["codes"] == {"200": result["ok"]}, result
    assert result["ok"] > 64 * 10  # every client got many answers, not just one each
    # Flat memory: after warm-up, the last quarter's peak is within 32 MiB of the first quarter's.
    quarter = max(len(rss) // 4, 1)
    growth = max(rss[-quarter:]) - max(rss[:quarter])
    assert growth < 32 << 20, f"server RSS grew by {growth / 2**20:.1f} MiB under load"
    assert kget(f"{mlp_server.url}/ready").status_code == 200


def _fuzz(op: object, mode: object, base_url: str, seen: set[int]) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(op.as_strategy(generation_mode=mode))  # type: ignore[attr-defined]
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, headers=AUTH)
        seen.add(response.status_code)
        assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code}"

    check()


def test_schemathesis_finds_no_server_error(mlp_server: Server) -> None:
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{mlp_server.url}/openapi.json", headers=AUTH)
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        # Negative cases exist only where there is a body or a parameter to break.
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        for mode in modes:
            _fuzz(op, mode, mlp_server.url, seen.setdefault(f"{op.label} {mode.value}", set()))
    predict = "POST /v1/models/mlp/predict"
    assert seen[f"{predict} negative"] and seen[f"{predict} negative"] <= {400, 413, 422}
    assert seen[f"{predict} positive"] <= {200, 422}
    assert seen["GET /ready positive"] == {200}
    assert kget(f"{mlp_server.url}/ready").status_code == 200


@pytest.mark.parametrize("content_type", ["application/json", TENSOR_MEDIA, "text/plain", ""])
def test_random_bytes_get_4xx_and_the_server_stays_up(mlp_server: Server, content_type: str) -> None:
    rng = np.random.default_rng(len(content_type))
    url = f"{mlp_server.url}/v1/models/mlp/predict"
    with httpx.Client(timeout=10, headers=AUTH) as client:
        for i in range(150):
            raw = rng.bytes(int(rng.integers(0, 2048)))
            if i % 3 == 0 and len(raw) >= 8:  # a plausible safetensors header length, then garbage
                raw = int(rng.integers(2, 4096)).to_bytes(8, "little") + raw[8:]
            r = client.post(url, content=raw, headers={"content-type": content_type} if content_type else {})
            assert 400 <= r.status_code < 500, (raw[:40], r.status_code, r.text)
    assert kget(f"{mlp_server.url}/ready").status_code == 200
