"""GPT-2, GPT-NeoX (Pythia) and Qwen3-MoE on the engine (CPU, fp32) against plain HF transformers hooks
(``family_oracle``): capture at every hook the family has, steering at every hook, patching, a causal-trace grid
with cells alone and packed; hooks a family lacks are refused before any engine starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from support import hf_gpt_moe_oracle as family_oracle
from conftest import BANK_ROWS, KV_ROWS, KV_RUNS, base_config, build_engine, rel_err, run_config, run_plan
from interp_runner.config import ConfigError
from interp_runner.models.facts import ModelFacts, UnsupportedModel
from interp_runner.models.layouts import layout_for
from interp_runner.models.materialize import model_path
from interp_runner.pipeline import prepare
from interp_runner.sites import site_id
from interp_runner.vectors.load import random_direction
from support.family_trace import FACTS, check_trace_grid

FAMILIES = ("tiny_gpt2", "tiny_pythia", "tiny_qwen3_moe")
PROMPTS = ["The Eiffel Tower is located in the city of", "Hello, my name is", "1 2 3 4 5", "def main():"]
LAYERS = 4


def hooks_of(name: str) -> tuple[str, ...]:
    config = json.loads((model_path(name) / "config.json").read_text())
    return layout_for(config["architectures"][0]).hooks


def config(name, prompts=PROMPTS, **parts) -> dict:
    return base_config(name, prompts={"items": prompts}, sampling={"max_tokens": 3, "logprobs": 5}, **parts)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, path, hooks, engine with steering, capture and patch ops at every site the family has)."""
    name = request.param
    path = model_path(name)
    hooks = hooks_of(name)
    sites = tuple(sorted(site_id(layer, hook) for layer in range(LAYERS) for hook in hooks))
    engine = build_engine(path, sites, sites, sites, BANK_ROWS, KV_ROWS, KV_RUNS)
    yield name, path, hooks, engine
    engine.close()


# -- no engine --------------------------------------------------------------------------------------------


def test_pythia_has_no_post_attn_and_says_so_naming_the_key():
    steering = {"global": {"base": {"post_attn": {"layer": 1, "vector": [0.0] * 128}}}}
    with pytest.raises(ConfigError) as err:
        prepare(config("tiny_pythia", steering=steering))
    key, reason = err.value.problems[0]
    assert key == "steering.global.base.post_attn"
    assert "not a hook of gpt_neox blocks" in reason and "pre_attn, attn_out, mlp_out, post_block" in reason
    with pytest.raises(ConfigError) as err:
        prepare(config("tiny_pythia", capture=[{"hooks": ["mlp_out", "post_attn"], "layers": "all"}]))
    assert err.value.problems[0][0] == "capture[0].hooks[1]"
    with pytest.raises(ConfigError) as err:
        prepare(config("tiny_pythia", patching=[{"prompts": [1], "source": {"prompt": 0}, "hook": "post_attn",
                                                 "layers": [1], "positions": [0]}]))
    assert err.value.problems[0][0] == "patching[0].hook"


def test_a_sequential_gpt_neox_block_is_refused(tmp_path):
    """The GPT-NeoX layout describes Pythia's parallel block; a config with use_parallel_residual false would
    have a post_attn stream the layout does not place, so it is refused by name."""
    folder = tmp_path / "neox"
    folder.mkdir()
    source = model_path("tiny_pythia")
    for f in source.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    config_json = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config_json, "use_parallel_residual": False}))
    with pytest.raises(UnsupportedModel, match="use_parallel_residual is False; gpt_neox blocks are supported"):
        ModelFacts.from_folder(folder)


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_weights_are_the_pinned_bytes_and_hf_loads_every_tensor(name, tmp_path):
    from safetensors.numpy import load_file

    from interp_runner.models import materialize, tiny_gpt_moe, tiny_random

    path = model_path(name)
    family = tiny_gpt_moe.FAMILIES[name]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tiny_random.write_safetensors(tiny_gpt_moe.weights(family, vocab), tmp_path / "model.safetensors")
    assert materialize.sha256_file(tmp_path / "model.safetensors") == tiny_gpt_moe.WEIGHTS_SHA256[name]
    assert materialize.sha256_file(path / "model.safetensors") == tiny_gpt_moe.WEIGHTS_SHA256[name]
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state, stored = model.state_dict(), load_file(str(path / "model.safetensors"))
    if name == "tiny_qwen3_moe":  # HF fuses each layer's experts: [experts, 2 x inner, hidden] gate then up
        fused = state["model.layers.1.mlp.experts.gate_up_proj"]
        up = stored["model.layers.1.mlp.experts.5.up_proj.weight"]
        assert torch.equal(fused[5, tiny_gpt_moe.EXPERT_INTERMEDIATE:], torch.from_numpy(up))
        assert model.config.num_experts == tiny_gpt_moe.EXPERTS  # config.json's key, read through HF's alias
    else:  # GPT-2's Conv1D weights are [in, out] in HF as in the checkpoint; HF names Pythia's embed_out lm_head
        renamed = {"embed_out.weight": "lm_head.weight"}
        for key, array in stored.items():
            assert torch.equal(state[renamed.get(key, key)], torch.from_numpy(array)), key


