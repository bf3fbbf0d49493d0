"""Causal tracing's results -> the store's effect grids (``TraceLayout`` read back), with ROME's token roles.

The grids' ``token`` axis, and ``prompt``, ``prompt_tokens``, ``token_text``, ``num_tokens`` and the subject span,
are the **clean** prompt's: a cell at token t restores the clean run's states of token t. Under noise the
corrupted runs are that prompt too. A counterfactual trace also stores its corrupted prompt as ``corrupt_prompt``,
``corrupt_prompt_tokens`` / ``corrupt_token_text`` (fact, corrupt_token) and ``corrupt_num_tokens``, and
``restored_at`` (fact, token): the corrupt-prompt position each clean token's states are restored at (the aligned
one, ``TraceFact.restored``), -1 where it has none (such tokens are never restored: NaN in the grids).

A request computed through a non-finite value (``RequestResult.nonfinite``: ``interp_runner.store.result_flags``) gives
no score: what it would fill is NaN, and the attribute ``nonfinite`` lists it.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from interp_runner.compile.plan import Plan
from interp_runner.kinds.causal_trace.plan import TraceFact, TraceLayout

ROLES = ("first subject", "middle subject", "last subject", "first subsequent", "further tokens", "last token")


def _roles(fact: TraceFact, num_tokens: int) -> dict[str, list[int]]:
    """Token positions (of the clean prompt, which the grids are indexed by) in each of ROME's roles."""
    subj = list(fact.subject_positions)
    first, last = subj[0], subj[-1]
    return {
        "first subject": [first], "middle subject": subj[1:-1], "last subject": [last],
        "first subsequent": [last + 1] if last + 1 < num_tokens else [],
        "further tokens": list(range(last + 2, num_tokens - 1)), "last token": [num_tokens - 1],
    }


def trace_dataset(plan: Plan, results: dict, tokenizer=None) -> xr.Dataset:
    """The effect grids of a finished trace as an xarray Dataset (``interp_runner.kinds.causal_trace.kind``)."""
    layout: TraceLayout = plan.layout
    F, K, L = len(layout.facts), len(layout.components), len(layout.layers)
    T = max(len(f.clean.token_ids) for f in layout.facts)
    clean_of = {f.index: f.restored for f in layout.facts}  # corrupt position -> clean position
    S = layout.samples
    grid_lp = np.full((F, K, L, T, S), np.nan, dtype=np.float64)
    grid_foil = np.full_like(grid_lp, np.nan)
    clean_lp, clean_foil = np.full(F, np.nan), np.full(F, np.nan)
    corrupt_lp, corrupt_foil = np.full((F, S), np.nan), np.full((F, S), np.nan)
    batch_lp = np.full((F, S), np.nan)
    clean_top = np.full(F, -1, dtype=np.int64)
    voided, nonfinite = [], []
    component_index = {k: i for i, k in enumerate(layout.components)}
    layer_index = {lay: i for i, lay in enumerate(layout.layers)}
    for request in plan.requests:
        result = results.get(request.rid)
        if result is not None and result.void:  # its patches were not applied: never a restored score
            voided.append({"request": request.rid, "reason": result.void})
            continue
        if result is not None and result.nonfinite:  # computed through a non-finite value: NaN, never a score
            nonfinite.append(request.rid)
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
            at = (f, component_index[m["component"]], layer_index[m["layer"]], clean_of[f][m["token"]], m["sample"])
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
            positions = _roles(fact, len(fact.clean.token_ids))[role]
            if positions:
                per_fact.append(np.nanmean(indirect[fact.index][:, :, positions], axis=-1))
        if per_fact:
            avg[:, :, r] = np.nanmean(np.stack(per_fact), axis=0)

    texts = np.full((F, T), "", dtype=object)
    if tokenizer is not None:
        for fact in layout.facts:
            texts[fact.index, : len(fact.clean.token_ids)] = tokenizer.token_texts(fact.clean.token_ids)
    max_subj = max(len(f.subject_positions) for f in layout.facts)
    noise = np.full((F, S, max_subj, layout.noise[0].shape[-1] if layout.noise else 1), np.nan, dtype=np.float32)
    for f, values in layout.noise.items():
        noise[f, :, : values.shape[1]] = values

    strings = np.dtypes.StringDType()
    grid = ("fact", "component", "layer", "token")
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
            "num_tokens": ("fact", np.array([len(f.clean.token_ids) for f in layout.facts], dtype=np.int32)),
            "prompt_tokens": (("fact", "token"), _padded([f.clean.token_ids for f in layout.facts], T)),
            "token_text": (("fact", "token"), texts.astype(strings)),
            "subject_start": ("fact", np.array([f.subject_positions[0] for f in layout.facts], dtype=np.int32)),
            "subject_end": ("fact", np.array([f.subject_positions[-1] + 1 for f in layout.facts], dtype=np.int32)),
            "subject": ("fact", np.array([f.subject for f in layout.facts], dtype=strings)),
            "prompt": ("fact", np.array([f.clean.text for f in layout.facts], dtype=strings)),
            "answer": ("fact", np.array([f.answer for f in layout.facts], dtype=strings)),
            "noise": (("fact", "sample", "subject_token", "hidden"), noise),
            "avg_indirect_effect": (("component", "layer", "role"), avg.astype(np.float32)),
        },
        coords={
            "fact_id": ("fact", np.array([f.id for f in layout.facts], dtype=strings)),
            "component": np.array(layout.components, dtype=strings),
            "layer": np.array(layout.layers, dtype=np.int32),
            "role": np.array(ROLES, dtype=strings),
        },
        attrs={
            "window": layout.window, "corruption": layout.corruption, "noise_std": layout.noise_std,
            "noise_samples": layout.samples, "noise_floor": noise_floor,
            "filtered_facts": [layout.facts[i].id for i in np.flatnonzero(filtered)],
            "voided": voided, "nonfinite": nonfinite, "skipped_positions": list(plan.skipped),
        },
    )
    for name in grid_names(ds):
        ds[name].attrs["token"] = "position in the clean prompt (prompt_tokens) whose states the cell restores"
    if layout.corruption == "counterfactual":
        ds = ds.assign(_corrupt_prompts(layout, T, tokenizer, strings))
    return ds


