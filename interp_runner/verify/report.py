"""Compare two stores array by array under the rule ``rules.choose_tolerance`` picks, and print what differs."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from interp_runner.verify.arrays import Difference, check_forced_greedy, compare_top_k, compare_variable, is_float, peak
from interp_runner.verify.derived import Allowed, compare_derived
from interp_runner.verify.rules import Tolerance, choose_tolerance
from interp_runner.verify.stores import Store, VerifyError, check_readable

# root attributes written by the provenance manifest and the run's status, not results
MANIFEST_KEYS = frozenset({
    "schema", "config_yaml", "config_sha256", "command", "overrides", "experiment", "experiments_dir", "package",
    "versions", "model", "seeds", "requests_sha256", "num_requests", "plugin", "host", "started_at",
    "finished_at", "status", "error", "engine", "figures", "exports", "timings", "run_key", "kind",
    "companions",
})
PROVENANCE = (
    ("versions", lambda a: a.get("versions")),
    ("model.weights_sha256", lambda a: (a.get("model") or {}).get("weights_sha256")),
    ("host", lambda a: a.get("host")),
    ("package.git_sha", lambda a: (a.get("package") or {}).get("git_sha")),
    ("package.git_dirty", lambda a: (a.get("package") or {}).get("git_dirty")),
    ("plugin.fingerprint", lambda a: (a.get("plugin") or {}).get("fingerprint")),
    ("engine.dtype", lambda a: (a.get("engine") or {}).get("dtype")),
    ("requests_sha256", lambda a: a.get("requests_sha256")),
    ("config_sha256", lambda a: a.get("config_sha256")),
)


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def provenance_differences(new: Store, ref: Store) -> list[tuple[str, object, object]]:
    """(key, reference value, new value) for each provenance entry that differs; dicts key by key."""
    out = []
    for key, get in PROVENANCE:
        a, b = get(ref.attrs), get(new.attrs)
        if isinstance(a, dict) or isinstance(b, dict):
            fa, fb = _flat(a or {}, key), _flat(b or {}, key)
            out += [(k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]
        elif a != b:
            out.append((key, a, b))
    if ref.attrs.get("config_sha256") != new.attrs.get("config_sha256"):
        fa, fb = _flat(ref.config, "config"), _flat(new.config, "config")
        out += [(k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]
    return out


def result_attribute_differences(new: Store, ref: Store) -> list[tuple[str, object, object]]:
    """Root attributes that are results (noise floor, filtered facts, voided requests, ...), shown as context:
    the arrays they summarize are compared already."""
    keys = (ref.attrs.keys() | new.attrs.keys()) - MANIFEST_KEYS
    return [(k, ref.attrs.get(k), new.attrs.get(k)) for k in sorted(keys) if ref.attrs.get(k) != new.attrs.get(k)]


@dataclass
class Report:
    new: Store
    ref: Store
    tolerance: Tolerance
    differences: list[Difference] = field(default_factory=list)  # mismatches
    tolerated: list[Difference] = field(default_factory=list)  # differences within the tolerance
    provenance: list[tuple[str, object, object]] = field(default_factory=list)
    attributes: list[tuple[str, object, object]] = field(default_factory=list)
    compared: int = 0

    @property
    def ok(self) -> bool:
        return not self.differences

    def add(self, found: Difference | None) -> None:
        if found is not None:
            (self.tolerated if found.tolerated else self.differences).append(found)


def _unreadable(name: str, stores: tuple[Store, Store], err: Exception) -> VerifyError:
    """A VerifyError naming the array and the store whose chunk could not be read."""
    for store in stores:
        try:
            check_readable(store)
        except VerifyError as found:
            return found
    return VerifyError(f"array {name!r} cannot be compared ({type(err).__name__}: {err})")


def probability_scale(store: Store) -> Callable[[], float]:
    """The store's largest probability (over its probability arrays), computed once when first asked."""
    found: list[float] = []

    def scale() -> float:
        if not found:
            probabilities = [v for n, v in store.ds.data_vars.items()
                             if store.kind.value_kind(str(n)) == "probability" and is_float(v.dtype)]
            found.append(max((peak(v) for v in probabilities), default=0.0))
        return found[0]

    return scale


