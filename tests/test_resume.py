"""Resuming a killed run through the real CLI: only the missing units run, and the store ends identical to an
uninterrupted run's; a store written by another run is never resumed into."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import xarray as xr
import zarr

from conftest import REPO
from test_cli import interp_run

pytestmark = pytest.mark.engine

TRACE = (
    "+experiment=causal_trace", "model=tiny_random", "engine=eager", "causal_trace.num_facts=2",
    "causal_trace.noise.samples=1", "causal_trace.window=2", "causal_trace.layers=[0,3]", "causal_trace.filter=false",
    "causal_trace.plots=false", "store.unit_requests=4",
)


def status(store) -> str:
    return dict(zarr.open_group(str(store), mode="r").attrs)["status"]


def test_a_killed_run_resumes_where_it_stopped_and_ends_identical(tmp_path):
    full = tmp_path / "full.zarr"
    proc = interp_run(*TRACE, f"store.path={full}", f"hydra.run.dir={tmp_path / 'full'}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    store = tmp_path / "killed.zarr"
    journal = tmp_path / "killed.zarr.units"
    cli = REPO / ".venv" / "bin" / "interp-run"
    killed = subprocess.Popen([str(cli), *TRACE, f"store.path={store}", f"hydra.run.dir={tmp_path / 'k'}"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and len(list(journal.glob("stage1-*.pkl"))) < 3:
        assert killed.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    done = sorted(p.name for p in journal.glob("*.pkl"))
    assert status(store) == "running" and 3 <= len(done)

    resumed = interp_run(*TRACE, f"store.path={store}", f"hydra.run.dir={tmp_path / 'r'}", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{len(done)} unit(s) already done" in resumed.stdout
    assert resumed.stdout.count("taken from the journal") == len(done)  # and none of them ran again,
    # but the clean runs, for the values they keep on the workers for the cells still to run
    assert resumed.stdout.count("runs again first, for the values it keeps") == 1
    assert status(store) == "complete" and not journal.exists()
    xr.testing.assert_equal(xr.open_zarr(str(store), consolidated=False), xr.open_zarr(str(full), consolidated=False))


def test_a_store_of_another_run_is_never_resumed_into(tmp_path):
    store = tmp_path / "other.zarr"
    first = interp_run("+experiment=steering_smoke", "model=tiny_random", "engine=eager", "sampling.max_tokens=2",
                       f"store.path={store}", f"hydra.run.dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr[-3000:]
    again = interp_run("+experiment=steering_smoke", "model=tiny_random", "engine=eager", "sampling.max_tokens=3",
                       f"store.path={store}", f"hydra.run.dir={tmp_path / 'b'}", "resume=true")
    assert again.returncode == 2
    assert "config error: resume:" in again.stderr and "never resumed into" in again.stderr
    missing = interp_run("+experiment=steering_smoke", "model=tiny_random", f"store.path={tmp_path / 'none.zarr'}",
                         f"hydra.run.dir={tmp_path / 'c'}", "resume=true")
    assert missing.returncode == 2 and "no store to resume" in missing.stderr
