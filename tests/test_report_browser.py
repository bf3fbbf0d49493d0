"""Reports as a person sees them: opened in headless Chromium (Debian's package, installed by
scripts/install_browser.sh when missing; never skipped), with no console error, exception or request beyond the
page itself, every image decoded at its file's size, and the expected headings. Each page's screenshot is saved
under the test's tmp folder, and under $REPORT_SCREENSHOT_DIR when that is set.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import xarray as xr
import zarr

from cdp_browser import Browser, PageLoad
from conftest import REPO
from interp_runner.report.run_report import default_kind, write_report
from interp_runner.sweep import swept_parameters
from test_cli import interp_run

GOLDEN = sorted((REPO / "experiments" / "golden").glob("*.zarr"))
REPORT_HEADINGS = ["Summary", "Figures", "Config", "Provenance", "Arrays"]


@pytest.fixture(scope="session")
def chromium() -> str:
    if shutil.which("chromium") is None:
        proc = subprocess.run(["bash", str(REPO / "scripts" / "install_browser.sh")], capture_output=True, text=True)
        assert proc.returncode == 0, f"installing chromium failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    path = shutil.which("chromium")
    assert path is not None, "no chromium on PATH after scripts/install_browser.sh"
    return path


@pytest.fixture(scope="module")
def browser(chromium):
    with Browser(chromium) as opened:
        yield opened


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's own header (IHDR)."""
    head = Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def open_and_shoot(browser: Browser, page: Path, shot: Path) -> PageLoad:
    load = browser.open(page)
    assert load.errors == [], load.errors
    assert load.requests == [page.resolve().as_uri()], load.requests  # the page itself, nothing else
    assert load.facts["scripts"] == 0
    for image in load.facts["images"]:
        assert image["complete"] and image["naturalWidth"] > 0 and image["naturalHeight"] > 0, image
    browser.screenshot(shot)
    assert png_size(shot)[0] == browser.width and png_size(shot)[1] > 200
    if os.environ.get("REPORT_SCREENSHOT_DIR"):
        keep = Path(os.environ["REPORT_SCREENSHOT_DIR"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, keep / shot.name)
    return load


@pytest.mark.parametrize("golden", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_the_report_of_a_golden_store_reads_cleanly_in_a_browser(browser, golden, tmp_path):
    page = write_report(golden, tmp_path / f"{golden.name}.report.html")
    load = open_and_shoot(browser, page, tmp_path / f"{golden.stem}.report.png")
    experiment = dict(zarr.open_group(str(golden), mode="r").attrs)["experiment"]
    assert load.facts["h1"] == [f"{experiment['name']} v{experiment['version']}"]
    ds = xr.open_zarr(str(golden), consolidated=False)
    kind = default_kind(ds)
    assert kind is not None, f"no kind claims {golden}"
    sections = [s.title for s in kind.report_sections(ds, [])]
    assert load.facts["h2"] == ["Summary", *sections, *REPORT_HEADINGS[1:]]
    assert {"Run", "Model", "Engine", "Timings", "Package and library versions", "Host"} <= set(load.facts["h3"])


@pytest.fixture(scope="module")
def traced_sweep(tmp_path_factory) -> Path:
    """Two small causal traces on tiny_random (noise k = 1, 3) with their figures: a sweep through the real CLI, its
    jobs in two processes at once, each writing the sweep's index as it ends (~1.5 min)."""
    sweep = tmp_path_factory.mktemp("traced") / "sweep"
    proc = interp_run("-m", "hydra/launcher=parallel", "+experiment=causal_trace", "model=tiny_random", "engine=eager",
                      "causal_trace.num_facts=1", "causal_trace.noise.samples=1", "causal_trace.window=2",
                      "causal_trace.filter=false", "causal_trace.noise.k=1,3", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


@pytest.mark.engine
def test_a_run_writes_its_report_beside_the_store_with_every_figure_shown(browser, traced_sweep, tmp_path):
    store = traced_sweep / "0" / "results.zarr"
    page = traced_sweep / "0" / "results.zarr.report.html"
    assert page.is_file()
    figures = [store.parent / "results.zarr.figures" / Path(p).name
               for p in dict(zarr.open_group(str(store), mode="r").attrs)["figures"]]
    assert len(figures) >= 4 and all(f.is_file() for f in figures)
    load = open_and_shoot(browser, page, tmp_path / "causal_trace_figures.report.png")
    shown = {image["alt"]: (image["naturalWidth"], image["naturalHeight"]) for image in load.facts["images"]}
    assert shown == {f.name: png_size(f) for f in figures}  # each figure once, decoded at its own size
    assert load.facts["h2"][0] == "Summary" and load.facts["h2"][-4:] == REPORT_HEADINGS[1:]


@pytest.mark.engine
def test_the_index_of_a_real_sweep_plots_the_headline_against_the_swept_override(browser, traced_sweep, tmp_path):
    load = open_and_shoot(browser, traced_sweep / "index.html", tmp_path / "causal_trace_sweep.index.png")
    assert load.facts["links"] == ["0/results.zarr.report.html", "1/results.zarr.report.html"]
    assert [image["alt"] for image in load.facts["images"]] == ["headline against causal_trace.noise.k"]
    # the plotted numbers are the jobs' headlines, each computed here from its store
    page = (traced_sweep / "index.html").read_text()
    for num in (0, 1):
        ds = xr.open_zarr(str(traced_sweep / str(num) / "results.zarr"), consolidated=False)
        headline = default_kind(ds).headline(ds)
        assert f"{headline.value:.4g}" in page


def test_a_sweep_index_reads_cleanly_in_a_browser(browser, tmp_path):
    from test_report import FakeKind, sweep_of_stores

    from interp_runner.report.sweep_index import write_sweep_index

    jobs = sweep_of_stores(tmp_path, [1, 2, 4])
    page = write_sweep_index(tmp_path, jobs, swept_parameters(jobs), kind_for=lambda ds: FakeKind(headline_attr="score"))
    load = open_and_shoot(browser, page, tmp_path / "sweep.index.png")
    assert load.facts["h2"] == ["Jobs", "Comparison"]
    assert [image["alt"] for image in load.facts["images"]] == ["headline against causal_trace.noise.k"]
    assert load.facts["links"] == ["0/results.zarr.report.html", "1/results.zarr.report.html"]
    # the links open the jobs' reports
    linked = browser.open(tmp_path / load.facts["links"][0])
    assert linked.errors == [] and linked.facts["h2"][0] == "Summary"
