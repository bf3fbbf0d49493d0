"""What a report's reader sees first and uses most, read back from the HTML and checked against the store itself
(zarr read directly, matplotlib's own colormaps): the header (model, date, kind, counts, store path, and a snippet
that opens the store), the kind's settings table, sites by name, the heatmaps' grids, folded per-fact sections,
figures named beside their heatmaps, and the size of a large trace's report. The browser's view is
tests/test_report_browser.py's.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from html import unescape
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import yaml
import zarr
from matplotlib import colormaps

from interp_runner.report.run_report import write_report
from test_report import GOLDEN, Page, assert_self_contained, png, read_page, store_copy

CMAPS = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}  # the trace figures' colours


def attrs_of(store: Path) -> dict:
    return dict(zarr.open_group(str(store), mode="r").attrs)


def arrays(store: Path) -> dict[str, np.ndarray]:
    return {name: array[...] for name, array in zarr.open_group(str(store), mode="r").arrays()}


def header(html: str) -> dict[str, str]:
    """The header's facts: <dt> name -> <dd> text."""
    block = html[html.index("<header>"): html.index("</header>")]
    return {unescape(k): " ".join(unescape(re.sub(r"<[^>]+>", "", v)).split())
            for k, v in re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", block)}


def snippet(html: str) -> str:
    return unescape(re.search(r'<pre id="open-snippet">(.*?)</pre>', html, re.S).group(1))


def kv_table(html: str, title: str) -> dict[str, str]:
    """The rows of the key-value table under the heading ``title``."""
    start = html.index(f"<h3>{title}</h3>")
    (table,) = Page(html[start: html.index("</table>", start) + 8]).tables
    return {row[0]: row[1] for row in table}


def heatmaps(page: Page) -> list[dict]:
    """Each heatmap's data attributes and the fills of its cells (the rects with no size of their own)."""
    found = []
    for tag, attrs in page.tags:
        if tag == "svg" and attrs.get("class") == "heatmap":
            found.append({**attrs, "cells": []})
        elif tag == "rect" and found and "width" not in attrs:
            found[-1]["cells"].append((int(attrs.get("y", 0)), int(attrs.get("x", 0)), attrs["fill"]))
    return found


def hex_colour(cmap: str, at: float) -> str:
    return "#%02x%02x%02x" % tuple(int(round(c * 255)) for c in colormaps[cmap](at)[:3])


@pytest.fixture
def trace(tmp_path) -> Path:
    return store_copy("causal_trace", tmp_path / "runs" / "trace.zarr")


def test_the_header_names_model_date_kind_counts_and_store_and_its_snippet_opens_the_store(trace):
    html = write_report(trace).read_text()
    attrs, data = attrs_of(trace), arrays(trace)
    facts = header(html)
    assert facts["model"] == f"{Path(attrs['model']['path']).name} ({attrs['model']['architecture']}, " \
                             f"{attrs['model']['num_layers']} layers, {attrs['model']['dtype']})"
    started, finished = (datetime.fromisoformat(attrs[k]) for k in ("started_at", "finished_at"))
    assert facts["date"] == f"{started:%Y-%m-%d %H:%M:%S} UTC, took {(finished - started).seconds} s"
    assert facts["kind"] == "causal_trace complete"
    # a cell: one (component, layer, token) of a fact's prompt
    cells = data["component"].size * data["layer"].size * int(data["num_tokens"].sum())
    assert facts["covers"] == (f"{attrs['num_requests']} requests · {data['fact_id'].size} facts · {cells} cells · "
                               "1 noise sample")
    assert facts["store"] == str(trace)
    # the snippet, run as written, opens this very store
    scope: dict = {}
    exec(snippet(html), scope)
    assert isinstance(scope["ds"], xr.Dataset) and scope["ds"].attrs["run_key"] == attrs["run_key"]
    np.testing.assert_array_equal(scope["ds"]["restored_prob"].values, data["restored_prob"])


def test_a_report_rendered_while_its_store_is_staged_names_where_the_store_goes(tmp_path):
    staged = store_copy("steering_smoke", tmp_path / ".results.zarr.partial" / "results.zarr")
    html = write_report(staged, tmp_path / "page.html").read_text()
    assert header(html)["store"] == str(tmp_path / "results.zarr")
    assert json.dumps(str(tmp_path / "results.zarr")) in snippet(html)


def test_trace_settings_have_their_own_table_and_leave_other_attributes(trace):
    html = write_report(trace).read_text()
    attrs = attrs_of(trace)
    config = yaml.safe_load(attrs["config_yaml"])["causal_trace"]
    settings = kv_table(html, "Trace settings")

    def shown(value) -> str:  # a table cell: floats to 4 significant digits, lists comma-joined
        if isinstance(value, list):
            return ", ".join(map(shown, value))
        return "yes" if value is True else "no" if value is False else f"{value:.4g}" if isinstance(value, float) \
            else str(value)

    for key, value in config.items():  # the config section, every key of it
        if isinstance(value, dict):
            assert {k: settings[f"{key}.{k}"] for k in value} == {k: shown(v) for k, v in value.items()}, key
        else:
            assert settings[key] == shown(value), key
    assert settings["corruption"] == "noise" and settings["window"] == str(attrs["window"]) == "2"
    assert (settings["noise.k"], settings["noise.samples"], settings["noise.seed"]) == ("3", "1", "0")
    assert settings["noise_std"] == f"{attrs['noise_std']:.4g}" and settings["noise_floor"] == "0"
    assert settings["filtered_facts"] == settings["voided"] == "—"
    assert "noise_samples" not in settings  # noise.samples says it
    other = kv_table(html, "Other attributes")
    assert not {"window", "corruption", "noise_std", "noise_samples", "noise_floor", "filtered_facts", "voided",
                "nonfinite", "skipped_positions"} & set(other), other


def test_sites_are_named_by_layer_and_hook(tmp_path):
    store = store_copy("steering_smoke", tmp_path / "s.zarr")
    assert attrs_of(store)["plugin"]["steer_sites"] == [0, 4, 5, 8, 10, 13, 15]
    html = write_report(store).read_text()
    plugin = kv_table(html, "Plugin and seeds")
    # site = layer * 5 + hook, hooks pre_attn, attn_out, post_attn, mlp_out, post_block (by hand)
    assert plugin["plugin.steer_sites"] == ("L0.pre_attn, L0.post_block, L1.pre_attn, L1.mlp_out, L2.pre_attn, "
                                            "L2.mlp_out, L3.pre_attn")
    engine = kv_table(html, "Engine")
    assert engine["plugin_status.steer_sites"] == plugin["plugin.steer_sites"]
    assert engine["plugin_status.patch_sites"] == "—"
    assert "0, 4, 5, 8" not in html


def test_trace_heatmaps_hold_the_stores_grids_coloured_as_the_figures(trace):
    page = read_page(write_report(trace))
    data = arrays(trace)
    components = [str(k) for k in data["component"]]
    found = heatmaps(page)
    assert len(found) == len(components) * (1 + data["fact_id"].size)  # the average, then each fact's
    layers = [str(layer) for layer in data["layer"]]
    for f in range(data["fact_id"].size):
        n, start, end = int(data["num_tokens"][f]), int(data["subject_start"][f]), int(data["subject_end"][f])
        tokens = [t + ("*" if start <= i < end else "") for i, t in enumerate(data["token_text"][f, :n])]
        for k, component in enumerate(components):
            shown = found[len(components) * (1 + f) + k]
            grid = data["restored_prob"][f, k, :, :n].T.astype(np.float64)  # (token, layer)
            assert json.loads(shown["data-rows"]) == tokens and json.loads(shown["data-cols"]) == layers
            assert shown["data-values"].split(",") == [f"{v:.6g}" for v in grid.ravel()]
            assert shown["data-value-name"] == f"p({str(data['answer'][f]).strip()})"
            assert float(shown["data-baseline"]) == float(data["corrupt_prob"][f])
            fills = {(r, c): fill for r, c, fill in shown["cells"]}
            assert sorted(fills) == [(r, c) for r in range(n) for c in range(len(layers))]
            # the scale runs from the corrupted run's p up to the largest restored p, as in the PNG
            top = np.unravel_index(np.argmax(grid), grid.shape)
            assert fills[top] == hex_colour(CMAPS[component], 1.0)
            low = np.argwhere(grid <= data["corrupt_prob"][f])
            assert all(fills[tuple(at)] == hex_colour(CMAPS[component], 0.0) for at in low)
    average = found[0]
    assert json.loads(average["data-rows"]) == [str(r) for r in data["role"]]
    assert average["data-values"].split(",") == [f"{v:.6g}" for v in data["avg_indirect_effect"][0].T.ravel()]


def test_each_facts_section_is_folded_and_the_trace_section_is_not(trace):
    html = write_report(trace).read_text()
    for fact_id in arrays(trace)["fact_id"]:
        anchor = "fact-" + re.sub(r"[^a-z0-9]+", "-", str(fact_id).lower())
        assert re.search(rf'<section id="{anchor}" class="folded">\s*<details class="fold">\s*<summary><h2>'
                         rf"Fact {fact_id}</h2>", html), fact_id
    assert re.search(r'<section id="causal-trace">\s*<h2>Causal trace</h2>', html)
    assert "<details class=\"fold\" open" not in html
    assert '<button type="button" data-fold="open">Open all</button>' in html


def test_figures_drawn_as_heatmaps_are_named_not_embedded_and_the_others_shown(trace):
    data = arrays(trace)
    folder = trace.parent / "trace.zarr.figures"
    folder.mkdir()
    names = [f"trace_{f}_{c}.png" for f in data["fact_id"] for c in data["component"]]
    names += ["average_indirect_effect.png", "extra.png"]
    for name in names:
        (folder / name).write_bytes(png(20, 10))
    zarr.open_group(str(trace), mode="r+").attrs["figures"] = [f"/elsewhere/trace.zarr.figures/{n}" for n in names]
    page = read_page(write_report(trace))
    assert [image["alt"] for image in page.all("img")] == ["extra.png"]
    words = page.words()
    for name in names[:-1]:
        assert f"PNG: trace.zarr.figures/{name}" in words, name
    assert f"{len(names) - 1} figure(s) drawn above as interactive heatmaps; their PNGs are in trace.zarr.figures/." \
        in words
    assert_self_contained(page, scripts=1)


def test_a_24_fact_full_trace_report_stays_small(tmp_path):
    """causal_trace_full's shape on a 30-layer model: 24 facts x 3 components x 30 layers x 12 tokens (25,920 cells)."""
    golden = xr.open_zarr(str(GOLDEN / "causal_trace.zarr"), consolidated=False).load()
    F, L, T = 24, 30, 12
    rng = np.random.default_rng(0)
    ds = golden.isel(fact=np.arange(F) % 2, layer=np.arange(L) % 2)
    ds = ds.assign_coords(fact_id=("fact", np.array([f"fact_{i}" for i in range(F)], dtype=np.dtypes.StringDType())),
                          layer=np.arange(L, dtype=np.int32))
    ds = ds.isel(token=np.arange(T) % ds.sizes["token"]).drop_vars([v for v in ds.data_vars if "sample" in ds[v].dims])
    grid = ds["restored_prob"].dims
    ds["restored_prob"] = (grid, rng.uniform(0, 1, ds["restored_prob"].shape).astype(np.float32))
    ds["num_tokens"] = ("fact", np.full(F, T, np.int32))
    store = tmp_path / "full.zarr"
    ds.attrs["noise_samples"] = 10
    ds.to_zarr(str(store), zarr_format=3, consolidated=False)
    out = write_report(store)
    assert out.read_text().count('<svg class="heatmap"') == 3 * (F + 1)
    size = out.stat().st_size
    assert size < 1_600_000, size  # ~60 bytes a cell; the PNGs it replaces took ~3.5 MB


def test_a_kinds_heatmap_escapes_its_labels_and_shows_no_value_as_such(tmp_path):
    from interp_runner.kinds.base import Heatmap, Section
    from test_report import HOSTILE, FakeKind

    values = np.array([[0.0, np.nan], [0.5, 1.0]])

    class Drawing(FakeKind):
        def report_sections(self, ds, figures):
            heatmap = Heatmap(f"map {HOSTILE}", values, (HOSTILE, "b"), ("0", HOSTILE), HOSTILE, "col", "v",
                              "Greys")
            return [Section(f"one {HOSTILE}", "text", heatmaps=(heatmap,), folded=True)]

    store = store_copy("steering_smoke", tmp_path / "s.zarr")
    page = read_page(write_report(store, kind_for=lambda ds: Drawing()))
    assert_self_contained(page, scripts=1)
    (shown,) = heatmaps(page)
    assert json.loads(shown["data-rows"]) == [HOSTILE, "b"] and json.loads(shown["data-cols"]) == ["0", HOSTILE]
    assert (shown["data-row-name"], shown["aria-label"]) == (HOSTILE, f"map {HOSTILE}")
    assert shown["data-values"] == "0,,0.5,1"
    fills = {(r, c): fill for r, c, fill in shown["cells"]}
    assert fills == {(0, 0): hex_colour("Greys", 0.0), (0, 1): "#eeeeee", (1, 0): hex_colour("Greys", 0.5),
                     (1, 1): hex_colour("Greys", 1.0)}
    assert HOSTILE in "".join(page.text) and f"one {HOSTILE}" in page.headings["h2"]
