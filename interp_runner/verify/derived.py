"""Arrays derived from other arrays, judged with the tolerance of what they derive from (the kind's
``verify_rules``, ``kinds.base``):

- ``Propagated``: sums, differences and means of the sources may differ by the sum of the sources' allowed
  differences (never by less than the array's own rule allows);
- ``Ratio``: n / d may differ, element by element, by atol(n) / |d| + |n| atol(d) / d^2 (first order, at the
  reference's values; never by less than the array's own rule allows);
- ``ThresholdFlag``: a boolean ``|source| > threshold`` may flip only in cells where the source lies, in both
  runs, within its allowed difference (plus the threshold's own move) of the threshold, the source agreeing
  there within its tolerance, and where the threshold moved within its own tolerance.

Where the comparison is exact, every allowed difference is 0: the derived arrays compare exactly too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from interp_runner.kinds.base import Propagated, Ratio, ThresholdFlag
from interp_runner.verify.arrays import Difference, _where, compare_variable, is_float, peak, stored_dtype
from interp_runner.verify.rules import Tolerance


class Allowed:
    """The allowed |difference| of each float array of a comparison (``rules.Tolerance.atol``), with the rules of
    the reference's kind for derived arrays; computed once per array."""

    def __init__(self, new, ref, tolerance: Tolerance, prob_scale: Callable[[], float]):
        self.new, self.ref, self.tolerance, self.prob_scale = new, ref, tolerance, prob_scale
        self.rules = dict(getattr(ref.kind, "verify_rules", None) or {})
        self._found: dict[str, tuple[float, str]] = {}

    def own(self, name: str) -> tuple[float, str]:
        var = self.ref.ds[name]
        return self.tolerance.atol(self.ref.kind.value_kind(name), lambda: peak(var), stored_dtype(var),
                                   self.prob_scale)

    def __call__(self, name: str, _seen: tuple[str, ...] = ()) -> tuple[float, str]:
        """(allowed |difference|, how it was chosen) for the float array ``name``."""
        if name not in self._found:
            own = self.own(name)
            rule = self.rules.get(name)
            if isinstance(rule, Propagated) and not self.tolerance.exact and name not in _seen \
                    and all(self.comparable(s) for s in rule.sources):
                parts = [self(s, (*_seen, name)) for s in rule.sources]
                total = sum(atol for atol, _ in parts)
                if total > own[0]:
                    own = total, f"sum of its sources': {' + '.join(rule.sources)}"
            self._found[name] = own
        return self._found[name]

    def comparable(self, name: str) -> bool:
        return all(name in s.ds.data_vars and is_float(s.ds[name].dtype) for s in (self.new, self.ref)) \
            and self.new.ds[name].shape == self.ref.ds[name].shape


def compare_derived(name: str, role: str, allowed: Allowed) -> Difference | None | bool:
    """The comparison of ``name`` under its kind's rule; False where it has none (compare it on its own)."""
    rule = allowed.rules.get(name)
    new, ref = allowed.new.ds[name], allowed.ref.ds[name]
    if isinstance(rule, Propagated) and is_float(ref.dtype):
        return compare_variable(name, role, new, ref, allowed.tolerance, allowed.prob_scale,
                                allowed.ref.kind.value_kind, atol=allowed(name))
    if isinstance(rule, Ratio) and is_float(ref.dtype):
        return compare_ratio(name, role, rule, allowed)
    if isinstance(rule, ThresholdFlag) and ref.dtype == bool:
        return compare_flag(name, role, rule, allowed)
    return False


