"""tiny_phi3, tiny_gemma2, tiny_gemma3: pinned bytes, loaded whole by HF transformers, and scaled so that every
path of their family runs in the test prompts (sliding windows crossed, soft caps binding, RoPE keyed by layer
type); a trace's noise scale is read from the embeddings as Gemma scales them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from interp_runner.models import materialize, tiny_families
from interp_runner.models.facts import embedding_rows

NAMES = tuple(tiny_families.FAMILIES)
PROMPT = "The Eiffel Tower is located in the city of"  # the shortest prompt the family tests use: 10 tokens


def load(path, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config).eval()


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0]


def moved(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=-1) / a.norm(dim=-1)).max())


@pytest.fixture(scope="module", params=NAMES)
def built(request):
    from transformers import AutoTokenizer

    path = materialize.model_path(request.param)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return request.param, path, tokenizer(PROMPT, return_tensors="pt").input_ids


def test_weights_hash_to_the_pinned_sha256_and_hf_loads_every_tensor(built, tmp_path):
    name, path, ids = built
    family = tiny_families.FAMILIES[name]
    config = json.loads((path / "config.json").read_text())
    tiny_families.write_folder(family, tmp_path, config["vocab_size"], config["bos_token_id"],
                               config["eos_token_id"], config["pad_token_id"])
    assert materialize.sha256_file(tmp_path / "model.safetensors") == tiny_families.WEIGHTS_SHA256[name]
    assert (path / "weights.sha256").read_text().split()[0] == tiny_families.WEIGHTS_SHA256[name]
    model = load(path)
    expected = tiny_families.weights(family, config["vocab_size"])
    state = model.state_dict()
    tied = {"lm_head.weight"} if config["tie_word_embeddings"] else set()
    assert set(state) - tied == set(expected)
    for key, array in expected.items():
        assert torch.equal(state[key], torch.from_numpy(array)), key
    norms = [array for key, array in expected.items() if key.endswith("norm.weight")]
    assert min(float(np.std(n)) for n in norms) > 0.01  # drawn, not constant: a misapplied norm shows


def test_the_prompts_run_every_path_of_the_family(built):
    name, path, ids = built
    model = load(path)
    config = model.config
    base = logits(model, ids)
    if name == "tiny_phi3":
        assert config.sliding_window is None  # vLLM's Llama layer would ignore it (docs/models.md)
        return
    assert ids.shape[1] > config.sliding_window
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types)
    # a wider window changes the logits: the window binds
    assert moved(base, logits(load(path, sliding_window=64), ids)) > 1e-3
    if name == "tiny_gemma2":
        assert config.query_pre_attn_scalar != config.head_dim
        assert moved(base, logits(load(path, query_pre_attn_scalar=config.head_dim), ids)) > 1e-3
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            assert moved(base, logits(load(path, **{cap: None}), ids)) > 1e-2, cap
        assert float(base.abs().max()) < config.final_logit_softcapping
    else:  # RoPE by layer type: the global layers' settings are not the sliding ones'
        rope = config.rope_parameters
        assert rope["full_attention"] != rope["sliding_attention"]
        same = {"full_attention": rope["sliding_attention"], "sliding_attention": rope["sliding_attention"]}
        assert moved(base, logits(load(path, rope_parameters=same), ids)) > 1e-3


def test_noise_scale_reads_the_embeddings_as_the_model_scales_them(built):
    """Layer 0's input is the embedding rows times sqrt(hidden) on Gemma, as HF computes it: the rows the trace's
    noise scale is taken from."""
    name, path, ids = built
    model = load(path)
    seen = {}
    handle = model.model.layers[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0][0]))
    try:
        logits(model, ids)
    finally:
        handle.remove()
    rows = embedding_rows(path, ids[0].tolist())
    np.testing.assert_allclose(rows, seen["x"].numpy(), rtol=1e-6, atol=1e-6)
    raw = model.model.embed_tokens.weight[ids[0]].detach().numpy()
    scale = np.sqrt(model.config.hidden_size) if "gemma" in name else 1.0
    np.testing.assert_allclose(rows, raw * np.float32(scale), rtol=1e-6)
