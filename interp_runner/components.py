"""The components a causal trace restores (``causal_trace.components``), written once: the plan, the hook check,
the figures and the report all read this table. Pure data, below every experiment kind.

``resid`` restores the residual stream of one layer (at ``causal_trace.resid_hook``); ``mlp`` and ``attn`` restore
the MLP / attention outputs of a window of ``causal_trace.window`` layers around it (ROME).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    hook: str | None  # the hook whose outputs a restore puts back (None: the residual stream at ``resid_hook``)
    label: str  # its name in figure titles
    cmap: str  # the matplotlib colour map of its heatmaps


COMPONENTS: dict[str, Component] = {
    "resid": Component(None, "state", "Purples"),
    "mlp": Component("mlp_out", "MLP", "Greens"),
    "attn": Component("attn_out", "Attn", "Reds"),
}
WINDOWED = frozenset(name for name, component in COMPONENTS.items() if component.hook is not None)
