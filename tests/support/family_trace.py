"""The causal-trace check every model family's tests make: ROME's grid on one fact (noise on layer 0's input at the
subject, as the model scales its embeddings; clean values put back per component, layer and token, over a window)
against a family oracle's restored log-probabilities, with cells as requests of their own or packed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_plan
from interp_runner.kinds.causal_trace.grids import trace_dataset

FACTS = REPO / "experiments" / "causal_trace" / "facts.jsonl"


def check_trace_grid(name: str, path: Path, engine, pack: bool, traced) -> None:
    """``traced(path, token_ids, subject_positions, noise, answer_id, cells, window)`` gives the oracle's
    (restored log-probability per cell, corrupt log-probability)."""
    layers, window = [0, 2, 3], 2
    config = {"model": {"name": name}, "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                                                  "pack_cells": pack},
              "prompts": {"items": []},
              "causal_trace": {"facts": str(FACTS), "num_facts": 1, "noise": {"samples": 1, "seed": 1},
                               "layers": layers, "window": window, "plots": False, "filter": False}}
    kept, engine.pack_cells = engine.pack_cells, pack
    try:
        plan, results = run_plan(engine, config)
    finally:
        engine.pack_cells = kept
    ds = trace_dataset(plan, results)
    assert ds.attrs["voided"] == []
    for fact in plan.layout.facts:
        f, n = fact.index, len(fact.clean.token_ids)
        assert n > 4
        cells = [(k, lay, t) for k in plan.layout.components for lay in layers for t in range(n)]
        want, want_corrupt = traced(path, list(fact.clean.token_ids), list(fact.subject_positions),
                                    ds["noise"].values[f, 0, : len(fact.subject_positions)],
                                    fact.clean.answer_ids[0], cells, window)
        got = np.array([float(ds["restored_logprob_samples"].sel(component=k, layer=lay).values[f, t, 0])
                        for k, lay, t in cells])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)
        assert float(ds["corrupt_logprob_samples"].values[f, 0]) == pytest.approx(want_corrupt, abs=1e-4)
        assert np.ptp(want) > 1e-2  # restores move the answer
