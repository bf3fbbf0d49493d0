"""Engine behaviour on tiny_random: batch isolation, prefix caching, compiled mode (CPU, fp32)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from support import hf_oracle
from conftest import (ALL_HOOKS, MODEL_RUNNERS, base_config, engine_at_every_site, rel_err, run_config,
                      through_buffer_and_direct)
from interp_runner.sites import site_id
from interp_runner.vectors.load import random_direction

pytestmark = pytest.mark.engine

PROMPTS = ["The Eiffel Tower is located in the city of", "Hello, my name is", "1 2 3 4 5", "def main():"]
# longer than two 128-token KV blocks (the CPU backend's block size), so prefix caching has full blocks to share
LONG = " ".join(f"item {i} is a {'red' if i % 3 else 'blue'} box," for i in range(60))


def config(prompts=PROMPTS, **parts) -> dict:
    return base_config("tiny_random", prompts={"items": prompts}, sampling={"max_tokens": 6, "logprobs": 5},
                       **parts)


def vector(seed=0, norm=4.0):
    return random_direction(seed=seed, norm=norm, size=128).tolist()


def test_mixed_batch_unsteered_requests_are_bit_identical(runner_engine):
    tiny_engine = runner_engine
    steering = {"request": [{"prompts": [1], "base": {"post_block": {"layer": "all", "vector": vector()}}},
                            {"prompts": [3], "prefill": {"pre_attn": {"layer": 0, "vector": vector(1)}}}]}
    # both batches compute every prompt token (no cache reads), so the batch layout is the same
    _, mixed = run_config(tiny_engine, config(steering=steering), skip_reading_prefix_cache=True)
    _, plain = run_config(tiny_engine, config(), skip_reading_prefix_cache=True)
    for i in (0, 2):
        assert mixed[i].token_ids == plain[i].token_ids
        assert mixed[i].logprobs == plain[i].logprobs
        assert mixed[i].top_logprobs == plain[i].top_logprobs
    assert mixed[1].logprobs != plain[1].logprobs and mixed[3].logprobs != plain[3].logprobs


def test_steering_and_capture_match_hf(runner_engine, tiny_path):
    tiny_engine = runner_engine
    vec = np.asarray(vector(2, 3.0), dtype=np.float32)
    steering = {"global": {"base": {"mlp_out": {"layer": 2, "vector": vec.tolist()}}}}
    capture = [{"hooks": ALL_HOOKS, "layers": "all", "positions": "all_prompt"}]
    plan, results = run_config(tiny_engine, config(steering=steering, capture=capture))
    for request, result in zip(plan.requests, results):
        ids = list(request.prompt.token_ids)
        tokens, logprobs = hf_oracle.greedy(tiny_path, ids, 6, steer={(2, "mlp_out"): vec})
        assert result.token_ids == tokens
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4)
        _, ref = hf_oracle.forward(tiny_path, ids, {(2, "mlp_out"): vec})
        for (layer, hook), want in ref.items():
            positions, got = result.captures[site_id(layer, hook)]
            assert positions.tolist() == list(range(len(ids)))
            assert rel_err(got, want) <= 1e-4, (layer, hook)


SCALES = (2.5, -1.5)


def test_steering_at_every_hook_and_scale_matches_hf(tiny_engine, tiny_path):
    """Each prompt steered at one hook (every hook, each at a scale other than 1, one of them negative): greedy
    tokens, their log-probabilities and every hook's values match plain HF hooks adding scale x vector."""
    vec = np.asarray(vector(8, 3.0), dtype=np.float32)
    cases = [(hook, scale) for hook in ALL_HOOKS for scale in SCALES]
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    steering = {"request": [{"prompts": [i], "base": {hook: {"layer": "1:3", "vector": vec.tolist(), "scale": scale}}}
                            for i, (hook, scale) in enumerate(cases)]}
    capture = [{"hooks": ALL_HOOKS, "layers": "all", "positions": "all_prompt"}]
    run = config(texts, steering=steering, capture=capture)
    run["sampling"] = {"max_tokens": 3}
    plan, results = run_config(tiny_engine, run)
    for request, result, (hook, scale) in zip(plan.requests, results, cases):
        ids = list(request.prompt.token_ids)
        steer = {(layer, hook): vec * np.float32(scale) for layer in (1, 2)}
        tokens, logprobs = hf_oracle.greedy(tiny_path, ids, 3, steer=steer)
        assert result.token_ids == tokens, (hook, scale)
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4, err_msg=f"{hook} {scale}")
        _, ref = hf_oracle.forward(tiny_path, ids, steer)
        _, unit = hf_oracle.forward(tiny_path, ids, {(layer, hook): vec for layer in (1, 2)})
        for (layer, at), want in ref.items():
            positions, got = result.captures[site_id(layer, at)]
            assert positions.tolist() == list(range(len(ids)))
            assert rel_err(got, want) <= 1e-4, (hook, scale, layer, at)
        # the steered values tell this scale from scale 1 far beyond the tolerance
        assert rel_err(unit[(2, "post_block")], ref[(2, "post_block")]) > 1e-2, (hook, scale)


