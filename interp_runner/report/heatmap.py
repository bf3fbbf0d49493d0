"""A ``Heatmap`` (``kinds.base``) as inline SVG: one unit square per cell, filled in Python from the heatmap's
matplotlib colormap, with row labels, column ticks and a colour bar, so the page shows it with no script and no
request. The cells' values (6 significant digits: a difference of two stays meaningful), row and column labels
ride on the ``<svg>`` as data attributes (``data-values``: row by row, comma-separated, empty for NaN); the page's
script (``templates/report.js``) shows a hovered cell's column, row and value (4 digits) from them.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np
from markupsafe import Markup, escape

from interp_runner.kinds.base import Heatmap

CELL_HEIGHT = 16
GRID_WIDTH = 360  # the cells' width to aim at; each cell stays within CELL_WIDTHS
CELL_WIDTHS = (8, 32)
CHAR_WIDTH = 6.7  # of the 11 px monospace labels
MAX_LABEL = 24  # characters of a row label shown (the tooltip shows it whole)
TICK_GAP = 24  # px between column tick labels at least
TICK_STEPS = (1, 2, 5, 10, 20, 50, 100)
BAR_WIDTH, BAR_STEPS = 12, 32
NO_VALUE = "#eeeeee"  # a NaN cell


@lru_cache(maxsize=None)
def palette(name: str) -> tuple[str, ...]:
    """256 colours of the matplotlib colormap ``name``, as #rrggbb."""
    from matplotlib import colormaps

    colours = colormaps[name].resampled(256)(np.linspace(0.0, 1.0, 256))
    return tuple("#%02x%02x%02x" % tuple(int(round(c * 255)) for c in rgba[:3]) for rgba in colours)


def scale(heatmap: Heatmap) -> tuple[float, float]:
    """The colour scale's ends: the heatmap's, else its finite values' range (never empty)."""
    finite = heatmap.values[np.isfinite(heatmap.values)]
    low = heatmap.vmin if heatmap.vmin is not None else (float(finite.min()) if finite.size else 0.0)
    high = heatmap.vmax if heatmap.vmax is not None else (float(finite.max()) if finite.size else 1.0)
    return low, high if high > low else low + max(abs(low), 1.0) * 1e-6


def value_text(value: float, digits: int = 4) -> str:
    return "" if not math.isfinite(value) else f"{value:.{digits}g}"


def _attr(value) -> str:
    return str(escape(value))


def _short(label: str) -> str:
    return label if len(label) <= MAX_LABEL else label[: MAX_LABEL - 1] + "…"


def _cell(row: int, column: int, fill: str) -> str:
    """One cell's square; x and y left out where 0 (the default), to keep large grids small."""
    x = f' x="{column}"' if column else ""
    y = f' y="{row}"' if row else ""
    return f'<rect{x}{y} fill="{fill}"/>'


def svg(heatmap: Heatmap) -> Markup:
    """The heatmap as an ``<svg class="heatmap">`` element."""
    values = np.asarray(heatmap.values, dtype=np.float64)
    n_rows, n_cols = values.shape
    if (n_rows, n_cols) != (len(heatmap.rows), len(heatmap.columns)):
        raise ValueError(f"heatmap {heatmap.title!r}: {values.shape} values for {len(heatmap.rows)} rows and "
                         f"{len(heatmap.columns)} columns")
    cell_w = min(max(GRID_WIDTH / max(n_cols, 1), CELL_WIDTHS[0]), CELL_WIDTHS[1])
    left = round(min(max((len(_short(r)) for r in heatmap.rows), default=1), MAX_LABEL) * CHAR_WIDTH) + 8
    top, grid_w, grid_h = 6, n_cols * cell_w, n_rows * CELL_HEIGHT
    low, high = scale(heatmap)
    bar_x, bar_h = left + grid_w + 14, max(grid_h, 64)
    bar_labels = max(len(value_text(low)), len(value_text(high))) * CHAR_WIDTH
    width, height = round(bar_x + BAR_WIDTH + 6 + bar_labels), top + max(grid_h, bar_h) + 40
    colours = palette(heatmap.colormap)

    def colour(value: float) -> str:
        if not math.isfinite(value):
            return NO_VALUE
        return colours[int(round(min(max((value - low) / (high - low), 0.0), 1.0) * 255))]

    data = {"title": heatmap.title, "rows": json.dumps(list(heatmap.rows), ensure_ascii=False),
            "cols": json.dumps(list(heatmap.columns), ensure_ascii=False), "row-name": heatmap.row_name,
            "col-name": heatmap.column_name, "value-name": heatmap.value_name,
            "values": ",".join(value_text(v, 6) for v in values.ravel())}
    if heatmap.baseline is not None:
        data["baseline-name"], data["baseline"] = heatmap.baseline[0], repr(float(heatmap.baseline[1]))
    parts = [f'<svg class="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{_attr(heatmap.title)}"'
             + "".join(f' data-{key}="{_attr(value)}"' for key, value in data.items()) + ">"]
    # row labels, right-aligned against the grid
    parts.append('<g class="hm-labels" text-anchor="end">')
    parts += [f'<text x="{left - 5}" y="{top + (r + 0.5) * CELL_HEIGHT:g}">{escape(_short(label))}</text>'
              for r, label in enumerate(heatmap.rows)]
    parts.append("</g>")
    # the cells: unit squares (sized by the stylesheet) in a group scaled to the cell size; x, y = column, row
    parts.append(f'<g class="hm-cells" transform="translate({left} {top}) scale({cell_w:g} {CELL_HEIGHT})">')
    for r in range(n_rows):
        parts.append("".join(_cell(r, c, colour(values[r, c])) for c in range(n_cols)))
    parts.append("</g>")
    # column ticks, at most one per TICK_GAP px, and the column axis' name
    step = next((s for s in TICK_STEPS if s * cell_w >= TICK_GAP), TICK_STEPS[-1])
    parts.append('<g class="hm-ticks" text-anchor="middle">')
    parts += [f'<text x="{left + (c + 0.5) * cell_w:g}" y="{top + grid_h + 14}">{escape(heatmap.columns[c])}</text>'
              for c in range(0, n_cols, step)]
    parts.append(f'<text class="hm-axis" x="{left + grid_w / 2:g}" y="{top + grid_h + 32}">'
                 f'{escape(heatmap.column_name)}</text></g>')
    # the colour bar: high at the top
    step_h = bar_h / BAR_STEPS
    parts.append('<g class="hm-bar">')
    parts += [f'<rect x="{bar_x:g}" y="{top + i * step_h:g}" width="{BAR_WIDTH}" height="{step_h + 0.5:g}" '
              f'fill="{colours[int(round((1 - (i + 0.5) / BAR_STEPS) * 255))]}"/>' for i in range(BAR_STEPS)]
    parts.append(f'<text x="{bar_x + BAR_WIDTH + 4:g}" y="{top + 9}">{escape(value_text(high))}</text>'
                 f'<text x="{bar_x + BAR_WIDTH + 4:g}" y="{top + bar_h}">{escape(value_text(low))}</text></g>')
    parts.append("</svg>")
    return Markup("\n".join(parts))
