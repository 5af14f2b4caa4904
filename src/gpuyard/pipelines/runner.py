"""Run a pipeline: each stage a job of the scheduler's ``JobService`` in this process, or inline.

The service is the one ``gpuyard server`` runs (same store, policy, local executor), without HTTP:
every stage is a recorded job (``gpuyard jobs ls`` shows it later) whose command is
``python -m gpuyard.scheduler.executors.worker TASK.json RESULT.json`` calling
:func:`gpuyard.pipelines.stages.run_stage`. A stage whose content hash (kind, resolved inputs, input
files) matches a cached result is skipped and its recorded outputs are reused.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError, GpuyardError
from gpuyard.pipelines import cache
from gpuyard.pipelines.inputs import stage_inputs
from gpuyard.pipelines.spec import PipelineSpec, StageSpec, render_summary, resolve
from gpuyard.settings import load_settings

Event = dict[str, Any]
EXECUTORS = ("jobs", "server", "inline")


class StageFailed(GpuyardError):
    """A stage's job failed; the message carries the end of its log."""


@dataclass
class StageResult:
    """What one stage did: its outputs, whether they came from the cache, its job and how long it took."""

    name: str
    uses: str
    outputs: dict[str, Any]
    cached: bool
    seconds: float
    key: str
    job_id: int | None = None


@dataclass
class PipelineResult:
    """The stages of one run, in order."""

    name: str
    stages: list[StageResult] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    def outputs(self, stage: str) -> dict[str, Any]:
        """Outputs of ``stage`` (ConfigError when the pipeline has no such stage)."""
        for st in self.stages:
            if st.name == stage:
                return st.outputs
        raise ConfigError(f"pipeline {self.name!r} has no stage {stage!r}")


class _ServerJobs:
    """The job calls the runner needs, against a running ``gpuyard server`` (its HTTP API)."""

    def __init__(self) -> None:
        from gpuyard.scheduler.client import JobClient

        self.client = JobClient(load_settings().server_url)
        self.client.list_jobs()  # fail now, with the client's message, when no server answers

    def submit(self, spec: Any) -> dict[str, Any]:
        return self.client.submit(spec)

    def get(self, job_id: int) -> dict[str, Any]:
        return self.client.get(job_id)

    def read_log(self, job_id: int, offset: int = 0, limit: int = 1 << 16) -> dict[str, Any]:
        doc: dict[str, Any] = self.client._call("GET", f"/jobs/{job_id}/logs", params={"offset": offset})
        return doc


