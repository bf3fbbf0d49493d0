"""Where a trace run's time goes, for ``trace_grid.py --profile`` and ``--timeline``: GPU kernel time against wall
time, the host's time by part (vLLM's scheduler and runner under V1 and V2, our planner, packing and collection),
functions by self and cumulative time, and a timeline of one run's phases."""

from __future__ import annotations

import time
from pathlib import Path

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


def profile_once(engine, run_once, on_gpu: bool) -> dict:
    """Where one run's time goes (``run_once()``: one whole run, returning its wall time first): GPU kernel time
    against the wall time (kernel-only tracing, which adds little host work), and the host's split over vLLM's and
    our functions (cProfile: slower, for the proportions)."""
    import cProfile
    import pstats

    out = {}
    if on_gpu:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall, _, _ = run_once()
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
    wall, _, _ = run_once()
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
        run_once()
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
