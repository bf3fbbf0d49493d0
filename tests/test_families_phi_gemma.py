"""Phi-3, Gemma 2 and Gemma 3 (text) on the engine (CPU, fp32) against plain HF transformers hooks
(``hf_sandwich_oracle``): capture at every hook, steering at every hook, patching, a causal-trace grid with cells
alone and packed. Gemma's branch hooks are the post-norm outputs (what the block adds), so
post_attn = pre_attn + attn_out and post_block = post_attn + mlp_out hold in the captured values too. Test prompts
are longer than the Gemma models' sliding windows and the Gemma 2 soft caps bind (``test_tiny_families``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support import hf_sandwich_oracle as oracle
from conftest import ALL_HOOKS, BANK_ROWS, KV_ROWS, KV_RUNS, base_config, build_engine, every_site, rel_err
from conftest import run_config, run_plan
from support.family_trace import check_trace_grid
from interp_runner.models.materialize import model_path
from interp_runner.sites import site_id
from interp_runner.vectors.load import random_direction

pytestmark = pytest.mark.engine

FAMILIES = ("tiny_phi3", "tiny_gemma2", "tiny_gemma3")
LAYERS = 4
# every prompt is longer than the sliding windows (4 tokens)
PROMPTS = ["The Eiffel Tower is located in the city of", "Once upon a time there was a small red fox",
           "def main(): return 1 + 2 + 3", "The capital of France is a city called"]
CLEAN, CORRUPT = "The Eiffel Tower is located in the city of", "The Big Ben clock is located in the city of"


def config(name, prompts=PROMPTS, **parts) -> dict:
    return base_config(name, prompts={"items": prompts}, sampling={"max_tokens": 3, "logprobs": 5}, **parts)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, path, hidden size, engine with steering, capture and patch ops at every site)."""
    path = model_path(request.param)
    sites = every_site(LAYERS)
    engine = build_engine(path, sites, sites, sites, BANK_ROWS, KV_ROWS, KV_RUNS)
    hidden = oracle.load(str(path)).config.hidden_size
    yield request.param, path, hidden, engine
    engine.close()


def test_capture_and_steering_at_every_hook_match_hf(family):
    """Each prompt steered at one hook (layers 1-2; scales 2 and -1.5): greedy tokens, their log-probabilities
    and every hook's values over the prompt match plain HF hooks adding scale x vector; the last prompt,
    unsteered, matches the unhooked model."""
    name, path, hidden, engine = family
    vec = random_direction(seed=5, norm=3.0, size=hidden).astype(np.float32)
    cases = [(hook, scale) for hook in ALL_HOOKS for scale in (2.0, -1.5)]
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))] + [PROMPTS[0]]
    steering = {"request": [{"prompts": [i], "base": {hook: {"layer": "1:3", "vector": vec.tolist(), "scale": scale}}}
                            for i, (hook, scale) in enumerate(cases)]}
    capture = [{"hooks": ALL_HOOKS, "layers": "all", "positions": "all_prompt"}]
    plan, results = run_config(engine, config(name, texts, steering=steering, capture=capture))
    unsteered = None
    for i, (request, result) in enumerate(zip(plan.requests, results)):
        ids = list(request.prompt.token_ids)
        steer = {(layer, cases[i][0]): vec * np.float32(cases[i][1]) for layer in (1, 2)} if i < len(cases) else None
        tokens, logprobs = oracle.greedy(path, ids, 3, steer)
        assert result.token_ids == tokens, (name, i)
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4, err_msg=f"{name} {i}")
        _, ref = oracle.forward(path, ids, steer)
        got = {}
        for layer in range(LAYERS):
            for hook in ALL_HOOKS:
                positions, got[layer, hook] = result.captures[site_id(layer, hook)]
                assert positions.tolist() == list(range(len(ids)))
                assert rel_err(got[layer, hook], ref[layer, hook]) <= 1e-4, (name, i, layer, hook)
            if steer and cases[i][0] in ("post_attn", "post_block") and layer in (1, 2):
                continue  # the vector added to the stream after the add is in that stream alone
            # the branch hooks are what the block adds: the stream identities hold in the captured values
            assert rel_err(got[layer, "pre_attn"] + got[layer, "attn_out"], got[layer, "post_attn"]) <= 1e-5
            assert rel_err(got[layer, "post_attn"] + got[layer, "mlp_out"], got[layer, "post_block"]) <= 1e-5
        if i == len(cases):
            unsteered = ref
    # steering at 2.0 moves the stream far beyond the tolerance (the case is not vacuous)
    _, steered = oracle.forward(path, list(plan.requests[0].prompt.token_ids),
                                {(layer, "pre_attn"): 2 * vec for layer in (1, 2)})
    assert rel_err(steered[3, "post_block"], unsteered[3, "post_block"]) > 1e-2


