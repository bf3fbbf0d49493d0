"""Reports of stores and sweeps, read back as HTML: what they show is checked against the store itself (its zarr
metadata and attributes read directly, the figure files' bytes), with a small fake kind where the kind's own
views are concerned. The browser's view is tests/test_report_browser.py's.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import zarr
from PIL import Image

from conftest import REPO
from interp_runner.kinds.base import Headline, Section, Table
from interp_runner.report import cli as report_cli, run_report
from interp_runner.report.run_report import write_report
from interp_runner.report.sweep_index import write_index_page, write_sweep_index
from interp_runner.sweep import INDEX, record_job, swept_parameters

GOLDEN = REPO / "experiments" / "golden"
HOSTILE = "<script>alert('x')</script><img src=x onerror=alert(1)>&amp;"


class Page(HTMLParser):
    """Every tag with its attributes, the text of each heading, and each table as rows of cell texts."""

    def __init__(self, html: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.headings: dict[str, list[str]] = {"h1": [], "h2": [], "h3": []}
        self.tables: list[list[list[str]]] = []
        self.scripts: list[str] = []
        self.text: list[str] = []
        self._in: str | None = None  # the heading or cell whose text is being read
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][-1].append("")
            self._in = "cell"
        elif tag in self.headings:
            self.headings[tag].append("")
            self._in = tag
        elif tag == "script":
            self.scripts.append("")
            self._in = "script"

    def handle_endtag(self, tag):
        if tag in ("td", "th", "script", *self.headings):
            self._in = None

    def handle_data(self, data):
        if self._in == "script":
            self.scripts[-1] += data
            return
        self.text.append(data)
        if self._in == "cell":
            self.tables[-1][-1][-1] += data
        elif self._in:
            self.headings[self._in][-1] += data

    @property
    def cells(self) -> list[str]:
        return [c for table in self.tables for row in table for c in row]

    def table(self, *header: str) -> list[list[str]]:
        """The rows (header row left out) of the table whose header starts with ``header``."""
        (found,) = [t for t in self.tables if t and tuple(t[0][: len(header)]) == header]
        return found[1:]

    def words(self) -> str:
        return " ".join("".join(self.text).split())

    def all(self, tag: str) -> list[dict]:
        return [attrs for t, attrs in self.tags if t == tag]


def read_page(path: Path) -> Page:
    return Page(Path(path).read_text(encoding="utf-8"))


def png(width: int, height: int, color=(200, 40, 40)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


class FakeKind:
    """Shows some of the figures in a section of its own, and hostile text everywhere it can."""

    name = "fake"
    section = None
    report_settings = (f"settings {HOSTILE}", ("hostile",))

    def __init__(self, shown: int = 1, headline_attr: str | None = None):
        self.shown, self.headline_attr = shown, headline_attr

    def summary(self, ds):
        return [f"summary {HOSTILE}", f"requests: {ds.attrs.get('num_requests')}"]

    def report_sections(self, ds, figures):
        table = Table(f"table {HOSTILE}", ("name", "value"), (("pi", 3.14159265), ("nan", float("nan")),
                                                              (HOSTILE, np.float32(0.5))))
        return [Section(f"Fake section {HOSTILE}", f"first paragraph {HOSTILE}\n\nsecond paragraph", (table,),
                        tuple(figures[: self.shown]))]

    def headline(self, ds):
        if self.headline_attr is None:
            return None
        return Headline("p(answer)", float(ds.attrs[self.headline_attr]))

    def counts(self, ds):
        return [(f"things {HOSTILE}", 1234), ("requests twice", 2 * int(ds.attrs["num_requests"]))]


def store_copy(name: str, path: Path, **attrs) -> Path:
    shutil.copytree(GOLDEN / f"{name}.zarr", path)
    if attrs:
        zarr.open_group(str(path), mode="r+").attrs.update(attrs)
    return path


CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def assert_self_contained(page: Page, hrefs_allowed=("#",), scripts: int = 0) -> None:
    """No stylesheet link, frame or object; ``scripts`` inline scripts, each admitted by its sha256 in the CSP and
    nothing else; every src a data: URI; links only where allowed; no event handler attributes."""
    assert not [t for t, _ in page.tags if t in ("link", "iframe", "object", "embed", "base")]
    for tag, attrs in page.tags:
        if "src" in attrs:
            assert attrs["src"].startswith("data:image/"), (tag, attrs["src"][:80])
        if "href" in attrs:
            assert attrs["href"].startswith(hrefs_allowed), attrs["href"]
        assert not any(name.startswith("on") for name in attrs), (tag, attrs)
    assert [a for a in page.all("script")] == [{}] * scripts  # inline, no src or type
    hashes = "".join(f" 'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
                     for s in page.scripts)
    csp = [a["content"] for a in page.all("meta") if a.get("http-equiv") == "Content-Security-Policy"]
    assert csp == [CSP + (f"; script-src{hashes}" if scripts else "")]


# ------------------------------------------------------------------ one store


@pytest.fixture
def figured_store(tmp_path) -> tuple[Path, dict[str, bytes]]:
    """A copy of the steering golden store with three figures beside it, recorded at the path where the store
    was written first (elsewhere): the report finds them in the figures folder beside the store."""
    store = tmp_path / "run" / "results.zarr"
    figures = {"first.png": png(64, 40), "second.png": png(30, 90, (20, 90, 200)), "third.png": png(50, 50)}
    (tmp_path / "run" / "results.figures").mkdir(parents=True)
    for name, data in figures.items():
        (tmp_path / "run" / "results.figures" / name).write_bytes(data)
    store_copy("steering_smoke", store, figures=[f"/gone/elsewhere/results.figures/{n}" for n in figures])
    return store, figures


def test_every_figure_is_inline_once_with_its_exact_bytes(figured_store):
    store, figures = figured_store
    out = write_report(store, kind_for=lambda ds: FakeKind(shown=1))
    assert out == store.parent / "results.zarr.report.html"
    page = read_page(out)
    images = page.all("img")
    assert [i["alt"] for i in images] == list(figures)  # the section's figure first, then the others
    for image, data in zip(images, figures.values()):
        assert base64.b64decode(image["src"].removeprefix("data:image/png;base64,")) == data
    assert "1 figure(s) shown in the sections above; the others:" in page.words()
    assert_self_contained(page, scripts=1)


def test_a_missing_figure_or_one_that_is_no_image_is_named_and_not_shown(figured_store):
    store, _ = figured_store
    (store.parent / "results.figures" / "second.png").unlink()
    (store.parent / "results.figures" / "third.png").write_bytes(b"%PDF-1.4 not an image")
    page = read_page(write_report(store, kind_for=lambda ds: FakeKind(shown=0)))
    assert [i["alt"] for i in page.all("img")] == ["first.png"]
    text = "".join(page.text)
    assert "second.png" in text and "cannot be read" in text
    assert "third.png" in text and "not a PNG, JPEG or GIF image: not shown" in text


def test_everything_from_the_store_and_the_kind_is_escaped(tmp_path):
    store = store_copy("steering_smoke", tmp_path / "results.zarr",
                       config_yaml=f"prompts:\n  items: ['{HOSTILE}']\n", overrides=[f"x={HOSTILE}"],
                       experiment={"name": HOSTILE, "version": 1}, hostile=HOSTILE,
                       model={"path": f"/models/{HOSTILE}"})
    page = read_page(write_report(store, kind_for=lambda ds: FakeKind()))
    assert_self_contained(page, scripts=1)
    text = "".join(page.text)
    for shown in (f"summary {HOSTILE}", f"first paragraph {HOSTILE}", f"items: ['{HOSTILE}']", f"{HOSTILE} v1",
                  f"1,234 things {HOSTILE}", HOSTILE.split("/")[-1]):
        assert shown in text, shown
    assert f"Fake section {HOSTILE}" in page.headings["h2"] and f"table {HOSTILE}" in page.headings["h3"]
    assert f"settings {HOSTILE}" in page.headings["h3"] and ["hostile", HOSTILE] in page.tables[0]
    assert HOSTILE in page.cells and "3.142" in page.cells and "0.5" in page.cells


def test_provenance_and_arrays_are_those_of_the_store(tmp_path):
    store = store_copy("causal_trace", tmp_path / "trace.zarr")
    page = read_page(write_report(store, kind_for=lambda ds: None))
    assert page.headings["h2"] == ["Summary", "Figures", "Config", "Provenance", "Arrays"]
    assert "No experiment kind is known for this store" in page.words()
    group = zarr.open_group(str(store), mode="r")
    attrs = dict(group.attrs)
    for value in (attrs["model"]["weights_sha256"], attrs["package"]["git_sha"], attrs["requests_sha256"],
                  attrs["run_key"], attrs["host"]["hostname"], attrs["versions"]["vllm"], attrs["started_at"],
                  attrs["finished_at"], str(attrs["timings"]["run_s"]), str(attrs["engine"]["startup"]["total_s"])):
        assert value in page.cells, value
    assert attrs["config_yaml"] in "".join(page.text)
    # the arrays table: one row (name, role, dims, dtype) per array, as zarr's own metadata gives them
    listed = {name: (dims, dtype) for name, _, dims, dtype in page.table("name", "role", "dims", "dtype")}
    arrays = dict(group.arrays())
    assert set(listed) == set(arrays)
    for name, array in arrays.items():
        dims = ", ".join(f"{d}: {n}" for d, n in zip(array.metadata.dimension_names, array.shape)) or "scalar"
        assert listed[name][0] == dims, name
        assert listed[name][1] == ("string" if "str" in str(array.dtype).lower() else str(array.dtype)), name


def test_a_failed_store_shows_its_error_and_no_views_of_the_kind(tmp_path):
    store = store_copy("steering_smoke", tmp_path / "results.zarr", status="failed", error="KeyboardInterrupt()")
    called = []

    class Recording(FakeKind):
        def summary(self, ds):
            called.append("summary")
            return []

    page = read_page(write_report(store, kind_for=lambda ds: Recording()))
    assert called == [] and "This run is failed: KeyboardInterrupt()" in page.words()
    assert page.headings["h2"] == ["Summary", "Figures", "Config", "Provenance", "Arrays"]


# ------------------------------------------------------------------ interp-report


def test_interp_report_rebuilds_a_store_report_and_a_sweep_index(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_report, "default_kind", lambda ds: FakeKind(headline_attr="num_requests"))
    store = store_copy("steering_smoke", tmp_path / "old" / "results.zarr")
    assert report_cli.main([str(store)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "old" / "results.zarr.report.html")
    assert report_cli.main([str(store), "--out", str(tmp_path / "elsewhere.html")]) == 0
    assert read_page(tmp_path / "elsewhere.html").headings["h1"] == ["steering_smoke v1"]

    (tmp_path / INDEX).write_text(json.dumps({"jobs": [
        {"num": 0, "overrides": ["a=1"], "status": "complete", "store": "old/results.zarr"}]}))
    assert report_cli.main([str(tmp_path)]) == 0
    assert [a["href"] for a in read_page(tmp_path / "index.html").all("a")] == ["old/results.zarr.report.html"]
    assert report_cli.main([str(tmp_path), "--out", str(tmp_path / "sub" / "page.html")]) == 0
    hrefs = [a["href"] for a in read_page(tmp_path / "sub" / "page.html").all("a")]
    assert hrefs == ["../old/results.zarr.report.html"]

    (tmp_path / "notes").mkdir()
    for path in (tmp_path / "notes", tmp_path / "missing.zarr"):
        assert report_cli.main([str(path)]) == 2
        assert "is neither a store of interp-runner nor a sweep folder" in capsys.readouterr().err
    assert not (tmp_path / "notes.report.html").exists() and not (tmp_path / "missing.zarr.report.html").exists()


# ------------------------------------------------------------------ sweep index


def sweep_of_stores(tmp_path: Path, values: list, extra=("model=tiny_random",)) -> list[dict]:
    """Jobs over ``k=values`` (one job's store failed), each a golden copy whose ``score`` attribute is ``10 * k``
    (the fake kind's headline); reports written for all but the last job."""
    jobs = []
    for num, value in enumerate(values):
        store = tmp_path / str(num) / "results.zarr"
        failed = num == 1
        store_copy("steering_smoke", store, score=10.0 * float(value), **({"status": "failed"} if failed else {}))
        if num < len(values) - 1:
            write_report(store, kind_for=lambda ds: FakeKind())
        jobs.append({"num": num, "overrides": [f"causal_trace.noise.k={value}", *extra],
                     "status": "failed" if failed else "complete", "store": f"{num}/results.zarr"})
    return jobs


def test_the_sweep_index_lists_every_job_and_plots_the_headline_against_the_swept_override(tmp_path):
    jobs = sweep_of_stores(tmp_path, [3, 1, 0.5, 2])
    out = write_sweep_index(tmp_path, jobs, swept_parameters(jobs), kind_for=lambda ds: FakeKind(headline_attr="score"))
    page = read_page(out)
    assert_self_contained(page, hrefs_allowed=tuple(f"{n}/results.zarr.report.html" for n in range(3)))
    assert page.headings["h2"] == ["Jobs", "Comparison"]
    assert "every job: model=tiny_random" in page.words()
    # links: relative, to the reports that exist, each of them there
    hrefs = [a["href"] for a in page.all("a")]
    assert hrefs == ["0/results.zarr.report.html", "1/results.zarr.report.html", "2/results.zarr.report.html"]
    assert all((tmp_path / h).is_file() for h in hrefs)
    jobs_table = page.table("job", "causal_trace.noise.k", "status", "headline", "report", "store")
    assert [row[:4] for row in jobs_table] == [["0", "3", "complete", "p(answer) = 30"], ["1", "1", "failed", "—"],
                                               ["2", "0.5", "complete", "p(answer) = 5"],
                                               ["3", "2", "complete", "p(answer) = 20"]]
    # the comparison table: the complete jobs' headlines by the swept value, in its order (job 1 failed)
    assert page.table("causal_trace.noise.k", "p(answer)") == [["0.5", "5"], ["2", "20"], ["3", "30"]]
    (image,) = page.all("img")
    plot = Image.open(io.BytesIO(base64.b64decode(image["src"].removeprefix("data:image/png;base64,"))))
    assert plot.format == "PNG" and plot.width > 300 and plot.height > 200
    # one figure line's pixels at least: not a blank canvas
    assert len(plot.convert("RGB").getcolors(maxcolors=1 << 20)) > 10


def test_the_sweep_index_has_no_plot_when_jobs_differ_in_two_overrides(tmp_path):
    jobs = sweep_of_stores(tmp_path, [1, 2, 3])
    jobs[2]["overrides"][1] = "model=smollm2_135m"
    page = read_page(write_sweep_index(tmp_path, jobs, swept_parameters(jobs),
                                       kind_for=lambda ds: FakeKind(headline_attr="score")))
    assert page.all("img") == []
    assert "The jobs differ in 2 overrides (causal_trace.noise.k, model): no single parameter to plot against." \
        in page.words()
    assert page.tables[0][0][:4] == ["job", "causal_trace.noise.k", "model", "status"]


def test_record_job_writes_the_index_page_and_never_fails_a_job_for_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_report, "default_kind", lambda ds: FakeKind(headline_attr="score"))
    jobs = sweep_of_stores(tmp_path, [1, 2])
    for job in jobs:
        record_job(tmp_path, job["num"], job["overrides"], tmp_path / job["store"], job["status"],
                   on_recorded=write_index_page)
    assert [row[:2] for row in read_page(tmp_path / "index.html").table("job", "causal_trace.noise.k")] == \
        [["0", "1"], ["1", "2"]]

    def no_space(*args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr("interp_runner.report.sweep_index.write_html", no_space)
        record_job(tmp_path, 2, ["causal_trace.noise.k=3", "model=tiny_random"], None, "config_error",
                   on_recorded=write_index_page)
    assert [j["num"] for j in json.loads((tmp_path / INDEX).read_text())["jobs"]] == [0, 1, 2]
    assert "warning: the sweep's index page was not written (OSError" in capsys.readouterr().err

    def broken(ds):
        raise RuntimeError("a broken kind")

    monkeypatch.setattr(run_report, "default_kind", broken)
    record_job(tmp_path, 2, ["causal_trace.noise.k=3", "model=tiny_random"], None, "config_error",
                   on_recorded=write_index_page)
    page = read_page(tmp_path / "index.html")  # a kind that fails spoils its rows only
    assert [row[3] for row in page.table("job")] == ["RuntimeError: a broken kind", "—", "—"]
    assert page.all("img") == []


def test_the_templates_ship_with_the_package():
    import fnmatch
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "interp_runner.report" in setuptools["packages"]
    patterns = setuptools["package-data"]["interp_runner.report"]
    templates = REPO / "interp_runner" / "report" / "templates"
    names = [str(p.relative_to(templates.parent)) for p in templates.rglob("*") if p.is_file()]
    assert names and all(any(fnmatch.fnmatch(n, pattern) for pattern in patterns) for n in names), names
