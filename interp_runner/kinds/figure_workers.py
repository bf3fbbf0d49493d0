"""Processes that draw a run's figures. Started ahead, while a GPU engine runs, they have imported matplotlib and
the kinds' drawing code by the time the store is written (on the GPU machine that import is most of the figures'
time)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context

PER_WORKER_AT_LEAST = 8  # a worker's start costs about as much as a few figures
PER_WORKER_AHEAD = 4  # workers started ahead start while the engine runs: more of them, fewer figures each
DRAWING_MODULES = ("matplotlib.pyplot", "interp_runner.kinds.causal_trace.figures")


def _import(modules: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    for name in modules:
        importlib.import_module(name)


def worker_count(figures: int, per_worker: int = PER_WORKER_AT_LEAST) -> int:
    """One process per core, each with at least ``per_worker`` figures; 0 or 1: draw in this process."""
    return min(os.cpu_count() or 1, figures // per_worker)


class FigureWorkers:
    """``count`` spawned processes (not forked: the parent may hold an engine's threads and device context), each
    importing ``DRAWING_MODULES`` as soon as it starts."""

    def __init__(self, count: int):
        self._pool = ProcessPoolExecutor(count, mp_context=get_context("spawn"))
        for _ in range(count):  # each submit while none is idle starts one more process
            self._pool.submit(_import, DRAWING_MODULES)

    @classmethod
    def ahead(cls, figures: int) -> FigureWorkers | None:
        """Workers for about ``figures`` figures, or None where they are drawn in this process."""
        count = worker_count(figures, PER_WORKER_AHEAD)
        return cls(count) if count > 1 else None

    def map(self, draw: Callable, jobs: Iterable) -> list:
        jobs = list(jobs)
        try:
            return list(self._pool.map(draw, jobs))
        except BrokenProcessPool:  # a parent whose main module cannot be re-imported (a script read from stdin)
            return [draw(job) for job in jobs]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> FigureWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
