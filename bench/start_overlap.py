"""Would compiling the plan while the engine starts pay? Sequential against overlapped, in fresh processes.

`interp-run` compiles the plan, then starts the engine with the sites and bank rows the plan needs. Overlapping
the two needs that engine spec before the plan. This bench measures what the overlap would save before any of it
is built: it compiles the plan once to learn the spec, then times fresh processes that either compile and then
start the engine (`seq`), or start the engine in a thread with that spec while the main thread compiles (`thread`;
both hold Python's GIL for much of their work). Runs alternate A B A B; the table shows each run's phases.

    python bench/start_overlap.py --repeats 2 --json out.json -- +experiment=causal_trace_full
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def config_of(overrides: list[str]) -> dict:
    import interp_runner.cli  # noqa: F401  (registers the config resolvers)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def one_run(mode: str, overrides: list[str], spec_file: Path) -> dict:
    import msgspec

    from interp_runner.engine.adapter import VllmEngine
    from interp_runner.engine.settings import on_gpu
    from interp_runner.payload import EngineSpec
    from interp_runner.pipeline import prepare
    from interp_runner.config.run import validate_config

    t0 = time.perf_counter()
    config = config_of(overrides)
    cfg = validate_config(config)
    engine_cfg = cfg.engine.resolved(on_gpu(), decodes=False)
    out: dict = {}

    def start(spec: EngineSpec, folder: str) -> None:
        t = time.perf_counter()
        out["engine"] = VllmEngine(folder, engine_cfg, spec)
        out["engine_s"] = time.perf_counter() - t

    if mode == "spec":
        prepared = prepare(config, base=REPO)
        spec = prepared.plan.engine_spec
        spec_file.write_text(json.dumps({"folder": str(prepared.facts.path), "spec": msgspec.to_builtins(spec)}))
        return {"requests": len(prepared.plan.requests)}
    known = json.loads(spec_file.read_text())
    spec = msgspec.convert(known["spec"], EngineSpec)
    if mode == "seq":
        t = time.perf_counter()
        prepared = prepare(config, base=REPO)
        plan_s = time.perf_counter() - t
        start(prepared.plan.engine_spec, known["folder"])
    else:
        thread = threading.Thread(target=start, args=(spec, known["folder"]))
        t = time.perf_counter()
        thread.start()
        prepared = prepare(config, base=REPO)
        plan_s = time.perf_counter() - t
        thread.join()
        assert prepared.plan.engine_spec == spec
    total = time.perf_counter() - t0
    return {"mode": mode, "plan_s": round(plan_s, 2), "engine_s": round(out["engine_s"], 2),
            "to_ready_s": round(total, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", choices=("spec", "seq", "thread"), help=argparse.SUPPRESS)
    ap.add_argument("--spec-file", type=Path, default=Path("/tmp/start_overlap_spec.json"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_run(args.one, args.overrides, args.spec_file)), flush=True)
        return
    rows = []
    for mode in ["spec"] + ["seq", "thread"] * args.repeats:
        cmd = [sys.executable, __file__, "--one", mode, "--spec-file", str(args.spec_file), "--", *args.overrides]
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not lines:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            raise SystemExit(f"{mode} failed ({done.returncode})")
        row = {**json.loads(lines[-1][7:]), "wall_s": round(wall, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\n| mode | plan s | engine s | plan + engine s | process wall s |\n|---|---|---|---|---|")
    for r in rows[1:]:
        print(f"| {r['mode']} | {r['plan_s']} | {r['engine_s']} | {r['to_ready_s']} | {r['wall_s']} |")


if __name__ == "__main__":
    main()
