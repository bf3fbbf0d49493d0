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
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

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
    """Wall time of each ``engine.run`` call (one per stage in ``execute``)."""

    def __init__(self, engine):
        self.calls: list[tuple[int, float]] = []
        run = engine.run

        def timed(requests, *a, **kw):
            t0 = time.perf_counter()
            try:
                return run(requests, *a, **kw)
            finally:
                self.calls.append((len(requests), time.perf_counter() - t0))

        engine.run = timed


def ours_once(engine, clock: StageClock, plan) -> tuple[float, list[float], dict]:
    from interp_runner.pipeline import execute

    if not engine.llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    clock.calls.clear()
    t0 = time.perf_counter()
    results = execute(engine, plan, log=lambda _: None, use_tqdm=False)
    total = time.perf_counter() - t0
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


HOST_PARTS = (  # (file, function, what) for the host profile; cumulative seconds unless noted
    ("bulk.py", "run_bulk", "our submit/read loop (self time)"),
    ("core.py", "preprocess_add_request", "vLLM: request objects, block hashes"),
    ("scheduler.py", "schedule", "vLLM: scheduler"),
    ("scheduler.py", "update_from_output", "vLLM: scheduler output processing"),
    ("gpu_model_runner.py", "_update_states", "vLLM runner: batch state"),
    ("gpu_model_runner.py", "_prepare_inputs", "vLLM runner: inputs"),
    ("gpu_model_runner.py", "_model_forward", "forward (launches, our planner included)"),
    ("runtime.py", "before_forward", "our planner"),
    ("runtime.py", "plan_sequences", "our packed cells' attention layout"),
    ("readback.py", "record_scores", "our scoring (launches)"),
    ("gpu_model_runner.py", "sample_tokens", "vLLM: sampling"),
    ("gpu_model_runner.py", "get_output", "host waiting for the GPU"),
    ("gpu_model_runner.py", "synchronize_input_prep", "host waiting for the previous step's inputs"),
    # vLLM's V2 runner (vllm/v1/worker/gpu/): its own names for the same parts
    ("gpu/model_runner.py", "add_requests", "V2 runner: batch state (requests added)"),
    ("gpu/model_runner.py", "update_requests", "V2 runner: batch state (requests updated)"),
    ("gpu/model_runner.py", "prepare_inputs", "V2 runner: inputs"),
    ("gpu/model_runner.py", "prepare_attn", "V2 runner: attention inputs"),
    ("gpu/model_runner.py", "sample_tokens", "V2 runner: sampling"),
    ("gpu/async_utils.py", "get_output", "V2 runner: host waiting for the GPU"),
    ("adapter.py", "collect", "our result collection"),
    ("pipeline.py", "execute", "whole run"),
)


def profile_once(engine, clock: StageClock, plan, on_gpu: bool) -> dict:
    """Where one run's time goes: GPU kernel time against the wall time (kernel-only tracing, which adds little
    host work), and the host's split over vLLM's and our functions (cProfile: slower, for the proportions)."""
    import cProfile
    import pstats

    out = {}
    if on_gpu:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall, _, _ = ours_once(engine, clock, plan)
            torch.cuda.synchronize()
        spans, by_name = [], {}
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            start, end = e.time_range.start, e.time_range.end
            spans.append((start, end))
            by_name[e.name] = by_name.get(e.name, 0.0) + (end - start) / 1e6
        spans.sort()
        busy, cur_start, cur_end = 0.0, None, None
        for start, end in spans:
            if cur_end is None or start > cur_end:
                if cur_end is not None:
                    busy += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        if cur_end is not None:
            busy += cur_end - cur_start
        kernel_s = sum(by_name.values())
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
        out["gpu"] = {"wall_s": wall, "kernels": len(spans), "kernel_s": kernel_s, "busy_s": busy / 1e6,
                      "busy_fraction": busy / 1e6 / wall, "top_kernels": [(n[:120], s) for n, s in top]}
    pr = cProfile.Profile()
    pr.enable()
    wall, _, _ = ours_once(engine, clock, plan)
    pr.disable()
    out["host"] = {"wall_s_under_cprofile": wall, **host_parts(pstats.Stats(pr).stats)}
    # then each stage (engine.run call) on its own, for where its time goes by cumulative time
    stages, run = [], engine.run

    def profiled(*a, **kw):
        stage = cProfile.Profile()
        stage.enable()
        try:
            return run(*a, **kw)
        finally:
            stage.disable()
            stages.append(pstats.Stats(stage).stats)

    engine.run = profiled
    try:
        ours_once(engine, clock, plan)
    finally:
        engine.run = run
    out["host_by_stage"] = [host_parts(stats) for stats in stages]
    return out


