"""Tensor parallelism on CPU: the same run with TP = 2 gives TP = 1's steering, capture, patching and scoring
results (fp32, within the all-reduce's rounding), and both ranks' intervention checksums are recorded and equal.

Each run is a fresh process (vLLM starts TP workers with spawn), bound to its own cores and with its own Inductor
cache (vLLM compiles the vocab-parallel embedding's mask with Inductor under TP, even in eager mode). On a GPU
machine the same tests run on two GPUs: each run process ends only once its engine's workers have (vLLM's own
shutdown returns while they still tear down, holding GPU memory the next run's engine start needs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr

from conftest import REPO

pytestmark = pytest.mark.engine

RUNNER = """
import json, sys
from pathlib import Path
from interp_runner.pipeline import run
if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text())
    print(run(config, Path(sys.argv[2])))
"""

# builds a TP = 2 engine, closes it, prints its processes' names and those still running after ``close``
CLOSE_RUNNER = """
import json, sys
import psutil
sys.path.insert(0, sys.argv[2])  # the tests folder
from conftest import build_engine
if __name__ == "__main__":
    engine = build_engine(sys.argv[1], [], [], tensor_parallel_size=2)
    processes = [psutil.Process(pid) for pid in engine.processes]
    names = sorted(p.name() for p in processes)
    engine.close()
    alive = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    print(json.dumps({"names": names, "alive": alive}))
