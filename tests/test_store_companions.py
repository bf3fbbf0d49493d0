"""What lies beside a store: a run replaces or deletes a companion (report, figures, exports) only where the store at
store.path lists that very content as its own, whatever ``store.overwrite`` says; companions are named after the
store's whole name, so two stores in one folder never share one. Also: no store inside an unfinished run's folder,
a lock that cannot be made says why, and an unfinished run resumes wherever it was moved.

In process, with a do-nothing engine: every check here runs before any engine starts (``NoEngine`` proves it).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import zarr

from interp_runner.config import ConfigError
from interp_runner.pipeline import run
from interp_runner.store.claim import StoreTarget
from test_store import store_config
from test_store_journal import resume, unfinished  # noqa: F401
from test_store_safety import NoEngine, engine_serving, exporting, snapshot


def drawing(monkeypatch) -> None:
    """The prompts kind, made to draw one figure (its bytes name the run's request count and seed)."""
    from interp_runner.kinds.prompts import PromptsKind

    def figures(self, ds, cfg, out_dir, workers=None):
        out_dir.mkdir(parents=True)
        (out_dir / "effect.png").write_bytes(f"{ds.sizes['request']} requests, seed {cfg.sampling.seed}".encode())
        return [out_dir / "effect.png"]

    monkeypatch.setattr(PromptsKind, "figures", figures)


def config_at(path: Path, overwrite: bool = False, seed: int = 7) -> dict:
    config = store_config(store={"path": str(path), "overwrite": overwrite})
    return {**config, "sampling": {**config["sampling"], "seed": seed}}


def run_at(path: Path, overwrite: bool = False, seed: int = 7) -> list[str]:
    config = config_at(path, overwrite, seed)
    logged = []
    run(config, path.parent, engine_factory=engine_serving(config), log=logged.append)
    return logged


def refused(path: Path, overwrite: bool, key: str = "store.path") -> str:
    """The message of the ConfigError (at ``key``) that refuses a run at ``path``, before any engine starts."""
    with pytest.raises(ConfigError) as err:
        run(config_at(path, overwrite), path.parent, engine_factory=NoEngine, log=lambda _: None)
    assert err.value.problems[0][0] == key, err.value.problems
    return str(err.value)


def attrs(path: Path) -> dict:
    return dict(zarr.open_group(str(path), mode="r").attrs)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ names


def test_companions_are_named_after_the_whole_store_name(tmp_path, monkeypatch):
    drawing(monkeypatch)
    exporting(monkeypatch)
    run_at(tmp_path / "x.zarr")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "x.zarr", "x.zarr.exports", "x.zarr.figures", "x.zarr.report.html"]
    assert attrs(tmp_path / "x.zarr")["figures"] == [str(tmp_path / "x.zarr.figures" / "effect.png")]


def test_two_stores_of_one_stem_keep_their_own_companions(tmp_path, monkeypatch):
    """x.zarr, then x.v2 (with and without store.overwrite): neither touches the other's report or figures."""
    drawing(monkeypatch)
    run_at(tmp_path / "x.zarr")
    first = snapshot(tmp_path)
    run_at(tmp_path / "x.v2")
    assert {k: v for k, v in snapshot(tmp_path).items() if k.startswith("x.zarr")} == first
    run_at(tmp_path / "x.v2", overwrite=True, seed=8)
    assert {k: v for k, v in snapshot(tmp_path).items() if k.startswith("x.zarr")} == first
    assert attrs(tmp_path / "x.zarr")["status"] == "complete"
    assert (tmp_path / "x.v2.figures" / "effect.png").read_bytes() == b"3 requests, seed 8"
    assert "x.zarr" in (tmp_path / "x.zarr.report.html").read_text()


