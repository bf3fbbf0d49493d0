"""Causal tracing, ROME-style (Meng et al. 2022): which hidden states carry a fact. Its section: ``causal_trace``.

The plan is ``plan``'s (clean, corrupted and restored runs of every fact), the store's arrays
``grids``' and the heatmaps ``figures``'. Store (``dataset``): per fact ``clean_prob``,
``corrupt_prob``, ``total_effect``; the grids ``restored_prob``, ``indirect_effect`` (restored - corrupt),
``recovered``, ``restored_logit_diff`` with dims (fact, component, layer, token); the per-sample scores, subject
spans, token texts, the noise itself, filtered facts and ``avg_indirect_effect`` (component, layer, role) over
ROME's token roles; the grids' tokens and ``prompt`` / ``prompt_tokens`` / ``token_text`` are the clean prompt's, and a
counterfactual trace adds its ``corrupt_prompt`` / ``corrupt_prompt_tokens`` / ``corrupt_token_text`` (``grids``).
Figures: a heatmap per fact and component and the averaged-effect plot (``plots: true``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import xarray as xr
from pydantic import AfterValidator, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from interp_runner.components import COMPONENTS
from interp_runner.config.schema import LayerSelector, PositiveFloat32, ResidualHook, Seed, Strict, distinct
from interp_runner.models.facts import ModelFacts
from interp_runner.compile.plan import Plan
from interp_runner.store.result_arrays import value_kind
from interp_runner.kinds.base import Headline, Propagated, Ratio, Section, Table, ThresholdFlag
from interp_runner.kinds.causal_trace.figures import figure_count, write_figures
from interp_runner.kinds.causal_trace.grids import trace_dataset
from interp_runner.kinds.causal_trace.plan import compile_trace
from interp_runner.kinds.causal_trace.report import average_heatmaps, fact_heatmaps


class Noise(Strict):
    k: PositiveFloat32 = 3.0  # std = k * std of the subjects' token embeddings
    samples: int = Field(3, ge=1)
    seed: Seed = 0


class CausalTrace(Strict):
    """ROME-style causal tracing over a JSONL of facts: {id, subject, prompt, answer[, foil, corrupt_prompt]}."""

    facts: str
    num_facts: int | None = Field(None, ge=1)  # the first N facts
    corruption: Literal["noise", "counterfactual"] = "noise"
    noise: Noise = Noise()
    # what each cell restores (``interp_runner.components``)
    components: Annotated[list[Literal[tuple(COMPONENTS)]], Field(min_length=1), AfterValidator(distinct)] = list(
        COMPONENTS)
    kinds: SkipJsonSchema[None] = Field(None, exclude=True)  # renamed ``components``: refused with a pointer there
    resid_hook: ResidualHook = "post_block"
    window: int = Field(10, ge=1)
    layers: LayerSelector = "all"  # restored layers (window centres for mlp/attn)
    filter: bool = True  # drop facts whose clean prediction is not the answer (ROME), listing them
    plots: bool = True

    @field_validator("kinds", mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> None:
        raise ValueError(f"renamed: give causal_trace.components (e.g. {list(COMPONENTS)}); 'kind' is the "
                         "experiment's kind")


VALUE_KINDS = {
    "restored_prob": "probability", "clean_prob": "probability", "corrupt_prob": "probability",
    "indirect_effect": "probability difference", "total_effect": "probability difference",
    "avg_indirect_effect": "probability difference",
}
VERIFY_RULES = {  # as ``grids`` computes them
    "indirect_effect": Propagated(("restored_prob", "corrupt_prob")),
    "total_effect": Propagated(("clean_prob", "corrupt_prob")),
    "avg_indirect_effect": Propagated(("indirect_effect",)),
    "recovered": Ratio("indirect_effect", "total_effect"),
    "above_noise_floor": ThresholdFlag("indirect_effect", "noise_floor", "probability difference"),
}
HEADLINE_ROLE = "last subject"
ITS_FACTS = "its facts are the prompts"


class CausalTraceKind:
    name = "causal_trace"
    section = "causal_trace"
    settings = CausalTrace
    excludes = {"steering": "", "capture": "", "patching": "", "prompts.items": ITS_FACTS, "prompts.file": ITS_FACTS}
    verify_rules = VERIFY_RULES

    def compile(self, cfg, facts: ModelFacts, tokenizer, base: Path | None, embeddings: Callable) -> Plan:
        return compile_trace(cfg, facts, tokenizer, base, embeddings, self.name)

    def dataset(self, plan: Plan, results: dict, hidden: int, tokenizer=None) -> xr.Dataset:
        return trace_dataset(plan, results, tokenizer)

    def figure_count(self, cfg, plan: Plan) -> int:
        return figure_count(len(plan.layout.facts), len(cfg.causal_trace.components)) if cfg.causal_trace.plots else 0

    def figures(self, ds: xr.Dataset, cfg, out_dir: Path, workers=None) -> list[Path]:
        return write_figures(ds, out_dir, workers) if cfg.causal_trace.plots else []

    def exports(self, ds: xr.Dataset, cfg, out_dir: Path) -> list[Path]:
        return []

    def summary(self, ds: xr.Dataset) -> list[str]:
        lines = [f"noise std {ds.attrs['noise_std']:.4f}, {ds.attrs['noise_samples']} sample(s); "
                 f"noise floor {ds.attrs['noise_floor']:.2e}; filtered facts: {ds.attrs['filtered_facts'] or 'none'}"]
        for f in range(ds.sizes["fact"]):
            line = f"[{ds['fact_id'].values[f]}] {_prompts(ds, f)}"
            if bool(ds["filtered"][f]):
                lines.append(line + "  (filtered: the clean run does not predict the answer)")
                continue
            peaks = _peaks(ds, f)
            lines.append(line)
            lines.append("  largest indirect effects: " + ", ".join(best for best, _ in peaks.values()))
            # the last token at the last layers is the answer itself; ROME's finding is the peak at the subject
            lines.append("  at the subject tokens:    " + ", ".join(at for _, at in peaks.values()))
        return lines

    def value_kind(self, name: str) -> str:
        return VALUE_KINDS.get(name) or value_kind(name)

    def report_sections(self, ds: xr.Dataset, figures: list[Path]) -> list[Section]:
        by_name = {Path(p).name: Path(p) for p in figures}
        components = [str(k) for k in ds["component"].values]
        counterfactual = "corrupt_prompt" in ds
        columns = ("fact", *(("clean prompt", "corrupt prompt") if counterfactual else ("prompt",)), "answer",
                   "p clean", "p corrupt", "filtered") \
            + tuple(f"peak {k}" for k in components) + tuple(f"peak {k} at the subject" for k in components)
        rows, per_fact = [], []
        for f in range(ds.sizes["fact"]):
            fact_id = str(ds["fact_id"].values[f])
            filtered = bool(ds["filtered"][f])
            peaks = {} if filtered else _peaks(ds, f)
            prompts = [str(ds["prompt"].values[f])] + ([str(ds["corrupt_prompt"].values[f])] if counterfactual else [])
            rows.append((fact_id, *prompts, str(ds["answer"].values[f]),
                         float(ds["clean_prob"][f]), float(ds["corrupt_prob"][f]), filtered)
                        + tuple(peaks[k][0] if peaks else "" for k in components)
                        + tuple(peaks[k][1] if peaks else "" for k in components))
            if filtered:
                continue
            table = Table("peak indirect effects", ("component", "largest", "at the subject tokens"),
                          tuple((k, *peaks[k]) for k in components))
            per_fact.append(Section(f"Fact {fact_id}", _prompts(ds, f), (table,),
                                    heatmaps=fact_heatmaps(ds, f, by_name), folded=True))
        text = (f"Noise std {ds.attrs['noise_std']:.4f} ({ds.attrs['noise_samples']} sample(s), corruption "
                f"{ds.attrs['corruption']}), noise floor {ds.attrs['noise_floor']:.2e}; filtered facts: "
                f"{', '.join(ds.attrs['filtered_facts']) or 'none'}.")
        if counterfactual:
            text += (" Grids and peaks are by the clean prompt's tokens: restoring a clean token's states at its "
                     "aligned position in the corrupt prompt.")
        return [Section("Causal trace", text, (Table("facts", columns, tuple(rows)),),
                        heatmaps=average_heatmaps(ds, by_name)), *per_fact]

    def headline(self, ds: xr.Dataset) -> Headline | None:
        if "resid" not in [str(k) for k in ds["component"].values]:
            return None
        effect = ds["avg_indirect_effect"].sel(component="resid", role=HEADLINE_ROLE).values.astype(np.float64)
        if not np.isfinite(effect).any():
            return None
        return Headline(f"mean indirect effect of restoring resid at the {HEADLINE_ROLE} token (over facts and "
                        "layers)", float(np.nanmean(effect)))

    report_settings = ("Trace settings", ("corruption", "window", "noise_samples", "noise_std", "noise_floor",
                                          "filtered_facts", "skipped_positions", "voided", "nonfinite"))

    def counts(self, ds: xr.Dataset) -> list[tuple[str, int]]:
        # a cell: one (component, layer, token) of one fact's clean prompt, restored in each noise sample
        cells = ds.sizes["component"] * ds.sizes["layer"] * int(ds["num_tokens"].values.sum())
        counts = [("facts", ds.sizes["fact"]), ("cells", cells), ("noise samples", int(ds.attrs["noise_samples"]))]
        return counts + ([("filtered facts", int(ds["filtered"].values.sum()))] if ds["filtered"].values.any() else [])


def _prompts(ds: xr.Dataset, f: int) -> str:
    """Fact ``f``'s prompts, answer and probabilities, each prompt named (clean, corrupt) in a counterfactual trace."""
    clean, answer = str(ds["prompt"].values[f]), str(ds["answer"].values[f])
    p_clean, p_corrupt = float(ds["clean_prob"][f]), float(ds["corrupt_prob"][f])
    if "corrupt_prompt" not in ds:
        return f"{clean!r} -> {answer!r}: p clean {p_clean:.3f}, corrupt {p_corrupt:.3f}"
    return (f"clean {clean!r} -> {answer!r}: p {p_clean:.3f}; corrupt {str(ds['corrupt_prompt'].values[f])!r} -> "
            f"{answer!r}: p {p_corrupt:.3f}")


def _peak(ds: xr.Dataset, f: int, component: str, grid: np.ndarray, first_token: int) -> str:
    if not np.isfinite(grid).any():
        return f"{component} -"
    layer, token = np.unravel_index(np.nanargmax(grid), grid.shape)
    text = str(ds["token_text"].values[f, first_token + token])
    return f"{component} {grid[layer, token]:+.3f} @ L{int(ds['layer'][layer])} {text!r}"


def _peaks(ds: xr.Dataset, f: int) -> dict[str, tuple[str, str]]:
    """Per component: the largest indirect effect of fact ``f`` anywhere, and at its subject tokens."""
    start, end = int(ds["subject_start"][f]), int(ds["subject_end"][f])
    out = {}
    for component in ds["component"].values:
        grid = ds["indirect_effect"].sel(component=component).isel(fact=f).values
        out[str(component)] = (_peak(ds, f, component, grid, 0),
                               _peak(ds, f, component, grid[:, start:end], start))
    return out


KIND = CausalTraceKind()
