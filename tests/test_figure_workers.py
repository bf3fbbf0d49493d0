"""Trace figures drawn by worker processes started ahead equal those drawn in the process, file for file."""

from __future__ import annotations

import xarray as xr

from conftest import REPO
from interp_runner.kinds.figure_workers import FigureWorkers, worker_count
from interp_runner.kinds.causal_trace.figures import write_figures

GOLDEN = REPO / "experiments" / "golden" / "causal_trace.zarr"


def test_figures_from_workers_started_ahead_equal_those_drawn_here(tmp_path):
    ds = xr.open_zarr(str(GOLDEN), consolidated=False)
    here = write_figures(ds, tmp_path / "here")  # too few for workers of its own
    with FigureWorkers(2) as workers:
        there = write_figures(ds, tmp_path / "there", workers)
    assert [p.name for p in here] == [p.name for p in there] and len(here) > 1
    for a, b in zip(here, there):
        assert a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and a.read_bytes() == b.read_bytes()


def test_few_figures_are_drawn_in_the_process():
    assert worker_count(7) == 0 and FigureWorkers.ahead(7) is None
