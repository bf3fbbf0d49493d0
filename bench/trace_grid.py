"""Causal-tracing grid time: interp-runner (one vLLM engine, the compiled ``causal_trace`` plan) against
hand-batched plain-HF hooks, on one fact, in one process, on one device.

The model is a Llama with random weights, Qwen3-0.6B-shaped by default (hidden 1024, 28 layers, 16 heads,
8 KV heads, head_dim 128, intermediate 3072, vocab 151936), written once as bf16 safetensors with SmolLM2's
tokenizer, so both sides run identical weights. The fact is one prompt of exactly N tokens (``--tokens``) built
from single-token words; its subject is tokens 1..3 (Gaussian noise on their embeddings, one sample), the
answer one token. A grid is every (layer, token) cell of the residual stream: 28 x 40 = 1,120 and
28 x 204 = 5,712 cells.

- ``interp-runner``: ``prepare`` a ``causal_trace`` config (components [resid], layers all, 1 noise sample, no
  filter, no plots), then ``execute(engine, plan)``: stage 0 = clean run with captures + corrupted run, stage 1 =
  every cell + the in-batch corrupted baseline. One VllmEngine serves every prompt length; it is warmed up with an
  untimed execute per length, and its prefix cache is reset before every run (each run starts cold, as a real
  run does; the sharing within a run is counted). Stage times are the wall time of ``engine.run`` per stage.
- ``hf``: transformers ``LlamaForCausalLM`` with forward hooks: one clean forward capturing every decoder
  layer's output (the residual stream after the block), then the cells in batches of ``--hf-batch`` rows (plus
  one corrupted row without restore), each row the corrupted prompt (noise added on ``embed_tokens``'s output,
  the plan's own noise) with one clean state written back at its (layer, token); the answer's log-probability
  from the last position. Index tensors are built outside the timed region.

Times are medians over ``--repeats`` runs (the two sides alternate). The max |difference| of the restored answer
log-probability between the two sides is informative only (bf16, different kernels). Prints a table last;
``--json`` keeps everything.

    python bench/trace_grid.py --json $OUT/trace_grid.json                                    # H100
    VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \\
        python bench/trace_grid.py --shape tiny --dtype float32 --eager --tokens 12 --repeats 1 \\
        --hf-batch 16 --max-num-seqs 64                                                       # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from trace_hf import HFTrace  # noqa: E402
from trace_profile import Timeline, profile_once, profile_table, timeline_table  # noqa: E402

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size")
SHAPES = {
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),
    "tiny": (128, 4, 4, 2, 32, 256, 49152),  # vocab: SmolLM2's tokenizer
}
GOALS = {40: 2.0, 204: 3.0}  # speedup targets over the HF baseline, by prompt length
SUBJECT = ("Golden", "Gate", "Bridge")  # tokens 1..3
ENDING = ("is", "located", "in", "the", "city", "of")
FILLER = ("It is a well known place and many people come to see it every year from all over the world and "
          "then they go home").split()
ANSWER = " Paris"


# -- model ----------------------------------------------------------------------------------------------


def parse_shape(text: str) -> dict:
    values = SHAPES.get(text) or tuple(int(x) for x in text.split(","))
    if len(values) != len(SHAPE_KEYS):
        raise SystemExit(f"--shape: {', '.join(SHAPES)} or {','.join(SHAPE_KEYS)}")
    return dict(zip(SHAPE_KEYS, values))


def model_folder(shape: dict, scratch: Path, device: str) -> Path:
    """Random bf16 Llama safetensors + SmolLM2's tokenizer, through steer_overhead's ``random_llama`` (which
    derives head_dim from hidden / heads: its LlamaConfig is swapped for one that keeps ours)."""
    import transformers
    from random_llama import random_llama

    shape = dict(shape)
    head_dim = shape.pop("head_dim")
    folder = scratch / ("llama-" + "-".join(str(v) for v in (*shape.values(), head_dim)) + "-hf")
    config_cls = transformers.LlamaConfig

    def with_head_dim(**kw):
        kw["head_dim"] = head_dim
        return config_cls(**kw)

    transformers.LlamaConfig = with_head_dim
    try:
        random_llama(folder, shape, "hf", device)
    finally:
        transformers.LlamaConfig = config_cls
    written = json.loads((folder / "config.json").read_text())
    if written.get("head_dim") != head_dim:
        raise RuntimeError(f"{folder}: head_dim {written.get('head_dim')}, wanted {head_dim}")
    return folder


# -- fact and plan --------------------------------------------------------------------------------------


def fact_prompt(tokenizer, n: int) -> dict:
    """A prompt of exactly ``n`` tokens, one word a token: 'The Golden Gate Bridge <filler> is located in the
    city of'."""
    fill = n - 1 - len(SUBJECT) - len(ENDING)
    if fill < 0:
        raise SystemExit(f"--tokens: {n} is too short (at least {n - fill})")
    words = ["The", *SUBJECT, *(FILLER[i % len(FILLER)] for i in range(fill)), *ENDING]
    text = " ".join(words)
    ids = tokenizer(text)
    per_word = [tokenizer.plain(w if i == 0 else " " + w) for i, w in enumerate(words)]
    if len(ids) != n or ids != [t for w in per_word for t in w]:
        raise RuntimeError(f"prompt of {n} words is {len(ids)} tokens, not one per word: {text!r}")
    if len(tokenizer.plain(ANSWER)) != 1:
        raise RuntimeError(f"answer {ANSWER!r} is not one token")
    return {"id": f"bench-{n}", "subject": " ".join(SUBJECT), "prompt": text, "answer": ANSWER}


