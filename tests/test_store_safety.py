"""Stores are safe: a run destroys nothing it did not create, locks its store path, and never runs code it reads.

Through the CLI's ``main`` (in this process, ``support.inprocess``; as a process of its own where another process
must hold the lock) where a config is refused (exit 2, the key named, no traceback, no engine started, what was
there intact byte for byte); with a fake engine where a run must write. Planted payloads (pickles, object arrays,
YAML python tags) would create a marker file if anything ran them. An unfinished run's journal:
``test_store_journal.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

from conftest import REPO, FakeEngineBase, base_config, has_cuda
from interp_runner.config import ConfigError
from interp_runner.pipeline import prepare, run
from interp_runner.store.claim import StoreTarget
from interp_runner.store.lock import StoreLock
from support.inprocess import interp_run as in_process
from test_cli import interp_run
from test_store import fake_results, store_config

GOLDEN = REPO / "experiments" / "golden" / "steering_smoke.zarr"
SMOKE = ("+experiment=steering_smoke", "model=tiny_random", "engine=eager", "sampling.max_tokens=2")


class Planted:
    """Unpickling this opens (creates) ``marker``: proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def smoke(tmp_path: Path, *args: str, process: bool = False):
    """``interp-run`` on the smoke experiment, through ``main`` in this process unless ``process``."""
    run = interp_run if process else in_process
    return run(*SMOKE, *args, f"hydra.run.dir={tmp_path / 'hydra'}")


