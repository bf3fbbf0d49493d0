"""The compiler on tiny_random (4 layers, hidden 128) with its real tokenizer: vectors, payloads, phases, layer
and position selectors, engine sites, the request hash, and that the requests are valid vLLM SamplingParams whose
payload survives msgpack (prefix-cache ranges and skipping: test_compiler_cache.py). No engine is started.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from conftest import base_config
from interp_runner.config import ConfigError
from interp_runner.contracts import DECODE, PAYLOAD_KEY, PREFILL, RequestPayload, payload_of
from interp_runner.kinds import kind_for
from interp_runner.models.facts import ModelFacts
from interp_runner.payload import unpack_positions, vector_key
from interp_runner.pipeline import load_tokenizer, prepare
from interp_runner.config.run import validate_config
from interp_runner.compile.selectors import parse_layers, parse_prompts
from interp_runner.sites import HOOKS, site_id
from interp_runner.vectors.load import random_direction

HIDDEN = 128
LAYERS = 4
PROMPTS = ["The Eiffel Tower is located in the city of", "Hello, my name is", "One two three", "Four"]


@pytest.fixture(scope="module")
def facts(tiny_path):
    return ModelFacts.from_folder(tiny_path)


@pytest.fixture(scope="module")
def tokenize(tiny_path):
    return load_tokenizer(tiny_path, chat_template=False)


@pytest.fixture(scope="module")
def compile_(facts, tokenize):
    def compile_config(config: dict, base=None):
        cfg = validate_config(config)
        return kind_for(cfg).compile(cfg, facts, tokenize, base, None)

    return compile_config


def cfg(**overrides) -> dict:
    return base_config(prompts={"items": PROMPTS}, **overrides)


def payload(request) -> RequestPayload | None:
    extra = request.sampling["extra_args"]
    return None if extra is None else extra[PAYLOAD_KEY]


def steer_of(request) -> list[list]:
    """A request's steering terms as [site, phases, vector key, scale]."""
    p = payload(request)
    return [] if p is None else [[t.site, t.phases, t.vector, t.scale] for t in p.steer]


def one_vector(plan) -> np.ndarray:
    assert len(plan.vectors) == 1, list(plan.vectors)
    return next(iter(plan.vectors.values()))


def steer_with(vector, layer=0, hook="post_block", **extra) -> dict:
    return cfg(steering={"global": {"base": {hook: {"layer": layer, "vector": vector, **extra}}}})


# ---------------------------------------------------------------- facts and prompts


def test_model_facts(facts):
    assert facts.architecture == "LlamaForCausalLM"
    assert (facts.num_layers, facts.hidden_size) == (LAYERS, HIDDEN)
    assert len(facts.weights_sha256) == 64


def test_prompts_tokenized_in_order(compile_, tokenize):
    plan = compile_(cfg())
    assert [r.rid for r in plan.requests] == ["r00000", "r00001", "r00002", "r00003"]
    for i, r in enumerate(plan.requests):
        assert r.prompt.index == i and r.prompt.text == PROMPTS[i] and r.prompt.id == f"p{i}"
        assert list(r.prompt.token_ids) == list(tokenize(PROMPTS[i]))
        assert r.engine_prompt() == {"prompt_token_ids": list(r.prompt.token_ids)}


def test_prompt_ids_and_prompt_file(compile_, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"text": "Hello there", "id": "hi"}\n\n{"prompt": "Bye now"}\n')
    plan = compile_(base_config(prompts={"file": "p.jsonl"}), base=tmp_path)
    assert [(r.prompt.id, r.prompt.text) for r in plan.requests] == [("hi", "Hello there"), ("p1", "Bye now")]
    plan = compile_(base_config(prompts={"items": [{"text": "Hello", "id": "greet"}, "World"]}))
    assert [r.prompt.id for r in plan.requests] == ["greet", "p1"]


