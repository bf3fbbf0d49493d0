"""The index page of a sweep: ``<sweep dir>/index.html``, one row per job (its swept overrides, status, headline
and a link to its report), and, when the jobs differ in exactly one override, each kind's headline against it as
a line plot. Takes the jobs as ``sweep.json`` lists them; ``interp_runner.sweep`` rewrites it as each job ends.
"""

from __future__ import annotations

import io
import math
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import xarray as xr

from interp_runner.kinds.base import Kind
from interp_runner.store.claim import StoreTarget
from interp_runner.store.read import open_dataset
from interp_runner.report.render import image_data_uri, render, write_html
from interp_runner.report import run_report
from interp_runner.sweep import read_jobs, swept_parameters

INDEX_PAGE = "index.html"


def write_sweep_index(sweep_dir: Path, jobs: list[dict], swept: dict[str, list], out_path: Path | None = None, *,
                      kind_for: Callable[[xr.Dataset], Kind | None] | None = None) -> Path:
    """Render ``out_path`` (default ``<sweep_dir>/index.html``) for ``jobs`` (``sweep.json``'s entries) and
    ``swept`` (override key -> each job's value, ``sweep.swept_parameters``)."""
    sweep_dir = Path(sweep_dir)
    out_path = Path(out_path) if out_path is not None else sweep_dir / INDEX_PAGE
    kind_for = kind_for or run_report.default_kind
    rows = [job_row(sweep_dir, job, {k: values[i] for k, values in swept.items()}, out_path.parent, kind_for)
            for i, job in enumerate(jobs)]
    swept_keys = set(swept)
    common = sorted({o for job in jobs for o in job["overrides"]
                     if o.split("=", 1)[0] not in swept_keys and all(o in j["overrides"] for j in jobs)})
    comparison = comparison_context(next(iter(swept)), rows) if len(swept) == 1 else None
    html = render("sweep.html", title=f"sweep {sweep_dir.name}", rows=rows, swept_keys=list(swept), common=common,
                  comparison=comparison, counts=status_counts(jobs))
    return write_html(out_path, html)


def job_row(sweep_dir: Path, job: dict, values: dict, page_dir: Path, kind_for) -> dict:
    store = None if job.get("store") is None else sweep_dir / job["store"]  # absolute paths stay as they are
    row = {"num": job["num"], "status": job["status"], "values": values, "overrides": job["overrides"],
           "store": job.get("store"), "report_href": None, "kind": None, "headline": None, "problem": None}
    if store is None:
        return row
    report = StoreTarget.at(store).report
    if report.is_file():
        row["report_href"] = quote(os.path.relpath(report, page_dir.resolve()))
    if job["status"] != "complete":
        return row
    try:
        ds = open_dataset(store)  # an array zarr cannot load names itself, with no zarr task left behind
        kind = kind_for(ds)
        row["kind"] = getattr(kind, "name", None)
        row["headline"] = kind.headline(ds) if kind is not None else None
    except Exception as err:  # one unreadable store spoils its own row, not the page
        row["problem"] = f"{type(err).__name__}: {err}"
    return row


def status_counts(jobs: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job["status"]] = counts.get(job["status"], 0) + 1
    return counts


def numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def comparison_context(key: str, rows: list[dict]) -> dict | None:
    """Each (kind, headline label)'s values along the one swept override: a table and a line plot."""
    series: dict[tuple[str, str], list[tuple[object, float]]] = {}
    for row in rows:
        headline = row["headline"]
        if headline is None or not math.isfinite(float(headline.value)):
            continue
        series.setdefault((row["kind"] or "?", headline.label), []).append((row["values"][key], float(headline.value)))
    if not series:
        return None
    xs = [x for points in series.values() for x, _ in points]
    ordered = all(numeric(x) for x in xs)
    if ordered:
        series = {name: sorted(points, key=lambda p: p[0]) for name, points in series.items()}
    return {"key": key, "series": [{"kind": k, "label": label, "points": points}
                                   for (k, label), points in series.items()],
            "uri": line_plot(key, series, ordered)}


def line_plot(key: str, series: dict, ordered: bool) -> str:
    """PNG data URI: one line per (kind, label) of headline values against ``key``'s values."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    categories: list[str] = []
    for (kind, label), points in series.items():
        if ordered:
            xs = [p[0] for p in points]
        else:  # categorical: positions in order of first appearance
            for x, _ in points:
                if str(x) not in categories:
                    categories.append(str(x))
            xs = [categories.index(str(p[0])) for p in points]
        ax.plot(xs, [p[1] for p in points], marker="o", label=f"{label} ({kind})")
    if not ordered:
        ax.set_xticks(range(len(categories)), categories)
    labels = sorted({label for _, label in series})
    ax.set_xlabel(key)
    ax.set_ylabel(labels[0] if len(labels) == 1 and len(labels[0]) <= 30 else "headline")
    ax.set_title(textwrap.fill(f"{' / '.join(labels)} against {key}", 80), fontsize=9)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return image_data_uri(buffer.getvalue())


def write_index_page(sweep_dir: Path, jobs: list[dict] | None = None, out_path: Path | None = None) -> Path:
    """``<sweep dir>/index.html`` (or ``out_path``) for ``jobs`` (default: those ``sweep.json`` lists)."""
    jobs = read_jobs(sweep_dir) if jobs is None else jobs
    return write_sweep_index(Path(sweep_dir), jobs, swept_parameters(jobs), out_path)