"""

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Big Ben clock is located in the city of"


def config(tp: int, store: str, max_tokens: int = 4) -> dict:
    return {
        "model": {"name": "tiny_random"},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 8,
                   "tensor_parallel_size": tp},
        "prompts": {"items": [{"text": t, "answer": " Paris", "foil": " Rome"} for t in (CLEAN, CORRUPT, CLEAN)]},
        "sampling": {"max_tokens": max_tokens},
        "steering": {
            "global": {"prefill": {"post_block": {"layer": 0, "vector": {"random": {"seed": 0, "norm": 2.0}}}}},
            "request": [{"prompts": [2], "decode": {"mlp_out": {"layer": "all",
                                                                "vector": {"random": {"seed": 1, "norm": 3.0}}}}}],
        },
        "capture": [
            {"name": "last", "hooks": ["pre_attn", "post_block"], "layers": "all", "positions": "last_prompt"},
            {"name": "gen", "hooks": ["mlp_out"], "layers": [0, 3], "positions": "all_generated"},
        ],
        "patching": [
            {"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": "all", "alpha": 0.5},
            {"prompts": [1], "source": {"zeros": True}, "hook": "attn_out", "layers": [1], "positions": [2, 3]},
        ],
        "store": {"path": store},
    }


def trace_config(tp: int, store: str) -> dict:
    """A causal trace with its cells packed into shared requests (as a GPU runs them)."""
    return {
        "model": {"name": "tiny_random"},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 8,
                   "tensor_parallel_size": tp, "pack_cells": True,
                   "cell_entry_stride": 1},
        "prompts": {"items": []},
        "causal_trace": {"facts": str(REPO / "experiments" / "causal_trace" / "facts.jsonl"), "num_facts": 1,
                         "components": ["resid", "mlp"], "layers": [0, 3], "window": 2, "noise": {"samples": 2},
                         "filter": False, "plots": False},
        "store": {"path": store},
    }


def tp_env(tp: int, tmp_path) -> dict:
    """The environment of a fresh process at tensor-parallel size ``tp``, its ranks bound to their own cores."""
    # the repository first, then the environment's own path (where packages may come from PYTHONPATH)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{tp}"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if tp > 1 else "0", "PYTHONPATH": path}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:tp])
    return env


def run_tp(tp: int, tmp_path, max_tokens: int = 1, make_config=None) -> xr.Dataset:
    store = tmp_path / f"tp{tp}.zarr"
    cfg = tmp_path / f"tp{tp}.json"
    made = make_config(tp, str(store)) if make_config else config(tp, str(store), max_tokens)
    cfg.write_text(json.dumps(made))
    out = subprocess.run([sys.executable, "-c", RUNNER, str(cfg), str(tmp_path / f"run{tp}")],
                         env=tp_env(tp, tmp_path), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return xr.open_zarr(store, consolidated=False)


def assert_recovered_within_propagated(one: xr.Dataset, two: xr.Dataset, logprob_atol: float) -> None:
    """``recovered`` = (p - c) / (k - c) of the patched request's probability p, the corrupt prompt's c and the clean
    prompt's k (here prompts 1 and 0). Each log-probability may differ between TP sizes by ``logprob_atol``
    (all-reduce order), so each probability by about that fraction of itself, and the ratio divides those by the
    clean-corrupt gap: |d recovered| <= atol (p + c |1 - r| + k |r|) / |k - c|."""
    rids = [str(r) for r in one["request"].values]
    prob = np.exp(one["answer_logprob"].values.astype(np.float64))
    solo = {int(r[1:6]): i for i, r in enumerate(rids) if len(r) == 6}  # r00001: prompt 1's unpatched run
    clean, corrupt = prob[solo[0]], prob[solo[1]]
    r1, r2 = one["recovered"].values.astype(np.float64), two["recovered"].values.astype(np.float64)
    assert np.array_equal(np.isnan(r1), np.isnan(r2)) and np.isfinite(r1).sum() == 1
    bound = logprob_atol * (prob + corrupt * np.abs(1 - r1) + clean * np.abs(r1)) / abs(clean - corrupt)
    ok = np.isfinite(r1)
    assert (np.abs(r2 - r1)[ok] <= bound[ok]).all(), (r1[ok], r2[ok], bound[ok])

@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores for two ranks")
@pytest.mark.parametrize("max_tokens", [4, 1], ids=["generate", "one-token-bulk"])
def test_tp2_matches_tp1_and_ranks_agree(tmp_path, max_tokens):
    """``max_tokens`` 1 sends every request through the engine core directly (the causal-trace path)."""
    one, two = run_tp(1, tmp_path, max_tokens), run_tp(2, tmp_path, max_tokens)
    checksums = json.loads(json.dumps(two.attrs["engine"]["intervention_checksums"]))
    assert len(checksums) == 2 and checksums[0] == checksums[1] and checksums[0]["steps"] > 0
    assert len(one.attrs["engine"]["intervention_checksums"]) == 1

    assert set(one.data_vars) == set(two.data_vars)
    np.testing.assert_array_equal(one["tokens"].values, two["tokens"].values)
    for name, var in one.data_vars.items():
        if var.dtype.kind == "f" and name != "recovered":
            a, b = var.values, two[name].values
            scale = max(float(np.nanmax(np.abs(a))), 1.0)
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * scale if var.dtype != np.float16 else 1e-2 * scale,
                                       err_msg=name)
    lp = one["answer_logprob"].values
    assert_recovered_within_propagated(one, two, logprob_atol=1e-4 * max(float(np.nanmax(np.abs(lp))), 1.0))
    # not vacuous: captures came back, and the patch moved its request away from the unpatched baseline
    assert np.isfinite(two["last"].values).sum() > 0
    assert max_tokens == 1 or np.isfinite(two["gen"].values).sum() > 0  # generated tokens, when fed back
    role = list(two["role"].values)
    patched, baseline = role.index("patched"), role.index("baseline")
    assert abs(float(two["answer_logprob"][patched]) - float(two["answer_logprob"][baseline])) > 1e-3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores for two ranks")
def test_tp2_packed_trace_cells_match_tp1(tmp_path):
    """Packed cells under TP = 2: each rank splits the packed requests into the same attention sequences (their
    layout is folded into the checksum) and the grid is TP = 1's."""
    one, two = run_tp(1, tmp_path, make_config=trace_config), run_tp(2, tmp_path, make_config=trace_config)
    checksums = json.loads(json.dumps(two.attrs["engine"]["intervention_checksums"]))
    assert len(checksums) == 2 and checksums[0] == checksums[1] and checksums[0]["steps"] > 0
    a, b = one["restored_logprob_samples"].values, two["restored_logprob_samples"].values
    assert np.isfinite(a).sum() == 2 * 2 * 2 * int(one["num_tokens"][0]) and two.attrs["voided"] == []
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * max(float(np.nanmax(np.abs(a))), 1.0))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores for two ranks")
def test_closing_a_tp_engine_waits_for_its_processes(tiny_path, tmp_path):
    """vLLM's shutdown kills an engine core that takes over 5 s to stop and returns while its TP workers still run;
    ``close`` returns only once every process the engine started has ended. In a fresh process, as every TP run
    here: vLLM caches its environment once an in-process engine has started."""
    out = subprocess.run([sys.executable, "-c", CLOSE_RUNNER, str(tiny_path), str(REPO / "tests")], env=tp_env(2, tmp_path),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["names"] == ["VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert found["alive"] == []
