"""Two code trees' bench results side by side, paired: the files bench/split_compare.sh leaves in one folder
(``bench_smollm2_<label>.json`` and ``trace_grid_<label>.json``, label = tree + round: before1, after1, ...).

- Steering and capture: each tree's overhead against idle, judged as steer_overhead.py judges it (median of
  paired ratios within ABBA rounds of one engine, 95% order-statistic interval, met only when all of it meets
  the goal), with the rounds of the tree's engines pooled.
- Between the trees: round k of ``before<i>`` paired with round k of ``after<i>`` (the engines ran one after the
  other on the same machine, in ABBA order over i), after / before - 1, median and 95% interval. "same" when
  the interval holds 0, otherwise "faster" or "slower".
- Trace grids: ours, HF (same process, alternating with ours) and the speedup per tree; between the trees the
  repeats paired by index, raw and divided by the same repeat's HF time (which cancels the GPU's drift), and
  split into stage 0 (one ``engine.run``) and the cells (every later ``engine.run``: one or several units).

    python bench/split_compare.py DIR            # Markdown tables
    python bench/split_compare.py DIR --json F   # and every number, with the raw results (F can be read back)
    python bench/split_compare.py F              # the tables again, from such a file
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import goal_of, median_interval, paired_ratios  # noqa: E402

TREES = ("before", "after")
LABEL = re.compile(r"^(bench_smollm2|trace_grid)_(before|after)(\d+)\.json$")


def raw_results(source: Path) -> dict:
    """file name -> result: the files of a folder, or the ``raw`` of a file written by ``--json``."""
    if source.is_dir():
        return {p.name: json.loads(p.read_text()) for p in sorted(source.glob("*.json")) if LABEL.match(p.name)}
    return json.loads(source.read_text())["raw"]


def load(raw: dict) -> dict:
    """{'small' | 'trace': {tree: {round: result}}}"""
    out = {"small": {t: {} for t in TREES}, "trace": {t: {} for t in TREES}}
    for name, result in sorted(raw.items()):
        m = LABEL.match(name)
        if m:
            kind = "small" if m[1] == "bench_smollm2" else "trace"
            out[kind][m[2]][int(m[3])] = result
    return out


def summary(changes: list[float]) -> dict:
    interval = median_interval(changes)
    verdict = "-" if interval is None else (
        "same" if interval[0] <= 0 <= interval[1] else "faster" if interval[1] < 0 else "slower")
    return {"n": len(changes), "median": statistics.median(changes) if changes else None,
            "interval": interval, "verdict": verdict}


def pairs(before: dict, after: dict, values) -> list[float]:
    """after / before - 1 for round k of before<i> and after<i>, every i both trees ran."""
    out = []
    for i in sorted(set(before) & set(after)):
        out += [a / b - 1 for a, b in zip(values(after[i]), values(before[i]))]
    return out


def interp_worker(result: dict) -> dict:
    return next(w for w in result["workers"] if w.get("kind") == "interp" and "times_s" in w)


def small_tables(runs: dict) -> tuple[str, dict]:
    numbers = {"per_tree": {}, "between": {}}
    lines = ["| tree | engines (rounds) | idle s | steered paired [95%] | goal | capture paired [95%] | goal |",
             "|---|---|---|---|---|---|---|"]
    for tree in TREES:
        workers = [interp_worker(r) for _, r in sorted(runs[tree].items())]
        if not workers:
            continue
        times = {c: [t for w in workers for t in w["times_s"][c]] for c in workers[0]["times_s"]}
        row = {"rounds": len(times["idle"]), "idle_median_s": statistics.median(times["idle"])}
        cells = []
        for cond in ("steered", "capture"):
            if cond not in times:
                cells += ["–", "–"]
                continue
            s = summary(paired_ratios(times, cond))
            _, met = goal_of(cond, s["median"], "smollm2", s["interval"])
            row[cond] = {**s, "goal_met": met}
            cells += [f"{s['median']:+.2%} [{s['interval'][0]:+.2%}, {s['interval'][1]:+.2%}]", met]
        numbers["per_tree"][tree] = row
        lines.append(f"| {tree} | {len(workers)} ({row['rounds']}) | {row['idle_median_s']:.4f} | " + " | ".join(cells)
                     + " |")
    before = {i: interp_worker(r) for i, r in runs["before"].items()}
    after = {i: interp_worker(r) for i, r in runs["after"].items()}
    lines += ["", "| after vs before | pairs | median | 95% interval | verdict |", "|---|---|---|---|---|"]
    for cond in ("idle", "steered", "capture"):
        if not before or cond not in next(iter(before.values()))["times_s"]:
            continue
        s = summary(pairs(before, after, lambda w: w["times_s"][cond]))
        numbers["between"][cond] = s
        lines.append(row_of(f"{cond} time", s))
    for cond in ("steered", "capture"):  # the overhead itself: (after cond / idle) / (before cond / idle)
        if not before or cond not in next(iter(before.values()))["times_s"]:
            continue
        s = summary(pairs(before, after, lambda w: [1 + r for r in paired_ratios(w["times_s"], cond)]))
        numbers["between"][f"{cond}_overhead"] = s
        lines.append(row_of(f"{cond} / idle of the same round", s))
    return "\n".join(lines), numbers


def row_of(what: str, s: dict) -> str:
    if s["interval"] is None:
        return f"| {what} | {s['n']} | – | – | – |"
    return (f"| {what} | {s['n']} | {s['median']:+.2%} | [{s['interval'][0]:+.2%}, {s['interval'][1]:+.2%}] | "
            f"{s['verdict']} |")


def trace_tables(runs: dict) -> tuple[str, dict]:
    numbers = {"per_tree": {}, "between": {}}
    lines = ["| tree | prompt | runs | ours s | stage 0 s | cells s (engine runs) | HF s | speedup | "
             "paired speedup [95%] | plugin |", "|---|---|---|---|---|---|---|---|---|---|"]
    by_length = {}  # (tree, tokens) -> {round: row}
    for tree in TREES:
        for i, result in sorted(runs[tree].items()):
            for row in result["lengths"]:
                row = {**row, "plugin": result["versions"]["plugin"]}
                by_length.setdefault((tree, row["tokens"]), {})[i] = row
    for (tree, n), rows in sorted(by_length.items(), key=lambda kv: (kv[0][1], TREES.index(kv[0][0]))):
        ours = [t for r in rows.values() for t in r["ours_times_s"]]
        stage0 = [s[0] for r in rows.values() for s in r["ours_stage_times_s"]]
        cells = [sum(s[1:]) for r in rows.values() for s in r["ours_stage_times_s"]]
        runs_of_cells = sorted({len(s) - 1 for r in rows.values() for s in r["ours_stage_times_s"]})
        hf = [t for r in rows.values() for t in r.get("hf_times_s", [])]
        speed = summary([h / o - 1 for r in rows.values()
                         for o, h in zip(r["ours_times_s"], r.get("hf_times_s", []))])
        row = {"runs": len(ours), "ours_median_s": statistics.median(ours),
               "stage0_median_s": statistics.median(stage0), "cells_median_s": statistics.median(cells),
               "cell_engine_runs": runs_of_cells,
               "hf_median_s": statistics.median(hf) if hf else None, "paired_speedup": speed,
               "plugins": sorted({r["plugin"] for r in rows.values()})}
        numbers["per_tree"][f"{tree}_{n}"] = row
        ratio = f"{row['hf_median_s'] / row['ours_median_s']:.2f}×" if hf else "–"
        paired = (f"{1 + speed['median']:.2f}× [{1 + speed['interval'][0]:.2f}, {1 + speed['interval'][1]:.2f}]"
                  if speed["interval"] else "–")
        lines.append(f"| {tree} | {n} tokens | {row['runs']} | {row['ours_median_s']:.3f} | "
                     f"{row['stage0_median_s']:.4f} | {row['cells_median_s']:.3f} "
                     f"({', '.join(map(str, runs_of_cells))}) | {row['hf_median_s'] or 0:.3f} | {ratio} | {paired} | "
                     f"`{', '.join(row['plugins'])}` |")
    lines += ["", "| after vs before | pairs | median | 95% interval | verdict |", "|---|---|---|---|---|"]
    for n in sorted({n for _, n in by_length}):
        before, after = by_length.get(("before", n), {}), by_length.get(("after", n), {})
        raw = summary(pairs(before, after, lambda r: r["ours_times_s"]))
        stage0 = summary(pairs(before, after, lambda r: [s[0] for s in r["ours_stage_times_s"]]))
        cells = summary(pairs(before, after, lambda r: [sum(s[1:]) for s in r["ours_stage_times_s"]]))
        per_hf = summary(pairs(before, after, lambda r: [o / h for o, h in zip(r["ours_times_s"], r["hf_times_s"])]))
        numbers["between"][n] = {"ours": raw, "stage0": stage0, "cells": cells, "ours_per_hf": per_hf}
        lines += [row_of(f"{n} tokens: ours", raw), row_of(f"{n} tokens: ours / HF of the same repeat", per_hf),
                  row_of(f"{n} tokens: stage 0", stage0), row_of(f"{n} tokens: cells", cells)]
    return "\n".join(lines), numbers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="a folder of results, or a file written by --json")
    ap.add_argument("--json", default="", help="write every number here, and the raw results")
    args = ap.parse_args(argv)
    raw = raw_results(args.source)
    runs = load(raw)
    out = {}
    if any(runs["small"].values()):
        text, out["small"] = small_tables(runs["small"])
        print("Steering and capture (SmolLM2-135M, interp engine)\n\n" + text + "\n")
    if any(runs["trace"].values()):
        text, out["trace"] = trace_tables(runs["trace"])
        print("Causal-trace grids\n\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": out, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
