"""The serving stage: deploy the model, send predictions, read the drift report, stop the server.

The server is a real ``gpuyard deploy`` (a background ``gpuyard serve`` recorded in the store); the
stage sends the test split as single-sample JSON requests, scores the answers, then sends the same
images darkened (a shifted population a camera fault would produce) and reads the drift report each
time. It undeploys at the end, so the pipeline leaves nothing running.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuyard.pipelines.arrays import split_arrays
from gpuyard.pipelines.inputs import ServeInputs, parse_inputs
from gpuyard.refs import ModelRef


def _send(client: Any, url: str, X: np.ndarray, per_request: int) -> np.ndarray:
    preds: list[Any] = []
    for at in range(0, len(X), per_request):
        rows = X[at : at + per_request]
        body = {"inputs": rows[0].tolist()} if per_request == 1 else {"inputs": rows.tolist()}
        r = client.post(url, json=body)
        r.raise_for_status()
        got = r.json()["predictions"]
        preds.extend(got if isinstance(got, list) else [got])
    return np.asarray(preds).reshape(len(X), -1)[:, 0]


def _drift(client: Any, base: str) -> dict[str, Any]:
    doc = client.get(f"{base}/drift").json()
    report = doc.get("report") or {}
    feats = report.get("features", [])
    alerts = [f["feature"] for f in feats if f.get("drift_psi") or f.get("drift_ks")]
    worst: dict[str, Any] = max(feats, key=lambda f: f.get("psi", 0.0), default={})
    pred = report.get("predictions") or {}
    return {
        "rows": report.get("rows", 0),
        "features_drifted": len(alerts),
        "features": len(feats),
        "max_psi": worst.get("psi"),
        "max_psi_feature": worst.get("feature"),
        "prediction_psi": pred.get("psi"),
        "prediction_drift": bool(pred.get("drift_psi")),
        "note": doc.get("reason") or doc.get("reference", ""),
    }


def serve_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Deploy ``model``, predict ``dataset``'s test split, then a shifted copy; report accuracy and drift."""
    import httpx

    from gpuyard.serve.deploy import deploy, undeploy
    from gpuyard.serve.options import DriftConfig, ServeOptions

    i = parse_inputs(ServeInputs, inputs, ctx["stage"])
    ref, data = i.model, i.dataset
    X, y = split_arrays(data, "test")
    # deploy() starts `gpuyard serve` with the default drift settings (window 1000, tests from 200
    # rows), so the normal phase sends at least 200 rows and the shifted phase a whole window.
    cfg = DriftConfig()
    n = len(X)
    shifted_n = cfg.window
    reps = -(-shifted_n // n)
    X_shift, y_shift = np.tile(X, (reps, 1))[:shifted_n], np.tile(y, reps)[:shifted_n]
    dep = deploy(ref, ServeOptions(port=0, replicas=1, device="cpu"))
    try:
        name = ModelRef.parse(ref).name
        base = f"{dep['url']}/v1/models/{name}"
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {dep['api_key']}"}) as client:
            preds = _send(client, f"{base}/predict", X, 1)
            served_acc = float(np.mean(preds == y))
            before = _drift(client, base)
            # A darker camera: every pixel at 60% of its value, batches of 20 images per request.
            dark = _send(client, f"{base}/predict", X_shift * 0.6, 20)
            dark_acc = float(np.mean(dark == y_shift))
            after = _drift(client, base)
            stats = client.get(f"{base}/stats").json()
    finally:
        undeploy(str(dep["id"]))
    from gpuyard.serve.alerts import list_alerts

    # Reading the drift report evaluates the window, and the server records alerts as it does so.
    alerts = [a for a in list_alerts(name, limit=10_000) if a["deployment_id"] == dep["id"]]
    answers = [a["retrain"].get("result") for a in alerts if isinstance(a["retrain"], dict)]
    action = next((r.get("action") for r in answers if isinstance(r, dict) and r.get("action")), None)
    lat = {k: stats.get(k) for k in ("p50_ms", "p95_ms", "p99_ms", "requests", "throughput_rps")}
    lines = [
        f"deployment {dep['id']}: {ref} at {dep['url']} (stopped after this stage)",
        f"{n} test images sent one per request: served accuracy {served_acc:.4f}",
        f"drift, window of {before['rows']} normal requests:"
        f" {before['features_drifted']} of {before['features']}"
        f" pixels drifted, largest PSI {before['max_psi']} ({before['max_psi_feature']}),"
        f" prediction PSI {before['prediction_psi']}",
        f"{shifted_n} darkened images (60% brightness, 20 per request): served accuracy {dark_acc:.4f}",
        f"drift, window of {after['rows']} darkened requests:"
        f" {after['features_drifted']} of {after['features']}"
        f" pixels drifted, largest PSI {after['max_psi']} ({after['max_psi_feature']}),"
        f" prediction PSI {after['prediction_psi']}",
        f"{len(alerts)} drift alerts recorded (`gpuyard deployments alerts`); the retraining hook answered:"
        f" {action or 'no answer'} (`gpuyard models retrain POLICY` acts on it)",
        f"server latency over all {lat['requests']} requests: p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms",
    ]
    return {
        "deployment": dep["id"],
        "url": dep["url"],
        "served_accuracy": served_acc,
        "shifted_accuracy": dark_acc,
        "drift_before": before,
        "drift_after": after,
        "latency": lat,
        "alerts": len(alerts),
        "report": lines,
    }
