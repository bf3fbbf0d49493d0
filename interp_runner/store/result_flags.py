"""Requests computed through a non-finite value (``RequestResult.nonfinite``): what every store says of them.

The plugin flags a request whose residual stream the model's final norm could not normalize (the float32 sum of
squares of a row is inf or NaN: a huge steering scale, say, makes the norm's output zeros and every logit equal,
with no inf or NaN anywhere) or whose scored logits are not all finite. Its numbers are artifacts: each kind stores
them as NaN and says which results depended on them. The store's attribute ``nonfinite_requests`` counts the flagged
requests per role and lists the first ``LISTED``; the summary and the report give a line of it. Where the
config alone makes the overflow certain (a steering term whose own sum of squares leaves float32's range:
``interp_runner.compile.overflow``), it is refused before any engine starts. Below every kind.

The engine checks the rows a request computes. A request can also read rows it did not compute: values and KV
another request kept on the workers (``Plan.refs``: patch sources, streams and KV of packed cells), or blocks of
the prefix cache computed by a request with the same prompt and interventions. ``propagate`` flags such readers of
flagged requests too, once the plan has run.
"""

from __future__ import annotations

from collections import Counter

from interp_runner.payload import kv_key

NONFINITE_ATTR = "nonfinite_requests"
LISTED = 20


def _signature(request) -> tuple:
    """What a request computes its prompt's rows from: the same for requests whose KV the prefix cache shares."""
    payload = request.payload
    if payload is None:
        return tuple(request.prompt.token_ids), (), None
    return tuple(request.prompt.token_ids), payload.steer, payload.patch


def _sources(request, refs: dict) -> set[str]:
    """The requests whose kept values or KV ``request`` reads (``Plan.refs``)."""
    payload = request.payload
    if payload is None:
        return set()
    keys = list(payload.patch.sources) if payload.patch is not None else []
    runs = [payload.start.run] if payload.start is not None else []
    runs += [payload.reuse.run] if payload.reuse is not None else []
    keys += [kv_key(run) for run in runs]
    return {refs[k][0] for k in keys if k in refs}


def propagate(plan, results: dict) -> int:
    """Flag every request that read a flagged request's values or KV (see the module's docstring), in stage
    order; returns how many were flagged here."""
    flagged = {rid for rid, result in results.items() if result.nonfinite}
    if not flagged:
        return 0
    twins = {_signature(r) for r in plan.requests if r.rid in flagged}
    added = 0
    for request in sorted(plan.requests, key=lambda r: r.stage):
        result = results.get(request.rid)
        if result is None or result.nonfinite:
            continue
        if _sources(request, plan.refs) & flagged or (result.cached_tokens and _signature(request) in twins):
            result.nonfinite = True
            flagged.add(request.rid)
            twins.add(_signature(request))
            added += 1
    return added


def flagged_attrs(plan, results: dict) -> dict:
    """``nonfinite_requests``: how many of the plan's requests were flagged (per role), the first ``LISTED``."""
    flagged = [r for r in plan.requests if getattr(results.get(r.rid), "nonfinite", False)]
    return {"count": len(flagged), "of": len(plan.requests),
            "by_role": dict(Counter(r.role for r in flagged)), "requests": [r.rid for r in flagged[:LISTED]]}


def nonfinite_lines(attrs: dict) -> list[str]:
    """The summary's line on flagged requests (none where no request was flagged, or the store predates it)."""
    info = attrs.get(NONFINITE_ATTR)
    if not info or not info.get("count"):
        return []
    roles = ", ".join(f"{n} {role}" for role, n in sorted(info["by_role"].items()))
    shown = ", ".join(info["requests"]) + (", ..." if info["count"] > len(info["requests"]) else "")
    return [f"warning: {info['count']} of {info['of']} requests were computed through a non-finite value (the "
            f"final norm overflowed, or the logits were not finite): their results are NaN, not numbers ({roles}: "
            f"{shown})"]
