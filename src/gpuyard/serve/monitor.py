"""Serving metrics: Prometheus series for scraping, plus a sliding window for p50/p95/p99 in JSON.

With several replica processes, ``PROMETHEUS_MULTIPROC_DIR`` is set by the parent before any replica
imports prometheus-client, and ``/metrics`` aggregates every replica's files
(prometheus-client's documented multiprocess mode); a single process uses its own registry.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WINDOW_S = 60.0
WINDOW_MAX = 50_000  # latencies kept for the JSON percentiles (bounded memory under any load)


def multiprocess_dir() -> str | None:
    """The multiprocess folder when several replicas share their metrics, else None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class ServeMetrics:
    """Every figure the server reports for one model."""

    def __init__(self, model: str, version: int) -> None:
        self.model, self.version = model, version
        self.registry = CollectorRegistry()
        labels = ["model", "version"]
        self._lv = (model, str(version))
        reg = self.registry
        self.latency = Histogram(
            "gpuyard_serve_request_seconds",
            "Time from request received to answer ready, successful predictions only.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.batch_size = Histogram(
            "gpuyard_serve_batch_samples",
            "Samples per forward pass.",
            labels,
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self.batch_seconds = Histogram(
            "gpuyard_serve_batch_seconds",
            "Forward pass time per batch.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.requests = Counter(
            "gpuyard_serve_requests",
            "Prediction requests answered, by HTTP status.",
            [*labels, "code"],
            registry=reg,
        )
        self.samples = Counter("gpuyard_serve_samples", "Samples predicted.", labels, registry=reg)
        self.errors = Counter(
            "gpuyard_serve_errors",
            "Requests refused or failed, by reason.",
            [*labels, "reason"],
            registry=reg,
        )
        self.drift = Gauge(
            "gpuyard_serve_drift",
            "Latest drift figure per feature and test (psi, ks).",
            [*labels, "feature", "metric"],
            registry=reg,
            multiprocess_mode="max",
        )
        self._h_latency = self.latency.labels(*self._lv)
        self._h_batch = self.batch_size.labels(*self._lv)
        self._h_batch_s = self.batch_seconds.labels(*self._lv)
        self._c_samples = self.samples.labels(*self._lv)
        self._c_ok = self.requests.labels(*self._lv, "200")
        self._window: deque[tuple[float, float]] = deque(maxlen=WINDOW_MAX)
        self._batches: deque[tuple[float, int]] = deque(maxlen=WINDOW_MAX)
        self._lock = threading.Lock()
        self.started = time.time()
        self._started_mono = time.monotonic()
        self.total_ok = 0
        self.total_errors = 0

    def observe_ok(self, seconds: float) -> None:
        """A successful prediction took ``seconds``."""
        self._h_latency.observe(seconds)
        self._c_ok.inc()
        self.total_ok += 1
        self._window.append((time.monotonic(), seconds))

    def observe_error(self, code: int, reason: str) -> None:
        """A request ended with ``code`` for ``reason`` (bad_json, shape, too_large, overloaded, ...)."""
        self.requests.labels(*self._lv, str(code)).inc()
        self.errors.labels(*self._lv, reason).inc()
        self.total_errors += 1

    def observe_batch(self, samples: int, seconds: float) -> None:
        """One forward pass over ``samples`` samples (called from the model thread)."""
        self._h_batch.observe(samples)
        self._h_batch_s.observe(seconds)
        self._c_samples.inc(samples)
        self._batches.append((time.monotonic(), samples))

    def set_drift(self, feature: str, metric: str, value: float) -> None:
        """Publish the latest drift figure of one feature."""
        self.drift.labels(*self._lv, feature, metric).set(value)

    def exposition(self) -> bytes:
        """The Prometheus text format (every replica's figures in multiprocess mode)."""
        folder = multiprocess_dir()
        if folder:
            reg = CollectorRegistry()
            MultiProcessCollector(reg, path=folder)
            return bytes(generate_latest(reg))
        return bytes(generate_latest(self.registry))

    def stats(self, window_s: float = WINDOW_S) -> dict[str, Any]:
        """Latency percentiles, throughput and batch sizes over the last ``window_s`` seconds."""
        now = time.monotonic()
        lat = np.array([s for t, s in list(self._window) if now - t <= window_s])
        sizes = np.array([n for t, n in list(self._batches) if now - t <= window_s])
        # Requests over the time they were counted in: the window (or the uptime, when shorter), as a
        # Prometheus rate would; when the bounded buffer is full its oldest entry starts the count.
        span = min(window_s, now - self._started_mono)
        if len(self._window) == self._window.maxlen:
            span = min(span, now - self._window[0][0])
        span = max(span, 1e-3)
        pct = {
            f"p{q}_ms": round(float(np.percentile(lat, q)) * 1000, 3) if lat.size else None
            for q in (50, 95, 99)
        }
        return {
            "model": self.model,
            "version": self.version,
            "window_s": window_s,
            "requests": int(lat.size),
            "throughput_rps": round(lat.size / span, 2) if lat.size else 0.0,
            **pct,
            "batches": int(sizes.size),
            "mean_batch": round(float(sizes.mean()), 2) if sizes.size else None,
            "max_batch_seen": int(sizes.max()) if sizes.size else None,
            "total_ok": self.total_ok,
            "total_errors": self.total_errors,
            "uptime_s": round(time.time() - self.started, 1),
        }
