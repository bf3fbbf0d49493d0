"""Runs a list of experiment configs in one fresh process per tensor-parallel size, as production runs them: one
engine pool, consecutive configs with the same model and engine settings sharing one engine built first with the
union of their sites (their TP workers never forked from the test process); and the checks the GPU TP tests make of
the stores those runs write. ``TP_RUNS`` runs the configs test modules add when imported at TP = 1 and TP = 2 that
way, once for the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import yaml

from conftest import REPO

BF16_FACTOR = 4.0  # a bfloat16 TP array may differ from the reference TP size by this many times bfloat16's own cost

RUNNER = """
import json, sys
from pathlib import Path
from interp_runner.engine.pool import EnginePool
from interp_runner.engine.settings import on_gpu
from interp_runner.pipeline import prepare, run
if __name__ == "__main__":
    jobs = json.loads(Path(sys.argv[1]).read_text())
    closed = Path(sys.argv[2]) if len(sys.argv) > 2 else None  # where the last engine's processes are reported
    pool = EnginePool(log=print)
    groups = []
    for job in jobs:
        same = lambda a, b: a["engine"] == b["engine"] and a["model"] == b["model"]
        if groups and same(groups[-1][0][0], job[0]):
            groups[-1].append(job)
        else:
            groups.append([job])
    try:
        for group in groups:
            spec, first = None, None
            for config, _ in group:
                forced = config.get("sampling", {}).get("teacher_forcing")
                if forced and not Path(forced).exists():
                    continue  # forced to a store of this group: its sites are the same experiment's
                prepared = prepare(config)
                spec = prepared.plan.engine_spec if spec is None else spec.union(prepared.plan.engine_spec)
                first = first or prepared
            pool.get(first.facts.path, first.cfg.engine.resolved(on_gpu(), True), spec,
                     first.cfg.model.weights_seed())
            for config, run_dir in group:
                run(config, Path(run_dir), engines=pool)
    finally:
        if closed is not None:  # the last engine's processes: their names, and those still running after close
            import psutil
            processes = [psutil.Process(pid) for pid in getattr(pool.engine, "processes", ())]
            names = sorted(p.name() for p in processes)
        pool.close()
        if closed is not None:
            alive = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            closed.write_text(json.dumps({"names": names, "alive": alive}))
    print("builds", pool.builds, "runs", pool.runs)
