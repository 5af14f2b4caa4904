"""Chat templates rendered with a deadline and a size limit, in a process of their own.

A chat template is code that came with the model (a member registered it), and it runs on what callers
send. Jinja's sandbox keeps it away from Python's internals but not from loops or allocations without
bound: ``range()`` nested three deep runs ~10^15 iterations, ``'x' * 10**10`` asks for 10 GB. So the
server renders in a worker process (``python -m gpuyard.serve.llm.templates``) whose address space is
capped (RLIMIT_AS), which stops as soon as the output passes its size limit, and which the server
kills when a render is not back within the deadline (a new worker starts for the next request). One
render fails its own request with one line; the others go on.

Protocol: the worker reads one JSON line (the template, the end-of-sequence token, the size limit),
then per request one JSON line ``{"messages": [...], "add_generation_prompt": bool}`` and answers one
JSON line ``{"text": ...}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from gpuyard.errors import ConfigError

# The worker's address space (Python + jinja2 take ~40 MB of it).
WORKER_MEMORY_BYTES = 1 << 30
DEFAULT_TIMEOUT_S = 2.0
# Variables the worker never needs: keys and tokens stay in the server process.
_SECRET_ENV = ("GPUYARD_SERVE_KEY", "GPUYARD_TOKEN", "GPUYARD_SERVE_KEY_SHA256")


class TemplateRenderer:
    """Renders one chat template in a worker process, one request at a time (thread-safe).

    Args:
        template: the Jinja chat template.
        eos_token: the value of ``eos_token`` in the template.
        max_chars: the longest rendered prompt; a longer output stops the render (ConfigError).
        timeout_s: the longest render; the worker is killed past it (ConfigError).
    """

    def __init__(self, template: str, eos_token: str, max_chars: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.template, self.eos, self.max_chars, self.timeout_s = template, eos_token, max_chars, timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""

    def _start(self) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuyard.serve.llm.templates"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._buf = b""
        assert proc.stdin is not None
        head = {"template": self.template, "eos_token": self.eos, "max_chars": self.max_chars}
        proc.stdin.write(json.dumps(head).encode() + b"\n")
        proc.stdin.flush()
        return proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            for f in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    f.close() if f else None

    def close(self) -> None:
        """Stop the worker."""
        with self._lock:
            self._stop()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The rendered prompt.

        Raises:
            ConfigError: the template failed, passed ``max_chars``, ran out of memory or time (one line).
        """
        line = json.dumps({"messages": messages, "add_generation_prompt": add_generation_prompt}).encode()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._stop()
                self._proc = self._start()
            proc = self._proc
            assert proc.stdin is not None and proc.stdout is not None
            t0 = time.monotonic()
            try:
                proc.stdin.write(line + b"\n")
                proc.stdin.flush()
                answer = self._read_line(proc, t0 + self.timeout_s)
            except OSError:
                self._stop()
                raise ConfigError("chat template: the renderer process died; try again") from None
            if answer is None:
                self._stop()
                raise ConfigError(
                    f"chat template: rendering took longer than {self.timeout_s:g} s and was stopped"
                )
        doc = json.loads(answer)
        if "error" in doc:
            raise ConfigError(f"chat template: {doc['error']}")
        return str(doc["text"])

    def _read_line(self, proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        fd = proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise OSError("the renderer closed its output")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line


# -- the worker ------------------------------------------------------------------------------------


def _limit_memory() -> None:
    import resource

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))


def _guarded(fn: Any, max_chars: int) -> dict[str, Any]:
    """Run ``fn`` (compile or render), turning every way a template fails into a one-line error."""
    import jinja2

    try:
        return {"text": fn()}
    except _TooLong:
        return {"error": f"the rendered prompt passed {max_chars} characters and was stopped"}
    except MemoryError:
        return {"error": f"rendering needed more than {WORKER_MEMORY_BYTES >> 20} MiB and was stopped"}
    except RecursionError:
        return {"error": "rendering recursed too deeply and was stopped"}
    except jinja2.TemplateSyntaxError as exc:
        return {"error": f"does not compile: {_first_line(exc)}"}
    except jinja2.TemplateError as exc:
        return {"error": _first_line(exc)}
    except Exception as exc:  # a template's own failure (a filter on the wrong type, ...)
        return {"error": f"{type(exc).__name__}: {_first_line(exc)}"}


class _TooLong(Exception):
    pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def main() -> None:
    """The worker: render requests from stdin until it closes (see the module docstring)."""
    _limit_memory()
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    head = json.loads(stdin.readline())
    max_chars = int(head["max_chars"])
    # The environment gpuyard.data.tokenizer.render_chat renders chat datasets with. Compiling may fail
    # like rendering does (jinja folds constant expressions such as 'x' * 10**10 while compiling).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    compiled = _guarded(lambda: env.from_string(head["template"]), max_chars)
    template: Any = compiled.get("text")

    def render(req: dict[str, Any]) -> str:
        parts: list[str] = []
        size = 0
        for piece in template.generate(
            messages=req["messages"],
            add_generation_prompt=bool(req.get("add_generation_prompt")),
            eos_token=head["eos_token"],
            bos_token="",
        ):
            size += len(piece)
            if size > max_chars:
                raise _TooLong
            parts.append(piece)
        return "".join(parts)

    for raw in stdin:
        req = json.loads(raw)
        out = compiled if template is None else _guarded(lambda req=req: render(req), max_chars)
        stdout.write(json.dumps(out, ensure_ascii=False).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main()