def assert_refused(proc, key: str, *phrases: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"config error: {key}:" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "engine started" not in proc.stdout
    for phrase in phrases:
        assert phrase in proc.stderr, (phrase, proc.stderr[-3000:])


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def golden_copy(path: Path) -> dict:
    shutil.copytree(GOLDEN, path)
    return dict(zarr.open_group(str(path), mode="r").attrs)


# ------------------------------------------------------------------ what is at store.path


@pytest.fixture
def area(tmp_path) -> Path:
    """The folder the stores go in (Hydra's run folder is elsewhere: it is not ours to compare)."""
    (tmp_path / "data").mkdir()
    return tmp_path / "data"


def test_a_folder_holding_a_user_file_is_never_touched(tmp_path, area):
    target = area / "results.zarr"
    target.mkdir()
    (target / "notes.txt").write_text("my notes")
    before = snapshot(area)
    for extra in ((), ("store.overwrite=true",)):
        assert_refused(smoke(tmp_path, f"store.path={target}", *extra), "store.path", "not a store of this runner")
        assert snapshot(area) == before  # and no unfinished run or lock is left either


def test_another_store_at_the_path_is_refused_naming_it(tmp_path, area):
    target = area / "results.zarr"
    attrs = golden_copy(target)
    before = snapshot(area)
    proc = smoke(tmp_path, f"store.path={target}")
    assert_refused(proc, "store.path", "already holds a store", "experiment steering_smoke v1",
                   f"run {attrs['run_key'][:12]}", f"started_at {attrs['started_at']}", "status complete",
                   "store.overwrite=true")
    assert snapshot(area) == before


@pytest.mark.engine
def test_overwrite_replaces_a_store_only_once_the_new_one_is_complete(tmp_path, area):
    target = area / "results.zarr"
    old = golden_copy(target)
    (area / "results.figures").mkdir()  # named after the stem: no store's companion
    (area / "results.figures" / "old.png").write_bytes(b"old figure")
    (area / "notes.txt").write_text("beside the store, not its own")
    proc = smoke(tmp_path, f"store.path={target}", "store.overwrite=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "store.overwrite: replaced" in proc.stdout
    new = dict(zarr.open_group(str(target), mode="r").attrs)
    assert new["status"] == "complete" and new["started_at"] != old["started_at"]
    assert xr.open_zarr(str(target), consolidated=False).sizes["generated"] == 2
    assert sorted(p.name for p in area.iterdir()) == ["notes.txt", "results.figures", "results.zarr",
                                                      "results.zarr.log", "results.zarr.report.html"]
    assert (area / "notes.txt").read_text() == "beside the store, not its own"
    assert (area / "results.figures" / "old.png").read_bytes() == b"old figure"


def test_a_config_the_engine_refuses_leaves_the_existing_store_byte_identical(tmp_path, area):
    target = area / "results.zarr"
    golden_copy(target)
    before = snapshot(area)
    if has_cuda():
        pytest.skip("this machine has a GPU: batch-invariant mode is allowed")
    proc = smoke(tmp_path, f"store.path={target}", "store.overwrite=true", "engine.batch_invariant=true")
    assert_refused(proc, "engine.batch_invariant", "needs a GPU")
    assert snapshot(area) == before  # no unfinished run, figures or lock left


def test_a_store_path_under_a_regular_file_is_refused(tmp_path, area):
    (area / "somefile").write_text("a file")
    proc = smoke(tmp_path, f"store.path={area / 'somefile' / 'x.zarr'}")
    assert_refused(proc, "store.path", "is a file, not a folder")
    assert snapshot(area) == {"somefile": b"a file"}


@pytest.mark.parametrize("overwrite", [(), ("store.overwrite=true",)])
@pytest.mark.parametrize("companion, file", [("figures", "mine.png"), ("exports", "mine.safetensors")])
def test_companions_without_their_store_are_refused(tmp_path, area, companion, file, overwrite):
    (area / f"results.zarr.{companion}").mkdir()
    (area / f"results.zarr.{companion}" / file).write_bytes(b"a file of its own")
    before = snapshot(area)
    assert_refused(smoke(tmp_path, f"store.path={area / 'results.zarr'}", *overwrite), "store.path",
                   f"results.zarr.{companion} is not the store's own: there is no store at")
    assert snapshot(area) == before


def test_exports_beside_a_store_that_lists_none_are_never_replaced(tmp_path, area):
    target = area / "results.zarr"
    golden_copy(target)  # made before stores listed their companions
    (area / "results.zarr.exports").mkdir()
    (area / "results.zarr.exports" / "old.gguf").write_bytes(b"old vector")
    before = snapshot(area)
    assert_refused(smoke(tmp_path, f"store.path={target}", "store.overwrite=true"), "store.path",
                   f"results.zarr.exports is not the store's own: the store at {target} lists no exports")
    assert snapshot(area) == before


class NoEngine:
    def __init__(self, *args):
        raise AssertionError("no engine may start")


def engine_serving(config: dict, dies_at_unit: int | None = None):
    """A fake engine class answering the plan's requests with ``fake_results``; interrupted at a unit."""
    plan = prepare(config).plan
    results = {r.rid: r for r in fake_results(plan)[0]}
    order = [r.rid for r in plan.requests]

    class Serving(FakeEngineBase):
        def run(self, requests, vectors=None, use_tqdm=True, **_):
            if dies_at_unit is not None and order.index(requests[0].rid) >= dies_at_unit:
                raise KeyboardInterrupt()
            return {r.rid: results[r.rid] for r in requests}

    return Serving


def exporting(monkeypatch, fails: bool = False) -> None:
    """The prompts kind, made to export one file (and then, with ``fails``, to fail)."""
    from interp_runner.kinds.prompts import PromptsKind

    def exports(self, ds, cfg, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "vectors.safetensors").write_bytes(f"{ds.sizes['request']} requests".encode())
        if fails:
            raise RuntimeError("export failed")
        return [out_dir / "vectors.safetensors"]

    monkeypatch.setattr(PromptsKind, "exports", exports)


def test_exports_are_staged_with_the_store_and_moved_beside_it(tmp_path, monkeypatch):
    exporting(monkeypatch)
    config = store_config(store={"path": str(tmp_path / "results.zarr")})
    target = StoreTarget.at(tmp_path / "results.zarr")
    logged = []
    run(config, tmp_path, engine_factory=engine_serving(config), log=logged.append)
    exported = tmp_path / "results.zarr.exports" / "vectors.safetensors"
    assert exported.read_bytes() == b"3 requests"
    attrs = dict(zarr.open_group(str(target.path), mode="r").attrs)
    assert attrs["exports"] == [str(exported)] and attrs["kind"] == "prompts"
    assert any(line.startswith(f"exports: {tmp_path / 'results.zarr.exports'} (1 files)") for line in logged)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "results.zarr.report.html") == [
        "results.zarr", "results.zarr.exports"]


def test_exports_of_a_failed_run_never_reach_the_store_path(tmp_path, monkeypatch):
    exporting(monkeypatch, fails=True)
    config = store_config(store={"path": str(tmp_path / "results.zarr")})
    target = StoreTarget.at(tmp_path / "results.zarr")
    with pytest.raises(RuntimeError, match="export failed"):
        run(config, tmp_path, engine_factory=engine_serving(config), log=lambda _: None)
    assert not target.exports.exists() and not target.path.exists()
    assert dict(zarr.open_group(str(target.staged), mode="r").attrs)["status"] == "failed"
    assert (target.staging(target.exports) / "vectors.safetensors").exists()  # only in the unfinished run
    exporting(monkeypatch)
    replaced = {**config, "store": {**config["store"], "overwrite": True}}
    run(replaced, tmp_path, engine_factory=engine_serving(replaced), log=lambda _: None)
    assert (target.exports / "vectors.safetensors").read_bytes() == b"3 requests"
    assert not target.work.exists()


@pytest.mark.parametrize("what", ["user folder", "nothing", "complete store"])
def test_resume_needs_an_unfinished_run(tmp_path, area, what):
    target = area / "results.zarr"
    if what == "user folder":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif what == "complete store":
        golden_copy(target)
    before = snapshot(area)
    proc = smoke(tmp_path, f"store.path={target}", "resume=true")
    expected = {"user folder": "(store.path) is not a store of this runner", "nothing": "no store to resume",
                "complete store": "with no unfinished run beside it"}[what]
    assert_refused(proc, "resume", expected)
    assert snapshot(area) == before
    assert sorted(p.name for p in area.iterdir()) == ([] if what == "nothing" else ["results.zarr"])


# ------------------------------------------------------------------ locks


@pytest.mark.cli
def test_a_store_path_locked_by_another_process_is_refused_naming_the_holder(tmp_path, area):
    target = area / "results.zarr"
    lock = StoreLock(StoreTarget.at(target).lock_file)
    lock.acquire()
    try:
        proc = smoke(tmp_path, f"store.path={target}", process=True)
    finally:
        lock.release()
    assert_refused(proc, "store.path", "in use by another run", f"pid {os.getpid()}",
                   f"host {socket.gethostname()}", f"started {lock.holder['started_at']}")
    assert list(area.iterdir()) == []


@pytest.mark.engine
def test_two_runs_into_one_store_path(tmp_path, area):
    target = area / "results.zarr"
    lock_file = StoreTarget.at(target).lock_file
    cli = REPO / ".venv" / "bin" / "interp-run"
    with open(tmp_path / "first.out", "w") as out, open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen([str(cli), *SMOKE, "sampling.max_tokens=32", f"store.path={target}",
                                  f"hydra.run.dir={tmp_path / 'first'}"], cwd=REPO, stdout=out, stderr=err)
        deadline = time.time() + 300
        while time.time() < deadline and not (lock_file.exists() and lock_file.read_bytes()):
            assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
            time.sleep(0.05)
        second = smoke(tmp_path, f"store.path={target}")
        first.wait(timeout=600)
    assert first.returncode == 0, (tmp_path / "first.err").read_text()[-3000:]
    assert_refused(second, "store.path", "in use by another run", f"pid {first.pid} ")
    assert dict(zarr.open_group(str(target), mode="r").attrs)["status"] == "complete"
    assert sorted(p.name for p in area.iterdir()) == ["results.zarr", "results.zarr.log",
                                                      "results.zarr.report.html"]  # the lock went


def test_the_stale_lock_of_a_killed_process_is_broken(tmp_path, area):
    target = area / "results.zarr"
    lock_file = StoreTarget.at(target).lock_file
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from interp_runner.store.lock import "
                               "StoreLock; StoreLock(sys.argv[1]).acquire(); time.sleep(600)", str(lock_file)])
    deadline = time.time() + 120
    while time.time() < deadline and not (lock_file.exists() and lock_file.read_bytes()):
        time.sleep(0.05)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert json.loads(lock_file.read_bytes())["pid"] == holder.pid  # left behind by the killed holder
    # a run that takes the lock (here, to be refused after it: nothing to resume) breaks it and says so
    proc = smoke(tmp_path, f"store.path={target}", "resume=true")
    assert f"broke the stale lock on {target}: its holder (pid {holder.pid} " in proc.stdout
    assert_refused(proc, "resume", "no store to resume")
    assert list(area.iterdir()) == []


