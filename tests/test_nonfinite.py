"""Requests computed through a non-finite value: flagged on the device per request, stored as NaN, said in the
summary and report, refused from the config where the overflow is certain.

A residual stream of ~1e19 per entry is finite in float32, but the final norm's sum of squares over the hidden
size overflows: its output becomes zeros and every logit the same, with no inf or NaN anywhere. The oracle is
plain HF transformers (``hf_oracle``) with the same steering: the float32 sum of squares of the stream its final
norm reads (the last layer's output), computed here in numpy.
"""

from __future__ import annotations

import functools
from unittest import mock

import numpy as np
import pytest
import torch
import xarray as xr

from support import hf_oracle
from conftest import base_config, run_config, run_plan
from interp_runner.config import ConfigError
from interp_runner.kinds.prompts import KIND as PROMPTS
from interp_runner.kinds.steering_vectors.kind import KIND as VECTORS
from interp_runner.pipeline import prepare
from interp_runner.compile.overflow import FLOAT32_MAX
from interp_runner.store.result_flags import flagged_attrs, nonfinite_lines
from interp_runner.vectors.load import random_direction

HIDDEN, LAYERS = 128, 4
ITEMS = [{"text": "The Eiffel Tower is located in the city of", "answer": " Paris", "foil": " Rome"},
         {"text": "Hello, my name is", "answer": " John", "foil": " Mary"},
         {"text": "My favourite colour is", "answer": " blue", "foil": " red"}]
# a unit direction times 1e19 at the output of every layer: each term's sum of squares is 1e38 (accepted), the
# stream after two layers holds about 4e38 (beyond float32's 3.4e38)
UNIT = random_direction(seed=3, norm=1.0, size=HIDDEN)
HUGE = 1e19


def unit_steering(tier: str) -> dict:
    return {tier: {"post_block": {"layer": "all", "vector": UNIT.tolist(), "scale": HUGE}}}


def final_norm_input_overflows(path, token_ids, steer) -> bool:
    """HF: whether the float32 sum of squares of any row the final norm reads is not finite."""
    _, acts = hf_oracle.forward(path, list(token_ids), steer)
    stream = acts[(LAYERS - 1, "post_block")].astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return not np.isfinite(np.square(stream).sum(axis=-1, dtype=np.float32)).all()


@pytest.fixture(scope="module")
def cached_hf():
    with mock.patch.object(hf_oracle, "load", functools.lru_cache(maxsize=2)(hf_oracle.load)):
        yield


# -- config refusals (no engine) ----------------------------------------------------------------------------------


