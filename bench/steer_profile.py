"""Where an interp engine's time goes in ``steer_overhead.py``: one untimed run per condition with the plugin's and
the runner's calls timed in every worker (``interp_runner.plugin.step_timers``, started and stopped through
``collective_rpc``, so TP workers' own processes too), and the table of it."""

from __future__ import annotations

import statistics


def planner_profile(llm, plan, engine, generate) -> dict:
    """Where a run's time goes (an untimed extra run): on the host, generation and the collection of results; in
    every worker, the plugin's planner, its after-forward work, its collect and the results' packing, and the
    runner's ``execute_model`` and ``sample_tokens``. Per rank: steps, mean / median / max microseconds, total
    milliseconds. ``generate(llm, plan, engine)`` makes the run and returns its ``wall_s`` and ``collect_s``."""
    llm.collective_rpc("interp_timers_start")
    try:
        run = generate(llm, plan, engine)
    finally:
        ranks = llm.collective_rpc("interp_timers_stop")
    return {"wall_s": run.wall_s, "collect_s": run.collect_s, "ranks": ranks}


def breakdown(results: list[dict]) -> str:
    """Per interp engine and condition: the median collection time of the timed runs, and the profiled run's
    milliseconds per call kind, summed over steps, on the result rank (rank 0) and the slowest other rank."""
    keys = ("planner", "after_forward", "site_ops", "execute_model", "sample_tokens", "collect", "send_results")
    lines = ["where the time goes (ms): the host's collect call (median of the timed runs); then, in one profiled run,",
             "each worker call kind summed over steps (rank 0 / slowest other rank)",
             f"{'model':<20}{'condition':<10}{'host':>9}  " + "  ".join(f"{k:>19}" for k in keys)]
    for result in results:
        for w in result["workers"]:
            if w.get("kind") != "interp" or "planner" not in w:
                continue
            label = result["model"] + (f" tp{result['tp']}" if result.get("tp", 1) > 1 else "")
            for cond, prof in w["planner"].items():
                ranks = prof.get("ranks") or [{}]
                cells = []
                for k in keys:
                    own = ranks[0].get(k, {}).get("total_ms")
                    other = max((r.get(k, {}).get("total_ms", 0.0) for r in ranks[1:]), default=None)
                    cell = "-" if own is None else f"{own:.1f}"
                    cells.append(cell + ("" if other is None else f" / {other:.1f}"))
                collect = statistics.median(w.get("collect_times_s", {}).get(cond) or [float("nan")]) * 1e3
                lines.append(f"{label:<20}{cond:<10}{collect:>9.1f}  " + "  ".join(f"{c:>19}" for c in cells))
    return "\n".join(lines)
