"""Resuming a killed run (a real ``interp-run`` process, killed) through the CLI's ``main`` in this process
(``support.inprocess``): only the missing units run, and the store ends identical to an uninterrupted run's; a store
written by another run is never resumed into."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import time

import pytest
import xarray as xr
import zarr

from conftest import REPO
from interp_runner.store.claim import StoreTarget
from support.inprocess import interp_run

pytestmark = pytest.mark.engine

TRACE = (
    "+experiment=causal_trace", "model=tiny_random", "engine=eager", "causal_trace.num_facts=2",
    "causal_trace.noise.samples=1", "causal_trace.window=2", "causal_trace.layers=[0,3]", "causal_trace.filter=false",
    "causal_trace.plots=false", "store.unit_requests=4",
)


def status(store) -> str:
    return dict(zarr.open_group(str(store), mode="r").attrs)["status"]


def journaled(journal) -> list[str]:
    """The units the journal lists as finished."""
    try:
        return sorted(json.loads((journal / "index.json").read_bytes())["units"])
    except (OSError, ValueError):
        return []


class Planted:
    """Unpickling this creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_killed_run_resumes_where_it_stopped_and_ends_identical(tmp_path):
    full = tmp_path / "full.zarr"
    proc = interp_run(*TRACE, f"store.path={full}", f"hydra.run.dir={tmp_path / 'full'}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    store = tmp_path / "killed.zarr"
    target = StoreTarget.at(store)
    cli = REPO / ".venv" / "bin" / "interp-run"
    with open(tmp_path / "killed.err", "w") as err:
        killed = subprocess.Popen([str(cli), *TRACE, f"store.path={store}", f"hydra.run.dir={tmp_path / 'k'}"],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 600
    while time.time() < deadline and len([u for u in journaled(target.journal) if u.startswith("stage1-")]) < 3:
        assert killed.poll() is None, "the run ended before it could be killed: " + \
            (tmp_path / "killed.err").read_text()[-3000:]
        time.sleep(0.02)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    done = journaled(target.journal)
    assert status(target.staged) == "running" and 3 <= len(done) and not store.exists()
    assert json.loads(target.lock_file.read_bytes())["pid"] == killed.pid  # the killed run's lock, left behind

    # a pickle planted in the journal is refused, never loaded; the killed run's lock is broken on the way
    marker = tmp_path / "ran"
    planted = target.journal / "stage1-unit00099.pkl"
    planted.write_bytes(pickle.dumps(Planted(marker)))
    refused = interp_run(*TRACE, f"store.path={store}", f"hydra.run.dir={tmp_path / 'p'}", "resume=true")
    assert refused.returncode == 2 and "config error: resume:" in refused.stderr
    assert "stage1-unit00099.pkl was not written by the journal" in refused.stderr
    assert "Traceback" not in refused.stderr and "engine started" not in refused.stdout and not marker.exists()
    assert f"broke the stale lock on {store}: its holder (pid {killed.pid} " in refused.stdout
    planted.unlink()

    resumed = interp_run(*TRACE, f"store.path={store}", f"hydra.run.dir={tmp_path / 'r'}", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{len(done)} unit(s) already done" in resumed.stdout
    assert resumed.stdout.count("taken from the journal") == len(done)  # and none of them ran again,
    # but the clean runs, for the values they keep on the workers for the cells still to run
    assert resumed.stdout.count("runs again first, for the values it keeps") == 1
    assert status(store) == "complete" and not target.work.exists() and not target.lock_file.exists()
    xr.testing.assert_equal(xr.open_zarr(str(store), consolidated=False), xr.open_zarr(str(full), consolidated=False))


def test_a_store_of_another_run_is_never_resumed_into(tmp_path):
    store = tmp_path / "other.zarr"
    smoke = ("+experiment=steering_smoke", "model=tiny_random", "engine=eager")
    first = interp_run(*smoke, "sampling.max_tokens=2", f"store.path={store}", f"hydra.run.dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr[-3000:]
    done = interp_run(*smoke, "sampling.max_tokens=2", f"store.path={store}", f"hydra.run.dir={tmp_path / 'd'}",
                      "resume=true")
    assert done.returncode == 2 and "config error: resume:" in done.stderr and "nothing to resume" in done.stderr
    # the same store as another run's unfinished one
    target = StoreTarget.at(store)
    target.work.mkdir()
    for final in (store, *target.companions):
        if final.exists():
            final.rename(target.staging(final))
    zarr.open_group(str(target.staged), mode="r+").attrs["status"] = "running"
    again = interp_run(*smoke, "sampling.max_tokens=3", f"store.path={store}", f"hydra.run.dir={tmp_path / 'b'}",
                       "resume=true")
    assert again.returncode == 2
    assert "config error: resume:" in again.stderr and "never resumed into" in again.stderr
    missing = interp_run(*smoke, f"store.path={tmp_path / 'none.zarr'}", f"hydra.run.dir={tmp_path / 'c'}",
                         "resume=true")
    assert missing.returncode == 2 and "no store to resume" in missing.stderr
