"""ROME-style causal-tracing figures (Meng et al. 2022) from a tracing Dataset.

matplotlib is imported lazily inside the functions so that importing this
module stays cheap.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import xarray as xr

from interp_runner.components import COMPONENTS
from interp_runner.kinds.figure_workers import FigureWorkers



def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _model_name(ds: xr.Dataset) -> str:
    # attrs["model"] is either a name or a dict with a "path" (as in store attrs)
    model = ds.attrs.get("model")
    if isinstance(model, dict):
        model = model.get("name") or model.get("path")
    return Path(str(model)).name if model else "GPT"


def _xlabel(ds: xr.Dataset, component: str) -> str:
    if component == "resid":
        return f"single restored layer within {_model_name(ds)}"
    return f"center of interval of {ds.attrs['window']} restored {COMPONENTS[component].label} layers"


def _layer_ticks(ax, layers) -> None:
    # a tick every 5 layers at the cell centres, like ROME
    idx = list(range(0, len(layers), 5))
    ax.set_xticks([i + 0.5 for i in idx])
    ax.set_xticklabels([str(int(layers[i])) for i in idx])


def token_label(text: str) -> str:
    # keep whitespace-only / control tokens visible on the axis
    return text.replace("\n", "\\n").replace("\t", "\\t") or "␣"


def token_axis_label(ds: xr.Dataset) -> str:
    """Whose tokens a heatmap's rows are: the clean prompt's (``grids``)."""
    if ds.attrs.get("corruption") == "counterfactual":
        return "clean prompt's tokens (* subject), restored at the corrupt prompt's aligned positions"
    return "prompt's tokens (* subject, noised in the corrupted runs)"


def trace_heatmap(ds: xr.Dataset, fact: int, component: str, path) -> Path:
    """Restored probability per (token, layer) for one fact and one component."""
    plt = _pyplot()
    f = ds.isel(fact=fact)
    n = int(f["num_tokens"])
    scores = f["restored_prob"].sel(component=component).transpose("token", "layer").values[:n]
    labels = [token_label(str(t)) for t in f["token_text"].values[:n]]
    for i in range(int(f["subject_start"]), int(f["subject_end"])):
        labels[i] += "*"

    fig, ax = plt.subplots(figsize=(5.0, 1.2 + 0.22 * n))
    mesh = ax.pcolormesh(scores, cmap=COMPONENTS[component].cmap, vmin=float(f["corrupt_prob"]))
    ax.invert_yaxis()
    ax.set_yticks([i + 0.5 for i in range(n)])
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylabel(token_axis_label(ds), fontsize=8)
    _layer_ticks(ax, ds["layer"].values)
    ax.tick_params(axis="x", labelsize=8)
    if component == "resid":
        ax.set_title("Impact of restoring state after corrupted input", fontsize=10)
    else:
        ax.set_title(f"Impact of restoring {COMPONENTS[component].label} after corrupted input", fontsize=10)
    ax.set_xlabel(_xlabel(ds, component), fontsize=9)
    cb = fig.colorbar(mesh, ax=ax)
    cb.ax.tick_params(labelsize=8)
    # ROME puts p(answer) under the colorbar; beside it never collides with the xlabel
    cb.set_label(f"p({str(f['answer'].values).strip()})", fontsize=9)

    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def average_effect_plot(ds: xr.Dataset, path) -> Path:
    """One panel per component: avg_indirect_effect over (role, layer)."""
    plt = _pyplot()
    components = [str(k) for k in ds["component"].values]
    roles = [str(r) for r in ds["role"].values]
    fig, axes = plt.subplots(1, len(components), figsize=(5.0 * len(components), 2.6), squeeze=False)
    for ax, component in zip(axes[0], components):
        aie = ds["avg_indirect_effect"].sel(component=component).transpose("role", "layer").values
        mesh = ax.pcolormesh(aie, cmap=COMPONENTS[component].cmap, vmin=min(0.0, float(np.nanmin(aie))))
        ax.invert_yaxis()
        ax.set_yticks([i + 0.5 for i in range(len(roles))])
        ax.set_yticklabels(roles, fontsize=8)
        _layer_ticks(ax, ds["layer"].values)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(f"Average indirect effect of {COMPONENTS[component].label}", fontsize=10)
        ax.set_xlabel(_xlabel(ds, component), fontsize=9)
        cb = fig.colorbar(mesh, ax=ax)
        cb.ax.tick_params(labelsize=8)
    fig.tight_layout()

    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def heatmap_name(fact_id: str, component: str) -> str:
    """The file name of one fact's heatmap for one component."""
    return f"trace_{_safe(str(fact_id))}_{component}.png"


AVERAGE_FIGURE = "average_indirect_effect.png"


FIGURE_VARS = ("restored_prob", "num_tokens", "token_text", "subject_start", "subject_end", "corrupt_prob", "answer",
               "indirect_effect", "avg_indirect_effect")


def _render(job: tuple) -> Path:
    """One figure (in a worker process): ("trace", one fact's dataset, component, path) or ("average", dataset,
    path)."""
    if job[0] == "trace":
        _, ds, component, path = job
        return trace_heatmap(ds, 0, component, path)
    _, ds, path = job
    return average_effect_plot(ds, path)


def figure_count(num_facts: int, num_components: int) -> int:
    """The figures of a trace of ``num_facts`` facts at most: a heatmap per fact and component, and the average."""
    return num_facts * num_components + 1


def write_figures(ds: xr.Dataset, out_dir, workers: FigureWorkers | None = None) -> list[Path]:
    """Per-fact trace heatmaps for every component plus the averaged-effect figure, drawn by ``workers`` (default:
    as many processes as ``figure_workers.worker_count`` gives, started here)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ds = ds[[v for v in FIGURE_VARS if v in ds]].load()  # one read of what the figures show
    components = [str(k) for k in ds["component"].values]
    fact_ids = ds["fact_id"].values if "fact_id" in ds.coords else range(ds.sizes["fact"])
    jobs = []
    for i, fact_id in enumerate(fact_ids):
        # facts filtered out upstream carry an all-NaN indirect effect
        if bool(ds["indirect_effect"].isel(fact=i).isnull().all()):
            continue
        one = ds.isel(fact=[i])
        jobs += [("trace", one, c, out_dir / heatmap_name(fact_id, c)) for c in components]
    jobs.append(("average", ds.drop_dims("fact", errors="ignore"), out_dir / AVERAGE_FIGURE))
    if workers is not None:
        return workers.map(_render, jobs)
    with FigureWorkers.ahead(len(jobs)) or nullcontext() as started:
        return started.map(_render, jobs) if started else [_render(job) for job in jobs]
