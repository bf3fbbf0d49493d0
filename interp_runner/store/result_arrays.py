"""Store arrays every kind may use: strings, padded rows, captured activations, answer scores, and how a float array's
values scale (``interp-verify``'s default for arrays a kind does not name). Below every experiment kind."""

from __future__ import annotations

import numpy as np
import xarray as xr

from interp_runner.compile.plan import CaptureLayout, Plan
from interp_runner.sites import site_id


def strings(items) -> np.ndarray:
    """Variable-length UTF-8 strings (zarr v3 ``string``), not fixed-width numpy unicode."""
    return np.array(list(items), dtype=np.dtypes.StringDType())


def padded(rows: list, fill, dtype) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def capture_vars(layout: CaptureLayout) -> tuple[str, ...]:
    """The data variables of one capture entry (``capture_arrays``' other keys are coordinates)."""
    name = layout.name
    return (name,) + ((f"{name}_topk_ids", f"{name}_topk_weights") if layout.routing is not None else ())


def capture_arrays(layout: CaptureLayout, pairs: list, hidden: int) -> dict:
    """One capture entry's values (request, hook, layer, slot, hidden) and their coordinates, from (request, result)
    pairs in store order. An entry of router logits holds (request, hook, layer, slot, expert) and the experts each
    token chose (``routing_arrays``)."""
    name = layout.name
    width, feature = (layout.routing.num_experts, "expert") if layout.routing is not None else (hidden, "hidden")
    results = [result for _, result in pairs]
    per_request_positions = []
    for request, result in pairs:
        if result is None or request.role != "prompt" or result.prompt_index not in layout.prompt_indices:
            per_request_positions.append(np.zeros(0, dtype=np.int32))
            continue
        sites = [site_id(layer, hook) for hook in layout.hooks for layer in layout.layers]
        found = [result.captures.get(s, (np.zeros(0, np.int32), None))[0] for s in sites]
        positions = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int32)
        per_request_positions.append(positions)
    slots = max(max((len(p) for p in per_request_positions), default=0), 1)
    dtype = np.float32 if layout.dtype == "float32" else np.float16
    values = np.full(
        (len(results), len(layout.hooks), len(layout.layers), slots, width), np.nan, dtype=np.float32
    )
    for r, (result, positions) in enumerate(zip(results, per_request_positions)):
        if not len(positions) or result.nonfinite:  # computed through a non-finite value: NaN, not numbers
            continue
        for h, hook in enumerate(layout.hooks):
            for l, layer in enumerate(layout.layers):
                got = result.captures.get(site_id(layer, hook))
                if got is None:
                    continue
                slot = np.searchsorted(positions, got[0])
                values[r, h, l, slot] = got[1]
    dims = ("request", f"{name}_hook", f"{name}_layer", f"{name}_slot", feature)
    data = xr.DataArray(values.astype(dtype, copy=False) if layout.dtype != "bfloat16" else values, dims=dims)
    if layout.dtype == "bfloat16":  # numpy has no bfloat16: round to it and keep float32 storage
        import torch

        data = data.copy(data=torch.from_numpy(values).bfloat16().float().numpy())
    data.attrs["stored_dtype"] = layout.dtype
    routing = routing_arrays(layout, values) if layout.routing is not None else {}
    return {
        name: data,
        **routing,
        f"{name}_position": (("request", f"{name}_slot"), padded(per_request_positions, -1, np.int32)),
        f"{name}_hook": (f"{name}_hook", strings(layout.hooks)),
        f"{name}_layer": (f"{name}_layer", np.asarray(layout.layers, dtype=np.int32)),
    }


