"""The paired-interval method of the overhead benches, and their results table.

Each timed run of a condition is paired with the reference run of the same ABBA round (``paired_ratios``), which
cancels the slow drifts of a shared host; the change is the median of those ratios, and a goal is met only when the
median's whole distribution-free 95% interval meets it (``median_interval``, ``goal_of``). Used by
``steer_overhead.py``, ``split_compare.py``, ``serve_bench.py`` and ``tp_large.sh``.
"""

from __future__ import annotations

import math
import statistics

# condition -> (reference condition, limit): end-to-end time at most +limit, or (negative) throughput at least
# limit; steering is held to +1% on the GPU-bound 8B shape, +3% on small host-bound models. Judged on the
# median of paired ratios: each run against the reference run next to it in the same ABBA round, which cancels
# the slow drifts of a shared host; met only when the median's whole 95% interval meets the goal.
GOALS = {"steered": ("idle", 0.03), "capture": ("idle", -0.03)}
GOALS_8B = {**GOALS, "steered": ("idle", 0.01)}


def paired_ratios(times: dict, name: str) -> list[float]:
    """Each run of ``name`` against the idle run of the same ABBA round: its time / idle's - 1."""
    return [a / b - 1 for a, b in zip(times[name], times["idle"])]


def paired_changes(times: dict) -> dict:
    """condition -> median over ABBA rounds of (its run / the idle run of the same round) - 1."""
    if "idle" not in times:
        return {}
    return {name: statistics.median(paired_ratios(times, name)) for name in times if name != "idle"}


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: the widest pair of order statistics (k-th smallest,
    k-th largest) whose binomial coverage is at least ``level``; None when there are too few values."""
    n = len(values)
    ordered = sorted(values)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if coverage < level:
            break
        best = (ordered[k - 1], ordered[n - k])
    return best


def goal_of(condition: str, change: float | None, model: str = "",
            interval: tuple[float, float] | None = None) -> tuple[str, str]:
    """(goal, met?) of a condition's paired change of time against its reference condition, where timed.
    With the median's confidence interval: "yes" when all of it meets the goal, "NO" when none does, and
    "noise" when it straddles the limit (more rounds, or a quieter host, would decide)."""
    goals = GOALS_8B if "8b" in model else GOALS
    if condition not in goals or change is None:
        return "", ""
    against, limit = goals[condition]
    if limit < 0:  # a throughput floor: a time change c is a throughput change 1 / (1 + c) - 1
        goal, meets = f"tok/s>={limit:+.0%} vs {against}", lambda c: 1 / (1 + c) - 1 >= limit
    else:
        goal, meets = f"<={limit:+.0%} vs {against}", lambda c: c <= limit
    if interval is None:
        return goal, "yes" if meets(change) else "NO"
    lo, hi = (meets(c) for c in interval)
    return goal, "yes" if lo and hi else "NO" if not (lo or hi) else "noise"


def check_of(worker: dict, condition: str) -> str:
    if condition == "capture" and "capture_check" in worker:
        c = worker["capture_check"]
        lo, hi = c["rows_per_request"]
        rows = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return f"{c['requests']} req x {rows} rows, {c['runs_checked']} runs ok"
    changed = worker.get(f"{condition}_requests_changed")
    return f"{changed} changed" if changed else ""


def table(results: list[dict]) -> str:
    rows = [("model", "engine", "condition", "median s", "min s", "tok/s", "vs idle", "paired", "95% interval",
             "cpu paired", "vs stock", "goal", "met?", "runs", "check")]
    for res in results:
        model, workers = res["model"] + (f" tp{res['tp']}" if res.get("tp", 1) > 1 else ""), res["workers"]
        stock = next((w["median_s"].get("stock") for w in workers if w.get("kind") == "stock" and "median_s" in w),
                     None)
        idle = next((w["median_s"].get("idle") for w in workers if w.get("kind") == "interp" and "median_s" in w),
                    None)
        tokens = res["batch"] * res["max_tokens"]
        for w in workers:
            if "median_s" not in w:
                rows.append((model, w["kind"], "-", w.get("error", "?"), *[""] * 11))
                continue
            for cond, med in w["median_s"].items():
                rel_idle = f"{med / idle - 1:+.2%}" if idle and w["kind"] == "interp" else ""
                rel_stock = f"{med / stock - 1:+.2%}" if stock else ""
                paired = paired_changes(w["times_s"]).get(cond)
                interval = (median_interval(paired_ratios(w["times_s"], cond))
                            if paired is not None else None)
                goal, met = goal_of(cond, paired, model, interval) if w["kind"] == "interp" else ("", "")
                shown = f"[{interval[0]:+.2%}, {interval[1]:+.2%}]" if interval else ""
                cpu = paired_changes(w["cpu_times_s"]).get(cond) if "cpu_times_s" in w else None
                rows.append((model, w["kind"], cond, f"{med:.4f}", f"{min(w['times_s'][cond]):.4f}",
                             f"{tokens / med:.0f}", rel_idle, "" if paired is None else f"{paired:+.2%}", shown,
                             "" if cpu is None else f"{cpu:+.2%}", rel_stock, goal, met, str(len(w["times_s"][cond])),
                             check_of(w, cond)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
