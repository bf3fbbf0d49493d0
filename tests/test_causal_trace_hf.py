"""Causal tracing against plain HF transformers hooks: the grid on SmolLM2 (packed and unpacked cells), facts the
model gets wrong, and counterfactual prompts (cells restored at aligned positions only, the grid by clean token)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_plan
from interp_runner.kinds.causal_trace.grids import ROLES, trace_dataset
from interp_runner.pipeline import prepare
from interp_runner.sites import site_id
from support import hf_oracle
from test_causal_trace import LAYERS, run_packed, trace_config, write_facts


def hf_trace(path, fact_ids, subject, noise, answer, cells, window=10):
    """Log-probabilities of ``answer`` for each cell (component, layer, token) of one fact, from plain HF forward hooks:
    noise added to the subject's token embeddings, clean states put back at the restored sites."""
    model = hf_oracle.load(str(path))
    ids = torch.tensor([fact_ids])
    layers = model.model.layers
    n = len(fact_ids)
    with torch.no_grad():
        clean = {}
        hooks = []
        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: clean.__setitem__(("resid", i), o.clone())))
            hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: clean.__setitem__(("mlp", i), o.clone())))
            hooks.append(layer.self_attn.register_forward_hook(
                lambda m, a, o, i=i: clean.__setitem__(("attn", i), o[0].clone())))
        model(ids)
        for h in hooks:
            h.remove()

    batch = len(cells) + 1  # the last row: corrupted, nothing restored
    noise_t = torch.zeros(batch, n, noise.shape[-1])
    noise_t[:, subject] = torch.as_tensor(noise)
    restore = {}  # (component, layer) -> list of (row, token)
    for row, (component, layer, token) in enumerate(cells):
        targets = [layer] if component == "resid" else range(max(0, layer - window // 2),
                                                              min(len(layers), layer + window // 2))
        for lay in targets:
            restore.setdefault((component, lay), []).append((row, token))

    def put_back(component, i):
        def hook(module, args, output):
            out = output[0] if component == "attn" else output
            out = out.clone()
            for row, token in restore.get((component, i), []):
                out[row, token] = clean[(component, i)][0, token]
            return (out,) + tuple(output[1:]) if component == "attn" else out
        return hook

    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, o: o + noise_t)]
    for i, layer in enumerate(layers):
        hooks += [layer.register_forward_hook(put_back("resid", i)), layer.mlp.register_forward_hook(put_back("mlp", i)),
                  layer.self_attn.register_forward_hook(put_back("attn", i))]
    try:
        with torch.no_grad():
            logits = model(ids.repeat(batch, 1), logits_to_keep=1).logits[:, -1].double()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits, -1)[:, answer].numpy()
    return lp[:-1], lp[-1]


_HF_TRACES = {}  # (path, fact, subject, noise, answer) -> ({cell: logprob}, corrupted logprob)


