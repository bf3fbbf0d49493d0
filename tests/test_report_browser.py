"""Reports as a person sees them: opened in headless Chromium (Debian's package, installed by
scripts/install_browser.sh when missing; never skipped), with no console error, exception or request beyond the
page itself, every image decoded at its file's size, and the expected headings; and used as a person would, with
real mouse events: hovering a heatmap's cell shows its layer, token and value (checked against the store read with
zarr), folded sections open and close, the copy button puts the snippet on the clipboard, and nothing of it logs
an error or makes a request. Each page's screenshot is saved under the test's tmp folder, and under
$REPORT_SCREENSHOT_DIR when that is set.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import xarray as xr
import zarr

from support.cdp_browser import Browser, PageLoad
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


def open_and_shoot(browser: Browser, page: Path, shot: Path, scripts: int = 0) -> PageLoad:
    """Open ``page`` (a report has one inline script, an index none), check it loaded cleanly, screenshot it."""
    load = browser.open(page)
    assert load.errors == [], load.errors
    assert load.requests == [page.resolve().as_uri()], load.requests  # the page itself, nothing else
    assert load.facts["scripts"] == scripts and load.facts["script_srcs"] == []
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
    load = open_and_shoot(browser, page, tmp_path / f"{golden.stem}.report.png", scripts=1)
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
def test_a_run_writes_its_report_beside_the_store_naming_every_figure_beside_its_heatmap(browser, traced_sweep,
                                                                                         tmp_path):
    store = traced_sweep / "0" / "results.zarr"
    page = traced_sweep / "0" / "results.zarr.report.html"
    assert page.is_file()
    figures = [store.parent / "results.zarr.figures" / Path(p).name
               for p in dict(zarr.open_group(str(store), mode="r").attrs)["figures"]]
    assert len(figures) >= 4 and all(f.is_file() and png_size(f)[0] > 100 for f in figures)
    load = open_and_shoot(browser, page, tmp_path / "causal_trace_figures.report.png", scripts=1)
    # every figure is a grid the page draws as an interactive heatmap: named there, not embedded again
    assert load.facts["images"] == []
    captions = browser.evaluate("Array.from(document.querySelectorAll('figure.hm figcaption code'))"
                                ".map(c => c.textContent)")
    assert set(captions) == {f"results.zarr.figures/{f.name}" for f in figures}
    ds = xr.open_zarr(str(store), consolidated=False)
    assert browser.evaluate("document.querySelectorAll('svg.heatmap').length") == \
        ds.sizes["component"] * (1 + int((~ds["filtered"]).sum()))
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
    load = open_and_shoot(browser, page, tmp_path / "sweep.index.png")  # no script
    assert load.facts["h2"] == ["Jobs", "Comparison"]
    assert [image["alt"] for image in load.facts["images"]] == ["headline against causal_trace.noise.k"]
    assert load.facts["links"] == ["0/results.zarr.report.html", "1/results.zarr.report.html"]
    # the links open the jobs' reports
    linked = browser.open(tmp_path / load.facts["links"][0])
    assert linked.errors == [] and linked.facts["h2"][0] == "Summary"


# ------------------------------------------------------------------ using a report


@pytest.fixture(scope="module")
def trace_page(tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the causal-trace golden store and its report beside it."""
    store = tmp_path_factory.mktemp("trace") / "trace.zarr"
    shutil.copytree(REPO / "experiments" / "golden" / "causal_trace.zarr", store)
    return store, write_report(store)


def centre(browser: Browser, selector: str, index: int = 0, inner: str | None = None,
           inner_index: int = 0) -> tuple[float, float]:
    """The viewport point at the centre of the ``index``-th element matching ``selector`` (or of the
    ``inner_index``-th element in it matching ``inner``), scrolled into view."""
    return tuple(browser.evaluate(f"""(() => {{
        let element = document.querySelectorAll({json.dumps(selector)})[{index}];
        if ({json.dumps(inner)}) element = element.querySelectorAll({json.dumps(inner)})[{inner_index}];
        element.scrollIntoView({{block: "center", inline: "center"}});
        const box = element.getBoundingClientRect();
        return [box.x + box.width / 2, box.y + box.height / 2];
    }})()"""))


TOOLTIP = """(() => {
    const tip = document.getElementById("hm-tip"), box = tip.getBoundingClientRect();
    return {hidden: tip.hidden, display: getComputedStyle(tip).display, text: tip.textContent,
            x: box.x, y: box.y, width: box.width, height: box.height};
})()"""


