"""The report of one store: ``<name>.report.html`` beside it (``StoreTarget.report``), one static HTML file.

Its header names the model, the run's date, its kind, what it covered (``Kind.counts``) and the store's path, with
a snippet that opens the store in xarray. Then the run's summary (the kind's lines) and settings table
(``Kind.report_settings``), the kind's own sections (interactive heatmaps: ``heatmap``; many alike folded), every
figure of the store not drawn as a heatmap inline, the resolved config, the provenance manifest as tables (sites by
name: ``L5.post_attn``), and the store's arrays. Only the store (and its figures folder) is read, so a report can
be rebuilt for any store, old ones included (``interp-report STORE``).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import xarray as xr
import yaml

from interp_runner.kinds.base import Heatmap, Kind, Section
from interp_runner.store.result_flags import nonfinite_lines
from interp_runner.sites import site_of
from interp_runner.store.claim import StoreTarget
from interp_runner.store.read import open_dataset
from interp_runner.report.heatmap import svg
from interp_runner.report.render import cell, figure_entry, flatten, page_script, render, write_html

# manifest keys -> the table showing them (in this order); the rest goes under "Other attributes"
MANIFEST_TABLES = (
    ("Run", ("experiment", "kind", "status", "error", "started_at", "resumed_at", "finished_at", "run_key",
             "config_sha256", "requests_sha256", "num_requests", "command", "overrides", "experiments_dir",
             "schema")),
    ("Model", ("model",)),
    ("Engine", ("engine",)),
    ("Timings", ("timings",)),
    ("Package and library versions", ("package", "versions")),
    ("Host", ("host",)),
    ("Plugin and seeds", ("plugin", "seeds")),
)
NOT_TABLED = ("config_yaml", "figures")  # shown in their own sections
SUMMARY_SHOWN = 16  # summary lines shown unfolded, when many more follow
LOAD_BYTES = 64 << 20  # arrays up to this size are read into memory at once (captures stay on the disk)


def default_kind(ds: xr.Dataset) -> Kind | None:
    """The kind that wrote ``ds`` (None for a kind this version lacks)."""
    from interp_runner.kinds import kind_of_store

    try:
        return kind_of_store(dict(ds.attrs))
    except LookupError:
        return None


def write_report(store_path: Path, out_path: Path | None = None, *,
                 kind_for: Callable[[xr.Dataset], Kind | None] | None = None) -> Path:
    """Render the report of the store at ``store_path`` into ``out_path`` (default: beside the store); the kind
    that wrote it comes from ``kind_for`` (default: the registry's)."""
    store_path = Path(store_path)
    out_path = Path(out_path) if out_path is not None else StoreTarget.at(store_path).report
    ds = open_dataset(store_path)  # UnreadableStore names an array zarr cannot load
    for var in ds.variables.values():  # the kind's views read small arrays many times: once from the disk
        if var.nbytes <= LOAD_BYTES:
            var.load()
    kind = (kind_for or default_kind)(ds)
    return write_html(out_path, render("report.html", **report_context(ds, store_path, kind)))


def published_path(store_path: Path) -> Path:
    """Where the store is for its readers: a run renders the report of its store while it is staged
    (``StoreTarget.staged``: ``<parent>/.<name>.partial/<name>``), then moves both to ``<parent>/<name>``."""
    target = StoreTarget.at(store_path)
    staged = target.path.parent
    if staged.name == f".{target.path.name}.partial":
        return staged.parent / target.path.name
    return target.path


def report_context(ds: xr.Dataset, store_path: Path, kind: Kind | None) -> dict:
    attrs = dict(ds.attrs)
    status, kind_name, writer = attrs.get("status"), getattr(kind, "name", None), kind
    if status != "complete":  # arrays may be missing: the kind's views are for complete stores
        kind = None
    anchors = Anchors()
    figures = [figure_path(store_path, p) for p in attrs.get("figures") or []]
    summary = list(kind.summary(ds)) if kind is not None else []
    fold_at = SUMMARY_SHOWN if len(summary) > SUMMARY_SHOWN + 4 else len(summary)
    sections = [section_context(s, anchors) for s in (kind.report_sections(ds, figures) if kind else [])]
    shown = {f["path"] for s in sections for f in s["figures"]}
    drawn = {h["figure"] for s in sections for h in s["heatmaps"] if h["figure"] is not None} - shown
    experiment = attrs.get("experiment") or {}
    published = published_path(store_path)
    settings_title, settings_attrs = getattr(writer, "report_settings", ("Settings", ()))
    return {
        "title": f"{experiment.get('name', 'run')} v{experiment.get('version', '?')}",
        "store_name": store_path.name,
        "store_path": str(published),
        "snippet": f"import xarray as xr\nds = xr.open_zarr({json.dumps(str(published))}, consolidated=False)",
        "model": model_line(attrs.get("model")),
        "date": date_line(attrs),
        "counts": [f"{n:,} {singular(what) if n == 1 else what}" for what, n in counts(attrs, ds, kind)],
        "kind_name": kind_name,
        "status": status,
        "error": attrs.get("error"),
        "summary": summary[:fold_at],
        "summary_more": summary[fold_at:],
        "warnings": nonfinite_lines(attrs) if kind is not None else [],
        "settings": {"title": settings_title, "rows": settings_rows(attrs, getattr(writer, "section", None),
                                                                    settings_attrs)},
        "sections": [s for s in sections if not s["folded"]],
        "folded": [s for s in sections if s["folded"]],
        "folded_anchor": "folded",
        "figures": [figure_context(p, anchors) for p in figures if p not in shown and p not in drawn],
        "figures_in_sections": sum(p in shown for p in figures),
        "figures_drawn": sum(p in drawn for p in figures),
        "figures_folder": StoreTarget.at(published).figures.name,
        "figures_anchor": anchors.new("Figures"),
        "script": page_script(),
        "config_yaml": attrs.get("config_yaml"),
        "provenance": manifest_tables(attrs, settings_attrs),
        "arrays": array_rows(ds),
    }


def model_line(model) -> dict:
    """The model's name (its folder's) and what the manifest says of it."""
    if not isinstance(model, dict):
        return {"name": str(model) if model else "—", "details": ""}
    name = Path(str(model.get("name") or model.get("path") or "—")).name
    details = [str(model[k]) for k in ("architecture", "dtype") if model.get(k)]
    if model.get("num_layers"):
        details.insert(1, f"{model['num_layers']} layers")
    return {"name": name, "details": ", ".join(details)}


def date_line(attrs: dict) -> str:
    """When the run started (UTC), and how long it took where it finished."""
    try:
        started = datetime.fromisoformat(attrs["started_at"])
    except (KeyError, TypeError, ValueError):
        return "—"
    zone = "UTC" if started.utcoffset() == timedelta(0) else started.strftime("%z")
    line = f"{started:%Y-%m-%d %H:%M:%S} {zone}".rstrip()
    try:
        seconds = (datetime.fromisoformat(attrs["finished_at"]) - started).total_seconds()
    except (KeyError, TypeError, ValueError):
        return line
    return f"{line}, took {seconds:.0f} s" if seconds < 120 else f"{line}, took {seconds / 60:.1f} min"


def counts(attrs: dict, ds: xr.Dataset, kind: Kind | None) -> list[tuple[str, int]]:
    requests = [("requests", int(attrs["num_requests"]))] if isinstance(attrs.get("num_requests"), int) else []
    return requests + (list(kind.counts(ds)) if kind is not None else [])


def singular(what: str) -> str:
    """ "noise samples" -> "noise sample", "patched copies" -> "patched copy" (counts are named in the plural)."""
    if what.endswith("ies"):
        return what[:-3] + "y"
    return what[:-1] if what.endswith("s") else what


def settings_rows(attrs: dict, section: str | None, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """The kind's config section (from ``config_yaml``), then the root attributes ``names`` it does not repeat."""
    try:
        config = yaml.safe_load(attrs.get("config_yaml") or "") or {}
    except yaml.YAMLError:
        config = {}
    chosen = config.get(section) if section and isinstance(config, dict) else None
    rows = flatten(chosen) if isinstance(chosen, dict) else []
    given = {key.replace(".", "_") for key, _ in rows}
    rows += [(name, attrs[name]) for name in names if name in attrs and name not in given]
    return [(key, cell(value)) for key, value in rows]


def site_names(key: str, value):
    """Site ids (``sites``) of a manifest key ending in ``_sites`` as names: [12] -> ["L2.post_attn"]."""
    if key.endswith("_sites") and isinstance(value, list) and all(type(v) is int and v >= 0 for v in value):
        return [f"L{layer}.{hook}" for layer, hook in map(site_of, value)]
    return value


def figure_path(store_path: Path, recorded: str) -> Path:
    """Where a figure the store lists is now: in the figures folder beside the store (which moves with it, and
    holds the figures while a run stages its store), else where it was recorded."""
    recorded = Path(recorded)
    beside = store_path.parent / recorded.parent.name / recorded.name
    return beside if beside.exists() or not recorded.exists() else recorded


def section_context(section: Section, anchors: Anchors) -> dict:
    return {
        "title": section.title,
        "anchor": anchors.new(section.title),
        "folded": section.folded,
        "paragraphs": [p.strip() for p in re.split(r"\n\s*\n", section.text) if p.strip()],
        "tables": [{"title": t.title, "columns": list(t.columns), "rows": [list(r) for r in t.rows]}
                   for t in section.tables],
        "heatmaps": [heatmap_context(h, anchors) for h in section.heatmaps],
        "figures": [figure_context(Path(p), anchors) for p in section.figures],
    }


def heatmap_context(heatmap: Heatmap, anchors: Anchors) -> dict:
    figure = Path(heatmap.figure) if heatmap.figure is not None else None  # one of the store's (``figure_path``)
    return {"title": heatmap.title, "anchor": anchors.new(f"heatmap {heatmap.title}"), "svg": svg(heatmap),
            "figure": figure, "figure_name": f"{figure.parent.name}/{figure.name}" if figure else None}


def figure_context(path: Path, anchors: Anchors) -> dict:
    return {**figure_entry(path, anchors.new(f"figure {path.stem}")), "path": path}


def manifest_tables(attrs: dict, settings: tuple[str, ...] = ()) -> list[dict]:
    """The manifest as (title, rows of (key, value text)) tables; ``settings`` (the kind's settings table shows
    them) left out."""
    tables, seen = [], {*NOT_TABLED, *settings}
    for title, keys in (*MANIFEST_TABLES, ("Other attributes", tuple(k for k in attrs if k not in
                                                                     {k for _, ks in MANIFEST_TABLES for k in ks}))):
        rows = []
        for key in keys:
            if key not in attrs or key in seen:
                continue
            seen.add(key)
            value = attrs[key]
            if key in ("command", "overrides") and isinstance(value, list):
                value = shlex.join(str(v) for v in value) or "—"
            # a table of one key needs no prefix: "path" in "Model", not "model.path"
            rows += [(name, cell(site_names(name, v))) for name, v in flatten(value, "" if len(keys) == 1 else key)]
        if rows:
            tables.append({"title": title, "rows": rows})
    return tables


def array_rows(ds: xr.Dataset) -> list[dict]:
    """Data variables, then coordinates: name, dims with sizes, dtype."""
    rows = []
    for role, names in (("data", sorted(ds.data_vars)), ("coordinate", sorted(ds.coords))):
        for name in names:
            var = ds[name].variable
            dtype = "string" if var.dtype.kind in "TUSO" else str(var.dtype)
            rows.append({"name": str(name), "role": role, "dtype": dtype,
                         "dims": ", ".join(f"{d}: {n}" for d, n in zip(var.dims, var.shape)) or "scalar"})
    return rows


class Anchors:
    """Unique HTML ids from titles."""

    def __init__(self, reserved=("summary", "config", "provenance", "arrays", "folded", "hm-tip", "open-snippet")):
        self.used: set[str] = set(reserved)  # ids the template itself uses

    def new(self, title: str) -> str:
        base = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "section"
        anchor, n = base, 1
        while anchor in self.used:
            n += 1
            anchor = f"{base}-{n}"
        self.used.add(anchor)
        return anchor
