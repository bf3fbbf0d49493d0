"""The report beside a store is one of its companions (``StoreTarget.companions``), as its figures are: staged with
the store, moved into place with it, replaced with it by ``store.overwrite`` (the store lists it as its own),
never published by a run that fails, and a report the store at the path does not list is refused. In process, with
a fake engine (tests/test_store_safety.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import zarr

from interp_runner import pipeline
from interp_runner.config import ConfigError
from interp_runner.pipeline import run
from interp_runner.store.claim import StoreTarget
from test_report import read_page
from test_report_views import header
from test_store import store_config
from test_store_safety import NoEngine, engine_serving, snapshot


def config_at(store: Path, **store_settings) -> dict:
    return store_config(store={"path": str(store), **store_settings})


def attrs_of(store: Path) -> dict:
    return dict(zarr.open_group(str(store), mode="r").attrs)


def provenance_cells(page) -> dict[str, str]:
    return {row[0]: row[1] for table in page.tables for row in table if len(row) == 2}


def test_a_run_writes_the_report_of_its_complete_store_beside_it(tmp_path):
    store = tmp_path / "data" / "results.zarr"
    config = config_at(store)
    run(config, tmp_path / "run", engine_factory=engine_serving(config), log=lambda _: None)
    assert sorted(p.name for p in store.parent.iterdir()) == ["results.zarr", "results.zarr.report.html"]
    attrs = attrs_of(store)
    page = read_page(store.parent / "results.zarr.report.html")
    cells = provenance_cells(page)
    # rendered once the store was complete: its final status, finish time and timings
    assert cells["status"] == "complete" and cells["finished_at"] == attrs["finished_at"]
    assert cells["run_key"] == attrs["run_key"] and cells["store_s"] == str(attrs["timings"]["store_s"])
    assert page.headings["h1"] == [f"{attrs['experiment']['name']} v{attrs['experiment']['version']}"]
    # rendered while the store was staged, it names where the store is now
    assert header((store.parent / "results.zarr.report.html").read_text())["store"] == str(store)


@pytest.fixture
def old_store(tmp_path) -> tuple[Path, dict[str, bytes]]:
    """A complete store at the path, written by a run (another seed) with its report, and what the folder held."""
    store = tmp_path / "data" / "results.zarr"
    config = config_at(store)
    config["sampling"] = {**config["sampling"], "seed": 6}
    run(config, tmp_path / "old", engine_factory=engine_serving(config), log=lambda _: None)
    return store, snapshot(store.parent)


def test_a_run_that_fails_leaves_the_old_report_and_publishes_none(old_store, monkeypatch):
    store, before = old_store
    config = config_at(store, overwrite=True)

    def fails(staged, out):
        Path(out).write_text("half a report")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "write_report", fails)
    with pytest.raises(OSError):
        run(config, store.parent.parent / "run", engine_factory=engine_serving(config), log=lambda _: None)
    target = StoreTarget.at(store)
    # what was there is as it was; the failed run (kept for resume=true) holds its store and the half report
    assert {k: v for k, v in snapshot(store.parent).items() if not k.startswith(".")} == before
    assert attrs_of(target.staged)["status"] == "failed"
    assert target.staging(target.report).read_text() == "half a report"


def test_overwrite_replaces_the_report_with_the_store_once_the_new_one_is_complete(old_store):
    store, _ = old_store
    old_run_key = attrs_of(store)["run_key"]
    config = config_at(store, overwrite=True)
    logged = []
    run(config, store.parent.parent / "run", engine_factory=engine_serving(config), log=logged.append)
    assert any("store.overwrite: replaced" in line and "results.zarr.report.html" in line for line in logged)
    assert sorted(p.name for p in store.parent.iterdir()) == ["results.zarr", "results.zarr.report.html"]
    new = attrs_of(store)
    assert new["run_key"] != old_run_key
    assert provenance_cells(read_page(store.parent / "results.zarr.report.html"))["run_key"] == new["run_key"]


def test_a_report_without_its_store_is_refused(tmp_path):
    area = tmp_path / "data"
    area.mkdir()
    (area / "results.zarr.report.html").write_text("<p>someone's page</p>")
    before = snapshot(area)
    for overwrite in (False, True):  # not the run's to replace, whatever store.overwrite says
        with pytest.raises(ConfigError) as err:
            run(config_at(area / "results.zarr", overwrite=overwrite), tmp_path / "run", engine_factory=NoEngine,
                log=lambda _: None)
        (key, message), = err.value.problems
        assert key == "store.path" and f"{area / 'results.zarr.report.html'} is not the store's own" in message
        assert snapshot(area) == before
