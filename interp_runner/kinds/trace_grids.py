"""Causal tracing's results -> the store's effect grids (``TraceLayout`` read back), with ROME's token roles."""

from __future__ import annotations

import numpy as np
import xarray as xr

from ..plan import Plan
from .trace_plan import TraceFact, TraceLayout

ROLES = ("first subject", "middle subject", "last subject", "first subsequent", "further tokens", "last token")


def _roles(fact: TraceFact, num_tokens: int) -> dict[str, list[int]]:
    """Token positions (of the corrupt prompt, which cells are indexed by) in each of ROME's roles."""
    subj = list(fact.corrupt_subject)
    first, last = subj[0], subj[-1]
    return {
        "first subject": [first], "middle subject": subj[1:-1], "last subject": [last],
        "first subsequent": [last + 1] if last + 1 < num_tokens else [],
        "further tokens": list(range(last + 2, num_tokens - 1)), "last token": [num_tokens - 1],
    }


def trace_dataset(plan: Plan, results: dict, tokenizer=None) -> xr.Dataset:
    """The effect grids of a finished trace as an xarray Dataset (``interp_runner.kinds.causal_trace``)."""
    layout: TraceLayout = plan.layout
    F, K, L = len(layout.facts), len(layout.kinds), len(layout.layers)
    T = max(len(f.corrupt.token_ids) for f in layout.facts)
    S = layout.samples
    grid_lp = np.full((F, K, L, T, S), np.nan, dtype=np.float64)
    grid_foil = np.full_like(grid_lp, np.nan)
    clean_lp, clean_foil = np.full(F, np.nan), np.full(F, np.nan)
    corrupt_lp, corrupt_foil = np.full((F, S), np.nan), np.full((F, S), np.nan)
    batch_lp = np.full((F, S), np.nan)
    clean_top = np.full(F, -1, dtype=np.int64)
    voided = []
    kind_index = {k: i for i, k in enumerate(layout.kinds)}
    layer_index = {lay: i for i, lay in enumerate(layout.layers)}
    for request in plan.requests:
        result = results.get(request.rid)
        if result is not None and result.void:  # its patches were not applied: never a restored score
            voided.append({"request": request.rid, "reason": result.void})
            continue
        if result is None or result.score is None:
            continue
        lps = result.score["logprobs"]
        answer, foil = float(lps[0]), float(lps[1]) if len(lps) > 1 else np.nan
        m = request.meta
        f = m["fact"]
        if m["part"] == "clean":
            clean_lp[f], clean_foil[f], clean_top[f] = answer, foil, result.score["top_id"]
        elif m["part"] == "corrupt":
            if m.get("in_batch"):
                batch_lp[f, m["sample"]] = answer
            else:
                corrupt_lp[f, m["sample"]], corrupt_foil[f, m["sample"]] = answer, foil
        else:
            at = (f, kind_index[m["kind"]], layer_index[m["layer"]], m["token"], m["sample"])
            grid_lp[at], grid_foil[at] = answer, foil

    answers = np.array([f.clean.answer_ids[0] for f in layout.facts])
    filtered = (clean_top != answers) & layout.filter
    with np.errstate(invalid="ignore"):
        restored_prob = np.exp(grid_lp).mean(-1)
        corrupt_prob = np.exp(corrupt_lp).mean(-1)
        clean_prob = np.exp(clean_lp)
        indirect = restored_prob - corrupt_prob[:, None, None, None]
        recovered = indirect / (clean_prob - corrupt_prob)[:, None, None, None]
        logit_diff = (grid_lp - grid_foil).mean(-1)
        noise_floor = float(np.nanmax(np.abs(np.exp(batch_lp) - np.exp(corrupt_lp)), initial=0.0))
    restored_prob[filtered] = np.nan
    indirect[filtered] = np.nan

    avg = np.full((K, L, len(ROLES)), np.nan)
    for r, role in enumerate(ROLES):
        per_fact = []
        for fact in layout.facts:
            if filtered[fact.index]:
                continue
            positions = _roles(fact, len(fact.corrupt.token_ids))[role]
            if positions:
                per_fact.append(np.nanmean(indirect[fact.index][:, :, positions], axis=-1))
        if per_fact:
            avg[:, :, r] = np.nanmean(np.stack(per_fact), axis=0)

    texts = np.full((F, T), "", dtype=object)
    if tokenizer is not None:
        for fact in layout.facts:
            texts[fact.index, : len(fact.corrupt.token_ids)] = tokenizer.token_texts(fact.corrupt.token_ids)
    max_subj = max(len(f.subject_positions) for f in layout.facts)
    noise = np.full((F, S, max_subj, layout.noise[0].shape[-1] if layout.noise else 1), np.nan, dtype=np.float32)
    for f, values in layout.noise.items():
        noise[f, :, : values.shape[1]] = values

    strings = np.dtypes.StringDType()
    grid = ("fact", "kind", "layer", "token")
    ds = xr.Dataset(
        {
            "restored_prob": (grid, restored_prob.astype(np.float32)),
            "indirect_effect": (grid, indirect.astype(np.float32)),
            "recovered": (grid, recovered.astype(np.float32)),
            "restored_logit_diff": (grid, logit_diff.astype(np.float32)),
            "restored_logprob_samples": (grid + ("sample",), grid_lp.astype(np.float32)),
            "above_noise_floor": (grid, np.abs(indirect) > noise_floor),
            "clean_prob": ("fact", clean_prob.astype(np.float32)),
            "clean_logit_diff": ("fact", (clean_lp - clean_foil).astype(np.float32)),
            "corrupt_prob": ("fact", corrupt_prob.astype(np.float32)),
            "corrupt_logprob_samples": (("fact", "sample"), corrupt_lp.astype(np.float32)),
            "corrupt_logprob_in_batch": (("fact", "sample"), batch_lp.astype(np.float32)),
            "total_effect": ("fact", (clean_prob - corrupt_prob).astype(np.float32)),
            "clean_top_token": ("fact", clean_top.astype(np.int32)),
            "clean_correct": ("fact", clean_top == answers),
            "answer_token": ("fact", answers.astype(np.int32)),
            "filtered": ("fact", filtered),
            "num_tokens": ("fact", np.array([len(f.corrupt.token_ids) for f in layout.facts], dtype=np.int32)),
            "prompt_tokens": (("fact", "token"), np.array(
                [list(f.corrupt.token_ids) + [-1] * (T - len(f.corrupt.token_ids)) for f in layout.facts],
                dtype=np.int32)),
            "token_text": (("fact", "token"), texts.astype(strings)),
            "subject_start": ("fact", np.array([f.corrupt_subject[0] for f in layout.facts], dtype=np.int32)),
            "subject_end": ("fact", np.array([f.corrupt_subject[-1] + 1 for f in layout.facts], dtype=np.int32)),
            "subject": ("fact", np.array([f.subject for f in layout.facts], dtype=strings)),
            "prompt": ("fact", np.array([f.corrupt.text for f in layout.facts], dtype=strings)),
            "answer": ("fact", np.array([f.answer for f in layout.facts], dtype=strings)),
            "noise": (("fact", "sample", "subject_token", "hidden"), noise),
            "avg_indirect_effect": (("kind", "layer", "role"), avg.astype(np.float32)),
        },
        coords={
            "fact_id": ("fact", np.array([f.id for f in layout.facts], dtype=strings)),
            "kind": np.array(layout.kinds, dtype=strings),
            "layer": np.array(layout.layers, dtype=np.int32),
            "role": np.array(ROLES, dtype=strings),
        },
        attrs={
            "window": layout.window, "corruption": layout.corruption, "noise_std": layout.noise_std,
            "noise_samples": layout.samples, "noise_floor": noise_floor,
            "filtered_facts": [layout.facts[i].id for i in np.flatnonzero(filtered)],
            "voided": voided, "skipped_positions": list(plan.skipped),
        },
    )
    return ds