def grid_names(ds: xr.Dataset) -> list[str]:
    return [str(n) for n, v in ds.data_vars.items() if v.dims[:4] == ("fact", "component", "layer", "token")]


def _padded(rows, width: int) -> np.ndarray:
    return np.array([list(r) + [-1] * (width - len(r)) for r in rows], dtype=np.int32).reshape(len(rows), width)


def _corrupt_prompts(layout: TraceLayout, width: int, tokenizer, strings) -> dict:
    """A counterfactual trace's corrupted prompts, and where each clean token is restored in them."""
    facts = layout.facts
    corrupt_width = max(len(f.corrupt.token_ids) for f in facts)
    texts = np.full((len(facts), corrupt_width), "", dtype=object)
    restored_at = np.full((len(facts), width), -1, dtype=np.int32)
    for fact in facts:
        if tokenizer is not None:
            texts[fact.index, : len(fact.corrupt.token_ids)] = tokenizer.token_texts(fact.corrupt.token_ids)
        for corrupt_pos, clean_pos in fact.restored.items():
            restored_at[fact.index, clean_pos] = corrupt_pos
    at = xr.Variable(("fact", "token"), restored_at, attrs={
        "meaning": "the corrupt-prompt position where the cells put the clean states of this clean-prompt token; "
                   "-1: no aligned position (never restored)"})
    return {
        "corrupt_prompt": ("fact", np.array([f.corrupt.text for f in facts], dtype=strings)),
        "corrupt_prompt_tokens": (("fact", "corrupt_token"), _padded([f.corrupt.token_ids for f in facts],
                                                                     corrupt_width)),
        "corrupt_token_text": (("fact", "corrupt_token"), texts.astype(strings)),
        "corrupt_num_tokens": ("fact", np.array([len(f.corrupt.token_ids) for f in facts], dtype=np.int32)),
        "restored_at": at,
    }
