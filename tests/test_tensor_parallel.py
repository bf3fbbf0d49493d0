"""Tensor parallelism on CPU: the same run with TP = 2 gives TP = 1's steering, capture, patching and scoring
results (fp32, within the all-reduce's rounding), and both ranks' intervention checksums are recorded and equal.

Every run at one TP size goes in one fresh process (vLLM starts TP workers with spawn), on one engine whose settings
all the configs here share (``support.tp_jobs.TP_RUNS``, with the other modules' TP runs), bound to its own cores and
with its own Inductor cache (vLLM compiles the vocab-parallel embedding's mask with Inductor under TP, even in eager
mode); each test compares the stores of one config. On a GPU machine the same tests run on two GPUs: each run
process ends only once its engine's workers have (vLLM's own shutdown returns while they still tear down, holding GPU
memory the next run's engine start needs).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import xarray as xr

from conftest import REPO
from support.tp_jobs import TP_RUNS, assert_recovered_within, scale_of

pytestmark = pytest.mark.engine

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Big Ben clock is located in the city of"
TWO_RANKS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores for two ranks")


def engine(tp: int) -> dict:
    """The engine settings of every config here: one engine per TP size serves them all."""
    return {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 8,
            "tensor_parallel_size": tp, "pack_cells": True, "cell_entry_stride": 1}


def config(tp: int, store: str, max_tokens: int = 4) -> dict:
    return {
        "model": {"name": "tiny_random"},
        "engine": engine(tp),
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
        "engine": engine(tp),
        "prompts": {"items": []},
        "causal_trace": {"facts": str(REPO / "experiments" / "causal_trace" / "facts.jsonl"), "num_facts": 1,
                         "components": ["resid", "mlp"], "layers": [0, 3], "window": 2, "noise": {"samples": 2},
                         "filter": False, "plots": False},
        "store": {"path": store},
    }


# each test's config, run with the session's other TP runs; ``max_tokens`` 1 sends every request through the engine
# core directly (the causal-trace path)
TP_RUNS.add("tp_generate", lambda tp, store, _: config(tp, store, 4))
TP_RUNS.add("tp_one-token-bulk", lambda tp, store, _: config(tp, store, 1))
TP_RUNS.add("tp_trace", lambda tp, store, _: trace_config(tp, store))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return TP_RUNS.stores(tmp_path_factory)


def assert_recovered_within_propagated(one: xr.Dataset, two: xr.Dataset, logprob_atol: float) -> None:
    """``recovered`` of the patched request (its probability p) against the corrupt prompt's c and the clean
    prompt's k (here prompts 1 and 0), within the bound ``assert_recovered_within`` propagates."""
    rids = [str(r) for r in one["request"].values]
    prob = np.exp(one["answer_logprob"].values.astype(np.float64))
    solo = {int(r[1:6]): i for i, r in enumerate(rids) if len(r) == 6}  # r00001: prompt 1's unpatched run
    clean, corrupt = prob[solo[0]], prob[solo[1]]
    r1, r2 = one["recovered"].values.astype(np.float64), two["recovered"].values.astype(np.float64)
    assert np.array_equal(np.isnan(r1), np.isnan(r2)) and np.isfinite(r1).sum() == 1
    assert_recovered_within(r1, r2, prob, clean, corrupt, logprob_atol)


@TWO_RANKS
@pytest.mark.parametrize("job", ["generate", "one-token-bulk"])
def test_tp2_matches_tp1_and_ranks_agree(runs, job):
    """``max_tokens`` 1 sends every request through the engine core directly (the causal-trace path)."""
    one, two, max_tokens = runs[1][f"tp_{job}"], runs[2][f"tp_{job}"], 4 if job == "generate" else 1
    checksums = json.loads(json.dumps(two.attrs["engine"]["intervention_checksums"]))
    assert len(checksums) == 2 and checksums[0] == checksums[1] and checksums[0]["steps"] > 0
    assert len(one.attrs["engine"]["intervention_checksums"]) == 1

    assert set(one.data_vars) == set(two.data_vars)
    np.testing.assert_array_equal(one["tokens"].values, two["tokens"].values)
    for name, var in one.data_vars.items():
        if var.dtype.kind == "f" and name != "recovered":
            a, b = var.values, two[name].values
            scale = scale_of(a)  # no finite value in ``gen`` when no token is generated
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * scale if var.dtype != np.float16 else 1e-2 * scale,
                                       err_msg=name)
    lp = one["answer_logprob"].values
    assert_recovered_within_propagated(one, two, logprob_atol=1e-4 * scale_of(lp))
    # not vacuous: captures came back, and the patch moved its request away from the unpatched baseline
    assert np.isfinite(two["last"].values).sum() > 0
    assert max_tokens == 1 or np.isfinite(two["gen"].values).sum() > 0  # generated tokens, when fed back
    role = list(two["role"].values)
    patched, baseline = role.index("patched"), role.index("baseline")
    assert abs(float(two["answer_logprob"][patched]) - float(two["answer_logprob"][baseline])) > 1e-3


@TWO_RANKS
def test_tp2_packed_trace_cells_match_tp1(runs):
    """Packed cells under TP = 2: each rank splits the packed requests into the same attention sequences (their
    layout is folded into the checksum) and the grid is TP = 1's."""
    one, two = runs[1]["tp_trace"], runs[2]["tp_trace"]
    checksums = json.loads(json.dumps(two.attrs["engine"]["intervention_checksums"]))
    assert len(checksums) == 2 and checksums[0] == checksums[1] and checksums[0]["steps"] > 0
    a, b = one["restored_logprob_samples"].values, two["restored_logprob_samples"].values
    assert np.isfinite(a).sum() == 2 * 2 * 2 * int(one["num_tokens"][0]) and two.attrs["voided"] == []
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * scale_of(a))


@TWO_RANKS
def test_closing_a_tp_engine_waits_for_its_processes(runs):
    """vLLM's shutdown kills an engine core that takes over 5 s to stop and returns while its TP workers still run;
    ``close`` returns only once every process the engine started has ended: here the TP = 2 process's last engine,
    closed in that fresh process once it has run its configs (vLLM caches its environment once an in-process engine
    has started)."""
    found = runs["closed"]
    assert found["names"] == ["VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert found["alive"] == []
