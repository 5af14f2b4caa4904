"""The settings of a model server: batching, drift monitoring and the server's own options.

Plain dataclasses without heavy imports, so the command line can take its defaults from them (every
``gpuyard`` run imports every CLI module) and a deployment record can store them as JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpuyard.errors import ConfigError

MODES = ("inline", "thread")
ENGINES = ("auto", "vllm", "gpuyard")  # a language model's engine (docs/llm.md)
# The most LoRA adapters (--adapter) one deployment serves by name: vLLM keeps a slot of each in every
# batch (--max-loras), sized by the largest rank, on the GPU or in the CPU replica's memory.
MAX_ADAPTERS = 32


@dataclass(frozen=True)
class BatchConfig:
    """How requests are gathered.

    Attributes:
        max_batch: most samples in one forward pass.
        max_wait_ms: longest time the oldest request waits for others to join its batch.
        threads: intra-op threads of the model thread (``torch.set_num_threads``); 0: chosen by the runner.
        max_queue: requests waiting beyond this are refused with 503 (back-pressure, bounded memory).
        mode: ``inline`` (the event loop runs the forward pass) or ``thread`` (a model thread does).
    """

    max_batch: int = 32
    max_wait_ms: float = 2.0
    threads: int = 0
    max_queue: int = 4096
    mode: str = "inline"

    def __post_init__(self) -> None:
        # Named by their `gpuyard serve`/`deploy` flags: that is where most of these values come from.
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch {self.max_batch}: must be at least 1")
        if not 0 <= self.max_wait_ms <= 10_000:
            raise ConfigError(f"--max-wait-ms {self.max_wait_ms:g}: must be between 0 and 10000")
        if self.threads < 0:
            raise ConfigError(f"--threads {self.threads}: must be >= 0 (0: (cores - 1) / replicas)")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue={self.max_queue}: must be at least 1")
        if self.mode not in MODES:
            raise ConfigError(f"--batching {self.mode!r}: use one of {', '.join(MODES)}")


@dataclass(frozen=True)
class DriftConfig:
    """Drift monitoring settings.

    Attributes:
        window: served samples in the sliding window.
        min_rows: samples needed in the window before any test runs.
        interval_s: seconds between evaluations (a background thread; the model thread only copies rows).
        psi_threshold: PSI at or above which a feature alerts.
        ks_alpha: family-wise KS significance (divided by the number of features).
        cooldown_s: a feature that alerted stays quiet for this long (one alert per episode).
    """

    window: int = 1000
    min_rows: int = 200
    interval_s: float = 5.0
    psi_threshold: float = 0.25
    ks_alpha: float = 0.001
    cooldown_s: float = 600.0

    def __post_init__(self) -> None:
        if self.window < 10 or not 10 <= self.min_rows <= self.window:
            raise ConfigError(
                f"drift window={self.window}, min_rows={self.min_rows}: need 10 <= min_rows <= window"
            )
        if self.interval_s <= 0 or self.psi_threshold <= 0 or not 0 < self.ks_alpha < 1:
            raise ConfigError("drift interval_s and psi_threshold must be > 0, ks_alpha in (0, 1)")


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``gpuyard serve`` takes besides the model reference.

    Attributes:
        host: interface to bind (127.0.0.1 unless you mean to expose the model).
        port: TCP port; 0 picks a free one.
        replicas: server processes sharing the port (one per GPU where there are GPUs).
        device: auto, cpu, cuda or cuda:N.
        batch: batching settings (``threads`` 0 means (cores - 1) / replicas, at least 1).
        max_body_bytes: bodies above this get 413.
        max_rows: most samples per request.
        drift: monitor drift when the model has a reference.
        drift_config: window and thresholds.
        deployment_id: the store record to keep up to date (set by ``gpuyard deploy``).
        drain_s: on SIGTERM, the longest wait for requests in flight (then they are cut, and said so).
        max_prompt_tokens: a language model's longest prompt (0: its context length less one).
        special_tokens: a language model's chat messages may contain control tokens: special-token
            strings typed in a message's content act as the tokens (off: they stay text).
        engine: a language model's engine: ``vllm``, ``gpuyard`` (its own) or ``auto`` (vLLM when
            installed, see :mod:`gpuyard.serve.llm.vllm_engine`).
        adapters: registered LoRA adapters (references) served by name beside a language model, on
            its base (``--adapter``; vLLM only: :func:`gpuyard.serve.llm.vllm_engine.lora_set`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    device: str = "auto"
    batch: BatchConfig = field(default_factory=BatchConfig)
    max_body_bytes: int = 4 << 20
    max_rows: int = 1024
    drift: bool = True
    drift_config: DriftConfig = field(default_factory=DriftConfig)
    deployment_id: int | None = None
    drain_s: float = 30.0
    max_prompt_tokens: int = 0
    special_tokens: bool = False
    engine: str = "auto"
    adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 64:
            raise ConfigError(f"--replicas {self.replicas}: must be between 1 and 64")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be between 0 and 65535")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes {self.max_body_bytes}: must be at least 1024")
        if self.max_rows < 1:
            raise ConfigError(f"max_rows={self.max_rows}: must be at least 1")
        if not 0 <= self.drain_s <= 3600:
            raise ConfigError(f"--drain-timeout {self.drain_s:g}: must be between 0 and 3600 seconds")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        if self.max_prompt_tokens < 0:
            raise ConfigError(f"--max-prompt-tokens {self.max_prompt_tokens}: must be >= 0 (0: the context)")
        object.__setattr__(self, "adapters", tuple(self.adapters))  # a list given in Python, or from JSON
        if len(self.adapters) > MAX_ADAPTERS:
            raise ConfigError(
                f"--adapter: {len(self.adapters)} given; one deployment serves {MAX_ADAPTERS} at most"
            )
        for i, given in enumerate(self.adapters):
            if not isinstance(given, str) or not given.strip():
                raise ConfigError(
                    f"--adapter {str(given)[:200]!r}: name a registered LoRA adapter (NAME:VERSION)"
                )
            if given in self.adapters[:i]:
                raise ConfigError(f"--adapter {given[:200]!r}: given twice")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (nested configs included)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServeOptions:
        """Inverse of :meth:`to_json`."""
        doc = dict(doc)
        doc["batch"] = BatchConfig(**doc["batch"])
        doc["drift_config"] = DriftConfig(**doc["drift_config"])
        doc["adapters"] = tuple(doc.get("adapters") or ())  # JSON keeps a list; older records have none
        return cls(**doc)
