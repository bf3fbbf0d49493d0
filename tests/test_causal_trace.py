"""Causal tracing: the compiled grid, bad inputs, and packed cells (against HF hooks: test_causal_trace_hf.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REPO, run_plan
from interp_runner.kinds.causal_trace.grids import trace_dataset
from interp_runner.kinds.causal_trace.plan import corrupt_rid
from interp_runner.config import ConfigError
from interp_runner.pipeline import prepare
from interp_runner.sites import site_id

FACTS = REPO / "experiments" / "causal_trace" / "facts.jsonl"
LAYERS = [0, 4, 11, 18, 29]


def trace_config(model="smollm2_135m", **trace) -> dict:
    return {
        "model": {"name": model},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256},
        "prompts": {"items": []},
        "causal_trace": {"facts": str(FACTS), "num_facts": 2, **trace},
    }


def run_packed(engine, config: dict, pack: bool):
    """``run_plan`` with ``pack_cells`` set to ``pack`` for the run (packed cells also skip the layers below their
    restores)."""
    config = {**config, "engine": {**config["engine"], "pack_cells": pack}}
    kept, engine.pack_cells = engine.pack_cells, pack
    try:
        return run_plan(engine, config)
    finally:
        engine.pack_cells = kept


def write_facts(tmp_path, rows) -> str:
    path = tmp_path / "facts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# -- compiling --------------------------------------------------------------------------------------------


def test_the_grid_compiles_into_one_batched_stage():
    plan = prepare(trace_config(noise={"samples": 2}, layers=LAYERS)).plan
    layout = plan.layout
    cells = [r for r in plan.requests if r.meta.get("part") == "cell"]
    tokens = sum(len(f.clean.token_ids) for f in layout.facts)
    assert len(cells) == 2 * 3 * len(LAYERS) * tokens  # samples x components x layers x tokens
    assert {r.stage for r in cells} == {1} and all(r.condition and r.condition.endswith("clean") for r in cells)
    assert [r.rid for r in plan.requests if r.stage == 0] == [
        "f000-clean", "f000-corrupt-s0", "f000-corrupt-s1", "f001-clean", "f001-corrupt-s0", "f001-corrupt-s1"]
    # ROME's window: range(max(0, L - w/2), min(n, L + w/2))
    assert layout.window_layers(0) == list(range(0, 5))
    assert layout.window_layers(11) == list(range(6, 16))
    assert layout.window_layers(29) == list(range(24, 30))
    last = len(layout.facts[0].clean.token_ids) - 1
    cell = next(r for r in cells if r.meta == {"fact": 0, "part": "cell", "component": "mlp", "layer": 11,
                                               "token": last - 1, "sample": 1})
    patch = cell.payload.patch
    sites = np.frombuffer(patch.sites, dtype=np.int32).tolist()
    positions = np.frombuffer(patch.positions, dtype=np.int32).tolist()
    subject = list(layout.facts[0].subject_positions)
    assert sites == [site_id(0, "pre_attn")] * len(subject) + [site_id(lay, "mlp_out") for lay in range(6, 16)]
    assert positions == subject + [last - 1] * 10
    assert np.frombuffer(patch.value_weights, dtype=np.float32).tolist() == [1.0] * len(subject) + [0.0] * 10
    # every cell of one noise sample shares the KV of the positions before its restored token
    noise_ranges = [r for r in cell.kv_ranges if r.start in subject]
    same_sample = next(r for r in cells if r.meta["fact"] == 0 and r.meta["sample"] == 1 and r.meta["token"] == last)
    assert [r for r in same_sample.kv_ranges if r.start in subject] == noise_ranges
    # a cell's KV is its own from its restored token on (or from the noise after it, which is its sample's):
    # those blocks are never hashed or cached; the corrupted runs share theirs
    for r in cells:
        token, subject = r.meta["token"], layout.facts[r.meta["fact"]].subject_positions
        after = min([p for p in subject if p > token], default=token)
        assert r.payload.kv_private == (token if token in subject or token > subject[-1] else after), r.rid
    assert all(r.payload is None or r.payload.kv_private is None for r in plan.requests if r.meta.get("part") != "cell")


@pytest.mark.parametrize("pack, stride", [(False, 1), (True, 1), (True, 2)],
                         ids=["cells-alone", "cells-packed", "cells-packed-stride-2"])
def test_runs_keep_exactly_the_values_cells_read(pack, stride):
    """Each clean run keeps on the workers the (site, position) values its fact's cells restore; with packed
    cells, each corrupted run also keeps its residual stream at the layers its cells start from (their lowest
    restored layer, rounded down to a multiple of ``cell_entry_stride``) and its prompt's KV (which its cells
    reuse before their restored token), and nothing more: the bank is sized for those values, the KV rows for
    those prompts (``Plan.refs``), and the plan releases them."""
    from interp_runner.payload import kv_key, ref_key, unpack_positions

    config = trace_config("tiny_random", components=["resid", "mlp", "attn"], layers=[0, 3], window=2,
                          noise={"samples": 2})
    config["engine"].update(pack_cells=pack, cell_entry_stride=stride)
    plan = prepare(config).plan
    kept, runs, kv_prompts = set(), {}, []
    for r in plan.requests:
        keep = r.payload.keep if r.payload is not None else None
        if keep is not None:
            runs[r.rid] = keep.run
            kept |= {ref_key(keep.run, site, p) for group in keep.groups for site in group.sites
                     for p in unpack_positions(group.positions).tolist()}
            if keep.kv:
                assert r.meta["part"] == "corrupt" and r.sampling["skip_reading_prefix_cache"]  # every position
                kept.add(kv_key(keep.run))
                kv_prompts.append(len(r.prompt.token_ids))
    assert kept == set(plan.refs)
    assert bool(kv_prompts) == pack
    assert plan.engine_spec.bank_rows == len(plan.refs) + len(plan.sources) - len(kv_prompts)
    assert (plan.engine_spec.kv_rows, plan.engine_spec.kv_runs) == (sum(kv_prompts), len(kv_prompts))
    cells = [r for r in plan.requests if r.meta.get("part") == "cell"]
    # window 2 at layer 3: layers 2 and 3 (mlp, attn); resid at layer 3 (2 with stride 2); layer 0 starts at the
    # bottom
    want = {("resid", 0): None, ("mlp", 0): None, ("attn", 0): None, ("resid", 3): 3 if stride == 1 else 2,
            ("mlp", 3): 2, ("attn", 3): 2}
    for r in cells:
        run = runs.get(corrupt_rid(r.meta["fact"], r.meta["sample"]))
        reuse = r.payload.reuse
        assert ((reuse.run, reuse.position) if reuse else None) == ((run, r.meta["token"]) if pack else None)
        start = r.payload.start
        layer = want[r.meta["component"], r.meta["layer"]]
        if not pack or layer is None:
            assert start is None
            continue
        assert (start.layer, start.run) == (layer, runs[corrupt_rid(r.meta["fact"], r.meta["sample"])])
        n = len(r.prompt.token_ids)
        assert all(ref_key(start.run, site_id(layer, "pre_attn"), p) in plan.refs for p in range(n))
    assert any(r.payload.start for r in cells) == pack


def test_a_voided_cell_is_listed_and_never_in_the_grid():
    """A cell the workers voided (a source missing) still ran and has a score, of an unpatched run: the grid
    leaves it out and the store lists it."""
    from interp_runner.engine.results import RequestResult

    plan = prepare(trace_config("tiny_random", components=["resid"], layers=[0], noise={"samples": 1}, filter=False,
                                num_facts=1)).plan
    score = {"token_ids": np.array([1, 2]), "logprobs": np.array([-1.0, -2.0], np.float32), "top_id": 1,
             "top_logprob": -1.0}
    results = {r.rid: RequestResult(r.rid, 0, [1], "", [-1.0], score=score) for r in plan.requests}
    cell = next(r for r in plan.requests if r.meta.get("part") == "cell")
    results[cell.rid].void = "1 patch source(s) not on the worker"
    ds = trace_dataset(plan, results)
    m = cell.meta
    assert np.isnan(ds["restored_logprob_samples"].values[0, 0, 0, m["token"], 0])
    assert [v["request"] for v in ds.attrs["voided"]] == [cell.rid]


def test_noise_scale_is_k_times_the_subject_embedding_std(smollm2_path):
    from interp_runner.models.facts import embedding_rows

    plan = prepare(trace_config(noise={"k": 3.0, "samples": 1, "seed": 4})).plan
    layout = plan.layout
    ids = [f.clean.token_ids[p] for f in layout.facts for p in f.subject_positions]
    want = 3.0 * np.std(embedding_rows(smollm2_path, ids), ddof=1)
    assert layout.noise_std == pytest.approx(want, rel=1e-6)
    again = prepare(trace_config(noise={"k": 3.0, "samples": 1, "seed": 4})).plan.layout
    np.testing.assert_array_equal(layout.noise[0], again.noise[0])  # seeded
    assert abs(np.std(layout.noise[0]) / want - 1) < 0.1


@pytest.mark.parametrize(
    "row, trace, key, reason",
    [
        ({"answer": " Parisian capital"}, {}, "causal_trace.facts[0].answer", "tokens"),
        ({"subject": "The Louvre"}, {}, "causal_trace.facts[0].subject", "is not in the prompt"),
        ({}, {"window": 31}, "causal_trace.window", "larger than the model"),
        ({"corrupt_prompt": "Completely different words here"}, {"corruption": "counterfactual"},
         "causal_trace.facts[0].corrupt_prompt", "cannot be aligned"),
        ({}, {"corruption": "counterfactual"}, "causal_trace.facts[0].corrupt_prompt", "needs a corrupt_prompt"),
        ({}, {"layers": [30]}, "causal_trace.layers[0]", "out of range"),
    ],
)
def test_bad_trace_inputs_name_the_key(tmp_path, row, trace, key, reason):
    fact = {"id": "eiffel", "subject": "The Eiffel Tower", "prompt": "The Eiffel Tower is located in the city of",
            "answer": " Paris", **row}
    with pytest.raises(ConfigError) as err:
        prepare({**trace_config(**trace), "causal_trace": {"facts": write_facts(tmp_path, [fact]), **trace}})
    (path, why), = err.value.problems
    assert path == key and reason in why, err.value.problems


@pytest.mark.parametrize(
    "patching, key, reason",
    [
        ({"source": {"prompt": 5}}, "patching[0].source.prompt", "out of range"),
        ({"positions": {"span": "Louvre"}}, "patching[0].positions.span", "is not in prompt 1"),
        ({"positions": [40]}, "patching[0].positions[0]", "beyond prompt 1"),
        ({"prompts": [0]}, "patching[0].source.prompt", "cannot patch itself"),
        ({"layers": [4]}, "patching[0].layers[0]", "out of range"),
    ],
)
def test_bad_patch_inputs_name_the_key(patching, key, reason):
    config = {
        "model": {"name": "tiny_random"},
        "prompts": {"items": ["The Eiffel Tower is in Paris", "The Colosseum is in Rome"]},
        "patching": [{"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": "all", **patching}],
    }
    with pytest.raises(ConfigError) as err:
        prepare(config)
    (path, why), = err.value.problems
    assert path == key and reason in why, err.value.problems


def test_unalignable_patch_prompts_are_refused_and_partial_ones_listed():
    base = {"model": {"name": "tiny_random"}}
    clean, other = "The Eiffel Tower is located in the city of", "Paris, the capital of France"
    with pytest.raises(ConfigError) as err:
        prepare({**base, "prompts": {"items": [clean, other]}, "patching": [
            {"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": 0, "positions": [2, 3]}]})
    assert err.value.problems[0][0] == "patching[0].source.prompt" and "cannot be aligned" in err.value.problems[0][1]
    # different lengths: the shared prefix maps by identity, the shared suffix by the length difference
    shorter = "The Great Wall is located in the city of"  # 9 tokens; the clean prompt has 10
    plan = prepare({**base, "prompts": {"items": [shorter, clean]}, "patching": [
        {"prompts": [1], "source": {"prompt": 0}, "hook": "post_block", "layers": 0, "positions": "all"}]}).plan
    (skipped,) = plan.skipped
    assert skipped["positions"] == [1, 2, 3]  # E, iffel, Tower: no counterpart in the source
    patched = next(r for r in plan.requests if r.role == "patched")
    assert np.frombuffer(patched.payload.patch.positions, dtype=np.int32).tolist() == [0, 4, 5, 6, 7, 8, 9]
    sources = [plan.refs[k][2] for k in patched.payload.patch.sources]
    assert sources == [0, 3, 4, 5, 6, 7, 8]


def test_multi_token_answers_need_first_token_scoring():
    config = {"model": {"name": "tiny_random"},
              "prompts": {"items": [{"text": "The Eiffel Tower is in", "answer": " Parisian capital"}]}}
    with pytest.raises(ConfigError) as err:
        prepare(config)
    assert err.value.problems[0][0] == "prompts.items[0].answer"
    plan = prepare({**config, "scoring": {"first_token": True}}).plan
    assert len(plan.requests[0].prompt.answer_ids) == 1


# -- packed cells -------------------------------------------------------------------------------------------


def long_fact(tmp_path, repeats: int) -> str:
    filler = " and then".join([" it stood there for many years"] * repeats)
    return write_facts(tmp_path, [{"id": "long", "subject": "The Eiffel Tower",
                                   "prompt": f"The Eiffel Tower{filler} is located in the city of", "answer": " Paris"}])


def test_cells_pack_into_block_aligned_segments_after_their_shared_prefix(tmp_path):
    from interp_runner.contracts import PAYLOAD_KEY, decode_payload
    from interp_runner.compile.packing import pack_requests

    plan = prepare(trace_config("tiny_random", components=["resid"], layers=[1], noise={"samples": 1}, filter=False,
                                num_facts=1, facts=long_fact(tmp_path, 18))).plan
    n = len(plan.layout.facts[0].corrupt.token_ids)
    assert n > 130
    packed, single = pack_requests(plan.requests, block_size=32, max_tokens=1023)
    cells = [r for r in plan.requests if r.meta.get("part") == "cell"]
    members = [m.rid for p in packed for m in p.members]
    assert sorted(members + [r.rid for r in single]) == sorted(r.rid for r in plan.requests)  # each once
    assert {r.meta.get("part") for r in single} >= {"clean", "corrupt"} and len(packed) > 4
    assert all(plan_cell.meta.get("part") == "cell" for p in packed for plan_cell in p.members)
    assert len(members) > 0.9 * len(cells)
    prompt = list(plan.layout.facts[0].corrupt.token_ids)
    for p in packed:
        payload = decode_payload(p.sampling["extra_args"][PAYLOAD_KEY])  # as the plugin reads it
        layout = payload.cells
        prefix, stride = layout.prefix, layout.stride
        assert 2 <= len(p.members) and len(p.token_ids) == prefix + stride * len(p.members) <= 1023
        assert prefix % 32 == 0 and stride % 32 == 0 and stride >= n - prefix > stride - 32
        assert payload.kv_private == prefix
        for k, member in enumerate(p.members):
            token = member.meta["token"]
            assert prefix <= token < prefix + 32  # the block of its restore: all it shares with other cells
            segment = p.token_ids[prefix + k * stride :][: n - prefix]
            assert segment == prompt[prefix:]
        # each member's restore, moved into its segment; the noise before the prefix once
        positions = np.frombuffer(payload.patch.positions, dtype=np.int32)
        restores = [pos for pos, key in zip(positions.tolist(), payload.patch.sources) if key.startswith("ref:")]
        assert restores == [prefix + k * stride + m.meta["token"] - prefix for k, m in enumerate(p.members)]
    # nothing else packs: requests with captures, several tokens or no private KV stay as they are
    assert not pack_requests([r for r in plan.requests if r.meta.get("part") != "cell"], 32, 1023)[0]


@pytest.mark.engine
def test_packed_cells_score_as_unpacked_ones(runner_engine, tmp_path, monkeypatch):
    """Cells packed into shared requests (prefix, chunked steps, segments at their prompt's positions) give the
    scores the same cells give as requests of their own; also when the first step starts before every packed
    request is submitted (as where vLLM queues steps: GPUs). Under each model runner."""
    tiny_engine = runner_engine
    config = trace_config("tiny_random", components=["resid", "mlp"], layers=[0, 3], window=2, noise={"samples": 2},
                          filter=False, num_facts=1, facts=long_fact(tmp_path, 34))
    config["engine"].update(max_model_len=1024, cell_entry_stride=1)  # as the engine has; every entry layer
    from interp_runner.plugin import skipping

    computed = []  # per step run layer by layer: (rows computed, rows in the step)

    def run_layers(runner, state, input_ids, positions, _f=skipping.run_layers):
        computed.append((state.sequences["skip"].rows[-1], input_ids.shape[0]))
        return _f(runner, state, input_ids, positions)

    monkeypatch.setattr(skipping, "run_layers", run_layers)
    results = {}
    for pack in (False, True):
        plan, results[pack] = run_packed(tiny_engine, config, pack)
    assert computed  # packed cells restoring above layer 0 skipped the layers below
    reused = tiny_engine.llm.collective_rpc("interp_status")[0]["reused_kv_rows"]
    assert reused > 0  # cells computed no position before their restore: their runs' kept KV stood for them
    assert any(rows < total for rows, total in computed)  # segments' padding is never computed
    core, calls = tiny_engine.llm.llm_engine.engine_core, []
    for name in ("add_request", "get_output"):
        monkeypatch.setattr(core, name, lambda *a, _f=getattr(core, name), _n=name: calls.append(_n) or _f(*a))
    monkeypatch.setattr(tiny_engine, "steps_overlap", lambda: True)
    _, early = run_packed(tiny_engine, config, True)
    cells_submitted = calls[calls.index("add_request", calls.index("get_output")):]  # after stage 0's steps
    last_add = len(cells_submitted) - 1 - cells_submitted[::-1].index("add_request")
    assert cells_submitted.index("get_output") < last_add  # a step ran before the last cells were submitted
    for rid, result in early.items():
        np.testing.assert_allclose(result.score["logprobs"], results[True][rid].score["logprobs"], atol=1e-4, rtol=0)
    n = len(plan.layout.facts[0].corrupt.token_ids)
    assert n > 256  # cells share prefixes of one and two CPU blocks (128 tokens)
    cells = [r.rid for r in plan.requests if r.meta.get("part") == "cell"]
    assert len(cells) == 2 * 2 * 2 * n
    for rid in cells:
        alone, packed = results[False][rid], results[True][rid]
        assert packed.void is None and packed.score is not None
        np.testing.assert_allclose(packed.score["logprobs"], alone.score["logprobs"], atol=1e-4, rtol=0)
        assert packed.score["top_id"] == alone.score["top_id"] and packed.token_ids == alone.token_ids
    late = [rid for rid in cells if results[True][rid].cached_tokens]
    assert late and all(results[True][rid].cached_tokens % 128 == 0 for rid in late)
    ds = {pack: trace_dataset(plan, results[pack]) for pack in results}
    np.testing.assert_allclose(ds[True]["restored_prob"].values, ds[False]["restored_prob"].values, atol=1e-4)