def test_prefix_cache_never_mixes_steered_and_unsteered_kv(runner_engine):
    tiny_engine = runner_engine
    steered = {"global": {"prefill": {"post_block": {"layer": 1, "vector": vector(3)}}}}
    # reference results computed without reading the cache
    _, fresh_plain = run_config(tiny_engine, config([LONG]), skip_reading_prefix_cache=True)
    _, fresh_steered = run_config(tiny_engine, config([LONG], steering=steered), skip_reading_prefix_cache=True)
    # the unsteered prompt is now cached: a prefill-steered request must not reuse its KV, and vice versa
    _, steered_after_plain = run_config(tiny_engine, config([LONG], steering=steered))
    _, plain_after_steered = run_config(tiny_engine, config([LONG]))
    np.testing.assert_allclose(steered_after_plain[0].logprobs, fresh_steered[0].logprobs, atol=1e-5)
    np.testing.assert_allclose(plain_after_steered[0].logprobs, fresh_plain[0].logprobs, atol=1e-5)
    assert abs(fresh_plain[0].logprobs[0] - fresh_steered[0].logprobs[0]) > 1e-3


def test_capture_of_a_cached_prompt_returns_every_position(tiny_engine):
    _, first = run_config(tiny_engine, config([LONG]))  # fills the prefix cache
    capture = [{"hooks": ["post_block"], "layers": [0, 3], "positions": "all_prompt"}]
    plan, again = run_config(tiny_engine, config([LONG], capture=capture))
    n = len(plan.requests[0].prompt.token_ids)
    assert n > 256
    for layer in (0, 3):
        positions, values = again[0].captures[site_id(layer, "post_block")]
        assert positions.tolist() == list(range(n))
        assert np.isfinite(values).all()
    assert again[0].token_ids == first[0].token_ids


@pytest.fixture(scope="module")
def compiled_engine(tiny_path):
    yield from engine_at_every_site(tiny_path, 4, enforce_eager=False)


def test_compiled_mode_steering_and_capture_match_hf(compiled_engine, tiny_path):
    from vllm.config import CompilationMode

    assert compiled_engine.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    vec = np.asarray(vector(4, 3.0), dtype=np.float32)
    steering = {"request": [{"prompts": [0, 2], "base": {"post_attn": {"layer": 1, "vector": vec.tolist()}}}]}
    capture = [{"hooks": ["pre_attn", "post_block", "mlp_out"], "layers": "all", "positions": "all"}]
    plan, results = run_config(compiled_engine, config(steering=steering, capture=capture))
    for request, result in zip(plan.requests, results):
        ids = list(request.prompt.token_ids)
        steer = {(1, "post_attn"): vec} if request.prompt.index in (0, 2) else None
        tokens, logprobs = hf_oracle.greedy(tiny_path, ids, 6, steer=steer)
        assert result.token_ids == tokens
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-4)
        full = ids + result.token_ids[:-1]
        _, ref = hf_oracle.forward(tiny_path, full, steer)
        for layer in range(4):
            for hook in ("pre_attn", "post_block", "mlp_out"):
                positions, got = result.captures[site_id(layer, hook)]
                assert positions.tolist() == list(range(len(full)))
                assert rel_err(got, ref[(layer, hook)]) <= 1e-4, (layer, hook)


@pytest.fixture(scope="module")
def chunked_engine(tiny_path):
    """Prefill split into 64-token chunks: a long prompt takes several steps."""
    yield from engine_at_every_site(tiny_path, 4, max_num_batched_tokens=64, max_num_seqs=4)