def hf_trace_cells(path, fact_ids, subject, noise, answer, cells) -> tuple[dict, float]:
    """``hf_trace`` as ({cell: logprob}, corrupted logprob), computed once per fact and noise: a later call for the
    same or fewer cells reads it back (each batch row is a forward of its own, whatever else the batch holds)."""
    key = (str(path), tuple(fact_ids), tuple(subject), np.asarray(noise, dtype=np.float32).tobytes(), answer)
    known = _HF_TRACES.get(key)
    if known is None or not set(cells) <= known[0].keys():
        lp, corrupt = hf_trace(path, fact_ids, subject, noise, answer, cells)
        known = _HF_TRACES[key] = (dict(zip(cells, lp)), corrupt)
    return known


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True], ids=["cells-alone", "cells-packed"])
def test_trace_grid_matches_hf_hooks(smollm2_engine, smollm2_path, pack):
    # packed on a CPU, each cell's segment is a 128-token block: fewer layers keep it quick
    layers = [0, 11, 29] if pack else LAYERS
    config = trace_config(noise={"samples": 1, "seed": 1}, layers=layers, plots=False)
    plan, results = run_packed(smollm2_engine, config, pack)
    ds = trace_dataset(plan, results)
    layout = plan.layout
    assert not ds["filtered"].any() and ds.attrs["voided"] == []
    for fact in layout.facts:
        f = fact.index
        n = len(fact.clean.token_ids)
        # the oracle over every layer of LAYERS, shared by both grids (the packed one's layers are among them)
        every = [(k, lay, t) for k in layout.components for lay in LAYERS for t in range(n)]
        oracle, want_corrupt = hf_trace_cells(smollm2_path, list(fact.clean.token_ids), list(fact.subject_positions),
                                              ds["noise"].values[f, 0, : len(fact.subject_positions)],
                                              fact.clean.answer_ids[0], every)
        cells = [(k, lay, t) for k in layout.components for lay in layers for t in range(n)]
        want = np.array([oracle[cell] for cell in cells])
        got = np.array([float(ds["restored_logprob_samples"].sel(component=k, layer=lay).values[f, t, 0])
                        for k, lay, t in cells])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert float(ds["corrupt_logprob_samples"].values[f, 0]) == pytest.approx(want_corrupt, abs=1e-4)
        logits, _ = hf_oracle.forward(smollm2_path, list(fact.clean.token_ids))
        clean = float(torch.softmax(logits[-1].double(), -1)[fact.clean.answer_ids[0]])
        assert float(ds["clean_prob"][f]) == pytest.approx(clean, abs=1e-4)
        # corrupting the subject really hurts, and some restore brings the answer back
        assert float(ds["total_effect"][f]) > 0.2
        assert float(np.nanmax(ds["indirect_effect"].values[f])) > 0.5 * float(ds["total_effect"][f])
    # noise floor: the in-batch corrupted runs against the solo ones
    solo, in_batch = (ds[k].values.astype(np.float64) for k in ("corrupt_logprob_samples", "corrupt_logprob_in_batch"))
    assert ds.attrs["noise_floor"] == pytest.approx(float(np.abs(np.exp(in_batch) - np.exp(solo)).max()))
    assert list(ds["role"].values) == list(ROLES)
    assert np.isfinite(ds["avg_indirect_effect"].sel(role="last token").values).all()


@pytest.mark.engine
def test_facts_the_model_gets_wrong_are_filtered_and_listed(tiny_engine):
    plan, results = run_plan(tiny_engine, trace_config("tiny_random", window=2, layers=[0], noise={"samples": 1}))
    ds = trace_dataset(plan, results)
    assert not ds["clean_correct"].any()  # a random model predicts none of the answers
    assert ds["filtered"].all() and ds.attrs["filtered_facts"] == list(ds["fact_id"].values)
    assert not [r for r in plan.requests if r.stage == 1 and r.rid in results]  # their cells never ran
    assert np.isnan(ds["indirect_effect"].values).all()
    assert np.isfinite(ds["clean_prob"].values).all() and np.isfinite(ds["corrupt_prob"].values).all()


def test_counterfactual_cells_restore_aligned_positions_only(tmp_path):
    fact = {"id": "eiffel", "subject": "The Eiffel Tower", "prompt": "The Eiffel Tower is located in the city of",
            "answer": " Paris", "corrupt_prompt": "The Great Wall is located in the city of"}  # 10 vs 9 tokens
    plan = prepare(trace_config(corruption="counterfactual", layers=[2], components=["resid"], num_facts=1,
                                facts=write_facts(tmp_path, [fact]))).plan
    (f,) = plan.layout.facts
    assert f.skipped == (1, 2) and f.corrupt_subject == (1, 2) and plan.skipped == ({"fact": 0, "positions": [1, 2]},)
    cells = [r for r in plan.requests if r.meta.get("part") == "cell"]
    assert sorted(r.meta["token"] for r in cells) == [0, 3, 4, 5, 6, 7, 8]
    assert all(r.prompt.text == fact["corrupt_prompt"] for r in cells)
    # the corrupt run is the counterfactual prompt itself, with no noise; restores read the clean run's positions
    corrupt = next(r for r in plan.requests if r.rid == "f000-corrupt-s0")
    assert corrupt.prompt.text == fact["corrupt_prompt"] and corrupt.payload.patch is None
    last = next(r for r in cells if r.meta["token"] == 8)
    (src,) = last.payload.patch.sources
    assert plan.refs[src] == ("f000-clean", site_id(2, "post_block"), 9)


