"""The compiler's prefix-cache records on tiny_random: a steered request's KV ranges and their digests (keyed by the
steering, not by the order of its terms, and following its tier), and which captures make a request skip reading the
prefix cache. No engine is started."""

from __future__ import annotations

import pytest

from test_compiler import HIDDEN, cfg, compile_, facts, steer_with, tokenize  # noqa: F401  (fixtures)


def kv_digest(request, start: int) -> str | None:
    return next((x.digest for x in request.kv_ranges if x.start == start), None)


def test_kv_ranges_key_prefix_cache_blocks_by_steering(compile_):
    a, b = [1.0] * HIDDEN, [2.0] * HIDDEN
    config = cfg(steering={"request": [
        {"prompts": [0, 1], "base": {"post_block": {"layer": 0, "vector": a}}},
        {"prompts": [2], "base": {"post_block": {"layer": 0, "vector": b}}},
    ]}, capture=[{"hooks": ["post_block"], "positions": "last_prompt"}])
    plan = compile_(config)
    for r in plan.requests[:3]:  # base steering: the prompt's positions and the generated ones
        n = len(r.prompt.token_ids)
        assert [(x.start, x.end) for x in r.kv_ranges] == [(0, n), (n, -1)]
    assert kv_digest(plan.requests[0], 0) == kv_digest(plan.requests[1], 0)  # identically steered: shared
    assert kv_digest(plan.requests[2], 0) != kv_digest(plan.requests[0], 0)  # a different vector
    assert plan.requests[3].kv_ranges == ()  # capture only: shares KV with unsteered requests
    # a different scale, layer or hook is a different digest; the same steering compiles to the same one
    base = kv_digest(plan.requests[0], 0)
    for term, hook in [({"layer": 0, "vector": a, "scale": 2.0}, "post_block"),
                       ({"layer": 1, "vector": a}, "post_block"), ({"layer": 0, "vector": a}, "mlp_out")]:
        other = compile_(cfg(steering={"request": [{"prompts": [0], "base": {hook: term}}]}))
        assert kv_digest(other.requests[0], 0) not in (None, base)
    same = compile_(cfg(steering={"global": {"base": {"post_block": {"layer": 0, "vector": a}}}}))
    assert {kv_digest(r, 0) for r in same.requests} == {base}


def test_kv_ranges_follow_the_tier(compile_):
    a = [1.0] * HIDDEN
    prefill = compile_(cfg(steering={"global": {"prefill": {"post_block": {"layer": 0, "vector": a}}}})).requests[0]
    decode = compile_(cfg(steering={"global": {"decode": {"post_block": {"layer": 0, "vector": a}}}})).requests[0]
    n = len(prefill.prompt.token_ids)
    assert [(x.start, x.end) for x in prefill.kv_ranges] == [(0, n)]
    assert [(x.start, x.end) for x in decode.kv_ranges] == [(n, -1)]  # the prompt's KV stays shared


def test_kv_ranges_ignore_term_order(compile_):
    a, b = [1.0] * HIDDEN, [2.0] * HIDDEN
    one = compile_(cfg(steering={"request": [{"prompts": 0, "base": {"post_block": [
        {"layer": 0, "vector": a}, {"layer": 1, "vector": b}]}}]}))
    two = compile_(cfg(steering={"request": [{"prompts": 0, "base": {"post_block": [
        {"layer": 1, "vector": b}, {"layer": 0, "vector": a}]}}]}))
    assert one.requests[0].kv_ranges == two.requests[0].kv_ranges


@pytest.mark.parametrize(
    "positions, skips",
    [("last_prompt", False), ("all_generated", False), ([-1], False), ("all_prompt", True), ("all", True),
     ([0], True), ([-2, -1], True)],
)
def test_skip_reading_prefix_cache_only_for_earlier_prompt_positions(compile_, positions, skips):
    config = cfg(capture=[{"hooks": ["post_block"], "positions": positions, "prompts": [0, 1]}])
    plan = compile_(config)
    flags = [r.sampling["skip_reading_prefix_cache"] for r in plan.requests]
    assert flags == ([True, True, None, None] if skips else [None] * 4)


def test_skip_reading_prefix_cache_from_any_capture_entry(compile_):
    config = cfg(capture=[
        {"name": "a", "hooks": ["post_block"], "positions": "last_prompt"},
        {"name": "b", "hooks": ["mlp_out"], "positions": [0], "prompts": [2]},
    ])
    flags = [r.sampling["skip_reading_prefix_cache"] for r in compile_(config).requests]
    assert flags == [None, None, True, None]


def test_steering_alone_does_not_skip_the_prefix_cache(compile_):
    plan = compile_(steer_with([1.0] * HIDDEN))
    assert all(r.sampling["skip_reading_prefix_cache"] is None for r in plan.requests)