def problems(config: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        prepare(config)
    return err.value.problems


def test_a_steering_term_whose_squares_leave_float32_is_refused_naming_its_scale():
    unit = UNIT.tolist()
    cfg = base_config(steering={"global": {"base": {"post_block": {"layer": 1, "vector": unit, "scale": 1e30}}}})
    (path, reason), = problems(cfg)
    assert path == "steering.global.base.post_block.scale" and "sum of squares is 1e+60" in reason
    per_request = {"request": [{"prompts": [0], "prefill": {"pre_attn": {"layer": 0, "vector": unit}}},
                               {"prompts": [1], "decode": {"mlp_out": {"layer": 2, "vector": unit, "scale": 2e19}}}]}
    assert [p for p, _ in problems(base_config(steering=per_request))] == ["steering.request[1].decode.mlp_out.scale"]
    # the vector's own entries count: 1e10 in each of 128 entries times 2e9 squares to 5.1e39
    big = {"global": {"base": {"attn_out": {"layer": 0, "vector": [1e10] * HIDDEN, "scale": 2e9}}}}
    assert [p for p, _ in problems(base_config(steering=big))] == ["steering.global.base.attn_out.scale"]
    # below the limit the config stands (the engine's check takes over): 1e19 squares to 1e38
    prepare(base_config(steering={"global": unit_steering("base")}))


def test_steering_vector_scales_whose_square_leaves_float32_are_refused_by_index():
    from test_steering_vectors import sv_config

    (path, reason), = problems(sv_config(eval={"scales": [1.0, -2.0, 3e38]}))
    assert path == "steering_vectors.eval.scales[2]" and "beyond float32's range" in reason
    assert [p for p, _ in problems(sv_config(eval={"scales": [-1.9e19, 1.0]}))] == ["steering_vectors.eval.scales[0]"]
    assert 1.8e19 ** 2 < FLOAT32_MAX
    prepare(sv_config(eval={"scales": [1.0, 1.8e19]}))


# -- the store and the summary (no engine) ------------------------------------------------------------------------


def test_summary_says_how_many_requests_were_flagged_and_which():
    from types import SimpleNamespace as NS

    plan = NS(requests=[NS(rid=f"r{i}", role="prompt" if i < 3 else "patched") for i in range(5)])
    results = {"r0": NS(nonfinite=False), "r1": NS(nonfinite=True), "r3": NS(nonfinite=True)}
    attrs = {"nonfinite_requests": flagged_attrs(plan, results)}
    assert attrs["nonfinite_requests"] == {"count": 2, "of": 5, "by_role": {"prompt": 1, "patched": 1},
                                           "requests": ["r1", "r3"]}
    line, = nonfinite_lines(attrs)
    assert line.startswith("warning: 2 of 5 requests were computed through a non-finite value")
    assert "NaN" in line and "1 patched, 1 prompt: r1, r3" in line
    assert nonfinite_lines({"nonfinite_requests": flagged_attrs(plan, {})}) == [] == nonfinite_lines({})


# -- the device flags (no engine) ---------------------------------------------------------------------------------


def test_flags_reach_only_the_requests_of_bad_rows_and_a_slot_starts_clean_for_its_next_owner():
    from support import planner as stand_in

    from interp_runner.contracts import RequestPayload

    state = stand_in.planner()
    payloads = {"A": (3, RequestPayload("A")), "B": (2, None), "C": (2, RequestPayload("C")),
                "D": (2, RequestPayload("D"))}
    requests = {rid: stand_in.request(p, n) for rid, (n, p) in payloads.items()}

    def step(rows, bad_rows, live=requests):
        num = sum(n for _, _, n in rows)
        state.before_forward(stand_in.runner(live, rows), num)
        bad = torch.zeros(num, dtype=torch.bool)
        bad[bad_rows] = True
        state.flag_rows(bad)  # what the last layer's op does
        state.after_forward()

    step([("A", 0, 3), ("B", 0, 2), ("C", 0, 2)], [1, 3, 4])  # A's middle row and both of B's (no payload)
    slots = state.result_flags.row_slot[:7].tolist()
    assert slots[0] == slots[1] == slots[2] != 0 and slots[3] == slots[4] == 0 and slots[5] == slots[6] != 0
    step([("A", 3, 1), ("B", 2, 1), ("C", 2, 1)], [])
    state.finished(["A"])
    assert state.collect(["A"])["A"]["nonfinite"] is True
    live = {rid: r for rid, r in requests.items() if rid != "A"}
    step([("C", 3, 1), ("D", 0, 2)], [0], live)  # C's decode row; D takes the slot A freed
    assert state.result_flags.row_slot[1].item() == slots[0]
    step([("C", 4, 1), ("D", 2, 1)], [], live)
    state.finished(["C", "D"])
    got = state.collect(["C", "D"])
    assert got["C"]["nonfinite"] is True and got["D"]["nonfinite"] is False


def test_a_packed_request_flags_a_cell_by_its_own_rows_or_the_shared_prefix():
    """Rows before the prefix's end are the carrier's (every cell reads them), segment k's rows cell k's; in a step
    that skips layers rows come in model order (``row_of``)."""
    from types import SimpleNamespace as NS

    from interp_runner.plugin.nonfinite import ResultFlags
    from interp_runner.plugin.staging import PinnedRing

    def carrier():
        cells = NS(prefix=4, stride=2, rids=["c0", "c1", "c2"])
        return NS(rid="packed", cells=cells, flag_slot=0, cell_flag_slots=None)

    flags = ResultFlags(32, torch.device("cpu"), PinnedRing(0, torch.device("cpu")), True)
    for bad_rows, row_of, want in [([7], None, [False, True, False]), ([2], None, [True, True, True]),
                                   ([1], np.arange(11)[::-1], [False, False, True]), ([], None, [False] * 3)]:
        plan = carrier()
        flags.acquire(plan)
        lone = NS(rid="lone", cells=None, flag_slot=0)
        flags.acquire(lone)
        starts, computed = np.array([0, 10, 11]), np.array([0, 0])  # prefix 0-3, segments 4-5, 6-7, 8-9
        flags.plan(np.array([plan.flag_slot, lone.flag_slot]), [(0, plan)], starts, computed, 12, 11, row_of)
        bad = torch.zeros(11, dtype=torch.bool)
        bad[bad_rows] = True
        flags.flag_rows(bad)
        flags.release(plan)
        flags.release(lone)
        got = flags.collect(["c0", "c1", "c2", "lone"])
        assert [got[r] for r in ("c0", "c1", "c2")] == want and got["lone"] is False, (bad_rows, row_of)
    assert int(flags.flags.sum()) == int(flags.flags[0])  # every released slot was zeroed


# -- the engine (tiny_random, CPU, float32) -----------------------------------------------------------------------


@pytest.mark.engine
def test_only_the_request_computed_through_an_overflow_is_flagged_and_stored_as_nan(tiny_engine, tiny_path,
                                                                                       cached_hf):
    """Prompt 0 is steered on every token (it overflows from its prompt on), prompt 2 on generated tokens only
    (it overflows in decode steps, which repeat the planned step's buffers), prompt 1 not at all: exactly 0 and 2
    are flagged, as HF's own stream says; prompt 1's results are those of a run without the others' steering."""
    steering = {"request": [{"prompts": [0], **unit_steering("base")}, {"prompts": [2], **unit_steering("decode")}]}
    capture = [{"name": "last", "hooks": ["post_block"], "layers": [0, 3], "positions": "last_prompt"}]
    config = base_config(prompts={"items": ITEMS}, sampling={"max_tokens": 4, "logprobs": 2}, capture=capture)
    plan, mixed = run_config(tiny_engine, {**config, "steering": steering}, skip_reading_prefix_cache=True)
    _, plain = run_config(tiny_engine, config, skip_reading_prefix_cache=True)
    assert [r.nonfinite for r in mixed] == [True, False, True]
    assert not any(r.nonfinite for r in plain)

    # the oracle: HF's final norm input overflows for exactly the flagged requests (decode: over the generated
    # tokens, which the decode tier steers)
    for request, result in zip(plan.requests, mixed):
        ids = list(request.prompt.token_ids)
        full = ids + result.token_ids[:-1]
        index = request.prompt.index
        steer = {(layer, "post_block"): UNIT * np.float32(HUGE) for layer in range(LAYERS)} if index != 1 else None
        rows = np.arange(len(ids), len(full)) if index == 2 else None
        _, acts = hf_oracle.forward(tiny_path, full, steer, rows)
        stream = acts[(LAYERS - 1, "post_block")].astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            overflows = ~np.isfinite(np.square(stream).sum(axis=-1, dtype=np.float32))
        assert overflows.any() == result.nonfinite, index
        if index == 2:  # its prompt rows are as unsteered: the first token is the plain run's
            assert not overflows[: len(ids)].any() and overflows[len(ids):].all()
            assert result.token_ids[0] == plain[2].token_ids[0]

    # the unflagged request computes as if alone with its batch
    assert mixed[1].token_ids == plain[1].token_ids and mixed[1].logprobs == plain[1].logprobs
    assert mixed[1].top_logprobs == plain[1].top_logprobs
    np.testing.assert_array_equal(mixed[1].score["logprobs"], plain[1].score["logprobs"])

    # the store: flagged, status "nonfinite", no number computed through the overflow
    by_rid = {r.rid: res for r, res in zip(plan.requests, mixed)}
    ds = PROMPTS.dataset(plan, by_rid, HIDDEN)
    assert ds["nonfinite"].values.tolist() == [True, False, True]
    assert ds["status"].values.tolist() == ["nonfinite", "done", "nonfinite"]
    for name in ("answer_logprob", "answer_prob", "foil_logprob", "logit_diff"):
        values = ds[name].values
        assert np.isnan(values[[0, 2]]).all() and np.isfinite(values[1]), name
    assert ds["top_token"].values[0] == -1 and ds["top_token"].values[2] == -1
    assert np.isnan(ds["logprob"].values[[0, 2]]).all() and np.isfinite(ds["logprob"].values[1]).all()
    assert np.isnan(ds["top_logprob"].values[[0, 2]]).all()
    assert np.isnan(ds["last"].values[[0, 2]]).all() and np.isfinite(ds["last"].values[1]).all()
    np.testing.assert_allclose(ds["answer_logprob"].values[1], plain[1].score["logprobs"][0])
    ds.attrs["nonfinite_requests"] = flagged_attrs(plan, by_rid)
    line, = nonfinite_lines(ds.attrs)
    assert "2 of 3 requests" in line and f"{plan.requests[0].rid}, {plan.requests[2].rid}" in line


@pytest.mark.engine
def test_a_huge_accepted_eval_scale_gives_nan_cells_flagged_not_zero(tiny_engine, tiny_path, cached_hf):
    """steering_vectors with a scale the config accepts (its square is below float32's limit) but whose product with
    the derived vector overflows the final norm: those cells are flagged and NaN, their mean effect NaN, never the
    0.0 an all-equal row of logits gives; cells at scale 1 keep their numbers."""
    from test_steering_vectors import sv_config

    scales = [1.0, 1.8e19]
    config = sv_config(hooks=["post_block"], layers=[1, 2], methods=["mean_diff"], eval={"scales": scales})
    plan, results = run_plan(tiny_engine, config)
    ds = VECTORS.dataset(plan, results, HIDDEN, None)
    vectors = ds["vector"].sel({"method": "mean_diff", "vector_hook": "post_block"})
    flagged = ds["nonfinite"].transpose("prompt", "layer", "scale").values
    steered = ds["steered_logit_diff"].transpose("prompt", "layer", "scale").values
    want = np.zeros_like(flagged)
    heldout = plan.layout.heldout
    for p, prompt in enumerate(heldout):
        for l, layer in enumerate(ds["layer"].values):
            vec = vectors.sel(vector_layer=layer).values
            for k, scale in enumerate(scales):
                steer = {(int(layer), "post_block"): vec * np.float32(scale)}
                want[p, l, k] = final_norm_input_overflows(tiny_path, prompt.token_ids, steer)
    assert want[:, :, 1].any() and not want[:, :, 0].any(), "the scales must give both outcomes"
    np.testing.assert_array_equal(flagged, want)
    assert np.isnan(steered[flagged]).all() and np.isfinite(steered[~flagged]).all()
    assert not (steered[flagged] == 0).any()
    mean = ds["mean_effect"].transpose("layer", "scale").values
    np.testing.assert_array_equal(np.isnan(mean), flagged.any(axis=0))
    assert not ds["baseline_nonfinite"].values.any()


@pytest.mark.engine
def test_cells_packed_after_an_overflowing_corruption_are_flagged_and_never_in_the_grid(tiny_engine, tmp_path):
    """Subject noise of 1e21 x the embeddings' std: each noised row's squares sum beyond float32's range (computed
    here from the stored noise), so the corrupted runs and every cell (packed, entering above layer 0 with the
    corrupted stream, which keeps noised subject rows) are flagged and the grids NaN; the clean runs are not. Cells
    restoring a token at or before the subject compute noised rows and are flagged by the engine; the others, and the
    in-batch corrupted run, read the corrupted run's kept KV or its prefix-cache blocks, and are flagged as its
    readers (``result_flags.propagate``)."""
    from interp_runner.kinds.causal_trace.grids import trace_dataset
    from test_causal_trace import long_fact, run_packed, trace_config

    config = trace_config("tiny_random", components=["resid", "mlp"], layers=[0, 3], window=1,
                          noise={"samples": 1, "k": 1e21}, filter=False, num_facts=1, facts=long_fact(tmp_path, 34))
    config["engine"].update(max_model_len=1024, cell_entry_stride=1)
    plan, results = run_packed(tiny_engine, config, True)
    ds = trace_dataset(plan, results)
    noise = ds["noise"].values.astype(np.float64)  # (fact, sample, subject token, hidden)
    assert (np.square(noise).sum(axis=-1) > FLOAT32_MAX).all()  # every noised row overflows the norms
    parts = {part: [results[r.rid].nonfinite for r in plan.requests if r.meta.get("part") == part]
             for part in ("clean", "corrupt", "cell")}
    assert parts["clean"] and not any(parts["clean"])
    assert parts["corrupt"] and all(parts["corrupt"])
    assert len(parts["cell"]) > 100 and all(parts["cell"])
    assert np.isnan(ds["restored_prob"].values).all() and np.isnan(ds["corrupt_prob"].values).all()
    assert np.isfinite(ds["clean_prob"].values).all()
    assert sorted(ds.attrs["nonfinite"]) == sorted(r.rid for r in plan.requests if results[r.rid].nonfinite)


@pytest.mark.engine
def test_the_store_summary_and_report_of_a_run_say_which_requests_were_flagged(tiny_engine, tmp_path, capsys):
    from interp_runner.engine.pool import EnginePool
    from interp_runner.pipeline import run
    from interp_runner.summary import print_summary

    store = tmp_path / "results.zarr"
    steering = {"request": [{"prompts": [1], **unit_steering("base")}]}
    config = base_config(prompts={"items": ITEMS}, steering=steering, store={"path": str(store)})
    pool = EnginePool(lambda *args: tiny_engine)  # a pool of the caller's: the session's engine stays open
    run(config, tmp_path / "run", log=lambda _: None, engines=pool)
    ds = xr.open_zarr(str(store), consolidated=False)
    assert ds.attrs["status"] == "complete"
    assert ds["nonfinite"].values.tolist() == [False, True, False]
    assert np.isnan(ds["answer_logprob"].values[1]) and np.isfinite(ds["answer_logprob"].values[[0, 2]]).all()
    rid = str(ds["request"].values[1])
    assert ds.attrs["nonfinite_requests"] == {"count": 1, "of": 3, "by_role": {"prompt": 1}, "requests": [rid]}
    capsys.readouterr()
    print_summary(store)
    printed = capsys.readouterr().out
    assert "warning: 1 of 3 requests were computed through a non-finite value" in printed and rid in printed
    report = (tmp_path / "results.zarr.report.html").read_text()
    assert "1 of 3 requests were computed through a non-finite value" in report