def _compare_one(name: str, role: str, new: Store, ref: Store, tolerance: Tolerance,
                 prob_scale: Callable[[], float], allowed: Allowed) -> Difference | None:
    derived = compare_derived(name, role, allowed)  # judged with the tolerance of what it derives from
    if derived is not False:
        return derived
    a, b = new.ds[name], ref.ds[name]
    top_k = name == "top_token_ids" and "top_logprob" in new.ds and "top_logprob" in ref.ds
    if top_k and not tolerance.exact:
        return compare_top_k(a, new.ds["top_logprob"], b, ref.ds["top_logprob"], tolerance)
    return compare_variable(name, role, a, b, tolerance, prob_scale, ref.kind.value_kind)


def compare(new: Store, ref: Store, exact: bool = False) -> Report:
    """Compare ``new`` with the reference ``ref``: every data variable and coordinate."""
    tolerance = choose_tolerance(new, ref, exact)
    report = Report(new, ref, tolerance)
    prob_scale = probability_scale(ref)
    allowed = Allowed(new, ref, tolerance, prob_scale)
    for role, names in (("data", lambda ds: ds.data_vars), ("coord", lambda ds: ds.coords)):
        new_names, ref_names = set(names(new.ds)), set(names(ref.ds))
        for name in sorted(ref_names - new_names):
            report.differences.append(Difference(str(name), role, f"missing from {new.path.name}"))
        for name in sorted(new_names - ref_names):
            report.differences.append(Difference(str(name), role, f"not in {ref.path.name}"))
        for name in sorted(new_names & ref_names):
            report.compared += 1
            try:
                report.add(_compare_one(str(name), role, new, ref, tolerance, prob_scale, allowed))
            except Exception as err:  # a chunk that does not decode: no comparison (exit 2)
                raise _unreadable(str(name), (new, ref), err) from None
    greedy = {"tokens", "logprob", "top_logprob"} <= set(new.ds.data_vars)
    if tolerance.teacher_forced and new.greedy and greedy and is_float(new.ds["logprob"].dtype):
        report.add(check_forced_greedy(new.ds["tokens"], new.ds["logprob"], new.ds["top_logprob"], tolerance))
    report.provenance = provenance_differences(new, ref)
    report.attributes = result_attribute_differences(new, ref)
    return report


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _short(value, width: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def print_report(report: Report, out=None) -> None:
    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    p(f"reference: {report.ref.path}")
    p(f"compared:  {report.new.path}")
    p(f"comparison: {report.tolerance.describe()}")
    if report.provenance:
        p("\nprovenance differences (information only):")
        for key, a, b in report.provenance:
            p(f"  {key}: {_short(a)} -> {_short(b)}")
    if report.attributes:
        p("\nresult attributes that differ (their arrays are compared below):")
        for key, a, b in report.attributes:
            p(f"  {key}: {_short(a)} -> {_short(b)}")
    if report.tolerated:
        p("\nwithin tolerance:")
        _table(report.tolerated, p)
    if report.ok:
        p(f"\nOK: all {report.compared} arrays match" + (" (within tolerance)" if report.tolerated else ""))
        return
    one_sided = sum(1 for d in report.differences if d.note.startswith(("missing from", "not in")))
    p(f"\nMISMATCH: {len(report.differences) - one_sided} of {report.compared} arrays in both stores differ"
      + (f", {one_sided} in only one store" if one_sided else ""))
    _table(report.differences, p)
    forked = any(d.name == "tokens" and d.allowed == "exact" for d in report.differences)
    if forked and not report.tolerance.exact and not report.tolerance.teacher_forced:
        p("\nthe generated tokens fork; on another kernel path near ties may do so legitimately: "
          "`interp-verify REFERENCE --rerun` compares a rerun teacher-forced to the reference's tokens")


def _table(differences: list[Difference], p) -> None:
    header = ("array", "max abs diff", "max rel diff", "allowed", "where (worst)", "reference -> compared", "what")
    rows = [(f"{d.name}{' (coord)' if d.role == 'coord' else ''}", _num(d.max_abs), _num(d.max_rel), d.allowed or "-",
             d.where or "-", d.values or "-", d.note) for d in differences]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    p("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for row in rows:
        p("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