def test_counterfactual_store_names_the_clean_and_the_corrupt_prompt(tmp_path, smollm2_path):
    """The store's prompt, prompt_tokens and token_text are the clean prompt's (HF's tokenizer here), the corrupt
    prompt's are stored beside them under corrupt_*, and each cell's score lands at the clean token whose states it
    restores (aligned by hand: the common prefix by identity, the common suffix by the length difference)."""
    from transformers import AutoTokenizer

    from interp_runner.engine.results import RequestResult
    from interp_runner.kinds.causal_trace.kind import KIND
    from interp_runner.kinds.causal_trace.figures import token_axis_label, trace_heatmap

    clean_text, corrupt_text = "The Eiffel Tower is located in the city of", "The Great Wall is located in the city of"
    fact = {"id": "eiffel", "subject": "The Eiffel Tower", "prompt": clean_text, "answer": " Paris",
            "corrupt_prompt": corrupt_text}
    prepared = prepare(trace_config(corruption="counterfactual", layers=[2], components=["resid"], num_facts=1,
                                    facts=write_facts(tmp_path, [fact])))
    plan = prepared.plan
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    clean_ids, corrupt_ids = tok(clean_text)["input_ids"], tok(corrupt_text)["input_ids"]
    assert (len(clean_ids), len(corrupt_ids)) == (10, 9)
    prefix = next(i for i, (a, b) in enumerate(zip(clean_ids, corrupt_ids)) if a != b)
    suffix = next(i for i, (a, b) in enumerate(zip(clean_ids[::-1], corrupt_ids[::-1])) if a != b)
    restored_at = [t if t < prefix else t - 1 if t >= len(clean_ids) - suffix else -1 for t in range(10)]
    assert restored_at == [0, -1, -1, -1, 3, 4, 5, 6, 7, 8]
    answer = tok(" Paris", add_special_tokens=False)["input_ids"][0]

    def result(r, lp):
        score = {"logprobs": np.array([lp], np.float32), "top_id": answer, "top_logprob": lp}
        return RequestResult(r.rid, 0, [answer], "", [lp], score=score)

    lp = {"clean": np.log(0.97), "corrupt": np.log(0.25)}
    results = {r.rid: result(r, lp.get(r.meta["part"], -0.01 * (r.meta.get("token", 0) + 1))) for r in plan.requests}
    ds = KIND.dataset(plan, results, 576, prepared.tokenizer)

    assert str(ds["prompt"].values[0]) == clean_text and str(ds["corrupt_prompt"].values[0]) == corrupt_text
    assert ds["prompt_tokens"].values[0].tolist() == clean_ids and int(ds["num_tokens"][0]) == 10
    assert ds["corrupt_prompt_tokens"].values[0].tolist() == corrupt_ids and int(ds["corrupt_num_tokens"][0]) == 9
    assert list(ds["token_text"].values[0]) == [tok.decode([i]) for i in clean_ids]
    assert list(ds["corrupt_token_text"].values[0]) == [tok.decode([i]) for i in corrupt_ids]
    assert ds["restored_at"].values[0].tolist() == restored_at
    # subject span: the clean prompt's "The Eiffel Tower" (tokens 0-3)
    assert (int(ds["subject_start"][0]), int(ds["subject_end"][0])) == (0, 4)
    grid = ds["restored_logprob_samples"].values[0, 0, 0, :, 0]
    for t, at in enumerate(restored_at):
        if at < 0:
            assert np.isnan(grid[t])  # no aligned position: never restored
        else:
            assert grid[t] == pytest.approx(-0.01 * (at + 1))
    assert "clean prompt" in ds["restored_prob"].attrs["token"]

    lines = KIND.summary(ds)
    assert lines[1] == (f"[eiffel] clean {clean_text!r} -> ' Paris': p 0.970; corrupt {corrupt_text!r} -> ' Paris': "
                        "p 0.250")
    main, per_fact = KIND.report_sections(ds, [])
    columns = main.tables[0].columns
    row = dict(zip(columns, main.tables[0].rows[0]))
    assert row["clean prompt"] == clean_text and row["corrupt prompt"] == corrupt_text
    assert f"clean {clean_text!r}" in per_fact.text and f"corrupt {corrupt_text!r}" in per_fact.text
    assert token_axis_label(ds).startswith("clean prompt's tokens")
    assert trace_heatmap(ds, 0, "resid", tmp_path / "h.png").stat().st_size > 0


