"""Steering and capture overhead: end-to-end generation time of one interp engine with the plugin idle vs every
request steered vs every request captured, next to a stock engine without any interp spec.

Rows (each engine in its own process, built once, warmed up, then timed):

- ``interp``: a VllmEngine built with steering ops at every layer of one hook (and, with the ``capture``
  condition, capture at those same sites). The ``--conditions`` run on that same engine, interleaved (ABBA,
  ABCCBA, ...): ``idle`` (requests carry no interventions), ``steered`` (every request steered at every layer
  of the hook; ``--vectors`` distinct vectors spread over the batch) and ``capture`` (every request captures
  its last prompt position at every layer of the hook). The requests of each condition are compiled from a
  config by ``interp_runner.pipeline.prepare``, as a run compiles them, and the engine is built with the union
  of their engine specs. After every timed ``capture`` run the captured rows are counted: each request must
  bring back one row per layer (its last prompt position, ``hidden`` finite values), or the run fails.
- ``stock``: plain vLLM, same settings and requests, no interp spec (the plugin is registered but the engine
  is not instrumented), on the model runner the interp engine takes (the caller's ``VLLM_USE_V2_MODEL_RUNNER``
  or vLLM's pick).
- ``stock-default`` (optional): plain vLLM with the plugin disabled and vLLM's default model runner.

Every request decodes exactly ``--max-tokens`` tokens (``ignore_eos``), greedy, no detokenization, and every run
starts with an empty prefix cache (so no condition reads an earlier run's prompts from it); the time is
the wall time of ``LLM.generate`` over the whole batch, on the interp engine followed by ``VllmEngine.collect``,
which takes the requests' results off the workers (as ``VllmEngine.run`` does; for ``idle`` and ``steered`` it
returns nothing). Goals, in the table: ``steered`` at most +3% time vs ``idle``, ``idle`` at most +1% vs
``stock``, ``capture`` at most 3% less throughput than ``idle``. Prints a table last, then where the interp
engine's time goes (the collect call's share of each timed run, and one untimed run per condition with the plugin's
and the runner's calls timed in every worker, TP workers included); ``--json`` keeps everything.

    python bench/steer_overhead.py --model smollm2_135m
    python bench/steer_overhead.py --model llama8b-random          # random-weight 8B-shaped Llama
    python bench/steer_overhead.py --device-profile                # and where the device's time goes, by kernel
    python bench/steer_overhead.py --host-profile                  # and where the host's time goes, by function
    python bench/steer_overhead.py --model tiny_random --dtype float32 --eager --batch 4 --max-tokens 8 \\
        --repeats 2 --vectors 2                                     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules beside this one

from paired import median_interval, paired_changes, paired_ratios, table  # noqa: E402
from random_llama import llama_shape, random_llama  # noqa: E402
from steer_profile import (breakdown, device_profile, device_table, host_profile, host_table,  # noqa: E402
                           planner_profile)

TOPICS = ["a lighthouse keeper", "the history of bread", "a journey to Mars", "an old clock", "the ocean floor",
          "a chess tournament", "a city in the rain", "the first computer", "a mountain village", "a lost dog",
          "the northern lights", "a jazz musician", "a garden in winter", "a train at night", "a desert festival",
          "a library of maps"]
CONDITIONS = ("idle", "steered", "capture")


# -- models -------------------------------------------------------------------------------------------


def resolve_model(args) -> tuple[Path, bool]:
    """(model folder, use vLLM's dummy loader)."""
    from interp_runner.models.materialize import model_path

    if args.model in ("llama8b-random", "random-llama"):
        shape = llama_shape(args.llama_shape)
        tag = "-".join(str(v) for v in shape.values())
        folder = Path(args.scratch) / f"llama-{tag}-{args.weights}"
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return random_llama(folder, shape, args.weights, device), args.weights == "dummy"
    return model_path(args.model), False


# -- requests -----------------------------------------------------------------------------------------


def plans(args, folder: Path) -> dict:
    """Plans by condition, compiled from configs: the same prompts and sampling; ``steered`` steers every
    request, ``capture`` captures every request's last prompt position at every layer of ``--hook``."""
    from interp_runner.pipeline import prepare

    prompts = [f"Request {i}. Write a long and detailed story about {TOPICS[i % len(TOPICS)]}, "
               f"chapter {i // len(TOPICS) + 1}:" for i in range(args.batch)]
    base = {
        # a dummy-weights folder has no weight files: compiled as seeded weights (the engine draws vLLM's dummy ones)
        "model": {"name": "bench", "path": str(folder), **({"weights": "seeded"} if args.dummy else {})},
        "engine": {"dtype": args.dtype, "enforce_eager": args.eager, "max_model_len": args.max_model_len,
                   "tensor_parallel_size": args.tp},
        "prompts": {"items": prompts},
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0},
    }
    steering = {"request": [
        {"prompts": [i for i in range(args.batch) if i % args.vectors == k],
         "base": {args.hook: {"layer": "all", "vector": {"random": {"seed": k, "norm": args.norm}}}}}
        for k in range(min(args.vectors, args.batch))
    ]}
    capture = [{"name": "acts", "hooks": [args.hook], "layers": "all", "positions": "last_prompt"}]
    out = {
        "idle": prepare(base).plan,
        "steered": prepare({**base, "steering": steering}).plan,
        "capture": prepare({**base, "capture": capture}).plan,
    }
    for plan in out.values():
        for request in plan.requests:
            request.sampling.update(ignore_eos=True, detokenize=False)
    return out