def test_trace_noise_is_scaled_from_the_family_token_embedding():
    """GPT-2's layer-0 stream holds token + position embeddings; the noise is k x the std of the subject's token
    embedding rows (``wte``), as ROME scales it."""
    from safetensors.numpy import load_file

    config = {"model": {"name": "tiny_gpt2"}, "prompts": {"items": []},
              "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256},
              "causal_trace": {"facts": str(FACTS), "num_facts": 2, "window": 2, "noise": {"k": 3.0, "samples": 1}}}
    layout = prepare(config).plan.layout
    ids = [f.clean.token_ids[p] for f in layout.facts for p in f.subject_positions]
    wte = load_file(str(model_path("tiny_gpt2") / "model.safetensors"))["transformer.wte.weight"]
    assert layout.noise_std == pytest.approx(3.0 * np.std(wte[ids], ddof=1), rel=1e-6)


def test_gpt2_config_names_are_read():
    facts = ModelFacts.from_folder(model_path("tiny_gpt2"))
    assert (facts.num_layers, facts.hidden_size, facts.num_heads, facts.head_dim, facts.intermediate_size) == \
        (4, 128, 4, 32, 512)
    assert facts.max_model_len == 2048


# -- on the engine ----------------------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_pythia"])
def test_compiled_blocks_that_return_the_stream_match_hf(name):
    """The blocks without fused add+norm under torch.compile: steering at a branch and a stream hook, capture at
    every hook, as plain HF hooks compute them."""
    from vllm.config import CompilationMode

    path, hooks = model_path(name), hooks_of(name)
    sites = tuple(sorted(site_id(layer, hook) for layer in range(LAYERS) for hook in hooks))
    engine = build_engine(path, sites, sites, enforce_eager=False)
    try:
        assert engine.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
        vec = random_direction(seed=5, norm=3.0, size=128).astype(np.float32)
        steering = {"request": [{"prompts": [0], "base": {"attn_out": {"layer": 1, "vector": vec.tolist()}}},
                                {"prompts": [1], "base": {"post_block": {"layer": 2, "vector": vec.tolist()}}}]}
        capture = [{"hooks": list(hooks), "layers": "all", "positions": "all_prompt"}]
        plan, results = run_config(engine, config(name, PROMPTS[:3], steering=steering, capture=capture))
    finally:
        engine.close()
    steers = [{(1, "attn_out"): vec}, {(2, "post_block"): vec}, None]
    for request, result, steer in zip(plan.requests, results, steers):
        ids = list(request.prompt.token_ids)
        tokens, logprobs = family_oracle.greedy(path, ids, 3, steer)
        assert result.token_ids == tokens
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4)
        _, ref = family_oracle.forward(path, ids, steer)
        for layer in range(LAYERS):
            for hook in hooks:
                assert rel_err(result.captures[site_id(layer, hook)][1], ref[(layer, hook)]) <= 1e-4, (layer, hook)


