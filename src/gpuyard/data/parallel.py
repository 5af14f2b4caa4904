"""Run one function over many shards: in this process, in a local process pool, or as Ray tasks.

The same task function and the same task arguments go to every engine, so results are identical
whichever runs them (a test compares the pool and Ray byte for byte through the version hash).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, ProcessPoolExecutor, ThreadPoolExecutor, wait
from typing import Any

from gpuyard.errors import ConfigError, GpuyardError

ENGINES = ("pool", "thread", "ray", "serial")
START_METHOD_ENV = "GPUYARD_DATA_START_METHOD"


def start_method() -> str:
    """How pool workers start: ``fork`` on Linux (no re-import, no ``__main__`` guard needed), else ``spawn``.

    The tasks use Arrow single-threaded and never touch torch, and Arrow re-creates its thread pool
    after a fork, so forking is safe here; set GPUYARD_DATA_START_METHOD=spawn to choose otherwise.
    """
    default = "fork" if sys.platform.startswith("linux") else "spawn"
    method = os.environ.get(START_METHOD_ENV, default)
    if method not in mp.get_all_start_methods():
        raise ConfigError(
            f"{START_METHOD_ENV}={method!r}: use one of {', '.join(mp.get_all_start_methods())}"
        )
    return method


Progress = Callable[[str, int, int], None]


def run_tasks(
    fn: Callable[[dict[str, Any]], Any],
    tasks: list[dict[str, Any]],
    *,
    engine: str = "pool",
    workers: int | None = None,
    ray_address: str | None = None,
    progress: Progress | None = None,
    stage: str = "",
    executor: Executor | None = None,
) -> list[Any]:
    """``[fn(t) for t in tasks]``, run by ``engine``; results keep the order of ``tasks``.

    Args:
        fn: a module-level function (it is pickled by reference).
        tasks: one argument dict per shard.
        engine: ``pool`` (processes on this machine), ``thread`` (threads of this process: the tasks'
            heavy work is Arrow and NumPy, which release the GIL, and nothing is pickled or forked),
            ``ray`` (tasks on a Ray cluster) or ``serial``.
        workers: pool size (default: CPU count); ignored by Ray, which places one CPU per task.
        ray_address: Ray cluster to join when Ray is not initialised yet (default: start a local one).
        progress: called with (stage, done, total) as tasks finish.
        stage: label passed to ``progress``.
        executor: a pool from :func:`open_pool` to reuse (saves starting processes for each pass).

    Raises:
        ConfigError: unknown engine, or Ray not installed.
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine {engine!r} unknown; use one of {', '.join(ENGINES)}")
    if not tasks:
        return []
    if engine == "ray":
        return _run_ray(fn, tasks, ray_address, progress, stage)
    if executor is not None:
        return _run_pool(fn, tasks, executor, progress, stage)
    size = min(workers or os.cpu_count() or 1, len(tasks))
    if engine == "thread" and size > 1:
        with ThreadPoolExecutor(max_workers=size, thread_name_prefix="gpuyard-data") as threads:
            return _run_pool(fn, tasks, threads, progress, stage)
    if engine == "serial" or size <= 1:
        results = []
        for i, task in enumerate(tasks):
            results.append(fn(task))
            if progress is not None:
                progress(stage, i + 1, len(tasks))
        return results
    with ProcessPoolExecutor(max_workers=size, mp_context=mp.get_context(start_method())) as pool:
        return _run_pool(fn, tasks, pool, progress, stage)


@contextlib.contextmanager
def open_pool(engine: str, workers: int | None, tasks: int) -> Iterator[Executor | None]:
    """A process (or thread) pool to share between passes of one job; None when the engine uses none."""
    size = min(workers or os.cpu_count() or 1, tasks)
    if engine not in ("pool", "thread") or size <= 1:
        yield None
        return
    if engine == "thread":
        with ThreadPoolExecutor(max_workers=size, thread_name_prefix="gpuyard-data") as threads:
            yield threads
        return
    with ProcessPoolExecutor(max_workers=size, mp_context=mp.get_context(start_method())) as pool:
        yield pool


def _run_pool(
    fn: Callable[[dict[str, Any]], Any],
    tasks: list[dict[str, Any]],
    pool: Executor,
    progress: Progress | None,
    stage: str,
) -> list[Any]:
    results: list[Any] = [None] * len(tasks)
    pending = {pool.submit(fn, t): i for i, t in enumerate(tasks)}
    done_count = 0
    while pending:
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for fut in done:
            results[pending.pop(fut)] = fut.result()
            done_count += 1
            if progress is not None:
                progress(stage, done_count, len(tasks))
    return results


def _run_ray(
    fn: Callable[[dict[str, Any]], Any],
    tasks: list[dict[str, Any]],
    address: str | None,
    progress: Progress | None,
    stage: str,
) -> list[Any]:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("--engine ray needs Ray: pip install 'gpuyard[ray]'") from exc
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    remote = ray.remote(num_cpus=1)(fn)
    refs = [remote.remote(t) for t in tasks]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(tasks)
    waiting = list(refs)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                # Surface gpuyard's own errors (a corrupt shard, a bad column) as themselves, not wrapped.
                cause = getattr(exc, "cause", None)
                if isinstance(cause, GpuyardError):
                    raise cause from exc
                raise
        if progress is not None:
            progress(stage, len(tasks) - len(waiting), len(tasks))
    return results