def host_parts(stats) -> dict:
    """A cProfile's time in ``HOST_PARTS``, and its functions by self time and (vLLM's and ours) by cumulative
    time."""
    parts = {}
    for (filename, _, func), (_, ncalls, tottime, cumtime, _) in stats.items():
        for file, name, what in HOST_PARTS:
            if func == name and filename.endswith("/" + file):
                got = parts.setdefault(what, {"s": 0.0, "calls": 0})
                got["s"] += tottime if "self time" in what else cumtime
                got["calls"] += ncalls
    named = [(f"{Path(f).name}:{line}:{func}", tt, ct, nc) for (f, line, func), (_, nc, tt, ct, _) in stats.items()]
    ours_or_vllm = {f"{Path(f).name}:{line}:{func}" for (f, line, func) in stats
                    if "/interp_runner" in f or "/vllm/" in f}
    return {"parts": parts, "top_self_time": sorted(named, key=lambda x: -x[1])[:40],
            "top_cumulative": sorted((x for x in named if x[0] in ours_or_vllm), key=lambda x: -x[2])[:60]}


def profile_table(n: int, profile: dict) -> str:
    lines = []
    gpu = profile.get("gpu")
    if gpu:
        lines.append(f"{n} tokens: wall {gpu['wall_s']:.3f} s, GPU busy {gpu['busy_s']:.3f} s "
                     f"({100 * gpu['busy_fraction']:.0f}%), {gpu['kernels']} kernels")
        lines += [f"    {s * 1e3:8.1f} ms  {name}" for name, s in gpu["top_kernels"][:8]]
    host = profile["host"]
    lines.append(f"{n} tokens: host profile (cProfile, wall {host['wall_s_under_cprofile']:.3f} s)")
    for _, _, what in HOST_PARTS:
        part = host["parts"].get(what)
        if part:
            lines.append(f"    {part['s'] * 1e3:8.1f} ms  {what} ({part['calls']} calls)")
    lines.append(f"{n} tokens: host functions by self time (cProfile)")
    lines += [f"    {tt * 1e3:8.1f} ms self {ct * 1e3:8.1f} ms cumulative {nc:7d} calls  {name}"
              for name, tt, ct, nc in host.get("top_self_time", [])[:25]]
    for k, stage in enumerate(profile.get("host_by_stage", [])):
        lines.append(f"{n} tokens: stage {k}, vLLM's and our functions by cumulative time (cProfile)")
        lines += [f"    {ct * 1e3:8.1f} ms cumulative {tt * 1e3:8.1f} ms self {nc:7d} calls  {name}"
                  for name, tt, ct, nc in stage["top_cumulative"][:45]]
    return "\n".join(lines)


class Timeline:
    """Host timestamps of one run's phases (``--timeline``): the named callables are wrapped while it runs."""

    def __init__(self, engine):
        import interp_runner.engine.bulk as bulk
        import interp_runner.compile.packing as packing

        core = engine.llm.llm_engine.engine_core
        self.events: list[tuple[str, float, float]] = []
        self.targets = [  # (owner, attribute, phase name)
            (engine, "run", "stage"),
            (engine, "register_sources", "sources to the workers"),
            (bulk, "group_cells", "grouping cells"),
            (packing.CellGroup, "request", "packed requests made"),
            (core, "add_request", "submit"),
            (core, "get_output", "engine step"),
            (engine, "collect", "result collection"),
        ]

    def run(self, fn):
        saved = []
        for owner, name, what in self.targets:
            original = getattr(owner, name)
            saved.append((owner, name, original, name in getattr(owner, "__dict__", {})))
            setattr(owner, name, self._wrap(original, what))
        try:
            t0 = time.perf_counter()
            out = fn()
            self.total = time.perf_counter() - t0
            self.t0 = t0
            return out
        finally:
            for owner, name, original, own in saved:
                if own:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)

    def _wrap(self, fn, what):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.events.append((what, t, time.perf_counter()))
        return timed

    def summary(self) -> list[dict]:
        """Per stage and phase (a phase before a stage's run counts to that stage): first start, last end (ms from
        the run's start), calls and summed time; for the stage itself, its three longest engine steps."""
        stages = sorted((a - self.t0, b - self.t0) for what, a, b in self.events if what == "stage")
        out: dict[tuple, dict] = {}
        for what, a, b in self.events:
            a, b = a - self.t0, b - self.t0
            k = next((i for i, (_, end) in enumerate(stages) if a < end), len(stages))
            name = f"stage {k}" if what == "stage" else what
            row = out.setdefault((k, name), {"stage": k, "phase": name, "first_ms": 1e9, "last_ms": 0.0,
                                             "calls": 0, "sum_ms": 0.0, "steps_ms": []})
            row["first_ms"] = min(row["first_ms"], a * 1e3)
            row["last_ms"] = max(row["last_ms"], b * 1e3)
            row["calls"] += 1
            row["sum_ms"] += (b - a) * 1e3
            if what == "engine step":
                out[k, name]["steps_ms"].append((b - a) * 1e3)
        for row in out.values():
            row["longest_steps_ms"] = sorted(row.pop("steps_ms"), reverse=True)[:3]
        return sorted(out.values(), key=lambda r: (r["stage"], r["first_ms"]))


