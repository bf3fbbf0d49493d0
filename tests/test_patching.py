"""Activation patching on the engine (CPU, fp32): exactness, identity, interpolation, prefix caching, voiding.

vLLM is not batch-invariant, so exact comparisons are made between requests of the same batch (a patched copy and
the unpatched copy of its destination that runs beside it), or between runs with the same batch layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ALL_HOOKS, BANK_ROWS, base_config, build_engine, every_site, run_config, run_plan
from interp_runner.pipeline import execute, prepare
from interp_runner.sites import site_id

pytestmark = pytest.mark.engine

CLEAN = "The Eiffel Tower is located in the city of"
# the same number of tokens as CLEAN, differing in the subject only
CORRUPT = "The Big Ben clock is located in the city of"
LONG = " ".join(f"item {i} is a {'red' if i % 3 else 'blue'} box," for i in range(60))


def scored(*texts, answer=" Paris", foil=" Rome") -> dict:
    return {"items": [{"text": t, "answer": answer, "foil": foil} for t in texts]}


def by_role(plan, results, role: str, prompt: int, patch: int | None = None):
    for r in plan.requests:
        if r.role == role and r.prompt.index == prompt and (patch is None or r.meta.get("patch") == patch):
            return results[r.rid]
    raise KeyError((role, prompt, patch))


def same_result(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs
    np.testing.assert_array_equal(a.score["logprobs"], b.score["logprobs"])


def test_self_patch_at_alpha_1_is_bit_exact(tiny_engine):
    # prompt 1 is prompt 0 again: patching it with prompt 0's own values changes no bit
    patching = [{"prompts": [1], "source": {"prompt": 0}, "hook": hook, "layers": "all", "alpha": 1.0}
                for hook in ALL_HOOKS]
    plan, results = run_plan(tiny_engine, base_config(prompts=scored(CLEAN, CLEAN), patching=patching,
                                                      sampling={"max_tokens": 4}))
    baseline = by_role(plan, results, "baseline", 1)
    for spec in range(len(ALL_HOOKS)):
        patched = by_role(plan, results, "patched", 1, spec)
        assert patched.void is None
        same_result(patched, baseline)
    # and the clean run itself
    np.testing.assert_allclose(baseline.score["logprobs"], results["r00000"].score["logprobs"], atol=1e-6)


def test_alpha_0_is_the_identity(tiny_engine):
    patching = [
        {"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": "all", "alpha": 0.0},
        {"prompts": [1], "source": {"zeros": True}, "hook": "mlp_out", "layers": [1, 2], "alpha": 0.0},
        {"prompts": [1], "source": {"vector": {"random": {"seed": 3, "norm": 50.0}}}, "hook": "pre_attn",
         "layers": 0, "positions": [0, 2], "alpha": 0.0},
    ]
    plan, results = run_plan(tiny_engine, base_config(prompts=scored(CLEAN, CORRUPT), patching=patching,
                                                      sampling={"max_tokens": 4}))
    baseline = by_role(plan, results, "baseline", 1)
    for spec in range(3):
        same_result(by_role(plan, results, "patched", 1, spec), baseline)
    # a real patch does move it
    moved = run_plan(tiny_engine, base_config(prompts=scored(CLEAN, CORRUPT), patching=[
        {**patching[0], "alpha": 1.0}], sampling={"max_tokens": 4}))
    assert by_role(*moved, "patched", 1).score["logprobs"][0] != baseline.score["logprobs"][0]


ALPHAS = (0.25, 0.5, 0.8)


def test_intermediate_alphas_mix_as_hf_hooks_do(runner_engine, tiny_path):
    """value <- (1 - alpha) * value + alpha * source at every hook, checked against plain HF hooks that mix the
    clean run's values into the corrupted run themselves; alpha**2 (or 1 - alpha) would move these scores by far
    more than the tolerance."""
    tiny_engine = runner_engine
    import torch

    from support import hf_oracle
    layers, positions = [1, 2], [1, 2, 3, -1]
    specs = [(hook, alpha) for hook in ALL_HOOKS for alpha in ALPHAS]
    patching = [{"prompts": [1], "source": {"prompt": 0}, "hook": hook, "layers": layers, "positions": positions,
                 "alpha": alpha} for hook, alpha in specs]
    plan, results = run_plan(tiny_engine, base_config(prompts=scored(CLEAN, CORRUPT), patching=patching,
                                                      sampling={"max_tokens": 1, "logprobs": 5}))
    clean_ids, corrupt_ids = (list(plan.requests[i].prompt.token_ids) for i in (0, 1))
    answer, foil = plan.requests[1].prompt.answer_ids
    _, clean_values = hf_oracle.forward(tiny_path, clean_ids)
    rows = [p % len(corrupt_ids) for p in positions]

    def hf_logprobs(hook, alpha):
        patches = {(layer, hook): (rows, alpha) for layer in layers}
        logits = hf_oracle.patched_logits(tiny_path, corrupt_ids, patches, clean_values)
        return torch.log_softmax(logits[-1].double(), -1).numpy()

    for spec, (hook, alpha) in enumerate(specs):
        got = by_role(plan, results, "patched", 1, spec)
        want = hf_logprobs(hook, alpha)
        assert got.void is None
        np.testing.assert_allclose(got.score["logprobs"], [want[answer], want[foil]], atol=1e-4, err_msg=hook)
        assert got.score["top_id"] == int(want.argmax()) == got.token_ids[0], (hook, alpha)
        top = got.top_logprobs[0][:5]  # HF's five most likely tokens (up to ties within the tolerance)
        ids = [t for t, _ in top]
        np.testing.assert_allclose([lp for _, lp in top], want[ids], atol=1e-4, err_msg=hook)
        assert want[ids].min() >= np.sort(want)[-5] - 1e-4, (hook, alpha)
        # the scores tell alpha from alpha**2 apart, far beyond the tolerance
        squared = hf_logprobs(hook, alpha * alpha)
        assert np.abs(squared[[answer, foil]] - want[[answer, foil]]).max() > 1e-2, (hook, alpha)


def test_restoring_every_token_at_the_first_layer_gives_the_clean_score(tiny_engine):
    patching = [{"prompts": [1], "source": {"prompt": 0}, "hook": "pre_attn", "layers": 0, "positions": "all"}]
    plan, results = run_plan(tiny_engine, base_config(prompts=scored(CLEAN, CORRUPT), patching=patching,
                                                      sampling={"max_tokens": 1}))
    clean, corrupt = results["r00000"].score["logprobs"], results["r00001"].score["logprobs"]
    patched = by_role(plan, results, "patched", 1).score["logprobs"]
    assert np.abs(clean - corrupt).max() > 1e-2
    np.testing.assert_allclose(patched, clean, atol=1e-5)


def test_alpha_moves_the_answer_monotonically_from_corrupt_to_clean(smollm2_engine):
    layer = 3  # the subject's residual stream in an early layer carries the fact
    patching = [{"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": layer,
                 "positions": {"span": "Big Ben clock"}, "alpha": a} for a in (0.0, 0.25, 0.5, 0.75, 1.0)]
    plan, results = run_plan(smollm2_engine, base_config(
        "smollm2_135m", prompts=scored(CLEAN, CORRUPT), patching=patching, sampling={"max_tokens": 1}))
    probs = [float(np.exp(by_role(plan, results, "patched", 1, i).score["logprobs"][0])) for i in range(5)]
    clean = float(np.exp(results["r00000"].score["logprobs"][0]))
    corrupt = float(np.exp(by_role(plan, results, "baseline", 1).score["logprobs"][0]))
    assert clean > 0.3 and corrupt < 0.05, (clean, corrupt)
    assert probs[0] == pytest.approx(corrupt, rel=1e-5)  # the same run, but packed with the others: fp32 apart
    assert all(a < b for a, b in zip(probs, probs[1:])), probs
    assert probs[-1] > corrupt + 0.5 * (clean - corrupt), (probs, clean, corrupt)


def test_an_unpatched_request_after_patched_ones_matches_a_fresh_engine(tiny_engine, tiny_path):
    plain = base_config(prompts=scored(CLEAN, CORRUPT, "Hello, my name is"), sampling={"max_tokens": 6,
                                                                                         "logprobs": 3})
    patching = [{"prompts": [1], "source": {"prompt": 0}, "hook": hook, "layers": "all", "positions": [0, 1]}
                for hook in ("post_block", "attn_out")]
    patching.append({"prompts": [2], "source": {"zeros": True}, "hook": "mlp_out", "layers": "all"})
    run_plan(tiny_engine, {**plain, "patching": patching})
    _, after = run_config(tiny_engine, plain, skip_reading_prefix_cache=True)
    sites = every_site(4)
    fresh = build_engine(tiny_path, sites, sites, sites, BANK_ROWS)
    try:
        _, first = run_config(fresh, plain, skip_reading_prefix_cache=True)
    finally:
        fresh.close()
    for a, b in zip(after, first):
        same_result(a, b)
        assert a.top_logprobs == b.top_logprobs


def test_patched_kv_is_only_shared_before_the_first_patched_position(runner_engine):
    tiny_engine = runner_engine
    # CPU KV blocks hold 128 tokens: a patch at position 200 leaves block [0, 128) shareable
    plain = base_config(prompts={"items": [LONG]}, sampling={"max_tokens": 3})
    patch = [{"prompts": [0], "source": {"vector": {"random": {"seed": 5, "norm": 8.0}}}, "hook": "post_block",
              "layers": 1, "positions": [200]}]
    _, fresh_plain = run_config(tiny_engine, plain, skip_reading_prefix_cache=True)
    _, again_plain = run_config(tiny_engine, plain)  # now cached
    assert again_plain[0].cached_tokens >= 256
    plan, patched = run_plan(tiny_engine, {**plain, "patching": patch})
    first = by_role(plan, patched, "patched", 0)
    assert first.cached_tokens == 128  # the block holding position 200 and the ones after it were recomputed
    plan2, uncached = run_plan(tiny_engine, {**plain, "patching": patch}, skip_reading_prefix_cache=True)
    np.testing.assert_allclose(first.logprobs, by_role(plan2, uncached, "patched", 0).logprobs, atol=1e-5)
    assert np.abs(np.array(first.logprobs) - np.array(fresh_plain[0].logprobs)).max() > 1e-4
    # no other request of its plan has this patch: its blocks from position 200 on were never cached, so the same
    # patch in a later plan recomputes them (to the same values), and an unpatched request never gets them
    assert next(r for r in plan.requests if r.role == "patched").payload.kv_private == 200
    plan3, repeat = run_plan(tiny_engine, {**plain, "patching": patch})
    again = by_role(plan3, repeat, "patched", 0)
    assert again.cached_tokens == 128
    np.testing.assert_allclose(again.logprobs, first.logprobs, atol=1e-5)
    _, plain_after = run_config(tiny_engine, plain)
    np.testing.assert_allclose(plain_after[0].logprobs, fresh_plain[0].logprobs, atol=1e-5)


def test_a_request_whose_source_is_missing_is_voided(tiny_engine):
    config = base_config(prompts=scored(CLEAN, CORRUPT), sampling={"max_tokens": 2}, patching=[
        {"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": "all"}])
    plan = prepare(config).plan
    patched = [r for r in plan.requests if r.role == "patched"]
    results = tiny_engine.run(patched, use_tqdm=False)  # its sources were never registered
    assert "not on the worker" in results[patched[0].rid].void

    class ForgetfulEngine:
        """Drops the values the clean run kept on the workers once it has run, as if they had been lost."""

        def __getattr__(self, name):
            return getattr(tiny_engine, name)

        def run(self, requests, vectors=None, use_tqdm=True, progress=None):
            out = tiny_engine.run(requests, vectors, use_tqdm, progress)
            tiny_engine.release_sources(list(plan.refs))
            return out

    from interp_runner.kinds.prompts import KIND as prompts_kind

    results = execute(ForgetfulEngine(), plan, log=lambda _: None, use_tqdm=False)
    ds = prompts_kind.dataset(plan, results, 128)
    voided = [v["request"] for v in ds.attrs["voided"]]
    assert voided == [patched[0].rid]
    assert ds["status"].values.tolist() == ["done", "done", "void", "done"]


def test_values_kept_on_the_workers_are_the_captured_values(runner_engine):
    """A source run keeps the values stage 1 patches in on the workers, written in the step that computes them:
    the bank then holds exactly what a capture of the same sites and positions returns, through the capture
    buffer (which holds a row captured and kept once) or, in a step that overflows it, copied directly. Released,
    they are freed once no request uses them: at once, once the request that kept them has finished."""
    import torch

    from interp_runner.plugin.runner_patches import state_of

    tiny_engine = runner_engine
    config = base_config(prompts=scored(CLEAN, CORRUPT), sampling={"max_tokens": 1}, patching=[
        {"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": "all"}],
        capture=[{"name": "clean", "hooks": ["post_block"], "layers": "all", "positions": "all_prompt",
                  "prompts": [0]}])
    plan = prepare(config).plan
    source = plan.requests[0]
    assert source.payload.keep.groups and len(plan.refs) == 4 * len(source.prompt.token_ids)
    state = tiny_engine.llm.collective_rpc(lambda worker: state_of(worker.model_runner))[0]  # this engine's
    for overflow in (False, True):
        kept_buffer = state.cap_out
        if overflow:
            state.cap_out = torch.zeros((3, kept_buffer.shape[1]), dtype=kept_buffer.dtype)
        try:
            out = tiny_engine.run([source], use_tqdm=False)  # alone: a step of its rows, each captured and kept
        finally:
            state.cap_out = kept_buffer
        for key, (rid, site, position) in plan.refs.items():
            assert key not in state._unwritten
            positions, values = out[rid].captures[site]
            np.testing.assert_array_equal(state.bank[state.bank_rows[key]].numpy(), values[positions == position][0])
        tiny_engine.release_sources(list(plan.refs))
        # the source run finished (its results were collected): its rows are free now, before the runner's next
        # step drops it
        assert not plan.refs.keys() & (state.bank_rows.keys() | state._released)


def test_scores_are_exact_logprobs_whatever_the_rank(tiny_engine, tiny_path):
    import torch

    from support import hf_oracle
    answers = [" Paris", " zebra", "!"]
    config = base_config(prompts={"items": [{"text": CLEAN, "answer": a, "foil": " Rome"} for a in answers]},
                         sampling={"max_tokens": 1})
    plan, results = run_config(tiny_engine, config)
    logits, _ = hf_oracle.forward(tiny_path, list(plan.requests[0].prompt.token_ids))
    ref = torch.log_softmax(logits[-1].double(), -1).numpy()
    for request, result in zip(plan.requests, results):
        answer, foil = request.prompt.answer_ids
        np.testing.assert_allclose(result.score["logprobs"], [ref[answer], ref[foil]], atol=1e-4)
        assert result.score["top_id"] == int(ref.argmax())
    assert int((ref > ref[plan.requests[1].prompt.answer_ids[0]]).sum()) > 20  # far outside any top-k


def test_patch_sites_enter_the_engine_spec():
    plan = prepare(base_config(prompts=scored(CLEAN, CORRUPT), patching=[
        {"prompts": [1], "source": {"prompt": 0}, "hook": "mlp_out", "layers": [1, 3]}])).plan
    assert plan.engine_spec.patch_sites == (site_id(1, "mlp_out"), site_id(3, "mlp_out"))
    assert plan.engine_spec.bank_rows == len(plan.refs) == 2 * len(plan.requests[0].prompt.token_ids)
