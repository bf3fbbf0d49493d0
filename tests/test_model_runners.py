"""vLLM's model runners (docs/model_runners.md): the config key, the engine's choice, V2's forced tokens.

The engine behaviour under each runner is tested by the engine tests that take ``runner_engine`` (conftest), against
the HF oracles and each other; this file holds what needs no engine.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import base_config
from interp_runner.config import ConfigError


@pytest.mark.parametrize("bad", ["v3", "V2", 2, None])
def test_a_bad_model_runner_is_refused_naming_the_key(bad):
    from interp_runner.pipeline import prepare

    config = base_config()
    config["engine"] = {**config["engine"], "model_runner": bad}
    with pytest.raises(ConfigError) as err:
        prepare(config)
    assert [path for path, _ in err.value.problems] == ["engine.model_runner"]


def test_the_engine_forces_a_runner_or_leaves_vllm_its_own_pick(monkeypatch):
    from interp_runner.engine import settings as engine

    monkeypatch.setattr(engine, "_caller_runner_env", None)
    monkeypatch.setenv(engine.RUNNER_ENV, "0")  # as an earlier engine of this process left it
    assert engine.select_model_runner("v2") and os.environ[engine.RUNNER_ENV] == "1"
    assert not engine.select_model_runner("v1") and os.environ[engine.RUNNER_ENV] == "0"
    assert not engine.select_model_runner("auto") and engine.RUNNER_ENV not in os.environ
    monkeypatch.setattr(engine, "_caller_runner_env", "1")  # the caller asked vLLM for V2 itself
    assert engine.select_model_runner("auto") and os.environ[engine.RUNNER_ENV] == "1"


def test_v2_forcing_leaves_only_each_forced_rows_next_token():
    from interp_runner.plugin.runners.v2_sampler import _force

    logits = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    slots = torch.tensor([3, 0, 5, 3])  # batch rows -> request slots
    pos = torch.tensor([9, 4, 7, 11])  # each row's position (it samples the token after it)
    forced = {3: ([2, 4, 1], 10), 5: ([5], 9)}  # slot -> (forced tokens, prompt length)
    _force(logits, slots, pos, forced)
    inf = float("-inf")
    # row 0: slot 3, position 9 = its prompt's last: generated token 0 -> 2; row 3: position 11 -> token 2 -> 1
    assert logits[0].tolist() == [inf, inf, 0.0, inf, inf, inf]
    assert logits[3].tolist() == [inf, 0.0, inf, inf, inf, inf]
    assert logits[1].tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]  # slot 0 forces nothing
    assert logits[2].tolist() == [12.0, 13.0, 14.0, 15.0, 16.0, 17.0]  # slot 5: position 7 is still its prompt


# -- the same results under both runners (each engine's own results are checked against HF in the engine tests) --

@pytest.mark.engine
def test_steering_capture_patching_and_scores_are_the_same_under_v1_and_v2(tiny_engine, tiny_engine_v2):
    import numpy as np

    from conftest import run_plan
    from interp_runner.vectors.load import random_direction

    assert (tiny_engine.model_runner, tiny_engine_v2.model_runner) == ("v1", "v2")
    items = [{"text": t, "answer": " Paris", "foil": " Rome"}
             for t in ("The Eiffel Tower is located in the city of", "The Big Ben clock is located in the city of")]
    vec = random_direction(seed=3, norm=4.0, size=128).tolist()
    config = base_config(
        prompts={"items": items}, sampling={"max_tokens": 3, "logprobs": 3},
        steering={"request": [{"prompts": [1], "base": {"post_attn": {"layer": 2, "vector": vec}}}]},
        capture=[{"hooks": ["post_block", "mlp_out"], "layers": "all", "positions": "all"}],
        patching=[{"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": [1], "alpha": 0.5}])
    runs = [run_plan(engine, config, skip_reading_prefix_cache=True) for engine in (tiny_engine, tiny_engine_v2)]
    (plan, v1), (_, v2) = runs
    assert v1.keys() == v2.keys() and len(v1) > len(items)  # the patched stage ran too
    for rid, a in v1.items():
        b = v2[rid]
        assert a.token_ids == b.token_ids and a.void is None and b.void is None
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert (a.score is None) == (b.score is None)
        if a.score is not None:
            np.testing.assert_allclose(a.score["logprobs"], b.score["logprobs"], atol=1e-5, rtol=0)
        assert a.captures.keys() == b.captures.keys()
        for site, (positions, values) in a.captures.items():
            np.testing.assert_array_equal(positions, b.captures[site][0])
            np.testing.assert_allclose(values, b.captures[site][1], atol=1e-5, rtol=0)