def test_tiers_follow_prompt_length_under_chunked_prefill(chunked_engine, tiny_engine):
    vec = np.asarray(vector(6, 2.0), dtype=np.float32)
    layer = 1
    steering = {"global": {"prefill": {"post_block": {"layer": layer, "vector": vec.tolist()}}}}
    capture = [{"hooks": ["post_attn", "mlp_out", "post_block"], "layers": [layer], "positions": "all"}]
    plan, chunked = run_config(chunked_engine, config([LONG, PROMPTS[0]], steering=steering, capture=capture))
    _, whole = run_config(tiny_engine, config([LONG, PROMPTS[0]], steering=steering, capture=capture),
                          skip_reading_prefix_cache=True)
    for request, result, reference in zip(plan.requests, chunked, whole):
        n = len(request.prompt.token_ids)
        positions, post_block = result.captures[site_id(layer, "post_block")]
        added = post_block - (result.captures[site_id(layer, "post_attn")][1]
                              + result.captures[site_id(layer, "mlp_out")][1])
        np.testing.assert_allclose(added[positions < n], np.broadcast_to(vec, added[positions < n].shape), atol=1e-4)
        np.testing.assert_allclose(added[positions >= n], 0, atol=1e-4)
        assert positions.tolist() == list(range(n + 5))
        assert result.token_ids == reference.token_ids
        assert rel_err(post_block, reference.captures[site_id(layer, "post_block")][1]) <= 1e-4


def test_captures_that_overflow_the_capture_buffer_come_back_the_same(runner_engine):
    tiny_engine = runner_engine
    """A step whose captured rows exceed the persistent buffer copies them out directly (outside CUDA graphs):
    same rows, same values as through the buffer."""
    capture = [{"name": "gen", "hooks": ALL_HOOKS, "layers": "all", "positions": "all_generated"},
               {"name": "prompt", "hooks": ["post_block"], "layers": [1, 2], "positions": "all_prompt"}]
    through_buffer, direct = through_buffer_and_direct(
        lambda: run_config(tiny_engine, config(capture=capture), skip_reading_prefix_cache=True)[1])
    for a, b in zip(through_buffer, direct):
        assert a.captures.keys() == b.captures.keys() and len(a.captures) == 4 * len(ALL_HOOKS)
        for site, (positions, values) in a.captures.items():
            np.testing.assert_array_equal(positions, b.captures[site][0])
            np.testing.assert_array_equal(values, b.captures[site][1])


def test_ranks_that_applied_different_interventions_fail_the_run(runner_engine):
    tiny_engine = runner_engine
    from interp_runner.engine.adapter import VllmEngine
    from interp_runner.engine.settings import EngineError

    steering = {"global": {"base": {"post_block": {"layer": 1, "vector": vector(5)}}}}
    before = tiny_engine.check_ranks()[0]
    run_config(tiny_engine, config(steering=steering))
    after = tiny_engine.check_ranks()[0]
    # one rank has nothing to compare: it counts the steps that applied something and folds nothing
    assert after["steps"] > before["steps"] and after["digest"] == before["digest"]

    class TwoRanks:  # what a diverged second rank would report
        def collective_rpc(self, method, args=()):
            assert method == "interp_checksum"
            return [after, {"digest": "0" * 32, "steps": after["steps"]}]

    diverged = VllmEngine.__new__(VllmEngine)
    diverged.llm = TwoRanks()
    with pytest.raises(EngineError, match="ranks applied different interventions"):
        diverged.check_ranks()


