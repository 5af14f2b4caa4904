"""Run one function over many shards: in this process, in a local process pool, or as Ray tasks.

The same task function and the same task arguments go to every engine, so results are identical
whichever runs them (a test compares the pool and Ray byte for byte through the version hash).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from gpuyard.errors import ConfigError, GpuyardError

ENGINES = ("pool", "ray", "serial")
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
) -> list[Any]:
    """``[fn(t) for t in tasks]``, run by ``engine``; results keep the order of ``tasks``.

    Args:
        fn: a module-level function (it is pickled by reference).
        tasks: one argument dict per shard.
        engine: ``pool`` (processes on this machine), ``ray`` (tasks on a Ray cluster) or ``serial``.
        workers: pool size (default: CPU count); ignored by Ray, which places one CPU per task.
        ray_address: Ray cluster to join when Ray is not initialised yet (default: start a local one).
        progress: called with (stage, done, total) as tasks finish.
        stage: label passed to ``progress``.

    Raises:
        ConfigError: unknown engine, or Ray not installed.
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine {engine!r} unknown; use one of {', '.join(ENGINES)}")
    if not tasks:
        return []
    if engine == "ray":
        return _run_ray(fn, tasks, ray_address, progress, stage)
    size = min(workers or os.cpu_count() or 1, len(tasks))
    if engine == "serial" or size <= 1:
        results = []
        for i, task in enumerate(tasks):
            results.append(fn(task))
            if progress is not None:
                progress(stage, i + 1, len(tasks))
        return results
    return _run_pool(fn, tasks, size, progress, stage)


def _run_pool(
    fn: Callable[[dict[str, Any]], Any],
    tasks: list[dict[str, Any]],
    size: int,
    progress: Progress | None,
    stage: str,
) -> list[Any]:
    # spawn, not fork: the parent may hold Arrow/torch thread pools that a forked child would inherit locked.
    results: list[Any] = [None] * len(tasks)
    with ProcessPoolExecutor(max_workers=size, mp_context=mp.get_context("spawn")) as pool:
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