def test_branch_hooks_are_what_the_block_adds(family):
    """attn_out / mlp_out are the attention / MLP outputs on Phi-3, and on Gemma those outputs passed through the
    post-attention / post-feedforward norms (what Gemma adds), which differ from them far beyond the tolerance."""
    name, path, _, engine = family
    capture = [{"hooks": ["attn_out", "mlp_out"], "layers": [1], "positions": "all_prompt"}]
    plan, results = run_config(engine, config(name, PROMPTS[:1], capture=capture))
    model = oracle.load(str(path))
    layer, raw = model.model.layers[1], {}
    handles = [layer.self_attn.register_forward_hook(lambda m, a, o: raw.__setitem__("attn_out", o[0][0])),
               layer.mlp.register_forward_hook(lambda m, a, o: raw.__setitem__("mlp_out", o[0]))]
    oracle.hf_oracle.hooked_logits(model, list(plan.requests[0].prompt.token_ids), handles)
    post_norm = {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"}
    for hook, norm in post_norm.items():
        got = results[0].captures[site_id(1, hook)][1]
        if "gemma" in name:
            assert rel_err(got, raw[hook].numpy()) > 1e-2, hook
            with torch.no_grad():
                assert rel_err(got, getattr(layer, norm)(raw[hook]).numpy()) <= 1e-4, hook
        else:
            assert rel_err(got, raw[hook].numpy()) <= 1e-4, hook


def test_patching_at_every_hook_mixes_as_hf_hooks_do(family):
    name, path, _, engine = family
    layers, positions, alpha = [1, 2], [1, 2, 3, -1], 0.7
    patching = [{"prompts": [1], "source": {"prompt": 0}, "hook": hook, "layers": layers, "positions": positions,
                 "alpha": alpha} for hook in ALL_HOOKS]
    items = [{"text": t, "answer": " Paris", "foil": " Rome"} for t in (CLEAN, CORRUPT)]
    plan, results = run_plan(engine, base_config(name, prompts={"items": items}, patching=patching,
                                                 sampling={"max_tokens": 1, "logprobs": 5}))
    clean_ids, corrupt_ids = (list(plan.requests[i].prompt.token_ids) for i in (0, 1))
    assert len(clean_ids) == len(corrupt_ids) > 4
    answer, foil = plan.requests[1].prompt.answer_ids
    _, clean_values = oracle.forward(path, clean_ids)
    rows = [p % len(corrupt_ids) for p in positions]
    patched = {r.meta["patch"]: results[r.rid] for r in plan.requests if r.role == "patched"}
    unpatched = torch.log_softmax(oracle.forward(path, corrupt_ids)[0][-1].double(), -1).numpy()
    for spec, hook in enumerate(ALL_HOOKS):
        logits = oracle.patched_logits(path, corrupt_ids, {(lay, hook): (rows, alpha) for lay in layers}, clean_values)
        want = torch.log_softmax(logits[-1].double(), -1).numpy()
        got = patched[spec]
        assert got.void is None
        np.testing.assert_allclose(got.score["logprobs"], [want[answer], want[foil]], atol=1e-4, err_msg=hook)
        assert np.abs(want[[answer, foil]] - unpatched[[answer, foil]]).max() > 1e-3, hook  # the patch matters
        assert got.score["top_id"] == int(want.argmax()), hook


@pytest.mark.parametrize("pack", [False, True], ids=["cells-alone", "cells-packed"])
def test_trace_grid_matches_hf_hooks(family, pack):
    """ROME's grid (noise on layer 0's input at the subject, as the model scales its embeddings; clean values put
    back per component, layer and token) matches plain HF hooks, with cells as requests of their own and packed."""
    name, path, _, engine = family
    check_trace_grid(name, path, engine, pack, oracle.traced_logprobs)


@pytest.mark.parametrize("name", FAMILIES)
def test_v2_runner_captures_and_steers_as_hf_hooks_do(name):
    """The same instrumented blocks under vLLM's V2 model runner: every hook's values and the greedy tokens of a
    steered prompt match plain HF hooks."""
    path = model_path(name)
    sites = every_site(LAYERS)
    engine = build_engine(path, sites, sites, (), model_runner="v2")
    try:
        assert engine.model_runner == "v2"
        hidden = oracle.load(str(path)).config.hidden_size
        vec = random_direction(seed=6, norm=3.0, size=hidden).astype(np.float32)
        steering = {"global": {"base": {"mlp_out": {"layer": 2, "vector": vec.tolist()}}}}
        capture = [{"hooks": ALL_HOOKS, "layers": "all", "positions": "all_prompt"}]
        plan, results = run_config(engine, config(name, PROMPTS[:2], steering=steering, capture=capture))
    finally:
        engine.close()
    for request, result in zip(plan.requests, results):
        ids = list(request.prompt.token_ids)
        steer = {(2, "mlp_out"): vec}
        tokens, logprobs = oracle.greedy(path, ids, 3, steer)
        assert result.token_ids == tokens
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4)
        _, ref = oracle.forward(path, ids, steer)
        for (layer, hook), want in ref.items():
            assert rel_err(result.captures[site_id(layer, hook)][1], want) <= 1e-4, (name, layer, hook)