# ------------------------------------------------------------------ files that are not the store's own


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_users_files_beside_a_store_path_are_never_replaced(tmp_path, monkeypatch, overwrite):
    """No store at thesis.zarr; the user's thesis.figures/, thesis.report.html and even files at the companions'
    own places: refused with and without store.overwrite, naming each file, and never suggesting the flag."""
    drawing(monkeypatch)
    (tmp_path / "thesis.figures").mkdir()
    (tmp_path / "thesis.figures" / "fig1.png").write_bytes(b"my figure")
    (tmp_path / "thesis.report.html").write_text("<p>my report</p>")
    (tmp_path / "thesis.zarr.figures").mkdir()
    (tmp_path / "thesis.zarr.figures" / "fig2.png").write_bytes(b"my other figure")
    (tmp_path / "thesis.zarr.report.html").write_text("<p>my other report</p>")
    before = snapshot(tmp_path)
    message = refused(tmp_path / "thesis.zarr", overwrite)
    for name in ("thesis.zarr.figures", "thesis.zarr.report.html"):
        assert f"{tmp_path / name} is not the store's own: there is no store at {tmp_path / 'thesis.zarr'}" in message
    assert "whatever store.overwrite says" in message and "set store.overwrite" not in message
    assert snapshot(tmp_path) == before
    # the user's files named after the stem are no store's companions: a run beside them leaves them be
    shutil.rmtree(tmp_path / "thesis.zarr.figures")
    (tmp_path / "thesis.zarr.report.html").unlink()
    run_at(tmp_path / "thesis.zarr", overwrite)
    assert (tmp_path / "thesis.figures" / "fig1.png").read_bytes() == b"my figure"
    assert (tmp_path / "thesis.report.html").read_text() == "<p>my report</p>"


def test_overwrite_replaces_companions_the_store_lists_as_its_own(tmp_path, monkeypatch):
    drawing(monkeypatch)
    exporting(monkeypatch)
    store = tmp_path / "x.zarr"
    run_at(store)
    listed = attrs(store)["companions"]
    # the hashes are of what lies beside the store, checked here with hashlib
    assert listed["report"] == hashlib.sha256(b"file\0" + (tmp_path / "x.zarr.report.html").read_bytes()).hexdigest()
    assert set(listed) == {"report", "figures", "exports"}
    old_report = sha256(tmp_path / "x.zarr.report.html")
    assert "already holds a store" in refused(store, overwrite=False)
    logged = run_at(store, overwrite=True, seed=8)
    assert any(line.startswith("store.overwrite: replaced") and "x.zarr.figures" in line for line in logged)
    assert (tmp_path / "x.zarr.figures" / "effect.png").read_bytes() == b"3 requests, seed 8"
    assert sha256(tmp_path / "x.zarr.report.html") != old_report
    assert attrs(store)["seeds"]["sampling"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "x.zarr", "x.zarr.exports", "x.zarr.figures", "x.zarr.report.html"]


@pytest.mark.parametrize("change", ["edit report", "add figure", "edit figure", "unlisted"])
def test_a_companion_the_store_does_not_list_as_is_never_replaced(tmp_path, monkeypatch, change):
    drawing(monkeypatch)
    store = tmp_path / "x.zarr"
    run_at(store)
    if change == "edit report":
        with open(tmp_path / "x.zarr.report.html", "a") as f:
            f.write("<p>my notes on this run</p>")
    elif change == "add figure":
        (tmp_path / "x.zarr.figures" / "mine.png").write_bytes(b"mine")
    elif change == "edit figure":
        (tmp_path / "x.zarr.figures" / "effect.png").write_bytes(b"retouched")
    else:  # a store that lists no companions (an older store): its report is not proven its own
        group = zarr.open_group(str(store), mode="r+")
        group.attrs.update({"companions": {}})
    before = snapshot(tmp_path)
    message = refused(store, overwrite=True)
    what = "x.zarr.report.html" if change in ("edit report", "unlisted") else "x.zarr.figures"
    why = f"the store at {store} lists no report" if change == "unlisted" else f"it changed after the store at {store}"
    assert f"{tmp_path / what} is not the store's own: {why}" in message
    assert snapshot(tmp_path) == before


