"""A causal trace's grids as the report's interactive heatmaps (``base.Heatmap``), drawn as ``figures`` draws
its PNGs: per fact and component the restored p(answer) by (token, layer), its colour scale starting at the corrupted
run's p; and per component the average indirect effect by (token role, layer). Each names the PNG of the same grid
where the run drew one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr

from interp_runner.components import COMPONENTS
from interp_runner.kinds.base import Heatmap
from interp_runner.kinds.causal_trace.figures import AVERAGE_FIGURE, heatmap_name, token_label


def _title(component: str) -> str:
    return f"Impact of restoring {COMPONENTS[component].label} after corrupted input"


def _column_name(ds: xr.Dataset, component: str) -> str:
    return "layer" if component == "resid" else f"layer (centre of {ds.attrs['window']} restored)"


def _layers(ds: xr.Dataset) -> tuple[str, ...]:
    return tuple(str(int(layer)) for layer in ds["layer"].values)


def fact_heatmaps(ds: xr.Dataset, f: int, figures: dict[str, Path]) -> tuple[Heatmap, ...]:
    """Fact ``f``'s restored p(answer) per component; its tokens (``*``: the subject's) are the clean prompt's."""
    fact_id, n = str(ds["fact_id"].values[f]), int(ds["num_tokens"][f])
    start, end = int(ds["subject_start"][f]), int(ds["subject_end"][f])
    rows = tuple(token_label(str(text)) + ("*" if start <= i < end else "")
                 for i, text in enumerate(ds["token_text"].values[f, :n]))
    corrupt = float(ds["corrupt_prob"][f])
    value_name = f"p({str(ds['answer'].values[f]).strip()})"
    heatmaps = []
    for component in (str(k) for k in ds["component"].values):
        grid = ds["restored_prob"].isel(fact=f).sel(component=component).transpose("token", "layer").values[:n]
        heatmaps.append(Heatmap(
            _title(component), grid.astype(np.float64), rows, _layers(ds), "token", _column_name(ds, component),
            value_name,
            COMPONENTS[component].cmap, vmin=corrupt, baseline=("indirect effect", corrupt),
            figure=figures.get(heatmap_name(fact_id, component))))
    return tuple(heatmaps)


def average_heatmaps(ds: xr.Dataset, figures: dict[str, Path]) -> tuple[Heatmap, ...]:
    """The indirect effect averaged over the traced facts, per component, by ROME's token roles."""
    rows = tuple(str(r) for r in ds["role"].values)
    heatmaps = []
    for component in (str(k) for k in ds["component"].values):
        grid = ds["avg_indirect_effect"].sel(component=component).transpose("role", "layer").values
        grid = grid.astype(np.float64)
        low = float(np.nanmin(grid)) if np.isfinite(grid).any() else 0.0
        heatmaps.append(Heatmap(
            f"Average indirect effect of {COMPONENTS[component].label}", grid, rows, _layers(ds), "token role",
            _column_name(ds, component), "average indirect effect", COMPONENTS[component].cmap, vmin=min(0.0, low),
            figure=figures.get(AVERAGE_FIGURE)))
    return tuple(heatmaps)
