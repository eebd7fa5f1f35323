"""Run the grid's cells in worker processes: one per core, one intra-op thread each.

The grid is embarrassingly parallel. Processes (``spawn`` context) rather than threads,
each with ``torch.set_num_threads(1)`` (and ``OMP_NUM_THREADS=1`` in its environment),
so that N workers use N cores and never oversubscribe a machine that other work
shares. With one worker the runs execute in this process, one thread as well.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

import torch

from .data import TASKS, Task
from .runner import RunResult, RunSpec, train

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def default_workers(device: torch.device) -> int:
    """One worker per available core on the CPU; one on CUDA (the GPU is shared)."""
    if device.type == "cuda":
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@functools.cache
def _task(name: str) -> Task:
    return TASKS[name]()


def _init_worker() -> None:
    torch.set_num_threads(1)


def _run(spec: RunSpec, device: torch.device) -> RunResult:
    return train(_task(spec.task), spec, device)


@contextlib.contextmanager
def _single_threaded_environment() -> Iterator[None]:
    """Children started inside inherit one OpenMP/MKL thread; restored afterwards."""
    saved = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    os.environ.update(dict.fromkeys(THREAD_VARIABLES, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_grid(
    specs: list[RunSpec],
    device: torch.device,
    workers: int,
    on_result: Callable[[RunResult], None],
) -> list[RunResult]:
    """Run every spec (``workers`` at a time) and call ``on_result`` as each finishes;
    returns the results in the order of ``specs``."""
    for name in dict.fromkeys(s.task for s in specs):
        _task(name)  # build (and cache on disk) each dataset once, before the workers start
    results: dict[int, RunResult] = {}
    if workers <= 1 or len(specs) <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for i, spec in enumerate(specs):
                results[i] = _run(spec, device)
                on_result(results[i])
        finally:
            torch.set_num_threads(threads)
        return [results[i] for i in range(len(specs))]
    context = multiprocessing.get_context("spawn")
    with (
        _single_threaded_environment(),
        ProcessPoolExecutor(
            min(workers, len(specs)), mp_context=context, initializer=_init_worker
        ) as pool,
    ):
        pending = {pool.submit(_run, spec, device): i for i, spec in enumerate(specs)}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                results[i] = future.result()
                on_result(results[i])
    return [results[i] for i in range(len(specs))]