def test_sampling_fields(compile_):
    plan = compile_(cfg(sampling={"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 11, "logprobs": 4}))
    for i, r in enumerate(plan.requests):
        s = r.sampling
        assert (s["max_tokens"], s["temperature"], s["top_p"], s["logprobs"]) == (7, 0.5, 0.9, 4)
        assert s["seed"] == 11 + i  # seed of prompt i is seed + i
        assert s["extra_args"] is None and s["skip_reading_prefix_cache"] is None and r.kv_ranges == ()
    assert compile_(cfg()).requests[0].sampling["logprobs"] == 0


# ---------------------------------------------------------------- vectors


def test_inline_vector(compile_):
    values = np.linspace(-1, 1, HIDDEN)
    plan = compile_(steer_with(values.tolist()))
    vec = one_vector(plan)
    assert vec.dtype == np.float32 and vec.shape == (HIDDEN,)
    np.testing.assert_array_equal(vec, values.astype(np.float32))
    assert list(plan.vectors) == [vector_key(vec)]
    # the explicit form is the same vector
    assert compile_(steer_with({"values": values.tolist()})).vectors.keys() == plan.vectors.keys()


def test_npy_vector(compile_, tmp_path):
    values = np.random.default_rng(0).standard_normal(HIDDEN)  # float64 on disk
    np.save(tmp_path / "v.npy", values)
    plan = compile_(steer_with("v.npy"), base=tmp_path)
    np.testing.assert_array_equal(one_vector(plan), values.astype(np.float32))
    # a [1, hidden] array is squeezed; an absolute path needs no base
    np.save(tmp_path / "row.npy", values[None].astype(np.float32))
    plan = compile_(steer_with(str(tmp_path / "row.npy")))
    np.testing.assert_array_equal(one_vector(plan), values.astype(np.float32))


def test_safetensors_vector_with_key(compile_, tmp_path):
    a, b = np.ones(HIDDEN, np.float32), np.arange(HIDDEN, dtype=np.float32)
    save_file({"a": a, "b": b}, str(tmp_path / "v.safetensors"))
    plan = compile_(steer_with({"file": "v.safetensors", "key": "b"}), base=tmp_path)
    np.testing.assert_array_equal(one_vector(plan), b)
    save_file({"only": a}, str(tmp_path / "one.safetensors"))  # a single tensor needs no key
    np.testing.assert_array_equal(one_vector(compile_(steer_with("one.safetensors"), base=tmp_path)), a)


def test_pt_vector_weights_only(compile_, tmp_path):
    t = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0))
    torch.save(t, tmp_path / "v.pt")
    np.testing.assert_array_equal(one_vector(compile_(steer_with("v.pt"), base=tmp_path)), t.numpy())
    torch.save({"x": t.to(torch.bfloat16), "y": torch.zeros(HIDDEN)}, tmp_path / "d.pth")
    vec = one_vector(compile_(steer_with({"file": "d.pth", "key": "x"}), base=tmp_path))
    np.testing.assert_array_equal(vec, t.to(torch.bfloat16).float().numpy())


def test_named_vectors(compile_, tmp_path):
    love = np.full(HIDDEN, 0.5, np.float32)
    np.save(tmp_path / "love.npy", love)
    config = cfg(
        vectors={"love": "love.npy", "rand": {"random": {"seed": 5, "norm": 2.0}}, "unused": [1.0] * HIDDEN},
        steering={
            "global": {"base": {"post_block": {"layer": 0, "vector": "love"}}},
            "request": [{"prompts": 1, "decode": {"mlp_out": [
                {"layer": 1, "vector": {"name": "love"}, "scale": -1},
                {"layer": 2, "vector": "rand"},
            ]}}],
        },
    )
    plan = compile_(config, base=tmp_path)
    # only vectors that are used travel, each once, keyed by content
    assert set(plan.vectors) == {vector_key(love), vector_key(random_direction(5, 2.0, HIDDEN))}
    np.testing.assert_array_equal(plan.vectors[vector_key(love)], love)
    keys = [e[2] for e in steer_of(plan.requests[1])]
    assert keys == [vector_key(love), vector_key(love), vector_key(random_direction(5, 2.0, HIDDEN))]


def test_random_direction_has_norm_and_is_deterministic(compile_):
    plan = compile_(steer_with({"random": {"seed": 3, "norm": 4.5}}))
    vec = one_vector(plan)
    assert np.linalg.norm(vec) == pytest.approx(4.5, rel=1e-5)
    np.testing.assert_array_equal(vec, one_vector(compile_(steer_with({"random": {"seed": 3, "norm": 4.5}}))))
    np.testing.assert_array_equal(vec, random_direction(3, 4.5, HIDDEN))
    other = one_vector(compile_(steer_with({"random": {"seed": 4, "norm": 4.5}})))
    assert not np.allclose(vec, other)
    half = one_vector(compile_(steer_with({"random": {"seed": 3, "norm": 2.25}})))
    np.testing.assert_allclose(half * 2, vec, rtol=1e-6)


def test_identical_vectors_share_one_key(compile_):
    v = [0.1] * HIDDEN
    config = cfg(steering={"global": {"base": {"post_block": {"layer": 0, "vector": v}}},
                           "request": [{"prompts": 0, "prefill": {"pre_attn": {"layer": 1, "vector": v}}}]})
    plan = compile_(config)
    assert len(plan.vectors) == 1


def walk(obj):
    yield obj
    if isinstance(obj, dict):
        for v in obj.values():
            yield from walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from walk(v)


def test_vectors_travel_by_key_not_inside_requests(compile_):
    config = cfg(
        vectors={"a": [0.3] * HIDDEN},
        steering={"global": {"base": {"post_block": {"layer": "all", "vector": "a"}}},
                  "request": [{"prompts": "all", "decode": {"mlp_out": {"layer": 1,
                                                                        "vector": {"random": {"seed": 1}}}}}]},
        capture=[{"hooks": ["post_block"], "positions": "all"}],
    )
    plan = compile_(config)
    assert all(isinstance(k, str) and len(k) == 32 for k in plan.vectors)
    for key, vec in plan.vectors.items():
        assert vector_key(vec) == key and vec.dtype == np.float32 and vec.shape == (HIDDEN,)
    for r in plan.requests:
        for node in walk(msgspec.msgpack.decode(msgspec.msgpack.encode(r.sampling["extra_args"]))):
            if isinstance(node, (list, tuple)) and len(node) > 1:
                assert not all(isinstance(x, float) for x in node), f"a list of floats in {r.rid}'s extra_args"
            assert not isinstance(node, np.ndarray)
            if isinstance(node, bytes):  # packed positions only: int32, far shorter than a vector
                assert len(node) < HIDDEN * 4
        for site, phases, key, scale in steer_of(r):
            assert key in plan.vectors and isinstance(scale, float)


# ---------------------------------------------------------------- steering payload


def test_tiers_map_to_phase_masks(compile_):
    v = [1.0] * HIDDEN
    config = cfg(steering={"global": {
        "base": {"post_block": {"layer": 0, "vector": v, "scale": 1.5}},
        "prefill": {"attn_out": {"layer": 1, "vector": v}},
        "decode": {"pre_attn": {"layer": 2, "vector": v, "scale": -2}},
    }})
    plan = compile_(config)
    key = vector_key(np.asarray(v, np.float32))
    expected = [
        [site_id(0, "post_block"), 3, key, 1.5],
        [site_id(1, "attn_out"), 1, key, 1.0],
        [site_id(2, "pre_attn"), 2, key, -2.0],
    ]
    assert (PREFILL | DECODE, PREFILL, DECODE) == (3, 1, 2)
    for r in plan.requests:
        assert steer_of(r) == expected
        assert payload(r).rid == r.rid and not payload(r).capture


def test_global_terms_reach_every_request_and_request_terms_only_their_prompts(compile_):
    g, a, b = [1.0] * HIDDEN, [2.0] * HIDDEN, [3.0] * HIDDEN
    kg, ka, kb = (vector_key(np.asarray(x, np.float32)) for x in (g, a, b))
    config = cfg(steering={
        "global": {"base": {"post_block": {"layer": 3, "vector": g}}},
        "request": [
            {"prompts": [1, 3], "prefill": {"mlp_out": {"layer": 0, "vector": a}}},
            {"prompts": 3, "decode": {"post_attn": {"layer": 1, "vector": b, "scale": 0.5}}},
        ],
    })
    plan = compile_(config)
    glob = [site_id(3, "post_block"), 3, kg, 1.0]
    ra = [site_id(0, "mlp_out"), 1, ka, 1.0]
    rb = [site_id(1, "post_attn"), 2, kb, 0.5]
    assert [steer_of(r) for r in plan.requests] == [[glob], [glob, ra], [glob], [glob, ra, rb]]


def test_request_steering_without_global(compile_):
    config = cfg(steering={"request": [{"prompts": [2], "base": {"post_block": {"layer": 0, "vector": [1.0] * HIDDEN}}}]})
    plan = compile_(config)
    assert [payload(r) is None for r in plan.requests] == [True, True, False, True]
    assert [r.kv_ranges == () for r in plan.requests] == [True, True, False, True]
    assert "cache_salt" not in plan.requests[2].engine_prompt()


@pytest.mark.parametrize(
    "selector, layers",
    [("all", [0, 1, 2, 3]), ("1:3", [1, 2]), ([0, 2], [0, 2]), (3, [3]), ("2:", [2, 3]), (":1", [0]),
     (":", [0, 1, 2, 3])],
)
def test_layer_selectors(compile_, selector, layers):
    plan = compile_(steer_with([1.0] * HIDDEN, layer=selector, hook="mlp_out"))
    assert [e[0] for e in steer_of(plan.requests[0])] == [site_id(layer, "mlp_out") for layer in layers]
    assert plan.engine_spec.steer_sites == tuple(site_id(layer, "mlp_out") for layer in layers)
    assert parse_layers(selector, LAYERS, "x") == layers


def test_parse_helpers_directly():
    assert parse_prompts("all", 3, "p") == [0, 1, 2]
    assert parse_prompts(1, 3, "p") == [1]
    assert parse_prompts([2, 0], 3, "p") == [2, 0]
    with pytest.raises(ConfigError) as err:
        parse_layers([0, 4], LAYERS, "a.layer")
    assert err.value.problems == [("a.layer[1]", "4 out of range, model has 4 layers")]


# ---------------------------------------------------------------- capture payload


def capture_entry(request, index: int = 0):
    entry = payload(request).capture[index]
    return list(entry.sites), list(unpack_positions(entry.positions)), entry.generated


@pytest.mark.parametrize(
    "positions, expect, generated",
    [
        ("last_prompt", lambda n: [n - 1], False),
        ("all_prompt", lambda n: list(range(n)), False),
        ("all_generated", lambda n: [], True),
        ("all", lambda n: list(range(n)), True),
        ([0, -1, 1], lambda n: sorted({0, 1, n - 1}), False),
        ([-2], lambda n: [n - 2], False),
    ],
)
def test_capture_positions(compile_, positions, expect, generated):
    config = base_config(prompts={"items": PROMPTS[:3]},
                         capture=[{"hooks": ["post_block"], "layers": 1, "positions": positions}])
    plan = compile_(config)
    for r in plan.requests:
        n = len(r.prompt.token_ids)
        sites, got, gen = capture_entry(r)
        assert sites == [site_id(1, "post_block")]
        assert got == expect(n) and gen is generated
        assert not payload(r).steer and r.kv_ranges == ()


def test_capture_sites_layout_and_engine_spec(compile_):
    config = cfg(capture=[
        {"name": "resid", "hooks": ["post_block", "pre_attn"], "layers": [0, 2]},
        {"name": "mlp", "hooks": ["mlp_out"], "layers": "all", "prompts": [1, 2], "dtype": "bfloat16"},
    ])
    plan = compile_(config)
    resid_sites = [site_id(0, "post_block"), site_id(2, "post_block"), site_id(0, "pre_attn"), site_id(2, "pre_attn")]
    mlp_sites = [site_id(layer, "mlp_out") for layer in range(LAYERS)]
    for r in plan.requests:
        entries = payload(r).capture
        assert list(entries[0].sites) == resid_sites
        if r.prompt.index in (1, 2):
            assert len(entries) == 2 and list(entries[1].sites) == mlp_sites
        else:
            assert len(entries) == 1
    assert plan.engine_spec.capture_sites == tuple(sorted(resid_sites + mlp_sites))
    assert plan.engine_spec.steer_sites == ()
    (resid, mlp) = plan.captures
    assert (resid.name, resid.hooks, resid.layers, resid.dtype, resid.prompt_indices) == (
        "resid", ("post_block", "pre_attn"), (0, 2), "float32", (0, 1, 2, 3))
    assert (mlp.name, mlp.hooks, mlp.layers, mlp.dtype, mlp.prompt_indices) == (
        "mlp", ("mlp_out",), (0, 1, 2, 3), "bfloat16", (1, 2))


def test_engine_spec_sites_and_additional_config(compile_):
    v = [1.0] * HIDDEN
    config = cfg(
        steering={"global": {"prefill": {"attn_out": {"layer": [3, 1], "vector": v}}},
                  "request": [{"prompts": 0, "base": {"attn_out": {"layer": 1, "vector": v}}}]},
        capture=[{"hooks": ["post_attn"], "layers": 2, "prompts": [3]}],
    )
    plan = compile_(config)
    assert plan.engine_spec.steer_sites == (site_id(1, "attn_out"), site_id(3, "attn_out"))
    assert plan.engine_spec.capture_sites == (site_id(2, "post_attn"),)
    extra = plan.engine_spec.as_additional_config()["interp"]
    assert extra["steer_sites"] == [6, 16] and extra["capture_sites"] == [12]
    assert isinstance(extra["plugin"], str) and len(extra["plugin"]) == 16
    assert site_id(1, "attn_out") == 1 * len(HOOKS) + 1


# ---------------------------------------------------------------- request hash


def rich_config(scale: float = 2.0) -> dict:
    return cfg(
        sampling={"max_tokens": 5, "logprobs": 2},
        steering={"global": {"base": {"post_block": {"layer": "1:3", "vector": {"random": {"seed": 0}},
                                                     "scale": scale}}},
                  "request": [{"prompts": [1], "decode": {"mlp_out": {"layer": 0, "vector": [0.5] * HIDDEN}}}]},
        capture=[{"hooks": ["post_block", "mlp_out"], "layers": [0, 3], "positions": "all"}],
    )


def test_requests_sha256_is_stable_and_sensitive(compile_):
    first = compile_(rich_config())
    again = compile_(rich_config())
    assert len(first.requests_sha256) == 64
    assert first.requests_sha256 == again.requests_sha256
    assert compile_(rich_config(scale=2.5)).requests_sha256 != first.requests_sha256
    changed = rich_config()
    changed["sampling"] = {"max_tokens": 5, "logprobs": 2, "seed": 1}
    assert compile_(changed).requests_sha256 != first.requests_sha256
    changed = rich_config()
    changed["prompts"] = {"items": PROMPTS[:3] + ["Five"]}
    assert compile_(changed).requests_sha256 != first.requests_sha256
    changed = rich_config()
    changed["capture"] = [{"hooks": ["post_block", "mlp_out"], "layers": [0, 3], "positions": "all_prompt"}]
    assert compile_(changed).requests_sha256 != first.requests_sha256


def test_prepare_matches_compile_plan(compile_):
    assert prepare(rich_config()).plan.requests_sha256 == compile_(rich_config()).requests_sha256


# ---------------------------------------------------------------- vLLM contract


def test_sampling_params_construct_and_payload_survives_msgpack(compile_):
    import msgspec
    from vllm import SamplingParams

    plan = compile_(rich_config())
    for r in plan.requests:
        params = r.sampling_params()
        assert params.max_tokens == 5 and params.logprobs == 2 and params.seed == r.prompt.index
        # "all" reads every prompt position: only a one-token prompt has no earlier position to protect
        assert params.skip_reading_prefix_cache is (len(r.prompt.token_ids) > 1)
        assert isinstance(params.extra_args[PAYLOAD_KEY], bytes)  # the payload travels encoded
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params.extra_args))
        assert decoded == params.extra_args
        assert payload_of(SamplingParams(extra_args=decoded)) == r.payload  # decoded once, on the plugin side
        (entry,) = r.payload.capture
        assert list(unpack_positions(entry.positions)) == list(range(len(r.prompt.token_ids))) and entry.generated
    # unsteered, uncaptured requests carry no extra_args at all
    params = SamplingParams(**compile_(cfg()).requests[0].sampling)
    assert not params.extra_args


def test_a_folder_s_tokenizer_loads_once_until_its_files_change(tmp_path, tiny_path):
    """prepare() runs for every job of a sweep and every config of a session: the folder's tokenizer is loaded once
    and shared while its files stay as they were; a changed file is read again."""
    import json
    import shutil

    from interp_runner.compile.tokens import TextTokenizer
    from interp_runner.models.materialize import TOKENIZER_FILES

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", *TOKENIZER_FILES):
        if (tiny_path / name).exists():
            shutil.copy2(tiny_path / name, folder / name)
    first, again = TextTokenizer(folder), TextTokenizer(folder)
    assert again.hf is first.hf and again("Hello, my name is") == first("Hello, my name is")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["model_max_length"] = 123
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    changed = TextTokenizer(folder)
    assert changed.hf is not first.hf and changed.hf.model_max_length == 123
    assert first.hf.model_max_length != 123
