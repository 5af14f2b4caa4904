"""The model server over real HTTP on 127.0.0.1: predictions, formats, errors, metrics, batching, drift."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from safetensors.numpy import load, save

from gpuyard.serve.codec import TENSOR_MEDIA

from .conftest import AUTH, Server, kget, kpost

pytestmark = pytest.mark.integration

RNG = np.random.default_rng(7)


def predict_url(server: Server, name: str = "mlp") -> str:
    return f"{server.url}/v1/models/{name}/predict"


def test_json_predictions_match_the_registered_model(mlp_server: Server) -> None:
    from gpuyard.serve.model import load_served

    x = RNG.normal(size=(5, 8)).astype(np.float32)
    r = kpost(predict_url(mlp_server), json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    doc = r.json()
    local = load_served("mlp").forward(x)
    assert doc["model"] == "mlp" and doc["version"] == 1
    assert doc["predictions"] == local["predictions"].tolist()
    assert np.allclose(doc["probabilities"], local["probabilities"], atol=1e-6)
    single = kpost(predict_url(mlp_server), json={"inputs": x[0].tolist()}).json()
    assert single["predictions"] == doc["predictions"][:1]


def test_safetensors_in_and_out(mlp_server: Server) -> None:
    x = RNG.normal(size=(3, 8)).astype(np.float32)
    r = kpost(predict_url(mlp_server), content=save({"inputs": x}), headers={"content-type": TENSOR_MEDIA})
    assert r.status_code == 200 and r.headers["content-type"] == TENSOR_MEDIA
    out = load(r.content)
    assert out["probabilities"].shape == (3, 3) and np.allclose(out["probabilities"].sum(1), 1, atol=1e-5)
    as_json = kpost(predict_url(mlp_server), json={"inputs": x.tolist()}).json()
    assert out["predictions"].tolist() == as_json["predictions"]


@pytest.mark.parametrize(
    ("kwargs", "status", "words"),
    [
        ({"content": b"{not json"}, 400, "not valid JSON"),
        ({"json": {"inputs": [[0.0] * 7]}}, 422, "signature [-1, 8]"),
        ({"json": {"inputs": [[0.0] * 7 + ["x"]]}}, 422, "numbers"),
        ({"json": {"inputs": [[1e30] * 8]}}, 422, "outside the accepted range"),
        ({"content": b"\x00" * 100_000}, 413, "limit of 65536 bytes"),
        ({"content": b"junk", "headers": {"content-type": TENSOR_MEDIA}}, 400, "not a safetensors"),
    ],
)
def test_bad_requests_get_4xx_with_a_message(
    mlp_server: Server, kwargs: dict, status: int, words: str
) -> None:
    r = kpost(predict_url(mlp_server), **kwargs)
    assert r.status_code == status and words in r.json()["detail"]


def test_unknown_model_and_route_are_404(mlp_server: Server) -> None:
    r = kpost(predict_url(mlp_server, "other"), json={"inputs": [[0.0] * 8]})
    assert r.status_code == 404 and "'other' is not served here" in r.json()["detail"]
    assert kget(f"{mlp_server.url}/v1/models/mlp/nope").status_code == 404


def test_health_ready_info_and_openapi(mlp_server: Server) -> None:
    assert kget(f"{mlp_server.url}/health").json() == {"status": "ok"}
    assert kget(f"{mlp_server.url}/ready").json()["status"] == "ready"
    info = kget(f"{mlp_server.url}/v1/models/mlp").json()
    assert info["max_batch"] == 16 and info["signature"]["inputs"]["shape"] == [-1, 8]
    spec = kget(f"{mlp_server.url}/openapi.json").json()
    body = spec["paths"]["/v1/models/mlp/predict"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", TENSOR_MEDIA}


async def _burst(url: str, n: int) -> list[int]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=30, headers=AUTH) as client:
        x = RNG.normal(size=(n, 8)).astype(np.float32).tolist()
        rs = await asyncio.gather(*(client.post(url, json={"inputs": [row]}) for row in x))
    return [r.status_code for r in rs]


def test_concurrent_requests_are_batched_and_counted_in_metrics(mlp_server: Server) -> None:
    codes = asyncio.run(_burst(predict_url(mlp_server), 64))
    assert codes == [200] * 64
    stats = kget(f"{mlp_server.url}/v1/models/mlp/stats").json()
    assert stats["max_batch_seen"] > 1 and stats["max_batch_seen"] <= 16
    assert stats["replica_pid"] == mlp_server.proc.pid  # one replica: it runs in the server process
    assert stats["p50_ms"] is not None and stats["p99_ms"] >= stats["p50_ms"]
    text = kget(f"{mlp_server.url}/metrics").text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"
    }
    ok = samples['gpuyard_serve_requests_total{code="200",model="mlp",version="1"}']
    assert ok >= 64 and ok == stats["total_ok"]
    assert samples['gpuyard_serve_samples_total{model="mlp",version="1"}'] >= 64
    assert (
        samples['gpuyard_serve_batch_samples_count{model="mlp",version="1"}'] < ok
    )  # fewer passes than requests
    assert any(k.startswith("gpuyard_serve_errors_total") and 'reason="signature"' in k for k in samples)
    assert 'gpuyard_serve_request_seconds_bucket{le="0.05"' in text


def _poll(fn, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"condition not met within {timeout_s} s")


def test_shifted_inputs_raise_drift_alerts_in_the_store_and_the_api(mlp_server: Server) -> None:
    from gpuyard.serve.alerts import list_alerts

    # In-distribution traffic first: the window fills, the report is computed and nothing alerts.
    calm = RNG.normal(size=(300, 8)).astype(np.float32)
    assert kpost(predict_url(mlp_server), json={"inputs": calm.tolist()}).status_code == 200
    report = kget(f"{mlp_server.url}/v1/models/mlp/drift").json()
    assert report["enabled"] and "example:N(0,1)" in report["reference"]
    assert report["replica_pid"] == mlp_server.proc.pid
    assert not any(f["drift_psi"] for f in report["report"]["features"])
    assert list_alerts("mlp") == []
    # Feature 2 moves by 2.5 standard deviations (still inside the accepted range).
    shifted = RNG.normal(size=(300, 8)).astype(np.float32)
    shifted[:, 2] += 2.5
    assert kpost(predict_url(mlp_server), json={"inputs": shifted.tolist()}).status_code == 200
    alerts = _poll(lambda: kget(f"{mlp_server.url}/v1/models/mlp/alerts").json())
    flagged = {(a["kind"], a["feature"], a["metric"]) for a in alerts}
    assert ("input_drift", "f2", "psi") in flagged and ("input_drift", "f2", "ks") in flagged
    assert not any(a["feature"] in ("f0", "f5") for a in alerts)
    stored = list_alerts("mlp")
    assert {a["id"] for a in stored} == {a["id"] for a in alerts} and all(a["window"] == 300 for a in stored)
    # The retraining policy's hook (gpuyard.models.retrain.on_drift_alert) ran and its answer is kept.
    hooked = _poll(lambda: [a for a in list_alerts("mlp") if a["retrain"] is not None])
    assert "result" in hooked[0]["retrain"], hooked[0]["retrain"]
    from gpuyard.models.registry import model_events

    assert any(e["action"] == "drift_alert" for e in model_events("mlp"))
    text = kget(f"{mlp_server.url}/metrics").text
    assert 'gpuyard_serve_drift{feature="f2",metric="psi",model="mlp",version="1"}' in text
    assert json.loads(json.dumps(alerts))  # JSON all the way (no NaN)