"""


def run_jobs(tmp: Path, tp: int, jobs: list[tuple[dict, Path]], timeout: float = 900,
             report: Callable[[str], None] | None = None, extra_env: dict[str, str] | None = None,
             closed: Path | None = None) -> None:
    """Run ``jobs`` (config, run dir) in order in one process at tensor-parallel size ``tp``, ``extra_env`` added to
    its environment; fails the test with the first error of the process's log (kept as ``tmp/tp<tp>.log``). With
    ``closed``, the process writes there the names of its last engine's processes and those of them still running
    once the engine is closed (JSON: ``names``, ``alive``)."""
    spec = tmp / f"jobs{tp}.json"
    spec.write_text(json.dumps([[cfg, str(run_dir)] for cfg, run_dir in jobs]))
    # the repository first, then the environment's own path (where packages may come from PYTHONPATH)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if tp > 1 else "0",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor{tp}"), **(extra_env or {})}
    if all(cfg.get("engine", {}).get("enforce_eager") for cfg, _ in jobs):
        # vLLM torch.compiles its TP embedding's integer masking even in eager engines: on a CPU an Inductor build in
        # every worker, each also probing the CPU's vector units in a fresh Python process (~15 s a TP = 2 engine)
        env.setdefault("TORCH_COMPILE_DISABLE", "1")
    args = [sys.executable, "-c", RUNNER, str(spec), *([str(closed)] if closed is not None else [])]
    out = subprocess.run(args, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    log = tmp / f"tp{tp}.log"
    log.write_text(out.stdout + out.stderr)
    if report is not None:
        report(f"TP = {tp}: " + " | ".join(line.strip() for line in out.stdout.splitlines()
                                           if "engine start" in line or "builds" in line))
    if out.returncode != 0:  # a worker's root cause comes long before the engine core's report of it
        lines = (out.stdout + out.stderr).splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback" in line or "Error" in line), len(lines))
        pytest.fail(f"TP = {tp} run failed (whole log: {log}); first error:\n" + "\n".join(lines[first:first + 60])
                    + "\n...\n" + "\n".join(lines[-30:]))


def bound_ranks(tp: int) -> dict[str, str]:
    """The environment binding each of ``tp`` CPU ranks to a core of its own (none at TP = 1; a GPU ignores it)."""
    cores = sorted(os.sched_getaffinity(0))[:tp]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cores)} if tp > 1 else {}


class TpRuns:
    """Configs that test modules add when imported (``add``: a name and a function of TP size, store path and run
    folder giving the config), run on first ``stores``: all at TP = 1 in one process, then at TP = 2 in another
    where there are two cores (``run_jobs``, ranks bound to their own cores), configs with the same model and engine
    settings on one engine. Only the modules a session collects add theirs, so a session runs the processes once for
    all of them."""

    def __init__(self):
        self.configs: dict[str, Callable[[int, str, Path], dict]] = {}
        self.found: dict | None = None
        self.failure: str | None = None

    def add(self, name: str, make: Callable[[int, str, Path], dict]) -> None:
        self.configs[name] = make

    def stores(self, tmp_path_factory) -> dict:
        """{tp: {config name: store}}, and under "closed" what the TP = 2 process saw of its last engine's
        processes when it closed that engine after its runs (``run_jobs``'s ``closed``)."""
        if self.failure is not None:  # the session's runs failed once already
            pytest.fail(self.failure)
        if self.found is None:
            tmp = tmp_path_factory.mktemp("tp_runs")
            found = {}
            try:
                for tp in (1, 2) if len(os.sched_getaffinity(0)) >= 2 else (1,):
                    jobs = [(make(tp, str(tmp / f"{name}{tp}.zarr"), tmp), tmp / f"run_{name}{tp}")
                            for name, make in self.configs.items()]
                    run_jobs(tmp, tp, jobs, extra_env=bound_ranks(tp), closed=tmp / "closed.json" if tp > 1 else None)
                    found[tp] = {name: xr.open_zarr(tmp / f"{name}{tp}.zarr", consolidated=False)
                                 for name in self.configs}
            except pytest.fail.Exception as failed:
                self.failure = str(failed)
                raise
            if 2 in found:
                found["closed"] = json.loads((tmp / "closed.json").read_text())
            self.found = found
        return self.found


TP_RUNS = TpRuns()


def report(line: str) -> None:
    """Print ``line`` and keep it with the GPU check's logs (``INTERP_GPU_REPORT``, set by bench/gpu_check.sh and
    bench/tp_large.sh)."""
    print(line)
    if os.environ.get("INTERP_GPU_REPORT"):
        with open(os.environ["INTERP_GPU_REPORT"], "a") as f:
            f.write(line + "\n")


def ranks_agree(ds: xr.Dataset, ranks: int) -> None:
    checksums = json.loads(json.dumps(ds.attrs["engine"]["intervention_checksums"]))
    assert len(checksums) == ranks and all(c == checksums[0] for c in checksums) and checksums[0]["steps"] > 0


def compiled(ds: xr.Dataset) -> bool:
    eager = yaml.safe_load(ds.attrs["config_yaml"])["engine"]["enforce_eager"]
    return eager is False and bool(ds.attrs["host"]["gpus"])


def scale_of(a: np.ndarray) -> float:
    """The largest |value| among ``a``'s finite values, at least 1: what a TP comparison's tolerance is a share of."""
    finite = np.abs(a[np.isfinite(a)])
    return max(float(finite.max()), 1.0) if finite.size else 1.0


def assert_recovered_within(r1: np.ndarray, r2: np.ndarray, prob, clean, corrupt, logprob_atol: float) -> None:
    """``recovered`` = (p - c) / (k - c) of a probability p, the corrupt one c and the clean one k, from two TP sizes
    (``r1``, ``r2``). Each log-probability may differ between them by ``logprob_atol`` (all-reduce order), so each
    probability by about that fraction of itself, and the ratio divides those by the clean-corrupt gap:
    |d recovered| <= atol (p + c |1 - R| + k |R|) / |k - c|, with R the recovered value. Checked where R is finite,
    of which there must be some."""
    bound = logprob_atol * (prob + corrupt * np.abs(1 - r1) + clean * np.abs(r1)) / np.abs(clean - corrupt)
    ok = np.isfinite(r1)
    assert ok.any() and (np.abs(r2 - r1)[ok] <= bound[ok]).all(), \
        f"recovered: worst {np.max(np.abs(r2 - r1)[ok] / bound[ok]):.2f} of the propagated bound"


def float_arrays(ds: xr.Dataset) -> list[str]:
    return sorted(name for name, var in ds.data_vars.items() if var.dtype.kind == "f")


def within_bf16(one: xr.Dataset, two: xr.Dataset, ref: xr.Dataset) -> list[str]:
    """Every float array of ``two`` within BF16_FACTOR x |one - ref| of ``one`` (teacher-forced: same tokens); one
    line per array."""
    np.testing.assert_array_equal(one["tokens"].values, two["tokens"].values)
    np.testing.assert_array_equal(one["tokens"].values, ref["tokens"].values)
    lines = []
    for name in float_arrays(one):
        a, b, r = (ds[name].values.astype(np.float64) for ds in (one, two, ref))
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        if not np.isfinite(a).any():
            continue
        bf16_cost = float(np.nanmax(np.abs(a - r)))  # what bfloat16 costs here, at the reference TP size
        tol = max(BF16_FACTOR * bf16_cost, 1e-6 * scale_of(a))
        err = float(np.nanmax(np.abs(b - a)))
        lines.append(f"{name} {err:.4g}/{tol:.4g}")
        assert err <= tol, f"{name}: differs by {err:.4g} > {tol:.4g} (bf16 vs fp32: {bf16_cost:.4g})"
    assert lines
    return lines
