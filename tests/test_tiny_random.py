"""tiny_random: the same bytes on every machine (pinned sha256), a model that is neither degenerate nor amplifies
rounding, and a cached folder of an older builder replaced atomically."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from interp_runner.models import materialize, tiny_random


def test_weights_hash_to_the_pinned_sha256(tiny_path, tmp_path):
    vocab = json.loads((tiny_path / "config.json").read_text())["vocab_size"]
    tiny_random.write_safetensors(tiny_random.weights(vocab), tmp_path / "model.safetensors")
    assert materialize.sha256_file(tmp_path / "model.safetensors") == tiny_random.WEIGHTS_SHA256
    assert materialize.sha256_file(tiny_path / "model.safetensors") == tiny_random.WEIGHTS_SHA256
    assert (tiny_path / "weights.sha256").read_text().split()[0] == tiny_random.WEIGHTS_SHA256


def test_transformers_loads_every_tensor_and_small_perturbations_stay_small(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    expected = tiny_random.weights(model.config.vocab_size)
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, array in expected.items():
        assert torch.equal(state[name], torch.from_numpy(array)), name
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    ids = [tokenizer(p, return_tensors="pt").input_ids for p in tiny_random.PROBES]
    with torch.no_grad():
        firsts = {int(model(i).logits[0, -1].argmax()) for i in ids}
    assert len(firsts) > 1
    assert tiny_random.perturbation_growth(model, ids) <= tiny_random.MAX_PERTURBATION_GROWTH


def test_an_outdated_cached_folder_is_rebuilt_and_a_wrong_build_fails(tmp_path):
    old = tmp_path / "models" / "m"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"old")
    (old / "weights.sha256").write_text("0" * 64 + "\n")
    (old / "COMPLETE").write_text("ok\n")
    builds = []

    def build(out, data=b"new"):
        builds.append(out)
        out.mkdir()
        (out / "model.safetensors").write_bytes(data)

    pinned = hashlib.sha256(b"new").hexdigest()
    path = materialize._materialize("m", tmp_path, build, pinned)
    assert path == old and (path / "model.safetensors").read_bytes() == b"new"
    assert (path / "weights.sha256").read_text().split()[0] == pinned and (path / "COMPLETE").exists()
    assert sorted(p.name for p in path.parent.iterdir()) == [".m.lock", "m"]  # nothing left over
    assert materialize._materialize("m", tmp_path, build, pinned) == path and len(builds) == 1

    with pytest.raises(RuntimeError, match="not the pinned"):
        materialize._materialize("m", tmp_path, lambda out: build(out, b"other"), hashlib.sha256(b"x").hexdigest())
    assert (path / "model.safetensors").read_bytes() == b"new"  # the folder in place is left as it was
