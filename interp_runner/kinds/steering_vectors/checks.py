"""Warnings about a ``steering_vectors`` store's vectors, for its summary and report: degenerate vectors (no
direction, ``interp_runner.vectors.methods``) and vectors the pairs barely agree on."""

from __future__ import annotations

import numpy as np
import xarray as xr

# fewer pairs than this projecting positively on a vector (``pairs_aligned``): the pairs barely agree on it (a
# direction half the pairs contradict moves the average pair little, and may move many pairs the other way)
WEAK_AGREEMENT = 2 / 3


def _sites(ds: xr.Dataset, where: np.ndarray) -> str:
    """``where`` (method, vector_hook, vector_layer) as "pca at post_block L0, L3; ..." ."""
    out = []
    for m, method in enumerate(ds["method"].values):
        for h, hook in enumerate(ds["vector_hook"].values):
            layers = [f"L{int(x)}" for x, hit in zip(ds["vector_layer"].values, where[m, h]) if hit]
            if layers:
                out.append(f"{method} at {hook} {', '.join(layers)}")
    return "; ".join(out)


def vector_warnings(ds: xr.Dataset) -> list[str]:
    """Degenerate vectors (no direction: NaN, never exported, their evaluation NaN) and vectors the pairs barely
    agree on (fewer than ``WEAK_AGREEMENT`` of them project positively), one line each."""
    if "degenerate" not in ds:  # a store from before degeneracy was recorded
        return []
    order = ("method", "vector_hook", "vector_layer")
    degenerate = ds["degenerate"].transpose(*order).values
    aligned = ds["pairs_aligned"].transpose(*order).values
    below = float(ds.attrs.get("weak_agreement_below", WEAK_AGREEMENT))
    lines = []
    if degenerate.any():
        lines.append(f"warning: degenerate (the pairs' differences are within {ds.attrs['degenerate_below']:g} of "
                     f"the activations' norm: no direction, not stored, not exported, not evaluated): "
                     f"{_sites(ds, degenerate)}")
    with np.errstate(invalid="ignore"):
        weak = aligned < below
    if weak.any():
        lines.append(f"warning: the pairs barely agree (fewer than {below:.0%} project positively on the vector): "
                     f"{_sites(ds, weak)}")
    return lines