def timeline_table(n: int, rows: list[dict], total: float) -> str:
    lines = [f"{n} tokens: timeline of one run ({total * 1e3:.1f} ms), ms from its start"]
    for r in rows:
        extra = f" (longest {', '.join(f'{x:.1f}' for x in r['longest_steps_ms'])})" if r["longest_steps_ms"] else ""
        lines.append(f"    {r['first_ms']:8.1f} .. {r['last_ms']:8.1f}  {r['sum_ms']:8.1f} ms in {r['calls']:4d}  "
                     f"{r['phase']}{extra}")
    return "\n".join(lines)


# -- HF baseline ----------------------------------------------------------------------------------------


class HFTrace:
    """Hand-batched causal tracing with forward hooks on a plain transformers Llama."""

    def __init__(self, model, token_ids, subject, noise, answer: int, batch: int, device: str):
        import torch

        self.torch, self.model, self.device = torch, model, device
        self.ids = torch.tensor([token_ids], device=device)
        self.n = len(token_ids)
        self.subject = torch.tensor(subject, device=device)
        self.noise = torch.as_tensor(noise, device=device).to(model.dtype)  # [subject tokens, hidden]
        self.answer = answer
        layers = model.model.layers
        self.num_layers = len(layers)
        # rows: one corrupted baseline (layer -1), then every cell
        cells = [(-1, -1)] + [(lay, t) for lay in range(self.num_layers) for t in range(self.n)]
        self.batches = []
        for start in range(0, len(cells), batch):
            chunk = cells[start : start + batch]
            per_layer = {}
            for lay in range(self.num_layers):
                rows = [i for i, (cl, _) in enumerate(chunk) if cl == lay]
                if rows:
                    toks = [chunk[i][1] for i in rows]
                    per_layer[lay] = (torch.tensor(rows, device=device), torch.tensor(toks, device=device))
            self.batches.append((len(chunk), per_layer))
        self.mode = None  # "clean" | "cells"
        self.restore = {}
        self.clean = None  # [layers, tokens, hidden]
        self._captured = [None] * self.num_layers
        self.handles = [model.model.embed_tokens.register_forward_hook(self._embed)]
        self.handles += [layer.register_forward_hook(self._layer_hook(i)) for i, layer in enumerate(layers)]

    def _embed(self, module, inputs, out):
        if self.mode == "cells":
            out[:, self.subject] += self.noise
        return out

    def _layer_hook(self, index: int):
        def hook(module, inputs, out):
            h = out[0] if isinstance(out, tuple) else out
            if self.mode == "clean":
                self._captured[index] = h[0].detach().clone()
            elif index in self.restore:
                rows, toks = self.restore[index]
                h[rows, toks] = self.clean[index, toks]
            return out

        return hook

    def _answer_logprob(self, rows: int):
        torch = self.torch
        hidden = self.model.model(input_ids=self.ids.expand(rows, -1), use_cache=False).last_hidden_state
        logits = self.model.lm_head(hidden[:, -1]).float()
        return torch.log_softmax(logits, dim=-1)[:, self.answer]

    def grid(self):
        """(seconds, [layers, tokens] restored log-probs, clean log-prob, corrupt log-prob)."""
        torch = self.torch
        self._sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.mode = "clean"
            clean_lp = self._answer_logprob(1)
            self.clean = torch.stack(self._captured)
            self.mode = "cells"
            out = []
            for rows, per_layer in self.batches:
                self.restore = per_layer
                out.append(self._answer_logprob(rows))
            lps = torch.cat(out).cpu()
            clean_lp = float(clean_lp.cpu()[0])
        self._sync()
        dt = time.perf_counter() - t0
        self.mode, self.restore = None, {}
        return dt, lps[1:].view(self.num_layers, self.n).double().numpy(), clean_lp, float(lps[0])

    def _sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()


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
    ap.add_argument("--json", default="", help="write all numbers here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

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
        ours_t, stages_t, hf_t, cached = [], [], [], []
        variant_t: dict[str, list[float]] = {label: [] for label in variants[n]}
        variant_results: dict[str, dict] = {}
        for r in range(args.repeats):
            total, stages, results = ours_once(engine, clock, plan)
            ours_t.append(total)
            stages_t.append(stages)
            cached.append(sum(x.cached_tokens for x in results.values()))
            print(f"  ours {total:.3f} s (stages {', '.join(f'{s:.3f}' for s in stages)})", flush=True)
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
            row["profile"] = profile_once(engine, clock, plan, on_gpu)
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