def routing_arrays(layout: CaptureLayout, logits: np.ndarray) -> dict:
    """The experts each captured token chose and their weights, from its float32 router logits as captured (before
    the store's dtype): ``NAME_topk_ids`` (int32, by descending logit, ties to the lower expert id) and
    ``NAME_topk_weights`` (float32: the softmax over all experts at those ids, renormalized to sum to 1 where the
    model does), each (request, hook, layer, slot, routed); -1 and NaN where no token was captured."""
    routing, name = layout.routing, layout.name
    filled = np.isfinite(logits).all(-1)
    x = np.where(filled[..., None], logits, 0.0).astype(np.float32)
    ids = np.argsort(-x, axis=-1, kind="stable")[..., : routing.top_k]
    shifted = np.exp(x - x.max(-1, keepdims=True))
    probs = shifted / shifted.sum(-1, keepdims=True)
    weights = np.take_along_axis(probs, ids, -1)
    if routing.renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    ids, weights = ids.astype(np.int32), weights.astype(np.float32)
    ids[~filled], weights[~filled] = -1, np.nan
    dims = ("request", f"{name}_hook", f"{name}_layer", f"{name}_slot", "routed")
    described = {"description": f"the {routing.top_k} experts of {routing.num_experts} each token chose, from its "
                 f"router logits {name}" + (" (weights renormalized to sum to 1)" if routing.renormalize else "")}
    return {f"{name}_topk_ids": xr.DataArray(ids, dims=dims, attrs=described),
            f"{name}_topk_weights": xr.DataArray(weights, dims=dims, attrs=described)}


def score_arrays(plan: Plan, pairs: list) -> tuple[dict, dict]:
    """Scores, and for patched requests the recovered fraction and noise floor: (data vars, attributes). A request
    computed through a non-finite value (``RequestResult.nonfinite``) has none: NaN, and so is what depends on it."""
    n = len(pairs)
    answer, foil = np.full(n, np.nan), np.full(n, np.nan)
    top = np.full(n, -1, dtype=np.int32)
    for i, (_, result) in enumerate(pairs):
        if result is not None and result.score is not None and not result.nonfinite:
            lps = result.score["logprobs"]
            answer[i] = lps[0]
            foil[i] = lps[1] if len(lps) > 1 else np.nan
            top[i] = result.score["top_id"]
    prob = np.exp(answer)
    data = {
        "answer_logprob": ("request", answer.astype(np.float32)),
        "answer_prob": ("request", prob.astype(np.float32)),
        "foil_logprob": ("request", foil.astype(np.float32)),
        "logit_diff": ("request", (answer - foil).astype(np.float32)),
        "top_token": ("request", top),
    }
    if plan.num_stages == 1:
        return data, {}
    solo = {r.prompt.index: i for i, (r, _) in enumerate(pairs) if r.role == "prompt"}
    recovered = np.full(n, np.nan)
    gaps = []
    for i, (request, result) in enumerate(pairs):
        corrupt = prob[solo[request.prompt.index]]
        if request.role == "baseline":
            gaps.append(abs(prob[i] - corrupt))
        elif request.role == "patched" and request.meta.get("source") is not None:
            clean = prob[solo[request.meta["source"]]]
            with np.errstate(invalid="ignore", divide="ignore"):
                recovered[i] = (prob[i] - corrupt) / (clean - corrupt)
    floor = float(np.nanmax(gaps, initial=0.0)) if gaps else 0.0
    corrupt_of = np.array([prob[solo[r.prompt.index]] for r, _ in pairs])
    data["recovered"] = ("request", recovered.astype(np.float32))
    data["below_noise_floor"] = ("request", np.abs(prob - corrupt_of) <= floor)
    return data, {"noise_floor": floor}


def value_kind(name: str) -> str:
    """How a float array's values scale, read from its name: "probability" (``*_prob``), "probability difference"
    (``*effect``) or "other" (log-probabilities, logits, activations, ratios, ...)."""
    if "logprob" in name or "logit" in name:
        return "other"
    if name.endswith("_prob") or name == "prob":
        return "probability"
    if name.endswith("effect"):
        return "probability difference"
    return "other"
