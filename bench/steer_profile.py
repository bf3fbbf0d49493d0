"""Where an interp engine's time goes in ``steer_overhead.py``: one untimed run per condition with the plugin's and
the runner's calls timed in every worker (``interp_runner.plugin.step_timers``, started and stopped through
``collective_rpc``, so TP workers' own processes too), and the table of it; on request, where the device's time goes
(``torch.profiler``) and where the host's goes (``cProfile``)."""

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


def device_profile(llm, plan, engine, generate) -> dict:
    """One more untimed run under ``torch.profiler`` (the engine runs in this process): its wall time, its device
    activity (kernels and copies: milliseconds in all, and the 12 largest by name), and the host's calls that wait for
    the device with the copies from pageable host memory, each of which waits for the stream too
    (``interp_runner.plugin.profiles``). Same kernels and device time in two conditions but a longer wall: the
    host, or a wait, takes the difference."""
    from interp_runner.plugin.profiles import DeviceProfile

    profile = DeviceProfile()
    run = generate(llm, plan, engine)
    summary = profile.stop()
    top = sorted(summary["all"].items(), key=lambda kv: -kv[1][1])[:12]
    return {"wall_s": run.wall_s, **summary, "top": dict(top)}


def device_table(results: list[dict]) -> str:
    """Per interp engine and condition, the profiled run's wall and device time; then, against idle, the kernels whose
    device time changed most, and the waits."""
    lines = []
    for model, prof in _profiles(results, "device_profile"):
        lines.append(f"device profile ({model}): one run per condition under torch.profiler")
        lines.append(f"{'condition':<10}{'wall ms':>10}{'device ms':>11}{'device calls':>14}  waits (calls, host ms)")
        for cond, p in prof.items():
            waits = ", ".join(f"{k} {n} / {ms:.1f}" for k, (n, ms) in p["waits"].items()) or "none"
            lines.append(f"{cond:<10}{p['wall_s'] * 1e3:>10.1f}{p['device_ms']:>11.2f}{p['device_calls']:>14}  {waits}")
        lines += _against_idle(prof, "all", 8, "")
    return "\n".join(lines)


def host_profile(llm, plan, engine, generate, runs: int = 3) -> dict:
    """``runs`` more untimed runs under ``cProfile`` (the engine runs in this thread;
    ``interp_runner.plugin.profiles.HostProfile``): each function's calls, own and cumulative time a run (the 400
    largest), and the garbage collector's passes and time a run. Two conditions with the same device work but
    different wall times differ here, where the host works or waits (a wait shows in the call that waits)."""
    from interp_runner.plugin.profiles import HostProfile

    profile = HostProfile()
    walls = [generate(llm, plan, engine).wall_s for _ in range(runs)]
    summary = profile.stop()
    return {"wall_s": statistics.median(walls), "gc_passes": summary["gc_passes"] / runs,
            "gc_ms": summary["gc_ms"] / runs,
            "funcs": {k: [calls / runs, own / runs, cum / runs] for k, (calls, own, cum) in summary["funcs"].items()}}


def host_table(results: list[dict]) -> str:
    """Per interp engine and condition, the profiled runs' wall and the collector's time; then, against idle, the
    functions whose own time a run changed most."""
    lines = []
    for model, prof in _profiles(results, "host_profile"):
        lines.append(f"host profile ({model}): runs under cProfile, per run")
        for cond, p in prof.items():
            lines.append(f"{cond:<10} wall {p['wall_s'] * 1e3:8.1f} ms  gc {p['gc_passes']:6.1f} passes "
                         f"{p['gc_ms']:6.2f} ms")
        lines += _against_idle(prof, "funcs", 14, " own")
    return "\n".join(lines)


def _profiles(results: list[dict], key: str):
    """(model, profile by condition) of every engine that made a ``key`` profile."""
    for result in results:
        for w in result["workers"]:
            if w.get(key):
                yield result["model"], w[key]


def largest_changes(base: dict, other: dict, top: int) -> list[tuple[str, list, list]]:
    """The ``top`` names whose milliseconds (``name: [calls, ms, ...]``) changed most from ``base`` to ``other``, each
    with its two rows (a name missing on one side counts as zero calls and time there)."""
    zero = [0, 0.0]
    rows = [(name, base.get(name, zero), other.get(name, zero)) for name in set(base) | set(other)]
    return sorted(rows, key=lambda r: -abs(r[2][1] - r[1][1]))[:top]


def _against_idle(prof: dict, table: str, top: int, what: str) -> list[str]:
    """Per condition but idle, its ``top`` largest changes against idle in ``prof[condition][table]``."""
    idle = prof.get("idle")
    lines = []
    for cond, p in prof.items():
        if idle is None or cond == "idle":
            continue
        for name, before, after in largest_changes(idle[table], p[table], top):
            lines.append(f"  {cond} vs idle: {after[1] - before[1]:+8.2f} ms{what} ({before[0]:.0f} -> {after[0]:.0f} "
                         f"calls) {name[:100]}")
    return lines
