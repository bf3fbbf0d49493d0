"""The report of one store: ``<name>.report.html`` beside it (``StoreTarget.report``), one static HTML file.

It shows the run's summary (the kind's lines), the kind's own sections, every figure of the store inline, the
resolved config, the provenance manifest as tables, and the store's arrays. Only the store (and its figures
folder) is read, so a report can be rebuilt for any store, old ones included (``interp-report STORE``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

import xarray as xr

from ..kinds.base import Kind, Section
from ..result_flags import nonfinite_lines
from ..store_claim import StoreTarget
from ..store_read import open_dataset
from .render import cell, figure_entry, flatten, render, write_html

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


def default_kind(ds: xr.Dataset) -> Kind | None:
    """The kind that wrote ``ds`` (None for a kind this version lacks)."""
    from ..kinds import kind_of_store

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
    kind = (kind_for or default_kind)(ds)
    return write_html(out_path, render("report.html", **report_context(ds, store_path, kind)))


def report_context(ds: xr.Dataset, store_path: Path, kind: Kind | None) -> dict:
    attrs = dict(ds.attrs)
    status, kind_name = attrs.get("status"), getattr(kind, "name", None)
    if status != "complete":  # arrays may be missing: the kind's views are for complete stores
        kind = None
    anchors = Anchors()
    figures = [figure_path(store_path, p) for p in attrs.get("figures") or []]
    summary = [*kind.summary(ds), *nonfinite_lines(attrs)] if kind is not None else []
    sections = [section_context(s, anchors) for s in (kind.report_sections(ds, figures) if kind else [])]
    shown = {f["path"] for s in sections for f in s["figures"]}
    experiment = attrs.get("experiment") or {}
    return {
        "title": f"{experiment.get('name', 'run')} v{experiment.get('version', '?')}",
        "store_name": store_path.name,
        "kind_name": kind_name,
        "status": status,
        "error": attrs.get("error"),
        "summary": summary,
        "sections": sections,
        "figures": [figure_context(p, anchors) for p in figures if p not in shown],
        "figures_in_sections": sum(p in shown for p in figures),
        "figures_anchor": anchors.new("Figures"),
        "config_yaml": attrs.get("config_yaml"),
        "provenance": manifest_tables(attrs),
        "arrays": array_rows(ds),
    }


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
        "paragraphs": [p.strip() for p in re.split(r"\n\s*\n", section.text) if p.strip()],
        "tables": [{"title": t.title, "columns": list(t.columns), "rows": [list(r) for r in t.rows]}
                   for t in section.tables],
        "figures": [figure_context(Path(p), anchors) for p in section.figures],
    }


def figure_context(path: Path, anchors: Anchors) -> dict:
    return {**figure_entry(path, anchors.new(f"figure {path.stem}")), "path": path}


def manifest_tables(attrs: dict) -> list[dict]:
    """The manifest as (title, rows of (key, value text)) tables."""
    tables, seen = [], set(NOT_TABLED)
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
            rows += [(name, cell(v)) for name, v in flatten(value, "" if len(keys) == 1 else key)]
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

    def __init__(self, reserved=("summary", "config", "provenance", "arrays")):
        self.used: set[str] = set(reserved)  # ids the template itself uses

    def new(self, title: str) -> str:
        base = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "section"
        anchor, n = base, 1
        while anchor in self.used:
            n += 1
            anchor = f"{base}-{n}"
        self.used.add(anchor)
        return anchor