def test_a_companion_changed_while_the_run_went_is_kept_and_the_store_stays_staged(tmp_path, monkeypatch):
    drawing(monkeypatch)
    store = tmp_path / "x.zarr"
    run_at(store)
    config = config_at(store, overwrite=True, seed=8)
    serving = engine_serving(config)

    class EditsTheReport(serving):
        def run(self, requests, vectors=None, use_tqdm=True, **kw):
            (tmp_path / "x.zarr.report.html").write_text("<p>edited meanwhile</p>")
            return super().run(requests, vectors, use_tqdm, **kw)

    with pytest.raises(ConfigError, match="found as the run ended"):
        run(config, tmp_path, engine_factory=EditsTheReport, log=lambda _: None)
    assert (tmp_path / "x.zarr.report.html").read_text() == "<p>edited meanwhile</p>"
    assert attrs(store)["seeds"]["sampling"] == 7  # the old store, still in place
    assert attrs(StoreTarget.at(store).staged)["seeds"]["sampling"] == 8


def test_interp_report_replaces_only_the_report_the_store_lists(tmp_path):
    from interp_runner.report import cli as report_cli

    store = tmp_path / "x.zarr"
    run_at(store)
    report = tmp_path / "x.zarr.report.html"
    report.unlink()
    assert report_cli.main([str(store)]) == 0
    assert attrs(store)["companions"]["report"] == hashlib.sha256(b"file\0" + report.read_bytes()).hexdigest()
    run_at(store, overwrite=True, seed=8)  # the rebuilt report is the store's own: replaced
    report.write_text("<p>mine</p>")
    assert report_cli.main([str(store)]) == 2
    assert report.read_text() == "<p>mine</p>"


# ------------------------------------------------------------------ where a store may go


def test_a_store_path_inside_an_unfinished_run_is_refused(unfinished, tmp_path):
    config, target = unfinished
    before = snapshot(tmp_path)
    for inner in (target.work / "inner.zarr", target.work / "sub" / "inner.zarr", target.staged):
        message = refused(inner, overwrite=True)
        assert f"would be inside the unfinished run {target.work} (of the store {target.path})" in message
        assert snapshot(tmp_path) == before
    resume(config, engine_serving(config))  # and the unfinished run still resumes
    assert attrs(target.path)["status"] == "complete"


def test_a_lock_that_cannot_be_made_says_why(tmp_path):
    message = refused(Path("/proc/results.zarr"), overwrite=False)
    assert "cannot create the lock file /proc/.results.zarr.lock (No such file or directory)" in message
    assert "in use by another run" not in message
    (tmp_path / ".x.zarr.lock").mkdir()  # a folder where the lock file goes
    message = refused(tmp_path / "x.zarr", overwrite=False)
    assert f"cannot create the lock file {tmp_path / '.x.zarr.lock'} (Is a directory)" in message


# ------------------------------------------------------------------ an unfinished run, moved


@pytest.mark.parametrize("how", ["moved", "folder renamed", "store renamed"])
def test_a_moved_unfinished_run_resumes(unfinished, tmp_path, how):
    config, target = unfinished
    key = attrs(target.staged)["run_key"]
    if how == "store renamed":
        moved = StoreTarget.at(tmp_path / "thesis.zarr")
        target.work.rename(moved.work)
        (moved.work / target.path.name).rename(moved.staged)
    else:
        folder = tmp_path / ("elsewhere" if how == "moved" else "renamed")
        moved = StoreTarget.at(folder / target.path.name)
        folder.mkdir()
        target.work.rename(moved.work)
    moved_config = {**config, "store": {**config["store"], "path": str(moved.path)}}
    logged = resume(moved_config, engine_serving(moved_config))
    assert any(line.startswith(f"resuming {moved.path}: 1 unit(s) already done") for line in logged)
    assert attrs(moved.path)["status"] == "complete" and not moved.work.exists()
    assert attrs(moved.path)["run_key"] == key
