"""Whole-process wall time of `interp-run`, as a user waits for it, over repeated runs of named variants.

Each run is a fresh process (`python -m interp_runner ...`) writing its own store; the table shows the wall time
and where it went, from the store's provenance (`timings`: plan, engine, run, store, figures; `engine.startup`:
vLLM's own phase timings and whether its compile cache was hit). Runs go in the order given, so the first run of
a variant on a fresh machine is its cold start and later ones are warm.

    python bench/run_wall.py --variant eager:engine.enforce_eager=true --variant compiled:engine.enforce_eager=false \
        --repeats 2 --json out.json -- +experiment=causal_trace
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_once(overrides: list[str], store: Path, log: Path) -> dict:
    cmd = [sys.executable, "-m", "interp_runner", *overrides, f"store.path={store}",
           f"hydra.run.dir={store.parent / (store.stem + '-hydra')}"]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    row = {"wall_s": round(wall, 1), "rc": rc, "log": str(log)}
    if rc == 0:
        import zarr

        attrs = dict(zarr.open_group(str(store), mode="r").attrs)
        row["timings"] = attrs.get("timings", {})
        row["startup"] = (attrs.get("engine") or {}).get("startup", {})
        row["dtype"] = (attrs.get("engine") or {}).get("dtype")
    else:  # the run's own words on why, kept in the result (the log stays on the machine that ran it)
        row["error"] = log.read_text(errors="replace").strip().splitlines()[-3:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:override,override,... (default: one variant 'default' with no overrides)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--interleave", action="store_true", help="A B A B instead of A A B B")
    ap.add_argument("--dir", type=Path, default=None,
                    help="a folder to make this call's own folder in (default: the system's temporary folder)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="overrides for every run (after --)")
    args = ap.parse_args()
    variants = [(v.split(":", 1)[0], [o for o in v.split(":", 1)[1].split(",") if o]) if ":" in v else (v, [])
                for v in args.variant] or [("default", [])]
    # a folder of this call's own: a store left by an earlier call, or by another tree's bench beside this one,
    # is not this run's to replace (interp-run refuses it)
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="run-wall-", dir=args.dir))
    order = [(name, extra, i) for i in range(args.repeats) for name, extra in variants] if args.interleave \
        else [(name, extra, i) for name, extra in variants for i in range(args.repeats)]
    rows = []
    for name, extra, i in order:
        store = folder / f"{name}-{i}.zarr"
        row = {"variant": name, "repeat": i, **run_once([*args.overrides, *extra], store, folder / f"{name}-{i}.log")}
        rows.append(row)
        t, s = row.get("timings", {}), row.get("startup", {})
        print(f"{name:>12} #{i}: {row['wall_s']:7.1f} s  rc={row['rc']}  plan {t.get('plan_s', '-')}  "
              f"engine {t.get('engine_s', '-')} (compile {s.get('compile_s', '-')}, cache {s.get('compile_cache', '-')}, "
              f"graphs {s.get('graphs_s', '-')}, profile {s.get('profile_s', '-')})  run {t.get('run_s', '-')}  "
              f"store {t.get('store_s', '-')}  figures {t.get('figures_s', '-')}", flush=True)
        for line in row.get("error", []):
            print(f"{'':>14}{line}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "cpus": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