def engine_spec(plans_by_condition: dict, conditions: list[str], steer_sites: list[int]):
    """Steering ops at every layer of the hook (always), plus the sites the chosen conditions need."""
    from interp_runner.payload import EngineSpec

    spec = EngineSpec(tuple(steer_sites), ())
    for name in conditions:
        spec = spec.union(plans_by_condition[name].engine_spec)
    return spec


# -- one engine (worker process) ----------------------------------------------------------------------


def engine_settings(args) -> dict:
    return dict(dtype=args.dtype, enforce_eager=args.eager, max_model_len=args.max_model_len,
                max_num_seqs=args.batch, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
                tensor_parallel_size=args.tp)


def use_dummy_loader() -> None:
    import vllm

    llm = vllm.LLM

    def dummy_llm(*a, **kw):
        kw.setdefault("load_format", "dummy")
        return llm(*a, **kw)

    vllm.LLM = dummy_llm


def build(kind: str, args, folder: Path, dummy: bool, spec):
    """(LLM, VllmEngine or None)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if kind == "stock":  # on the runner the interp engine takes (engine.model_runner: auto): the caller's or vLLM's
        os.environ["INTERP_RUNNER_PLUGIN"] = "1"  # registered, but this engine carries no interp spec
    elif kind == "stock-default":
        os.environ.pop("INTERP_RUNNER_PLUGIN", None)
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if dummy:
        use_dummy_loader()
    if kind == "interp":
        from interp_runner.config.schema import EngineConfig
        from interp_runner.engine.adapter import VllmEngine

        engine = VllmEngine(str(folder), EngineConfig(**engine_settings(args)), spec)
        return engine.llm, engine
    import vllm

    s = engine_settings(args)
    llm = vllm.LLM(model=str(folder), dtype=s["dtype"], enforce_eager=s["enforce_eager"],
                   max_model_len=s["max_model_len"], max_num_seqs=s["max_num_seqs"],
                   kv_cache_memory_bytes=s["kv_cache_memory_bytes"], enable_prefix_caching=True, seed=0,
                   tensor_parallel_size=s["tensor_parallel_size"])
    return llm, None


def generate(llm, plan, engine=None):
    """(wall seconds, this process's CPU seconds, token ids per request, worker results by request id). A run
    whose wall time grows while its CPU time does not waited on something else: the GPU, or a busy host.
    With the interp ``engine``, the timed call also takes the requests' results (captures) off the workers with
    ``VllmEngine.collect``, as ``VllmEngine.run`` does (through a shared-memory block from workers in other
    processes; then the ranks' checksums are compared); the worker keeps a request's captures until collected.
    The prefix cache is emptied before each run."""
    prompts = [r.engine_prompt() for r in plan.requests]
    params = [r.sampling_params() for r in plan.requests]
    collected = {}
    # every run computes its prompts: an idle request would read the last run's blocks from the prefix cache, where
    # a steered one, whose blocks are its own (``kv_private``), may not
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine did not empty its prefix cache before a run")
    t0, c0 = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generated = time.perf_counter()
    if engine is not None:
        collected = engine.collect([r.rid for r in plan.requests])
    end, cpu = time.perf_counter(), time.process_time() - c0
    return Run(end - t0, cpu, end - generated, [list(o.outputs[0].token_ids) for o in outputs], collected)


class Run(NamedTuple):
    """One timed run: wall and CPU seconds (generation and collection), the collection's own wall seconds."""

    wall_s: float
    cpu_s: float
    collect_s: float
    tokens: list[list[int]]
    collected: dict


def check_captures(plan, collected: dict, hidden: int) -> dict:
    """Captured rows of each request of ``plan``, against what it asked for: one row per captured site at each
    captured position, ``hidden`` finite values each. Requests that capture nothing must bring back nothing."""
    from interp_runner.payload import unpack_positions

    rows, bad = [], []
    for request in plan.requests:
        captures = collected.get(request.rid, {}).get("captures", {})
        wanted = {}
        for capture in request.payload.capture if request.payload else ():
            for site in capture.sites:
                wanted[site] = sorted(set(wanted.get(site, [])) | set(unpack_positions(capture.positions).tolist()))
        count, problems = 0, []
        for site in sorted(set(wanted) | set(captures)):
            positions, values = captures.get(site, (np.zeros(0, np.int32), np.zeros((0, hidden), np.float32)))
            count += len(positions)
            if sorted(np.asarray(positions).tolist()) != wanted.get(site, []):
                problems.append(f"site {site}: positions {np.asarray(positions).tolist()}, "
                                f"wanted {wanted.get(site, [])}")
            elif np.shape(values) != (len(positions), hidden) or not np.isfinite(values).all():
                problems.append(f"site {site}: values of shape {np.shape(values)}, not all finite")
        rows.append(count)
        if problems:
            bad.append({"request": request.rid, "problems": problems[:4]})
    expected = [sum(len(unpack_positions(c.positions)) * len(c.sites) for c in r.payload.capture) if r.payload else 0
                for r in plan.requests]
    return {"requests": len(rows), "rows": sum(rows), "rows_per_request": [min(rows), max(rows)],
            "expected_rows_per_request": [min(expected), max(expected)], "bad": bad[:8], "ok": not bad}


def parse_cpus(text: str) -> set[int]:
    cpus = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def worker(args) -> dict:
    if args.cpus:  # before torch starts its threads, so they all inherit it
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    import torch

    from interp_runner.models.facts import ModelFacts
    from interp_runner.sites import site_id

    folder, dummy = Path(args.model_dir), args.dummy
    facts = ModelFacts.from_folder(folder, 0 if dummy else None)
    steer_sites = [site_id(layer, args.hook) for layer in range(facts.num_layers)]
    chosen = parse_conditions(args.conditions)
    compiled = plans(args, folder)
    spec = engine_spec(compiled, chosen, steer_sites)
    t0 = time.perf_counter()
    llm, engine = build(args.worker, args, folder, dummy, spec)
    startup = time.perf_counter() - t0
    vc = llm.llm_engine.vllm_config
    info = {
        "kind": args.worker,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "startup_s": startup,
        "dtype": str(vc.model_config.dtype),
        "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
        "compilation_mode": str(vc.compilation_config.mode),
        "use_v2_model_runner": bool(vc.use_v2_model_runner),
        "async_scheduling": bool(getattr(vc.scheduler_config, "async_scheduling", False)),
        "dummy_weights": dummy,
    }
    interp = engine is not None
    if interp:
        info["engine_spec"] = {"steer_sites": len(spec.steer_sites), "capture_sites": len(spec.capture_sites),
                               "patch_sites": len(spec.patch_sites)}
        conditions = {name: compiled[name] for name in chosen}
        engine.run(compiled["steered"].requests, compiled["steered"].vectors, use_tqdm=False)  # vectors; warm-up
    else:
        conditions = {args.worker: compiled["idle"]}
    outputs, checks = {}, {}

    def timed_run(name):
        run = generate(llm, conditions[name], engine)
        if any(len(t) != args.max_tokens for t in run.tokens):
            raise RuntimeError(f"{name}: not every request decoded {args.max_tokens} tokens")
        if interp:
            check = check_captures(conditions[name], run.collected, facts.hidden_size)
            if not check["ok"]:
                raise RuntimeError(f"{name}: captures are not what the requests asked for: {check}")
            checks.setdefault(name, []).append(check["rows"])
            checks[f"{name}:last"] = check
        return run

    for name in conditions:
        for _ in range(args.warmup):
            outputs[name] = timed_run(name).tokens
    times = {name: [] for name in conditions}
    cpu_times = {name: [] for name in conditions}
    collect_times = {name: [] for name in conditions}
    names = list(conditions)
    round_s = 0.0  # the last round's wall time
    for r in range(args.repeats):
        started = time.time()
        # the round and the profiled run after it would pass the budget's end
        if r >= 2 and args.stop_at and started + 2.5 * round_s > args.stop_at:
            info["rounds_cut"] = f"{r} of {args.repeats}: the budget's end"
            break
        for name in names if r % 2 == 0 else names[::-1]:
            run = timed_run(name)
            outputs[name] = run.tokens
            times[name].append(run.wall_s)
            cpu_times[name].append(run.cpu_s)
            collect_times[name].append(run.collect_s)
        round_s = time.time() - started
    info["times_s"] = times
    info["cpu_times_s"] = cpu_times
    info["collect_times_s"] = collect_times  # the part of times_s spent collecting results after generation
    info["median_s"] = {name: statistics.median(t) for name, t in times.items()}
    info["paired_vs_idle"] = paired_changes(times)
    if "idle" in times:
        info["paired_interval_95"] = {name: median_interval(paired_ratios(times, name))
                                      for name in times if name != "idle"}
    if interp:
        if "capture" in conditions:
            last = checks["capture:last"]
            info["capture_check"] = {
                "runs_checked": len(checks["capture"]),
                "rows_per_run": checks["capture"],
                "requests": last["requests"],
                "layers": facts.num_layers,
                "rows_per_request": last["rows_per_request"],
                "expected_rows_per_request": last["expected_rows_per_request"],
                "bytes_per_run": last["rows"] * facts.hidden_size * 4,  # float32 off the workers
                "ok": True,  # a run whose captures were off raised above
            }
        if "idle" in outputs:
            for name in ("steered", "capture"):
                if name in outputs:
                    changed = sum(a != b for a, b in zip(outputs["idle"], outputs[name]))
                    info[f"{name}_requests_changed"] = f"{changed}/{len(outputs['idle'])}"
            if info.get("steered_requests_changed", "").startswith("0/"):
                info["warning"] = "steering changed no request's tokens"
        info["planner"] = {name: planner_profile(llm, plan, engine, generate) for name, plan in conditions.items()}
        if args.device_profile:
            info["device_profile"] = {name: device_profile(llm, plan, engine, generate)
                                      for name, plan in conditions.items()}
        if args.host_profile:
            info["host_profile"] = {name: host_profile(llm, plan, engine, generate)
                                    for name, plan in conditions.items()}
    return info


def parse_conditions(text: str) -> list[str]:
    chosen = [c for c in text.split(",") if c]
    unknown = [c for c in chosen if c not in CONDITIONS]
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        raise SystemExit(f"--conditions: a comma list of distinct {', '.join(CONDITIONS)} (got {text!r})")
    return chosen


# -- driver -------------------------------------------------------------------------------------------


def run_worker(kind: str, args, folder: Path, dummy: bool, scratch: Path) -> dict:
    out = scratch / f"worker-{kind}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--worker", kind, "--model-dir", str(folder), "--worker-json", str(out)]
    if dummy:
        cmd.append("--dummy")
    # the worker takes no round it cannot end, with its profiled run, 15 s before the timeout
    cmd += ["--stop-at", str(time.time() + args.worker_timeout - 15)]
    for key in ("model", "batch", "max_tokens", "vectors", "hook", "norm", "repeats", "warmup", "dtype",
                "max_model_len", "kv_cache_gib", "conditions", "tp"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.eager:
        cmd.append("--eager")
    for flag in ("device_profile", "host_profile"):
        if getattr(args, flag):
            cmd.append(f"--{flag.replace('_', '-')}")
    if args.cpus:
        cmd += ["--cpus", args.cpus]
    print(f"== {args.model}: {kind} engine", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=args.worker_timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - t0
    if rc == 0 and out.exists():
        info = json.loads(out.read_text())
        info["process_s"] = wall
        return info
    return {"kind": kind, "error": f"worker exited with {rc}", "process_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2_135m",
                    help="smollm2_135m | tiny_random | llama8b-random | an HF folder")
    ap.add_argument("--engines", default="interp,stock", help="comma list of interp, stock, stock-default")
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help="comma list of the interp engine's conditions: idle, steered, capture")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--vectors", type=int, default=16, help="distinct steering vectors over the batch")
    ap.add_argument("--hook", default="post_block")
    ap.add_argument("--norm", type=float, default=4.0, help="norm of each steering vector")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per condition")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per condition first")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: torch.compile + CUDA graphs)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache per rank")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs) of each engine")
    ap.add_argument("--weights", choices=["dummy", "hf"], default="dummy",
                    help="llama8b-random: vLLM's dummy loader, or random bf16 safetensors from transformers")
    ap.add_argument("--llama-shape", default="", help="hidden,layers,heads,kv_heads,intermediate,vocab")
    ap.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "interp-bench"))
    ap.add_argument("--worker-timeout", type=float, default=600,
                    help="seconds an engine's process may take; it takes fewer rounds than --repeats where they would "
                         "not end in time")
    ap.add_argument("--cpus", default="", help="pin each engine process to these CPUs, e.g. 4-7 or 2,3 (default: any)")
    ap.add_argument("--device-profile", action="store_true",
                    help="after the timed runs, one more run per condition under torch.profiler: device time by kernel "
                         "and the host's waits for the device")
    ap.add_argument("--host-profile", action="store_true",
                    help="after the timed runs, three more runs per condition under cProfile: the host's time by "
                         "function and the garbage collector's")
    ap.add_argument("--json", default="", help="write all numbers here")
    ap.add_argument("--report", nargs="*", help="only print the table of these --json files")
    # internal: one engine in this process
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.report is not None:
        results = [json.loads(Path(p).read_text()) for p in args.report if Path(p).exists()]
        print(table(results))
        print(breakdown(results))
        print(device_table(results))
        print(host_table(results))
        return 0
    parse_conditions(args.conditions)
    if args.worker:
        info = worker(args)
        Path(args.worker_json).write_text(json.dumps(info, indent=1))
        return 0

    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder, dummy = resolve_model(args)
    prepare_s = time.perf_counter() - t0
    result = {
        "model": args.model, "folder": str(folder), "prepare_s": prepare_s,
        "batch": args.batch, "max_tokens": args.max_tokens, "vectors": args.vectors, "hook": args.hook,
        "norm": args.norm, "repeats": args.repeats, "warmup": args.warmup, "dtype": args.dtype,
        "eager": args.eager, "conditions": args.conditions, "cpus": args.cpus or "any", "tp": args.tp,
        "weights": args.weights if args.model in ("llama8b-random", "random-llama") else "file",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "workers": [],
    }
    for kind in [k for k in args.engines.split(",") if k]:
        result["workers"].append(run_worker(kind, args, folder, dummy, scratch))
        if args.json:  # after every engine, so a cut-off run keeps what it measured
            Path(args.json).write_text(json.dumps(result, indent=1))
    print(table([result]))
    print(breakdown([result]))
    print(device_table([result]))
    print(host_table([result]))
    failed = [w for w in result["workers"] if "error" in w]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
