"""What an experiment kind supplies. Pipeline, store, summary, verify and the report call only this interface and
never ask which kind they run; a kind is one module under ``interp_runner.kinds`` plus its
``conf/experiment/*.yaml``, registered once in ``interp_runner.kinds``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import xarray as xr
    from pydantic import BaseModel

    from interp_runner.kinds.figure_workers import FigureWorkers


@dataclass(frozen=True)
class Table:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class Heatmap:
    """A grid the report draws as an interactive heatmap: hovering a cell shows its row, column and value."""

    title: str
    values: np.ndarray  # (rows, columns) floats; NaN where there is no value
    rows: tuple[str, ...]  # row labels, e.g. token texts
    columns: tuple[str, ...]  # column labels, e.g. layer numbers
    row_name: str = "token"
    column_name: str = "layer"
    value_name: str = "value"
    colormap: str = "viridis"  # a matplotlib colormap
    vmin: float | None = None  # the colour scale's ends; default: the finite values' range
    vmax: float | None = None
    baseline: tuple[str, float] | None = None  # (name, b): a hovered cell also shows value - b under that name
    figure: Path | None = None  # the run's static figure of the same grid, if it drew one


@dataclass(frozen=True)
class Section:
    """A part of a run's report: paragraphs, tables, interactive heatmaps and some of the run's figures (shown
    inline); a folded section shows only its title until opened (one of many alike, e.g. a trace's facts)."""

    title: str
    text: str = ""
    tables: tuple[Table, ...] = ()
    figures: tuple[Path, ...] = ()
    heatmaps: tuple[Heatmap, ...] = ()
    folded: bool = False


@dataclass(frozen=True)
class Headline:
    """A kind's one number for a run, plotted along the swept parameter in a sweep's index report."""

    label: str
    value: float


@dataclass(frozen=True)
class Propagated:
    """A float array computed from the arrays ``sources`` by sums, differences and means (an effect = steered -
    baseline, its mean over prompts): ``interp-verify`` allows it the sum of their allowed differences."""

    sources: tuple[str, ...]


@dataclass(frozen=True)
class Ratio:
    """A float array ``numerator / denominator`` (arrays, broadcast by dims): ``interp-verify`` allows each element
    what its sources' allowed differences make of it, to first order."""

    numerator: str
    denominator: str


@dataclass(frozen=True)
class ThresholdFlag:
    """A boolean array ``|source| > threshold`` (``absolute``; else ``source > threshold``), ``threshold`` a root
    attribute of the store whose values scale as ``threshold_kind`` (see ``Kind.value_kind``): ``interp-verify``
    accepts a flipped cell only where ``source`` lies within its allowed difference of the threshold in both runs."""

    source: str
    threshold: str
    threshold_kind: str = "other"
    absolute: bool = True


VerifyRule = Propagated | Ratio | ThresholdFlag


class Kind(Protocol):
    name: str  # recorded in the store's manifest
    section: str | None  # the run config key holding its settings; None for the default kind
    settings: type[BaseModel] | None  # the pydantic model of that section
    # the prompts kind's keys (dotted: "steering", "prompts.items") its section cannot be combined with -> why ("" for
    # no reason given); a section is never combined with another kind's (``interp_runner.config.run``)
    excludes: dict[str, str]

    def compile(self, cfg, facts, tokenizer, base: Path | None, embeddings) -> Any:
        """Validated config + model facts -> ``Plan`` (its ``kind``: this kind's name); raises ``ConfigError`` naming
        the key on bad input."""

    def dataset(self, plan, results: dict, hidden: int, tokenizer) -> xr.Dataset:
        """Results by request id -> the store's arrays."""

    def figure_count(self, cfg, plan) -> int:
        """How many figures the run draws at most (the pipeline may start ``FigureWorkers`` for them early)."""

    def figures(self, ds: xr.Dataset, cfg, out_dir: Path, workers: FigureWorkers | None = None) -> list[Path]:
        """Figures of the written store, drawn into ``out_dir`` (created by the kind when it draws any), by
        ``workers`` where it has them; the paths."""

    def exports(self, ds: xr.Dataset, cfg, out_dir: Path) -> list[Path]:
        """Files other tools read (e.g. vectors as .safetensors / .gguf), written into ``out_dir`` (created by the
        kind when it writes any); the paths."""

    def summary(self, ds: xr.Dataset) -> list[str]:
        """A few lines for the terminal and the report."""

    def value_kind(self, name: str) -> str:
        """How the float array ``name`` scales, for ``interp-verify``'s tolerances: "probability",
        "probability difference" or "other"."""

    # arrays derived from other arrays -> how (``Propagated``, ``Ratio``, ``ThresholdFlag``): ``interp-verify`` judges
    # them with the tolerance of what they derive from; other arrays are judged on their own
    verify_rules: dict[str, VerifyRule]

    def report_sections(self, ds: xr.Dataset, figures: list[Path]) -> list[Section]:
        """The kind's own sections of the run's report."""

    # the report's settings table: its title and the root attributes it shows after the kind's config section
    report_settings: tuple[str, tuple[str, ...]]

    def counts(self, ds: xr.Dataset) -> list[tuple[str, int]]:
        """What the run covered, for the report's header: (what, how many), e.g. ("prompts", 12)."""

    def headline(self, ds: xr.Dataset) -> Headline | None:
        """The number a sweep compares across its jobs, or None."""