@pytest.mark.engine
def test_counterfactual_grid_is_by_clean_token_and_matches_hf_hooks(tiny_engine, tiny_path, tmp_path):
    """A counterfactual prompt of another length: the grid's value at clean token p is the corrupt run with the
    clean post_block state of token p put at its aligned corrupt position (plain HF hooks; aligned by hand)."""
    from transformers import AutoTokenizer

    clean_text, corrupt_text = "The Eiffel Tower is located in the city of", "The Great Wall is located in the city of"
    fact = {"id": "eiffel", "subject": "The Eiffel Tower", "prompt": clean_text, "answer": " Paris",
            "corrupt_prompt": corrupt_text}
    config = trace_config("tiny_random", corruption="counterfactual", components=["resid"], layers=[1], window=2,
                          filter=False, num_facts=1, plots=False, facts=write_facts(tmp_path, [fact]))
    plan, results = run_packed(tiny_engine, config, False)
    ds = trace_dataset(plan, results)
    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    clean_ids, corrupt_ids = tok(clean_text)["input_ids"], tok(corrupt_text)["input_ids"]
    answer = tok(" Paris", add_special_tokens=False)["input_ids"][0]
    assert len(clean_ids) != len(corrupt_ids)
    prefix = next(i for i, (a, b) in enumerate(zip(clean_ids, corrupt_ids)) if a != b)
    suffix = next(i for i, (a, b) in enumerate(zip(clean_ids[::-1], corrupt_ids[::-1])) if a != b)
    shift = len(corrupt_ids) - len(clean_ids)
    aligned = {p: p if p < prefix else p + shift for p in range(len(clean_ids))
               if p < prefix or p >= len(clean_ids) - suffix}
    assert ds["prompt_tokens"].values[0].tolist() == clean_ids
    assert ds["corrupt_prompt_tokens"].values[0].tolist() == corrupt_ids
    assert ds["restored_at"].values[0].tolist() == [aligned.get(p, -1) for p in range(len(clean_ids))]

    clean_logits, clean_acts = hf_oracle.forward(tiny_path, clean_ids)
    corrupt_logits, _ = hf_oracle.forward(tiny_path, corrupt_ids)
    for logits, name in ((clean_logits, "clean_prob"), (corrupt_logits, "corrupt_prob")):
        want = float(torch.softmax(logits[-1].double(), -1)[answer])
        assert float(ds[name][0]) == pytest.approx(want, abs=1e-5)
    grid = ds["restored_logprob_samples"].values[0, 0, 0, :, 0]
    for p in range(len(clean_ids)):
        if p not in aligned:
            assert np.isnan(grid[p]), p  # no aligned position in the corrupt prompt: never restored
            continue
        source = np.zeros((len(corrupt_ids), clean_acts[1, "post_block"].shape[-1]), np.float32)
        source[aligned[p]] = clean_acts[1, "post_block"][p]
        logits = hf_oracle.patched_logits(tiny_path, corrupt_ids, {(1, "post_block"): ([aligned[p]], 1.0)},
                                          {(1, "post_block"): source})
        want = float(torch.log_softmax(logits[-1].double(), -1)[answer])
        assert float(grid[p]) == pytest.approx(want, abs=1e-4), p
