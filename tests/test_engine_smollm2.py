"""Steering and capture on the real SmolLM2 (fp32, CPU) against plain HF transformers hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support import hf_oracle
from conftest import ALL_HOOKS, base_config, rel_err, run_config
from interp_runner.sites import site_id
from interp_runner.vectors.load import random_direction

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPTS = ["The Eiffel Tower is located in the city of", "My favourite food is", "Water boils at a temperature of"]


def config(**parts) -> dict:
    return base_config("smollm2_135m", prompts={"items": PROMPTS}, sampling={"max_tokens": 4, "logprobs": 5},
                       **parts)


@pytest.fixture(scope="module")
def unsteered(smollm2_engine):
    return run_config(smollm2_engine, config())[1]


def test_zero_vector_and_zero_scale_change_nothing(smollm2_engine, unsteered):
    zero = [0.0] * 576
    steering = {
        "global": {
            "base": {"post_block": {"layer": "all", "vector": zero}},
            "prefill": {"pre_attn": {"layer": [0, 3], "vector": {"random": {"seed": 1, "norm": 50}}, "scale": 0.0}},
        }
    }
    _, results = run_config(smollm2_engine, config(steering=steering))
    for got, want in zip(results, unsteered):
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs


@pytest.mark.parametrize("hook", ALL_HOOKS)
def test_steering_matches_hf_hooks(smollm2_engine, smollm2_path, unsteered, hook):
    layer = 7
    vec = random_direction(seed=3, norm=6.0, size=576)
    steering = {"request": [{"prompts": [0], "base": {hook: {"layer": layer, "vector": vec.tolist()}}}]}
    plan, results = run_config(smollm2_engine, config(steering=steering))
    ids = list(plan.requests[0].prompt.token_ids)

    tokens, logprobs = hf_oracle.greedy(smollm2_path, ids, 4, steer={(layer, hook): vec})
    assert results[0].token_ids == tokens
    np.testing.assert_allclose(results[0].logprobs, logprobs, atol=2e-4)
    # the full next-token distribution at the first step, not just the chosen token
    logits, _ = hf_oracle.forward(smollm2_path, ids, {(layer, hook): vec})
    ref = torch.log_softmax(logits[-1], -1)
    for token, lp in results[0].top_logprobs[0]:
        assert abs(lp - float(ref[token])) < 2e-4
    # and the steering really did something; the other prompts are untouched
    base_first = dict(unsteered[0].top_logprobs[0])
    moved = max(abs(lp - base_first.get(t, -100.0)) for t, lp in results[0].top_logprobs[0])
    assert moved > 1e-2
    for got, want in zip(results[1:], unsteered[1:]):
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


@pytest.mark.parametrize("positions", ["last_prompt", "all_prompt", [0, 2, -1], "all"])
def test_capture_matches_hf_every_hook(smollm2_engine, smollm2_path, positions):
    capture = [{"name": "acts", "hooks": ALL_HOOKS, "layers": "all", "positions": positions}]
    plan, results = run_config(smollm2_engine, config(capture=capture))
    for request, result in zip(plan.requests, results):
        prompt = list(request.prompt.token_ids)
        full = prompt + result.token_ids[:-1]  # the last sampled token is never fed to the model
        _, ref = hf_oracle.forward(smollm2_path, full)
        n = len(prompt)
        expected = {
            "last_prompt": [n - 1],
            "all_prompt": list(range(n)),
            "all": list(range(len(full))),
        }.get(positions) if isinstance(positions, str) else sorted({p % n for p in positions})
        for layer in range(30):
            for hook in ALL_HOOKS:
                got_positions, values = result.captures[site_id(layer, hook)]
                assert got_positions.tolist() == expected, (layer, hook)
                assert rel_err(values, ref[(layer, hook)][expected]) <= 1e-4, (layer, hook)


def test_tier_semantics_through_capture(smollm2_engine, unsteered):
    """prefill adds only on prompt rows, decode only on generated rows, base on both: the addition at a
    post_block site is post_block - (post_attn + mlp_out) of the same layer, read from capture."""
    layer = 12
    vec = random_direction(seed=5, norm=3.0, size=576)
    capture = [{"name": "acts", "hooks": ["post_attn", "mlp_out", "post_block"], "layers": [layer], "positions": "all"}]
    plain_plan, plain = run_config(smollm2_engine, config(capture=capture))
    for tier, on_prompt, on_generated in [("prefill", True, False), ("decode", False, True), ("base", True, True)]:
        steering = {"global": {tier: {"post_block": {"layer": layer, "vector": vec.tolist()}}}}
        plan, results = run_config(smollm2_engine, config(capture=capture, steering=steering))
        for request, result, base in zip(plan.requests, results, plain):
            n = len(request.prompt.token_ids)
            positions, post_block = result.captures[site_id(layer, "post_block")]
            _, post_attn = result.captures[site_id(layer, "post_attn")]
            _, mlp_out = result.captures[site_id(layer, "mlp_out")]
            added = post_block - (post_attn + mlp_out)
            prompt_rows, gen_rows = positions < n, positions >= n
            assert gen_rows.sum() == 3
            for rows, applied in [(prompt_rows, on_prompt), (gen_rows, on_generated)]:
                want = np.broadcast_to(vec if applied else 0 * vec, added[rows].shape)
                np.testing.assert_allclose(added[rows], want, atol=1e-3)
            if tier == "decode":  # prompt activations are untouched, bit for bit
                base_positions, base_values = base.captures[site_id(layer, "post_block")]
                assert np.array_equal(post_block[prompt_rows], base_values[base_positions < n])