def trace_config(args, folder: Path, facts_file: Path, on_gpu: bool, num_layers: int,
                 entry_stride: int | None = None) -> dict:
    engine = {"dtype": args.dtype, "enforce_eager": args.eager, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs}
    if entry_stride is not None:
        engine["cell_entry_stride"] = entry_stride
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else (16.0 if on_gpu else None)
    if kv_gib is not None:
        engine["kv_cache_memory_bytes"] = int(kv_gib * (1 << 30))
    if args.max_num_batched_tokens:
        engine["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.pack != "auto":
        engine["pack_cells"] = args.pack == "on"
    return {
        "model": {"name": "bench", "path": str(folder)},
        "engine": engine,
        "prompts": {"items": []},
        "sampling": {"max_tokens": 1},
        "causal_trace": {"facts": str(facts_file), "num_facts": 1, "components": ["resid"], "noise": {"samples": 1},
                         "layers": "all", "filter": False, "plots": False,
                         # unused by resid, but checked against the model's depth
                         "window": min(10, num_layers)},
    }


def merged_spec(specs):
    return functools.reduce(lambda a, b: a.union(b), specs)


# -- interp-runner side ---------------------------------------------------------------------------------


class StageClock:
    """Wall time of each ``engine.run`` call (one per stage in ``execute``), and the process's use of the host over
    the last whole run (``host``: CPU seconds of all its threads and of the main one, voluntary and involuntary
    context switches, the busiest other threads; the engine runs in this process): a run slower for want of a CPU
    shows more wall time and involuntary switches for the same CPU seconds, a run doing more work (or on a slower
    CPU) more of the main thread's CPU seconds, a busy neighbour thread by name."""

    def __init__(self, engine):
        self.calls: list[tuple[int, float]] = []
        self.host: dict[str, float] = {}
        run = engine.run

        def timed(requests, *a, **kw):
            t0 = time.perf_counter()
            try:
                return run(requests, *a, **kw)
            finally:
                self.calls.append((len(requests), time.perf_counter() - t0))

        engine.run = timed


def thread_times() -> dict[int, tuple[str, float, int]]:
    """This process's threads (Linux): thread id -> (name, CPU seconds so far, the CPU it last ran on)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(rest[11]) + int(rest[12])) / tick, int(rest[36]))
    return out


def thread_use(before: dict, after: dict) -> dict:
    """The busiest threads other than the main one over a run (CPU seconds, in the kernel's 10 ms ticks) and the CPU
    the main thread ran on last: a busy neighbour thread shows by name."""
    main = threading.main_thread().native_id
    used = {tid: (name, cpu - before.get(tid, (name, 0.0, 0))[1]) for tid, (name, cpu, _) in after.items()}
    others = sorted(((s, name) for tid, (name, s) in used.items() if tid != main and s > 0), reverse=True)
    return {"main_on_cpu": after.get(main, ("", 0.0, -1))[2],
            "other_threads": [[name, round(s, 3)] for s, name in others[:3]]}


def threads_note(host: dict) -> str:
    note = f"; main thread {host['main_cpu_s']:.3f} s"
    if "main_on_cpu" in host:
        others = ", ".join(f"{name} {s:.2f}" for name, s in host["other_threads"]) or "none"
        note += f", last on CPU {host['main_on_cpu']}; other threads: {others}"
    return note


def ours_once(engine, clock: StageClock, plan) -> tuple[float, list[float], dict]:
    from interp_runner.pipeline import execute

    if not engine.llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    clock.calls.clear()
    threads0 = thread_times() if sys.platform == "linux" else {}
    use0, main0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    results = execute(engine, plan, log=lambda _: None, use_tqdm=False)
    total = time.perf_counter() - t0
    use, main_cpu = resource.getrusage(resource.RUSAGE_SELF), time.thread_time() - main0
    clock.host = {"cpu_s": use.ru_utime + use.ru_stime - use0.ru_utime - use0.ru_stime, "main_cpu_s": main_cpu,
                  "voluntary_switches": use.ru_nvcsw - use0.ru_nvcsw,
                  "involuntary_switches": use.ru_nivcsw - use0.ru_nivcsw}
    if threads0:
        clock.host.update(thread_use(threads0, thread_times()))
    return total, [dt for _, dt in clock.calls], results


def ours_grid(plan, results, num_layers: int, n: int):
    """[layers, tokens] restored answer log-probabilities, clean and corrupt ones, via ``trace_dataset``."""
    import numpy as np

    from interp_runner.kinds.causal_trace.grids import trace_dataset

    ds = trace_dataset(plan, results)
    grid = ds["restored_logprob_samples"].values[0, 0, :, :n, 0].astype(np.float64)
    if grid.shape != (num_layers, n):
        raise RuntimeError(f"grid is {grid.shape}, not {(num_layers, n)}")
    return grid, float(np.log(ds["clean_prob"].values[0])), float(ds["corrupt_logprob_samples"].values[0, 0])


# -- driver ---------------------------------------------------------------------------------------------


def table(result: dict) -> str:
    rows = [("tokens", "cells", "ours s", "stage1 s", "HF s", "speedup", "goal", "met?", "ours cells/s",
             "HF cells/s", "max|dlp|", "unpacked s")]
    for r in result["lengths"]:
        ours, hf = r.get("ours_median_s"), r.get("hf_median_s")
        speed = hf / ours if ours and hf else None
        goal = GOALS.get(r["tokens"])
        rows.append((
            str(r["tokens"]), str(r["cells"]), f"{ours:.3f}" if ours else "-",
            f"{r['ours_stage1_median_s']:.3f}" if r.get("ours_stage1_median_s") else "-",
            f"{hf:.3f}" if hf else "-", f"{speed:.2f}x" if speed else "-", f">={goal:g}x" if goal else "-",
            ("yes" if speed >= goal else "NO") if goal and speed else "-",
            f"{r['cells'] / ours:.0f}" if ours else "-", f"{r['cells'] / hf:.0f}" if hf else "-",
            f"{r['max_abs_diff_logprob']:.3g}" if r.get("max_abs_diff_logprob") is not None else "-",
            f"{r['unpacked_median_s']:.3f}" if r.get("unpacked_median_s") else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", help=f"{' | '.join(SHAPES)} | {','.join(SHAPE_KEYS)}")
    ap.add_argument("--tokens", default="40,204", help="prompt lengths, comma list")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side and length")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per side and length first")
    ap.add_argument("--hf-batch", type=int, default=256, help="rows per HF forward")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: torch.compile + CUDA graphs)")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="also the most tokens a request of packed cells holds (the model's 8,192 positions)")
    ap.add_argument("--pack", choices=("auto", "on", "off"), default="auto",
                    help="engine.pack_cells (auto: on with a GPU)")
    ap.add_argument("--entry-strides", default="",
                    help="comma list of engine.cell_entry_stride values: the first is timed as 'ours', the others "
                         "once after each of its runs, on the same engine (default: the config's)")
    ap.add_argument("--step-tokens", default="",
                    help="comma list of tokens submitted before a step starts (VllmEngine.step_tokens), each timed "
                         "once after each 'ours' run, on the same engine")
    ap.add_argument("--unpacked-repeats", type=int, default=0,
                    help="then this many timed runs with cells unpacked, on the same engine")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=65536,
                    help="as causal_trace_full sets it (0: vLLM's default)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="default: 16 on GPU, the engine's on CPU")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="one more run per length under the profilers")
    ap.add_argument("--timeline", action="store_true", help="one more run per length with its phases timed")
    ap.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "interp-bench"))
    ap.add_argument("--blocking-sync", action="store_true", help="GPU waits sleep, not spin (bench/cuda_sync.py)")
    ap.add_argument("--json", default="", help="write all numbers here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.blocking_sync:  # before anything starts CUDA
        import cuda_sync
        cuda_sync.use_blocking_sync()

    import numpy as np
    import torch
    import transformers
    import vllm

    from interp_runner.engine.adapter import VllmEngine
    from interp_runner.payload import plugin_fingerprint
    from interp_runner.pipeline import load_tokenizer, prepare

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    lengths = sorted({int(x) for x in args.tokens.split(",") if x})
    shape = parse_shape(args.shape)

    t0 = time.perf_counter()
    folder = model_folder(shape, scratch, device)
    tokenizer = load_tokenizer(folder, False)
    strides = [int(x) for x in args.entry_strides.split(",") if x] or [None]
    prepared, prepare_s, variants = {}, {}, {}
    for n in lengths:
        facts_file = scratch / f"trace-fact-{n}.jsonl"
        facts_file.write_text(json.dumps(fact_prompt(tokenizer, n)) + "\n")
        t1 = time.perf_counter()
        prepared[n] = prepare(trace_config(args, folder, facts_file, on_gpu, shape["num_hidden_layers"], strides[0]))
        # variants timed beside 'ours': label -> (prepared config, engine attributes set for its runs)
        variants[n] = {f"entry stride {g}": (prepare(trace_config(args, folder, facts_file, on_gpu,
                                                                  shape["num_hidden_layers"], g)), {})
                       for g in strides[1:]}
        variants[n].update({f"steps of {t} tokens": (prepared[n], {"step_tokens": t})
                            for t in (int(x) for x in args.step_tokens.split(",") if x)})
        fact = prepared[n].plan.layout.facts[0]
        if len(fact.clean.token_ids) != n or fact.subject_positions != (1, 2, 3):
            raise RuntimeError(f"{n}: plan has {len(fact.clean.token_ids)} tokens, subject {fact.subject_positions}")
        prepare_s[n] = time.perf_counter() - t1
    setup_s = time.perf_counter() - t0

    result = {
        "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
                     "transformers": transformers.__version__, "plugin": plugin_fingerprint()},
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "shape": shape, "folder": str(folder), "weights": "random bf16 safetensors, shared by both sides",
        "setup_s": setup_s, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "lengths": [],
    }

    # one engine for every length: the longest plan's spec if it covers the rest, else the union
    longest = prepared[lengths[-1]]
    specs = [p.plan.engine_spec for p in prepared.values()]
    specs += [p.plan.engine_spec for per_length in variants.values() for p, _ in per_length.values()]
    spec = longest.plan.engine_spec
    if not all(spec.covers(s) for s in specs):
        spec = merged_spec(specs)
    t0 = time.perf_counter()
    engine = VllmEngine(str(folder), longest.cfg.engine, spec)
    vc = engine.llm.llm_engine.vllm_config
    result["engine"] = {
        "startup_s": time.perf_counter() - t0, "dtype": engine.dtype, "bank_rows": spec.bank_rows,
        "patch_sites": len(spec.patch_sites), "capture_sites": len(spec.capture_sites),
        "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
        "compilation_mode": str(vc.compilation_config.mode),
        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": vc.scheduler_config.max_num_seqs,
        "block_size": vc.cache_config.block_size, "prefix_caching": vc.cache_config.enable_prefix_caching,
        "pack_cells": engine.pack_cells,
        "kv_cache_memory_bytes": getattr(vc.cache_config, "kv_cache_memory_bytes", None),
    }
    clock = StageClock(engine)

    hf_model = None
    if not args.skip_hf:
        t0 = time.perf_counter()
        hf_model = transformers.LlamaForCausalLM.from_pretrained(
            str(folder), dtype=getattr(torch, args.dtype)).to(device).eval()
        result["hf_load_s"] = time.perf_counter() - t0
        result["hf_attn_implementation"] = hf_model.config._attn_implementation

    for n in lengths:
        p = prepared[n]
        plan, layout = p.plan, p.plan.layout
        fact = layout.facts[0]
        num_layers = len(layout.layers)
        row = {"tokens": n, "cells": num_layers * n, "requests": len(plan.requests), "prepare_s": prepare_s[n],
               "prompt": fact.clean.text, "answer_id": fact.clean.answer_ids[0]}
        print(f"== {n} tokens: {row['cells']} cells, {len(plan.requests)} requests", flush=True)
        hf = None
        if hf_model is not None:
            hf = HFTrace(hf_model, fact.clean.token_ids, fact.subject_positions, layout.noise[0][0],
                         fact.clean.answer_ids[0], args.hf_batch, device)
        for _ in range(args.warmup):
            ours_once(engine, clock, plan)
            if hf is not None:
                hf.grid()
        def run_variant(label):
            other, attributes = variants[n][label]
            saved = {k: getattr(engine, k) for k in attributes}
            for k, v in attributes.items():
                setattr(engine, k, v)
            try:
                return ours_once(engine, clock, other.plan)
            finally:
                for k, v in saved.items():
                    setattr(engine, k, v)

        for label in variants[n]:
            for _ in range(args.warmup):
                run_variant(label)
        ours_t, stages_t, hf_t, cached, host_use = [], [], [], [], []
        variant_t: dict[str, list[float]] = {label: [] for label in variants[n]}
        variant_results: dict[str, dict] = {}
        for r in range(args.repeats):
            total, stages, results = ours_once(engine, clock, plan)
            ours_t.append(total)
            stages_t.append(stages)
            cached.append(sum(x.cached_tokens for x in results.values()))
            host_use.append(clock.host)
            print(f"  ours {total:.3f} s (stages {', '.join(f'{s:.3f}' for s in stages)}; CPU "
                  f"{clock.host['cpu_s']:.3f} s, context switches {clock.host['voluntary_switches']} voluntary, "
                  f"{clock.host['involuntary_switches']} involuntary{threads_note(clock.host)})", flush=True)
            for label in variants[n]:
                total, stages, variant_results[label] = run_variant(label)
                variant_t[label].append(total)
                print(f"  ours, {label}: {total:.3f} s (stages {', '.join(f'{s:.3f}' for s in stages)})", flush=True)
            if hf is not None:
                dt, hf_grid, hf_clean, hf_corrupt = hf.grid()
                hf_t.append(dt)
                print(f"  hf   {dt:.3f} s", flush=True)
        grid, clean_lp, corrupt_lp = ours_grid(plan, results, num_layers, n)
        if variant_t:
            row["variants"] = {
                "entry_stride": strides[0], "times_s": variant_t,
                "median_s": {label: statistics.median(t) for label, t in variant_t.items()},
                # same engine, same weights: only the order of float sums differs
                "max_abs_diff": {label: float(np.nanmax(np.abs(grid - ours_grid(
                    variants[n][label][0].plan, variant_results[label], num_layers, n)[0]))) for label in variant_t}}
            print(f"  ours {statistics.median(ours_t):.3f} s (median); " + ", ".join(
                f"{label}: {statistics.median(t):.3f}" for label, t in variant_t.items()), flush=True)
        if args.unpacked_repeats:
            packing, engine.pack_cells = engine.pack_cells, False
            unpacked_t = []
            for _ in range(args.unpacked_repeats):
                total, stages, unpacked = ours_once(engine, clock, plan)
                unpacked_t.append(total)
                print(f"  ours, cells unpacked {total:.3f} s (stages {', '.join(f'{s:.3f}' for s in stages)})",
                      flush=True)
            engine.pack_cells = packing
            row.update(unpacked_times_s=unpacked_t, unpacked_median_s=statistics.median(unpacked_t),
                       max_abs_diff_packed_unpacked=float(np.nanmax(np.abs(
                           grid - ours_grid(plan, unpacked, num_layers, n)[0]))))
        row.update(
            ours_times_s=ours_t, ours_stage_times_s=stages_t, ours_median_s=statistics.median(ours_t),
            ours_host=host_use,
            ours_stage1_median_s=statistics.median(s[1] for s in stages_t) if len(stages_t[0]) > 1 else None,
            prompt_tokens=len(plan.requests) * n, cached_prompt_tokens=cached,
            ours_clean_logprob=clean_lp, ours_corrupt_logprob=corrupt_lp,
            ours_restored_logprob_range=[float(np.nanmin(grid)), float(np.nanmax(grid))],
            ours_missing_cells=int(np.isnan(grid).sum()),  # cells without a score (voided): should be 0
        )
        if hf is not None:
            for h in hf.handles:
                h.remove()
            row.update(
                hf_times_s=hf_t, hf_median_s=statistics.median(hf_t), hf_batches=len(hf.batches),
                hf_clean_logprob=hf_clean, hf_corrupt_logprob=hf_corrupt,
                max_abs_diff_logprob=float(np.nanmax(np.abs(grid - hf_grid))),
                abs_diff_clean_logprob=abs(clean_lp - hf_clean), abs_diff_corrupt_logprob=abs(corrupt_lp - hf_corrupt),
            )
            del hf
        if args.timeline:
            timeline = Timeline(engine)
            timeline.run(lambda: ours_once(engine, clock, plan))
            row["timeline"] = {"total_s": timeline.total, "phases": timeline.summary()}
            print(timeline_table(n, row["timeline"]["phases"], timeline.total), flush=True)
        if args.profile:
            row["profile"] = profile_once(engine, lambda: ours_once(engine, clock, plan), on_gpu)
            print(profile_table(n, row["profile"]), flush=True)
        if row["ours_missing_cells"]:
            print(f"  warning: {row['ours_missing_cells']} cells have no score", flush=True)
        result["lengths"].append(row)
        if args.json:  # after every length, so a cut-off run keeps what it measured
            Path(args.json).write_text(json.dumps(result, indent=1))

    print(f"device {result['device']}; {args.dtype}; cells = layers x tokens (kind resid, 1 noise sample); "
          f"medians of {args.repeats}; ours = execute() of the whole plan, stage1 = its cell stage; "
          f"max|dlp| = max |restored answer logprob, ours - HF| (informative)")
    for r in result["lengths"]:
        if "timeline" in r:
            print(timeline_table(r["tokens"], r["timeline"]["phases"], r["timeline"]["total_s"]))
        if "profile" in r:
            print(profile_table(r["tokens"], r["profile"]))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