def test_hovering_a_heatmap_cell_shows_its_layer_token_and_value(browser, trace_page):
    store, page = trace_page
    group = zarr.open_group(str(store), mode="r")
    data, window = {name: array[...] for name, array in group.arrays()}, group.attrs["window"]
    assert browser.open(page).errors == []
    browser.mouse(*centre(browser, "section.folded summary"), click=True)  # open the first fact's section
    components, layers = [str(c) for c in data["component"]], [int(x) for x in data["layer"]]
    n, corrupt, answer = int(data["num_tokens"][0]), float(data["corrupt_prob"][0]), str(data["answer"][0]).strip()
    subject = range(int(data["subject_start"][0]), int(data["subject_end"][0]))
    for c, component in enumerate(components):
        svg = len(components) + c  # after the trace section's average heatmaps, one per component
        for token, layer in ((0, 0), (n - 1, len(layers) - 1), (n // 2, len(layers) // 2)):
            # a heatmap's cells, row (token) by row
            x, y = centre(browser, "svg.heatmap", svg, ".hm-cells rect", token * len(layers) + layer)
            browser.mouse(x, y)
            tip = browser.evaluate(TOOLTIP)
            assert not tip["hidden"] and tip["display"] != "none" and tip["width"] > 0 and tip["height"] > 0, tip
            assert abs(tip["x"] - x) < tip["width"] + 40 and abs(tip["y"] - y) < tip["height"] + 40, (tip, x, y)
            lines = dict(line.split(": ", 1) for line in tip["text"].split("\n"))
            column = "layer" if component == "resid" else f"layer (centre of {window} restored)"
            assert list(lines) == [column, "token", f"p({answer})", "indirect effect"], lines
            assert lines[column] == str(layers[layer])
            assert lines["token"] == str(data["token_text"][0, token]) + ("*" if token in subject else "")
            value = float(data["restored_prob"][0, c, layer, token])
            assert float(lines[f"p({answer})"]) == pytest.approx(value, rel=1e-3)
            assert float(lines["indirect effect"]) == pytest.approx(value - corrupt, rel=2e-3, abs=abs(value) * 1e-5)
    browser.mouse(2, 2)  # off every heatmap: the tooltip goes
    assert browser.evaluate(TOOLTIP)["hidden"] is True
    after = browser.settle()
    assert after.errors == [] and after.requests == []


def test_folded_sections_open_and_close_by_their_titles_and_all_at_once(browser, trace_page):
    store, page = trace_page
    facts = zarr.open_group(str(store), mode="r")["fact_id"][...]
    assert browser.open(page).errors == []
    state = "Array.from(document.querySelectorAll('details.fold')).map(d => d.open)"
    shown = "Array.from(document.querySelectorAll('section.folded svg.heatmap')).map(s => s.checkVisibility())"
    per_fact = len(browser.evaluate(shown)) // len(facts)
    assert browser.evaluate(state) == [False] * len(facts)  # 2 facts: each section folded
    assert browser.evaluate(shown) == [False] * per_fact * len(facts)  # and its heatmaps hidden
    browser.mouse(*centre(browser, "section.folded summary h2"), click=True)
    assert browser.evaluate(state) == [True] + [False] * (len(facts) - 1)
    assert browser.evaluate(shown) == [True] * per_fact + [False] * per_fact * (len(facts) - 1)
    browser.mouse(*centre(browser, "section.folded summary h2"), click=True)
    assert browser.evaluate(state) == [False] * len(facts)
    browser.mouse(*centre(browser, "button[data-fold=open]"), click=True)
    assert browser.evaluate(state) == [True] * len(facts)
    browser.mouse(*centre(browser, "button[data-fold=close]"), click=True)
    assert browser.evaluate(state) == [False] * len(facts)
    after = browser.settle()
    assert after.errors == [] and after.requests == []


def test_the_copy_button_puts_the_snippet_that_opens_the_store_on_the_clipboard(browser, trace_page):
    store, page = trace_page
    assert browser.open(page).errors == []
    browser.mouse(*centre(browser, "button[data-copy]"), click=True)
    assert browser.evaluate("navigator.clipboard.readText()") == \
        f'import xarray as xr\nds = xr.open_zarr("{store}", consolidated=False)'
    assert browser.evaluate("document.querySelector('button[data-copy]').textContent") == "Copied"
    after = browser.settle()
    assert after.errors == [] and after.requests == []