@pytest.mark.engine
def test_capture_and_steering_at_every_hook_match_hf(family):
    """Each prompt steered at one hook (layers 1-2, a negative scale for half): greedy tokens, their
    log-probabilities and every hook's values over the prompt match plain HF hooks adding scale x vector; an
    unsteered prompt matches the unhooked model."""
    name, path, hooks, engine = family
    vec = random_direction(seed=3, norm=3.0, size=128).astype(np.float32)
    cases = [(hook, scale) for hook in hooks for scale in (2.0, -1.5)]
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))] + [PROMPTS[0]]
    steering = {"request": [{"prompts": [i], "base": {hook: {"layer": "1:3", "vector": vec.tolist(),
                                                             "scale": scale}}}
                            for i, (hook, scale) in enumerate(cases)]}
    capture = [{"hooks": list(hooks), "layers": "all", "positions": "all_prompt"}]
    plan, results = run_config(engine, config(name, texts, steering=steering, capture=capture))
    for i, (request, result) in enumerate(zip(plan.requests, results)):
        ids = list(request.prompt.token_ids)
        steer = {(layer, cases[i][0]): vec * np.float32(cases[i][1]) for layer in (1, 2)} if i < len(cases) else None
        tokens, logprobs = family_oracle.greedy(path, ids, 3, steer)
        assert result.token_ids == tokens, (name, i)
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4, err_msg=f"{name} {i}")
        _, ref = family_oracle.forward(path, ids, steer)
        for layer in range(LAYERS):
            for hook in hooks:
                positions, got = result.captures[site_id(layer, hook)]
                assert positions.tolist() == list(range(len(ids)))
                assert rel_err(got, ref[(layer, hook)]) <= 1e-4, (name, i, layer, hook)
    if name == "tiny_qwen3_moe":  # the router reads post_attention_layernorm(post_attn): routing follows from it
        model = family_oracle.load(str(path))
        ids = list(plan.requests[-1].prompt.token_ids)
        _, ref = family_oracle.forward(path, ids)
        for layer in range(LAYERS):
            block = model.model.layers[layer]
            post_attn = torch.as_tensor(results[-1].captures[site_id(layer, "post_attn")][1])
            with torch.no_grad():
                logits = block.mlp.gate(block.post_attention_layernorm(post_attn))[0].numpy()
            np.testing.assert_allclose(logits, ref[(layer, "router")], atol=1e-4)
            got, want = (family_oracle.routing(x, 2, True) for x in (logits, ref[(layer, "router")]))
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_allclose(got[1], want[1], atol=1e-4)
    if name == "tiny_gpt2":  # layer 0's stream is token + learned position embeddings
        _, ref = family_oracle.forward(path, list(plan.requests[-1].prompt.token_ids))
        model = family_oracle.load(str(path))
        ids = torch.tensor(plan.requests[-1].prompt.token_ids)
        with torch.no_grad():
            want = (model.transformer.wte(ids) + model.transformer.wpe(torch.arange(len(ids)))).numpy()
        assert rel_err(results[-1].captures[site_id(0, "pre_attn")][1], want) <= 1e-6


@pytest.mark.engine
def test_patching_at_every_hook_mixes_as_hf_hooks_do(family):
    name, path, hooks, engine = family
    clean, corrupt = "The Eiffel Tower is located in the city of", "The Big Ben clock is located in the city of"
    layers, positions, alpha = [1, 2], [1, 2, 3, -1], 0.7
    patching = [{"prompts": [1], "source": {"prompt": 0}, "hook": hook, "layers": layers, "positions": positions,
                 "alpha": alpha} for hook in hooks]
    items = [{"text": t, "answer": " Paris", "foil": " Rome"} for t in (clean, corrupt)]
    plan, results = run_plan(engine, base_config(name, prompts={"items": items}, patching=patching,
                                                 sampling={"max_tokens": 1, "logprobs": 5}))
    clean_ids, corrupt_ids = (list(plan.requests[i].prompt.token_ids) for i in (0, 1))
    assert len(clean_ids) == len(corrupt_ids)
    answer, foil = plan.requests[1].prompt.answer_ids
    _, clean_values = family_oracle.forward(path, clean_ids)
    rows = [p % len(corrupt_ids) for p in positions]
    patched = {r.meta["patch"]: results[r.rid] for r in plan.requests if r.role == "patched"}
    unpatched = torch.log_softmax(family_oracle.forward(path, corrupt_ids)[0][-1].double(), -1).numpy()
    for spec, hook in enumerate(hooks):
        logits = family_oracle.patched_logits(path, corrupt_ids, {(lay, hook): (rows, alpha) for lay in layers},
                                              clean_values)
        want = torch.log_softmax(logits[-1].double(), -1).numpy()
        got = patched[spec]
        assert got.void is None
        np.testing.assert_allclose(got.score["logprobs"], [want[answer], want[foil]], atol=1e-4, err_msg=hook)
        assert np.abs(want[[answer, foil]] - unpatched[[answer, foil]]).max() > 1e-3, hook  # the patch matters
        assert got.score["top_id"] == int(want.argmax()), hook


@pytest.mark.engine
@pytest.mark.parametrize("pack", [False, True], ids=["cells-alone", "cells-packed"])
def test_trace_grid_matches_hf_hooks(family, pack):
    """ROME's grid (noise on layer 0's input at the subject, as the model scales its embeddings; clean values put
    back per component, layer and token) matches plain HF hooks, with cells as requests of their own and packed."""
    name, path, _, engine = family
    check_trace_grid(name, path, engine, pack, family_oracle.trace)