class _JobRunner:
    """Runs stages as scheduler jobs (an in-process JobService or a running server); streams their logs."""

    def __init__(self, remote: bool = False, poll_s: float = 0.2) -> None:
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.service: Any
        if remote:
            self.service = _ServerJobs()
            return
        from gpuyard.scheduler.setup import build_service
        from gpuyard.train.resize import allowed_world_sizes

        self.service = build_service(train_sizes=allowed_world_sizes)
        self._thread = threading.Thread(target=self.service.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def run(self, st: StageSpec, task: Any, files: tuple[Path, Path], env: dict[str, str], emit: Any) -> Any:
        from gpuyard.scheduler.spec import JobSpec, JobState

        spec = JobSpec.model_validate(
            {
                "name": f"pipeline-{st.name}"[:100],
                "command": task.argv(*files),
                "resources": {"gpus": 0, "cpus": min(st.cpus, os.cpu_count() or 1)},
                "env": env,
            }
        )
        job_id = int(self.service.submit(spec)["id"])
        emit({"type": "job", "stage": st.name, "job_id": job_id})
        offset, doc = 0, self.service.get(job_id)
        while True:
            doc = self.service.get(job_id)
            offset = self._stream(job_id, offset, st.name, emit)
            if JobState(doc["state"]).terminal:
                break
            time.sleep(self.poll_s)  # the service has no completion callback: poll its record
        self._stream(job_id, offset, st.name, emit)
        if doc["state"] != JobState.SUCCEEDED or not files[1].exists():
            tail = self.service.read_log(job_id, max(0, offset - 4000), 8000)["text"]
            lines = [ln for ln in str(tail).splitlines() if ln.strip()][-8:]
            raise StageFailed(
                f"stage {st.name!r} ({st.uses}): job {job_id} {doc['state']}"
                f" (exit code {doc.get('exit_code')}); last lines of its log:\n  " + "\n  ".join(lines)
            )
        return json.loads(files[1].read_text())["result"], job_id

    def _stream(self, job_id: int, offset: int, stage: str, emit: Any) -> int:
        text = str(self.service.read_log(job_id, offset)["text"])
        complete = text[: text.rfind("\n") + 1]  # a partial last line waits for the next poll
        for line in complete.splitlines():
            if line.strip():
                emit({"type": "log", "stage": stage, "line": line})
        return offset + len(complete.encode())

    def close(self) -> None:
        if self._thread is None:
            self.service.client.close()
            return
        self._stop.set()
        self.service.wake.set()
        self._thread.join(timeout=5)


def run_pipeline(
    spec: PipelineSpec,
    base: str | Path = ".",
    *,
    executor: str = "jobs",
    use_cache: bool = True,
    on_event: Callable[[Event], None] | None = None,
) -> PipelineResult:
    """Run ``spec``'s stages in order and return what each produced.

    Args:
        spec: the pipeline.
        base: folder that relative paths in the spec (and ``module:function`` stages) are resolved from.
        executor: ``jobs`` (each stage a job of a JobService in this process), ``server`` (each stage a
            job of the running ``gpuyard server`` at ``GPUYARD_SERVER``) or ``inline`` (this process).
        use_cache: skip stages whose content hash has a cached result.
        on_event: receives ``{"type": "start"|"job"|"log"|"done"|"failed", "stage": ..., ...}``.

    Raises:
        ConfigError: unknown executor, or a reference to an output that does not exist.
        StageFailed: a stage's job failed (the run stops there; earlier results stay cached).
    """
    if executor not in EXECUTORS:
        raise ConfigError(f"executor {executor!r}: use one of {', '.join(EXECUTORS)}")
    from gpuyard.scheduler.executors.tasks import Task

    emit = on_event or (lambda _e: None)
    base_dir = Path(base).resolve()
    home = load_settings().ensure_home()
    result = PipelineResult(spec.name)
    outputs: dict[str, dict[str, Any]] = {}
    jobs = _JobRunner(remote=executor == "server") if executor != "inline" else None
    try:
        for st in spec.stages:
            inputs = resolve(st.inputs, outputs, f"stage {st.name}")
            stage_inputs(st.uses, inputs, st.name)  # a bad value fails here, before its job starts
            key = cache.stage_key(st.uses, inputs, base_dir)
            t0 = time.perf_counter()
            hit = cache.lookup(key) if (use_cache and st.cache) else None
            if hit is not None:
                res = StageResult(st.name, st.uses, hit["outputs"], True, 0.0, key, hit.get("job_id"))
                emit(
                    {
                        "type": "done",
                        "stage": st.name,
                        "cached": True,
                        "seconds": 0.0,
                        "outputs": res.outputs,
                        "job_id": res.job_id,
                    }
                )
            else:
                emit({"type": "start", "stage": st.name, "uses": st.uses})
                workdir = home / "pipelines" / spec.name / st.name / key[:12]
                workdir.mkdir(parents=True, exist_ok=True)
                ctx = {
                    "workdir": str(workdir),
                    "base": str(base_dir),
                    "pipeline": spec.name,
                    "stage": st.name,
                }
                task = Task(
                    fn="gpuyard.pipelines.stages:run_stage",
                    kwargs={"uses": st.uses, "inputs": inputs, "ctx": ctx},
                    name=st.name,
                )
                try:
                    out, job_id = _run_one(st, task, workdir, base_dir, jobs, emit)
                except GpuyardError as exc:
                    emit({"type": "failed", "stage": st.name, "error": str(exc)})
                    raise
                res = StageResult(st.name, st.uses, out, False, time.perf_counter() - t0, key, job_id)
                if st.cache:
                    cache.save(key, {"outputs": out, "job_id": job_id, "stage": st.name, "uses": st.uses})
                emit(
                    {
                        "type": "done",
                        "stage": st.name,
                        "cached": False,
                        "seconds": res.seconds,
                        "outputs": out,
                    }
                )
            outputs[st.name] = res.outputs
            result.stages.append(res)
        result.summary = render_summary(spec.summary, outputs)
    finally:
        if jobs is not None:
            jobs.close()
    return result


def _run_one(
    st: StageSpec, task: Any, workdir: Path, base: Path, jobs: _JobRunner | None, emit: Any
) -> tuple[dict[str, Any], int | None]:
    if jobs is None:
        import sys

        from gpuyard.pipelines.stages import run_stage

        if str(base) not in sys.path:
            sys.path.insert(0, str(base))  # as PYTHONPATH does for a job: the pipeline's own modules

        kw = task.kwargs
        return run_stage(kw["uses"], kw["inputs"], kw["ctx"]), None
    files = (workdir / "task.json", workdir / "result.json")
    files[1].unlink(missing_ok=True)
    files[0].write_text(task.to_json())
    # The stage's own modules (an example's model code) are importable from the pipeline's folder.
    path = os.pathsep.join(p for p in (str(base), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    out, job_id = jobs.run(st, task, files, env, emit)
    return out, job_id
