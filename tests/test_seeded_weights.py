"""Seeded weights (``model.weights: seeded``): a folder with only config.json and tokenizer files runs, every
tensor-parallel size holds the same weights, and they are the ones the seeding rule defines.

The oracle rebuilds every tensor with an independent implementation of that rule (numpy's wrapping uint32
arithmetic, not the product's overflow-free int64 torch code), loads them into a plain HF model and compares its
log-probabilities and layer outputs with an engine run at float32. The runs at TP = 1 and TP = 2 go with the
session's other TP runs (``support.tp_jobs.TP_RUNS``): one process per TP size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from conftest import base_config
from support.tp_jobs import TP_RUNS, scale_of

pytestmark = pytest.mark.engine

SEED = 11
PROMPTS = ["The Eiffel Tower is located in the city of", "The Big Ben clock is located in the city of",
           "The capital of France is"]


def without_weights(folder):
    """``folder`` made (if it is not there) with tiny_random's config.json and tokenizer files, without its weights."""
    from interp_runner.models.materialize import TOKENIZER_FILES, model_path

    if not folder.exists():
        tiny_path = model_path("tiny_random")
        folder.mkdir()
        for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
            if (tiny_path / name).exists():
                shutil.copy2(tiny_path / name, folder / name)
    assert not list(folder.glob("*.safetensors"))
    return folder


@pytest.fixture(scope="module")
def config_only_folder(tmp_path_factory):
    return without_weights(tmp_path_factory.mktemp("seeded_model") / "seeded")


def seeded_config(folder, tp: int, store: str) -> dict:
    return {
        "model": {"name": "seeded", "path": str(folder), "weights": "seeded", "seed": SEED},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 8,
                   "tensor_parallel_size": tp},
        "prompts": {"items": [{"text": t, "answer": " Paris", "foil": " Rome"} for t in PROMPTS]},
        "sampling": {"max_tokens": 3},
        "steering": {"request": [{"prompts": [2], "base": {"post_block": {
            "layer": "all", "vector": {"random": {"seed": 3, "norm": 0.5}}}}}]},
        "capture": [{"name": "last", "hooks": ["post_block"], "layers": "all", "positions": "last_prompt"}],
        "patching": [{"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": [1], "alpha": 1.0}],
        "store": {"path": store},
    }


TP_RUNS.add("seeded", lambda tp, store, tmp: seeded_config(without_weights(tmp / "seeded_model"), tp, store))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """{tp: the seeded config's store} (TP = 2 where there are two cores)."""
    runs = TP_RUNS.stores(tmp_path_factory)
    return {tp: runs[tp]["seeded"] for tp in (1, 2) if tp in runs}


# -- the seeding rule, written again -------------------------------------------------------------------------


def fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def oracle_tensor(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Element i: h = fmix32(fmix32(i_lo ^ k0) ^ (i_hi + k1)), keys from sha256("interp-seeded-v1:seed:name");
    value = (2 * (h >> 8) - (2**24 - 1)) * 0.02 * sqrt(3) / 2**24; 1-D norm weights are ones."""
    if len(shape) == 1 and "norm" in name:
        return np.ones(shape, np.float32)
    digest = hashlib.sha256(f"interp-seeded-v1:{seed}:{name}".encode()).digest()
    k0 = np.uint32(int.from_bytes(digest[:4], "little"))
    k1 = np.uint32(int.from_bytes(digest[4:8], "little"))
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    lo, hi = (i & np.uint64(0xFFFFFFFF)).astype(np.uint32), (i >> np.uint64(32)).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = fmix32(fmix32(lo ^ k0) ^ (hi + k1))
    odd = (h >> np.uint32(8)).astype(np.float64) * 2 - (2**24 - 1)
    return (odd * (0.02 * np.sqrt(3.0) / 2**24)).astype(np.float32).reshape(shape)


def oracle_model(folder):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(oracle_tensor(SEED, name, tuple(param.shape))))
    return model


# -- tests ----------------------------------------------------------------------------------------------------


def test_seeded_values_follow_the_rule_on_any_chunking(monkeypatch):
    """The product's generator gives the oracle's bits, whole or drawn in small chunks, and rows drawn alone."""
    from interp_runner.models import seeded

    name, shape = "model.layers.0.mlp.up_proj.weight", (37, 29)
    want = oracle_tensor(SEED, name, shape)
    np.testing.assert_array_equal(seeded.full_tensor(SEED, name, shape).numpy(), want)
    monkeypatch.setattr(seeded, "CHUNK", 100)
    np.testing.assert_array_equal(seeded.full_tensor(SEED, name, shape).numpy(), want)
    rows = seeded.uniform_values(SEED, name, 5 * 29, 2 * 29).numpy().reshape(2, 29)
    np.testing.assert_array_equal(rows, want[5:7])
    assert abs(float(want.std()) - 0.02) < 0.002 and abs(float(want.mean())) < 0.002
    assert not np.array_equal(seeded.full_tensor(SEED + 1, name, shape).numpy(), want)


def test_seeded_engine_matches_hf_with_oracle_weights(stores, config_only_folder):
    """TP = 1 on a folder without weights: first-token log-probabilities and every layer's output at the last prompt
    position equal HF's with the oracle's weights (float32), for the prompt neither steered nor patched."""
    import torch
    from transformers import AutoTokenizer

    ds = stores[1]
    assert ds.attrs["model"]["weights_sha256"].startswith("interp-seeded-v1:seed=11")
    model = oracle_model(config_only_folder)
    tokenizer = AutoTokenizer.from_pretrained(config_only_folder)
    outputs = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(
        out, tuple) else out)) for i, layer in enumerate(model.model.layers)]
    role, index = list(ds["role"].values), list(ds["prompt_index"].values)
    checked = 0
    try:
        for r in range(ds.sizes["request"]):
            if int(index[r]) != 0 or role[r] not in ("prompt", "baseline"):
                continue
            ids = torch.tensor([[int(t) for t in ds["prompt_tokens"].values[r][: int(ds["prompt_len"][r])]]])
            assert ids[0].tolist() == tokenizer(PROMPTS[0]).input_ids
            with torch.no_grad():
                logprobs = model(ids).logits[0, -1].double().log_softmax(-1)
            answer = tokenizer(" Paris", add_special_tokens=False).input_ids[0]
            assert abs(float(ds["answer_logprob"][r]) - float(logprobs[answer])) <= 1e-4
            assert int(ds["top_token"][r]) == int(logprobs.argmax())
            for layer in range(len(model.model.layers)):
                got = ds["last"].values[r, 0, layer, 0]
                want = outputs[layer][0, -1].numpy()
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))
            checked += 1
    finally:
        for h in hooks:
            h.remove()
    assert checked >= 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores for two ranks")
def test_seeded_tp2_matches_tp1(stores):
    """Each rank draws the full tensors and keeps its shard: TP = 2 holds TP = 1's weights, so steering, capture,
    patching and scoring agree within float32 all-reduce rounding, and both ranks' checksums are equal."""
    one, two = stores[1], stores[2]
    checksums = json.loads(json.dumps(two.attrs["engine"]["intervention_checksums"]))
    assert len(checksums) == 2 and checksums[0] == checksums[1] and checksums[0]["steps"] > 0
    np.testing.assert_array_equal(one["tokens"].values, two["tokens"].values)
    compared = 0
    for name, var in one.data_vars.items():
        if var.dtype.kind == "f":
            a, b = var.values, two[name].values
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * scale_of(a), err_msg=name)
            compared += int(np.isfinite(a).sum())
    assert compared > 0 and np.isfinite(two["last"].values).sum() > 0
    assert two.attrs["model"]["weights_sha256"] == one.attrs["model"]["weights_sha256"]


@pytest.mark.parametrize("model, key", [
    ({"weights": "seeded", "seed": -1}, "model.seed"),
    ({"weights": "seeded", "seed": 2**32}, "model.seed"),
    ({"weights": "seeded", "seed": "1"}, "model.seed"),
    ({"seed": 1}, "model.seed"),  # a seed for weights read from files
    ({"weights": "random"}, "model.weights"),
])
def test_bad_seeded_weights_config_names_the_key(model, key):
    from interp_runner.config import ConfigError
    from interp_runner.pipeline import prepare

    with pytest.raises(ConfigError) as err:
        prepare({**base_config(), "model": {"name": "tiny_random", **model}})
    assert str(err.value).startswith(key)


def test_seeded_folder_without_config_is_a_config_error(tmp_path):
    from interp_runner.config import ConfigError
    from interp_runner.pipeline import prepare

    with pytest.raises(ConfigError) as err:
        prepare({**base_config(), "model": {"name": "x", "path": str(tmp_path), "weights": "seeded"}})
    assert str(err.value).startswith("model.path") and "config.json" in str(err.value)


def test_llama70b_folder_holds_the_70b_shape(tmp_path):
    """The 70B-shaped folder: Llama-3-70B's config, a tokenizer whose ids fit its vocabulary, no weights; its
    checkpoint tensors are 70.55e9 values (Llama-3-70B's count), listed from the meta device."""
    from interp_runner.models import seeded
    from interp_runner.models.facts import ModelFacts

    folder = seeded.llama70b_folder(tmp_path / "llama70b")
    facts = ModelFacts.from_folder(folder, weights_seed=0)
    assert (facts.num_layers, facts.hidden_size, facts.num_heads, facts.num_kv_heads, facts.intermediate_size,
            facts.vocab_size, facts.dtype) == (80, 8192, 64, 8, 28672, 128256, "bfloat16")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192 and config["tie_word_embeddings"] is False
    specs = seeded.checkpoint_specs(folder)
    assert sum(int(np.prod(s)) for _, s in specs) == 70_553_706_496
    assert not list(folder.glob("*.safetensors"))
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(folder)) <= config["vocab_size"]