# ------------------------------------------------------------------ other files a run or a check reads


def test_vector_files_holding_pickles_are_refused_and_never_run(tmp_path):
    import torch

    marker = tmp_path / "ran"
    evil = np.empty(1, dtype=object)
    evil[0] = Planted(marker)
    np.save(tmp_path / "evil.npy", evil, allow_pickle=True)
    torch.save({"v": Planted(marker)}, tmp_path / "evil.pt")
    for name in ("evil.npy", "evil.pt"):
        config = base_config(vectors={"evil": str(tmp_path / name)},
                             steering={"global": {"base": {"post_block": {"layer": 0, "vector": "evil"}}}})
        with pytest.raises(ConfigError) as err:
            prepare(config)
        assert err.value.problems[0][0].startswith("vectors.evil"), err.value.problems
        assert not marker.exists()


def test_interp_verify_never_runs_a_python_tag_in_a_store_config(tmp_path):
    from support.inprocess import interp_verify  # as a process would: a rerun routes the process's logging

    store = tmp_path / "results.zarr"
    golden_copy(store)
    marker = tmp_path / "ran"
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["config_yaml"] = f"!!python/object/apply:builtins.open ['{marker}', 'w']\n"
    meta["attributes"]["config_sha256"] = "0" * 64  # so that comparing with another store reads it too
    (store / "zarr.json").write_text(json.dumps(meta))
    for args in (["--rerun", "--out", str(tmp_path / "out")], ["--against", str(GOLDEN)]):
        proc = interp_verify(store, *args)
        assert proc.returncode == 2 and "config_yaml is not plain YAML" in proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_interp_verify_refuses_a_store_with_a_pickled_object_array(tmp_path, capsys):
    from interp_runner import verify

    store, marker = tmp_path / "v2.zarr", tmp_path / "ran"
    (store / "x").mkdir(parents=True)
    (store / ".zgroup").write_text(json.dumps({"zarr_format": 2}))
    (store / ".zattrs").write_text(json.dumps({"status": "complete", "schema": "interp-runner/1"}))
    (store / "x" / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [1], "chunks": [1], "dtype": "|O", "compressor": None, "fill_value": 0,
        "filters": [{"id": "pickle"}], "order": "C"}))
    (store / "x" / ".zattrs").write_text(json.dumps({"_ARRAY_DIMENSIONS": ["d"]}))
    evil = np.empty(1, dtype=object)
    evil[0] = Planted(marker)
    (store / "x" / "0").write_bytes(pickle.dumps(evil))
    assert verify.main([str(store), "--against", str(GOLDEN)]) == 2
    assert "cannot read its arrays" in capsys.readouterr().err
    assert not marker.exists()


def test_a_sweep_index_with_a_python_tag_is_read_as_text(tmp_path):
    from interp_runner.sweep import INDEX as SWEEP_INDEX, open_sweep

    marker = tmp_path / "ran"
    tag = f"!!python/object/apply:builtins.open ['{marker}', 'w']"
    jobs = []
    for num, value in enumerate(("1", tag)):
        golden_copy(tmp_path / str(num) / "results.zarr")
        jobs.append({"num": num, "overrides": [f"sampling.seed={value}"], "status": "complete",
                     "store": f"{num}/results.zarr"})
    (tmp_path / SWEEP_INDEX).write_text(json.dumps({"jobs": jobs}))
    sweep = open_sweep(tmp_path)
    assert list(sweep["sampling.seed"].values) == ["1", tag] or list(sweep["sampling.seed"].values) == [1, tag]
    assert not marker.exists()