@pytest.mark.parametrize("model_runner", MODEL_RUNNERS)
def test_teacher_forcing_generates_the_given_tokens_with_the_model_log_probabilities(tiny_path, tmp_path,
                                                                                      model_runner):
    """``sampling.teacher_forcing``: each request generates its namesake's tokens from a store (none of them the
    greedy choice here), with decode-tier steering on them and captures at them, all as HF computes them on the
    prompt followed by those tokens. V1 forces them with a logits processor, V2 in its sampler."""
    import xarray as xr
    import zarr

    from interp_runner.config.schema import EngineConfig
    from interp_runner.engine.adapter import VllmEngine
    from interp_runner.pipeline import execute, prepare
    from interp_runner.plugin import ops

    prompts = PROMPTS[:2]
    forced = [[100, 2000, 300, 4000], [7, 8, 9, 10]]
    source = tmp_path / "source.zarr"
    plain = prepare(config(prompts)).plan
    ids = [list(r.prompt.token_ids) for r in plain.requests]
    width = max(len(i) for i in ids)
    xr.Dataset(
        {"prompt_tokens": (("request", "p"), np.array([i + [-1] * (width - len(i)) for i in ids], np.int32)),
         "prompt_len": ("request", np.array([len(i) for i in ids], np.int32)),
         "tokens": (("request", "generated"), np.array(forced, np.int32)),
         "num_generated": ("request", np.array([4, 4], np.int32))},
        coords={"request": np.array([r.rid for r in plain.requests], dtype=np.dtypes.StringDType())},
    ).to_zarr(str(source), mode="w", zarr_format=3, consolidated=False)
    zarr.open_group(str(source), mode="r+").attrs["status"] = "complete"

    vec = np.asarray(vector(7, 3.0), dtype=np.float32)
    steering = {"request": [{"prompts": [1], "decode": {"post_block": {"layer": 1, "vector": vec.tolist()}}}]}
    capture = [{"hooks": ["mlp_out"], "layers": [2], "positions": "all_generated"}]
    run = config(prompts, steering=steering, capture=capture)
    run["sampling"] = {"max_tokens": 4, "logprobs": 3, "teacher_forcing": str(source)}
    plan = prepare(run).plan
    assert plan.engine_spec.force_tokens
    engine = VllmEngine(str(tiny_path), EngineConfig(dtype="float32", enforce_eager=True, max_model_len=1024,
                                                     max_num_seqs=16, model_runner=model_runner,
                                                     kv_cache_memory_bytes=256 << 20), plan.engine_spec)
    try:
        assert engine.model_runner == model_runner
        results = execute(engine, plan, log=lambda _: None, use_tqdm=False)
        state = weakref.ref(ops.active_state())  # the engine's plugin state, active since its last step
    finally:
        engine.close()
    gc.collect()
    # on a GPU, a state that outlived its engine would be freed during the next engine's memory profiling
    assert state() is None, "the closed engine's plugin state is still held"
    for request, tokens in zip(plan.requests, forced):
        result, prompt = results[request.rid], list(request.prompt.token_ids)
        assert result.token_ids == tokens
        n = len(prompt)
        steer = {(1, "post_block"): vec} if request.prompt.index == 1 else None
        logits, acts = hf_oracle.forward(tiny_path, prompt + tokens[:-1], steer, np.arange(n, n + 3))
        logprobs = torch.log_softmax(logits[n - 1:], -1)
        assert all(int(row.argmax()) != t for row, t in zip(logprobs, tokens))  # forced, not chosen
        np.testing.assert_allclose(result.logprobs, [float(logprobs[i, t]) for i, t in enumerate(tokens)], atol=1e-4)
        for i, top in enumerate(result.top_logprobs):
            assert [t for t, _ in top[:3]] == logprobs[i].topk(3).indices.tolist()
        positions, got = result.captures[site_id(2, "mlp_out")]
        assert positions.tolist() == list(range(n, n + 3))
        assert rel_err(got, acts[(2, "mlp_out")][n:]) <= 1e-4


def test_step_timers_time_every_step_and_leave_nothing_behind(runner_engine):
    from interp_runner.plugin.runtime import InterpState

    planner = InterpState.before_forward
    llm = runner_engine.llm
    llm.collective_rpc("interp_timers_start")
    steering = {"request": [{"prompts": [0], "base": {"post_block": {"layer": "all", "vector": vector()}}}]}
    run_config(runner_engine, config(steering=steering))
    (timed,) = llm.collective_rpc("interp_timers_stop")
    steps = timed["execute_model"]["steps"]
    assert steps >= 6 and timed["planner"]["steps"] == steps and timed["sample_tokens"]["steps"] == steps
    assert timed["collect"]["steps"] >= 1
    assert all(t["total_ms"] > 0 and t["max_us"] >= t["median_us"] > 0 for t in timed.values())
    assert InterpState.before_forward is planner and llm.collective_rpc("interp_timers_stop") == [{}]


def test_profiles_sum_a_span_of_steps_by_kernel_or_function(runner_engine):
    llm = runner_engine.llm
    steering = {"request": [{"prompts": [0], "base": {"post_block": {"layer": "all", "vector": vector()}}}]}
    llm.collective_rpc("interp_profile_start")
    run_config(runner_engine, config(steering=steering))
    (profile,) = llm.collective_rpc("interp_profile_stop")
    # a CPU engine: its host ops stand in for kernels; the steered sites' ops among them
    assert profile["measured"] == "host" and profile["device_ms"] > 0
    assert profile["device_calls"] == sum(n for n, _ in profile["all"].values())
    assert profile["all"]["interp::site"][0] > 0 and any(name.endswith("mm") for name in profile["all"])
    assert llm.collective_rpc("interp_profile_stop") == [{}]
    llm.collective_rpc("interp_profile_start", args=("host",))
    run_config(runner_engine, config(steering=steering))
    (profile,) = llm.collective_rpc("interp_profile_stop")
    steer = [row for name, row in profile["funcs"].items() if name.endswith(" steer")]
    assert steer and steer[0][0] > 0 and profile["gc_passes"] >= 0
