"""Array by array: does the compared run's array match the reference's, under a ``rules.Tolerance``?"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from interp_runner.store.result_arrays import value_kind as default_value_kind
from interp_runner.verify.rules import Tolerance

BLOCK_ELEMENTS = 1 << 24  # compare large arrays in slabs of about this many elements


@dataclass
class Difference:
    name: str
    role: str  # data | coord
    note: str  # what differs
    max_abs: float | None = None
    max_rel: float | None = None
    where: str = ""  # the worst (float) or first (exact) differing element, by dim
    values: str = ""
    allowed: str = ""
    tolerated: bool = False  # differs, but within the tolerance


def slabs(var) -> Iterator[tuple[int, object]]:
    """(offset along the first dim, slab) covering ``var`` in pieces of about BLOCK_ELEMENTS elements."""
    if var.ndim == 0 or var.size <= BLOCK_ELEMENTS:
        yield 0, var
        return
    step = max(1, BLOCK_ELEMENTS // max(1, var.size // var.shape[0]))
    for start in range(0, var.shape[0], step):
        yield start, var.isel({var.dims[0]: slice(start, start + step)})


def _where(var, index: tuple[int, ...]) -> str:
    parts = []
    for dim, i in zip(var.dims, index):
        label = ""
        if dim in var.coords and var.coords[dim].ndim == 1 and dim != var.name:
            value = var.coords[dim].values[i]
            label = f" ({value!r})" if isinstance(value, str) else f" ({value})"
        parts.append(f"{dim}={i}{label}")
    return ", ".join(parts) or "(scalar)"


def _fmt(x, width: int = 32) -> str:
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.9g}"
    text = repr(x.item() if hasattr(x, "item") else x)
    return text if len(text) <= width else text[: width - 3] + "..."


def is_float(dtype) -> bool:
    return np.dtype(dtype).kind in "fc"


def _is_numeric(dtype) -> bool:
    return np.dtype(dtype).kind in "iufcb"


def peak(var) -> float:
    """The largest finite |value| of a float DataArray (0 when it has none)."""
    out = 0.0
    for _, slab in slabs(var):
        v = np.abs(slab.values.astype(np.float64))
        out = max(out, float(v[np.isfinite(v)].max(initial=0.0)))
    return out


def stored_dtype(var) -> str:
    return str(var.attrs.get("stored_dtype") or var.dtype)


def mismatched_layout(name: str, role: str, new, ref) -> Difference | None:
    if new.dims != ref.dims:
        return Difference(name, role, f"dims {new.dims} vs {ref.dims}")
    if new.shape != ref.shape:
        return Difference(name, role, f"shape {new.shape} vs {ref.shape}")
    if new.dtype != ref.dtype and not (new.dtype.kind in "OTU" and ref.dtype.kind in "OTU"):
        return Difference(name, role, f"dtype {new.dtype} vs {ref.dtype}")
    return None


def compare_variable(name: str, role: str, new, ref, tolerance: Tolerance,
                     prob_scale: Callable[[], float] = lambda: 0.0,
                     value_kind: Callable[[str], str] = default_value_kind,
                     atol: tuple[float, str] | None = None) -> Difference | None:
    """None when the DataArray ``new`` matches ``ref`` (the reference: relative differences are to it);
    ``prob_scale()``: the reference store's largest probability; ``value_kind``: how the store's float arrays
    scale (its experiment kind's ``value_kind``); ``atol``: (allowed |difference|, how) where the caller decided it
    (an array derived from others, ``derived``)."""
    found = mismatched_layout(name, role, new, ref)
    if found is not None or new.size == 0:
        return found
    if not is_float(new.dtype):
        return _compare_exact(name, role, new, ref)
    atol, how = atol or tolerance.atol(value_kind(name), lambda: peak(ref), stored_dtype(ref), prob_scale)
    worst, worst_at, worst_pair, max_rel, over, differing = -1.0, None, None, 0.0, 0, 0
    for (start, new_slab), (_, ref_slab) in zip(slabs(new), slabs(ref)):
        a = np.asarray(new_slab.values, dtype=np.complex128 if new.dtype.kind == "c" else np.float64)
        b = np.asarray(ref_slab.values, dtype=a.dtype)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.where(same, 0.0, np.abs(a - b))
        diff = np.where(np.isnan(diff), np.inf, diff)  # NaN against a number, or infinities of opposite sign
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(diff == 0, 0.0, diff / np.abs(b))
        rel = np.where(np.isnan(rel), np.inf, rel)
        over += int((diff > atol).sum())
        differing += int((diff > 0).sum())
        max_rel = max(max_rel, float(rel.max()))
        at = np.unravel_index(int(np.argmax(diff)), diff.shape)
        if diff[at] > worst:
            worst = float(diff[at])
            worst_at = (at[0] + start,) + tuple(at[1:]) if diff.ndim else ()
            worst_pair = (a[at], b[at])
    if differing == 0:
        return None
    if not over:
        note = f"{differing} of {new.size} elements differ"
    else:
        note = f"{over} of {new.size} elements " + ("differ" if atol == 0 else "beyond tolerance")
    return Difference(
        name, role, note, worst, max_rel, _where(new, worst_at), f"{_fmt(worst_pair[1])} -> {_fmt(worst_pair[0])}",
        "exact" if atol == 0 else f"{atol:.3g} ({how})", tolerated=over == 0,
    )


def _compare_exact(name: str, role: str, new, ref) -> Difference | None:
    count, first, first_pair, max_abs = 0, None, None, None
    numeric = _is_numeric(new.dtype) and new.dtype.kind != "b"
    for (start, new_slab), (_, ref_slab) in zip(slabs(new), slabs(ref)):
        a, b = np.asarray(new_slab.values), np.asarray(ref_slab.values)
        unequal = np.asarray(a != b)
        n = int(unequal.sum())
        if not n:
            continue
        if numeric:
            gap = np.abs(a.astype(np.float64) - b.astype(np.float64))
            largest = float(gap.max())
            if max_abs is None or largest > max_abs:
                max_abs = largest
                at = np.unravel_index(int(np.argmax(gap)), gap.shape)
                first, first_pair = ((at[0] + start,) + tuple(at[1:]) if gap.ndim else ()), (a[at], b[at])
        elif first is None:
            at = tuple(int(i) for i in np.argwhere(unequal)[0])
            first, first_pair = ((at[0] + start,) + at[1:] if at else ()), (a[at], b[at])
        count += n
    if not count:
        return None
    return Difference(
        name, role, f"{count} of {new.size} elements differ", max_abs, None, _where(new, first),
        f"{_fmt(first_pair[1])} -> {_fmt(first_pair[0])}", "exact",
    )


def compare_top_k(new_ids, new_lps, ref_ids, ref_lps, tolerance: Tolerance) -> Difference | None:
    """Top-k token ids (request, generated, top_k) as sets: a token in both must keep its log-probability within
    the tolerance (a reordering of near ties is fine), a token in one set only must lie within the tolerance of
    the other's k-th log-probability (it crossed the edge). Padding (-1) must match."""
    found = mismatched_layout("top_token_ids", "data", new_ids, ref_ids)
    if found is not None or new_ids.size == 0:
        return found
    atol, how = tolerance.atol("other", lambda: peak(ref_lps))
    a_ids, b_ids = new_ids.values, ref_ids.values
    a_lps, b_lps = new_lps.values.astype(np.float64), ref_lps.values.astype(np.float64)
    bad, moved, worst, first = 0, 0, 0.0, None
    for at in np.ndindex(a_ids.shape[:-1]):
        if np.array_equal(a_ids[at], b_ids[at]):
            continue
        moved += 1
        a = {int(t): lp for t, lp in zip(a_ids[at], a_lps[at]) if t >= 0}
        b = {int(t): lp for t, lp in zip(b_ids[at], b_lps[at]) if t >= 0}
        if bool(a) != bool(b):
            gap = np.inf
        else:
            edge_a, edge_b = min(a.values(), default=np.nan), min(b.values(), default=np.nan)
            gaps = [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
            gaps += [a[t] - edge_b for t in a.keys() - b.keys()] + [b[t] - edge_a for t in b.keys() - a.keys()]
            gap = max([g for g in gaps if not np.isnan(g)], default=0.0)
        worst = max(worst, gap)
        if gap > atol:
            bad += 1
            first = first or (at, a_ids[at], b_ids[at])
    if not moved:
        return None
    note = (f"{bad} of {moved} reordered steps beyond tolerance" if bad
            else f"{moved} steps reordered among near ties")
    where, pair = ("", "") if first is None else (
        _where(new_ids, first[0]), f"{_fmt(first[2].tolist(), 48)} -> {_fmt(first[1].tolist(), 48)}")
    return Difference("top_token_ids", "data", note, worst, None, where, pair,
                      f"{atol:.3g} ({how}) of log-prob", tolerated=not bad)


def check_forced_greedy(tokens, logprob, top_logprob, tolerance: Tolerance) -> Difference | None:
    """A greedy run teacher-forced to the reference's tokens: each forced token must stay the greedy choice within
    the log-probability tolerance (the top log-probability of its step minus its own); otherwise a free-running
    rerun would have forked beyond a near tie. The tolerance is that of the step's top-k log-probabilities."""
    atol, how = tolerance.atol("other", lambda: peak(top_logprob))
    ids, lps, top = tokens.values, logprob.values.astype(np.float64), top_logprob.values[..., 0].astype(np.float64)
    gap = np.where((ids >= 0) & np.isfinite(lps) & np.isfinite(top), top - lps, 0.0)
    over = int((gap > atol).sum())
    if not over:
        return None
    at = np.unravel_index(int(np.argmax(gap)), gap.shape)
    return Difference("tokens", "data", f"{over} of {int((ids >= 0).sum())} reference tokens are no longer the "
                      "greedy choice", float(gap[at]), None, _where(tokens, tuple(int(i) for i in at)),
                      f"top {_fmt(top[at])} vs forced {_fmt(lps[at])}", f"{atol:.3g} ({how}) below the top")
