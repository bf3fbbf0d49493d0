"""Patching scores: ``recovered`` = (patched - corrupt) / (clean - corrupt) and ``below_noise_floor`` (|patched -
corrupt| within the largest |in-batch - solo| gap of an unpatched destination), against numbers worked out by
hand: on made-up probabilities, and on a whole run's store on tiny_random."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import xarray as xr

from conftest import Borrowed, base_config
from interp_runner.engine.results import RequestResult
from interp_runner.store.result_arrays import score_arrays

# (role, destination prompt, source prompt, answer probability), in store order
ROWS = [
    ("prompt", 0, None, 0.8),     # clean
    ("prompt", 1, None, 0.2),     # corrupt A
    ("prompt", 2, None, 0.5),     # corrupt B
    ("patched", 1, 0, 0.65),      # (0.65 - 0.2) / (0.8 - 0.2) = 0.75; |0.45| > floor
    ("patched", 1, 0, 0.215),     # 0.015 / 0.6 = 0.025; |0.015| <= floor (0.03, set by B's baseline)
    ("baseline", 1, None, 0.21),  # gap 0.01
    ("patched", 2, 0, 0.52),      # 0.02 / 0.3; |0.02| <= floor
    ("patched", 2, 0, 0.44),      # -0.06 / 0.3 = -0.2; |0.06| > floor
    ("baseline", 2, None, 0.53),  # gap 0.03: the floor
    ("patched", 1, None, 0.5),    # a vector source: no clean run, no recovered; |0.3| > floor
]
RECOVERED = [math.nan, math.nan, math.nan, 0.75, 0.025, math.nan, 0.02 / 0.3, -0.2, math.nan, math.nan]
BELOW_FLOOR = {3: False, 4: True, 5: True, 6: True, 7: False, 8: True, 9: False}


def made_up_pairs():
    pairs = []
    for role, prompt, source, prob in ROWS:
        request = SimpleNamespace(role=role, prompt=SimpleNamespace(index=prompt),
                                  meta={} if role == "prompt" else {"source": source})
        score = {"logprobs": np.array([math.log(prob), math.log(0.1)]), "top_id": 7}
        pairs.append((request, RequestResult(f"r{len(pairs)}", prompt, [7], "", [-1.0], score=score)))
    return pairs


def test_recovered_and_the_noise_floor_on_made_up_scores():
    data, attrs = score_arrays(SimpleNamespace(num_stages=2), made_up_pairs())
    assert attrs["noise_floor"] == pytest.approx(0.03, abs=1e-12)
    np.testing.assert_allclose(data["recovered"][1], RECOVERED, rtol=1e-6, atol=1e-7)
    flags = data["below_noise_floor"][1]
    assert {i: bool(flags[i]) for i in BELOW_FLOOR} == BELOW_FLOOR
    np.testing.assert_allclose(data["answer_prob"][1], [p for *_, p in ROWS], rtol=1e-6)
    np.testing.assert_allclose(data["logit_diff"][1], [math.log(p / 0.1) for *_, p in ROWS], rtol=1e-6)


def test_a_single_stage_run_has_no_patching_scores():
    data, attrs = score_arrays(SimpleNamespace(num_stages=1), made_up_pairs()[:3])
    assert "recovered" not in data and "below_noise_floor" not in data and attrs == {}


CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Big Ben clock is located in the city of"
OTHER = "The Louvre museum is located in the city of"


@pytest.mark.engine
def test_a_patching_store_holds_recovered_and_the_flags_worked_out_from_its_scores(runner_engine, tmp_path):
    """Under each model runner; the store records the runner that ran."""
    from interp_runner.pipeline import run

    tiny_engine = runner_engine

    patch = {"source": {"prompt": 0}, "hook": "post_block", "layers": [1], "positions": "all"}
    patching = [{**patch, "prompts": [1, 2], "alpha": 0.0}, {**patch, "prompts": [1, 2], "alpha": 0.5},
                {**patch, "prompts": [1], "alpha": 1.0},
                {**patch, "prompts": [2], "source": {"vector": {"random": {"seed": 1, "norm": 4.0}}}}]
    items = [{"text": t, "answer": " Paris", "foil": " Rome"} for t in (CLEAN, CORRUPT, OTHER)]
    store = tmp_path / "scores.zarr"
    config = base_config(prompts={"items": items}, patching=patching, sampling={"max_tokens": 1},
                         store={"path": str(store)})
    run(config, tmp_path, engine_factory=lambda *_: Borrowed(tiny_engine), log=lambda _: None)
    ds = xr.open_zarr(str(store), consolidated=False)
    assert ds.attrs["engine"]["model_runner"] == tiny_engine.model_runner
    rids = [str(r) for r in ds["request"].values]
    prob = np.exp(ds["answer_logprob"].values.astype(np.float64))
    solo = {int(r[1:6]): i for i, r in enumerate(rids) if len(r) == 6}  # r00001: prompt 1's stage-0 run
    assert sorted(solo) == [0, 1, 2] and len(rids) == 3 + 6 + 2  # 6 patched copies, 2 unpatched ones
    floor = max(abs(prob[i] - prob[solo[int(r[1:6])]]) for i, r in enumerate(rids) if r[7:8] == "b")
    assert ds.attrs["noise_floor"] == pytest.approx(floor, abs=1e-7)
    patched = 0
    for i, r in enumerate(rids):
        corrupt = prob[solo[int(r[1:6])]]
        source = None if len(r) == 6 or r[7:8] == "b" else patching[int(r[8:])]["source"].get("prompt")
        if source is None:
            assert np.isnan(ds["recovered"].values[i]), r
        else:
            clean = prob[solo[source]]
            assert abs(clean - corrupt) > 1e-2 * clean  # the ratio is well conditioned
            want = (prob[i] - corrupt) / (clean - corrupt)
            assert float(ds["recovered"].values[i]) == pytest.approx(want, abs=1e-4), r
            patched += 1
        assert bool(ds["below_noise_floor"].values[i]) == (abs(prob[i] - corrupt) <= floor), r
    assert patched == 5
    flags = {r: bool(f) for r, f in zip(rids, ds["below_noise_floor"].values)}
    # alpha 0 changes nothing (within the floor); alpha 1 at every position of layer 1 restores the clean score
    assert flags["r00001-p000"] and flags["r00002-p001"] is False and not flags["r00001-p002"]
    assert float(ds["recovered"].sel(request="r00001-p002")) == pytest.approx(1.0, abs=1e-3)
    assert float(ds["recovered"].sel(request="r00001-p000")) == pytest.approx(0.0, abs=1e-3)