def compare_ratio(name: str, role: str, rule: Ratio, allowed: Allowed) -> Difference | None:
    """A ratio of two arrays: its own rule, then, where that refuses it, each element within what its sources'
    allowed differences make of it (module docstring)."""
    new, ref = allowed.new.ds[name], allowed.ref.ds[name]
    own = allowed.own(name)
    found = compare_variable(name, role, new, ref, allowed.tolerance, atol=own)
    if found is None or found.tolerated or found.note.startswith(("dims", "shape", "dtype")) \
            or allowed.tolerance.exact or not all(allowed.comparable(s) for s in (rule.numerator, rule.denominator)):
        return found
    n, d = (allowed.ref.ds[s].astype(np.float64) for s in (rule.numerator, rule.denominator))
    if not set(n.dims) | set(d.dims) <= set(ref.dims):
        return found
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = allowed(rule.numerator)[0] / np.abs(d) + np.abs(n) * allowed(rule.denominator)[0] / d ** 2
    bound = bound.broadcast_like(ref).transpose(*ref.dims).values
    bound = np.maximum(np.where(np.isfinite(bound), bound, 0.0), own[0])
    a, b = new.values.astype(np.float64), ref.values.astype(np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), np.inf, diff)
    over = diff > bound
    how = f"{own[0]:.3g} ({own[1]}), or what {rule.numerator} / {rule.denominator} allow, up to {bound.max():.3g}"
    if not over.any():
        return Difference(name, role, found.note.replace("beyond tolerance", "beyond its own tolerance, within its "
                          "sources'"), found.max_abs, found.max_rel, found.where, found.values, how, tolerated=True)
    at = np.unravel_index(int(np.argmax(np.where(over, diff - bound, -np.inf))), diff.shape)
    return Difference(name, role, f"{int(over.sum())} of {a.size} elements beyond tolerance", float(diff[at]), None,
                      _where(new, tuple(int(i) for i in at)), f"{b[at]:.9g} -> {a[at]:.9g}",
                      f"{bound[at]:.3g} there ({how})")


def _threshold(store, rule: ThresholdFlag) -> float | None:
    value = store.attrs.get(rule.threshold)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def compare_flag(name: str, role: str, rule: ThresholdFlag, allowed: Allowed) -> Difference | None:
    """A boolean threshold flag: exact, except for flips beside the threshold (module docstring)."""
    new, ref = allowed.new, allowed.ref
    found = compare_variable(name, role, new.ds[name], ref.ds[name], allowed.tolerance)
    t_new, t_ref = _threshold(new, rule), _threshold(ref, rule)
    if found is None or found.note.startswith(("dims", "shape", "dtype")) or allowed.tolerance.exact \
            or not allowed.comparable(rule.source) or new.ds[rule.source].shape != new.ds[name].shape \
            or t_new is None or t_ref is None:
        return found
    a, b = new.ds[name].values, ref.ds[name].values
    x_new = new.ds[rule.source].values.astype(np.float64)
    x_ref = ref.ds[rule.source].values.astype(np.float64)
    atol_x, how = allowed(rule.source)
    atol_t, _ = allowed.tolerance.atol(rule.threshold_kind, lambda: max(abs(t_new), abs(t_ref)), "",
                                       allowed.prob_scale)
    drift = abs(t_new - t_ref)
    margin = atol_x + drift
    v_new, v_ref = (np.abs(x_new), np.abs(x_ref)) if rule.absolute else (x_new, x_ref)
    with np.errstate(invalid="ignore"):
        near = (np.abs(v_new - t_new) <= margin) & (np.abs(v_ref - t_ref) <= margin) \
            & (np.abs(x_new - x_ref) <= atol_x)
    flipped = a != b
    bad = flipped & ~near if drift <= atol_t else flipped
    source = f"|{rule.source}|" if rule.absolute else rule.source
    threshold = f"{rule.threshold} {t_ref:.3g} -> {t_new:.3g}"
    allowed_text = f"flips where {source} is within {margin:.3g} of {rule.threshold} ({how})"
    if not bad.any():
        return Difference(name, role, f"{int(flipped.sum())} of {a.size} elements flip, each beside the threshold "
                          f"({threshold})", found.max_abs, None, found.where, found.values, allowed_text,
                          tolerated=True)
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    why = (f"the threshold moved beyond its tolerance {atol_t:.3g}" if drift > atol_t
           else f"{source} away from the threshold")
    return Difference(name, role, f"{int(bad.sum())} of {a.size} elements flip, {why} ({threshold})", None, None,
                      _where(new.ds[name], at), f"{bool(b[at])} ({rule.source} {x_ref[at]:.9g}) -> {bool(a[at])} "
                      f"({rule.source} {x_new[at]:.9g})", allowed_text)
