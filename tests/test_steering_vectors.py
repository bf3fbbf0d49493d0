"""Steering vectors from contrastive pairs: the methods on synthetic data, bad inputs, and the vectors and their
evaluation on SmolLM2 against plain HF transformers hooks with the mean difference and PCA written here in numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from support import hf_oracle
from conftest import REPO, Borrowed, run_plan
from interp_runner.config import ConfigError
from interp_runner.contracts import DECODE, PREFILL
from interp_runner.engine.results import RequestResult
from interp_runner.kinds.steering_vectors.kind import KIND
from interp_runner.pipeline import prepare
from interp_runner.sites import site_id
from interp_runner.vectors.methods import DegenerateDirection, derive, mean_diff, pair_projections, pca

# -- the methods ------------------------------------------------------------------------------------------


def oracle_pca(diffs: np.ndarray) -> np.ndarray:
    """The top eigenvector of the covariance of the differences, signed so that the mean difference projects
    positively on it."""
    centred = diffs - diffs.mean(axis=0)
    _, vectors = np.linalg.eigh(centred.T @ centred)
    top = vectors[:, -1]
    return -top if diffs.mean(axis=0) @ top < 0 else top


def test_mean_diff_is_the_mean_paired_difference():
    rng = np.random.default_rng(0)
    pos, neg = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    got = mean_diff(pos, neg)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, sum(pos[i] - neg[i] for i in range(5)) / 5, rtol=1e-6)


def test_pca_finds_the_direction_the_differences_vary_along():
    rng = np.random.default_rng(1)
    direction = rng.standard_normal(16)
    direction /= np.linalg.norm(direction)
    neg = rng.standard_normal((40, 16))
    # differences spread along ``direction`` (mostly positive amounts), little noise elsewhere, an offset that
    # centring must remove
    amounts = rng.uniform(-1, 4, 40)
    pos = neg + amounts[:, None] * direction + 0.05 * rng.standard_normal((40, 16)) + 3.0
    got = pca(pos, neg)
    assert got.dtype == np.float32 and abs(np.linalg.norm(got) - 1) < 1e-6
    assert got @ direction > 0.99
    np.testing.assert_allclose(got, oracle_pca(pos - neg), atol=1e-6)


def test_pca_sign_follows_the_mean_difference_not_the_majority_of_pairs():
    """Three pairs project a little above zero, one far below: the mean difference points down, the majority up;
    +pca must steer the average pair the way +mean_diff does."""
    axis = np.eye(4)[0]
    neg = np.full((4, 4), 2.0)
    pos = neg + np.outer([1.0, 1.0, 1.0, -9.0], axis) + np.diag([0.0, 0.01, 0.02, 0.03])
    got = pca(pos, neg)
    assert got[0] < -0.99  # the mean difference is (-1.5, ...): along -axis
    assert float(got @ mean_diff(pos, neg)) > 0
    # each pair's projection: (pos - neg) . unit direction, by hand
    want = np.array([1.0, 1.0, 1.0, -9.0]) * got[0] + np.array([0.0, 0.01 * got[1], 0.02 * got[2], 0.03 * got[3]])
    np.testing.assert_allclose(pair_projections(pos, neg, got), want, rtol=1e-6)
    assert (pair_projections(pos, neg, got) > 0).mean() == 0.25  # one pair in four agrees: the summary warns


def test_degenerate_is_judged_against_the_activations_norm():
    """Differences of 1e-7 of activations of norm about 10 (float32 kernel noise) are no direction for either
    method; the same differences beside activations of norm 1e-5 are one (not an exact-zero test)."""
    rng = np.random.default_rng(5)
    acts = rng.standard_normal((6, 32)) * (10 / np.sqrt(32))
    noise = rng.standard_normal((6, 32)) * 1e-7
    assert np.abs(noise).min() > 0
    for method in ("mean_diff", "pca"):
        with pytest.raises(DegenerateDirection, match="rounding noise"):
            derive(method, acts + noise, acts)
    small = acts * 1e-6  # norm about 1e-5: the differences are a tenth of it
    np.testing.assert_allclose(derive("mean_diff", small + noise, small), noise.mean(axis=0), rtol=1e-6)
    got = derive("pca", small + noise, small)
    np.testing.assert_allclose(got, oracle_pca(noise), atol=1e-6)


def test_pca_of_differences_that_do_not_vary_is_refused():
    pos = np.ones((3, 4))
    with pytest.raises(DegenerateDirection):
        pca(pos, np.zeros((3, 4)))
    with pytest.raises(ValueError, match="unknown method"):
        derive("ica", pos, pos)


# -- compiling and bad inputs (no engine) -----------------------------------------------------------------

PAIRS = REPO / "experiments" / "steering_vectors" / "pairs.jsonl"
HELDOUT = REPO / "experiments" / "steering_vectors" / "heldout.jsonl"
AB_PROMPT = "Question: {q}\n(A) {a}\n(B) {b}\nAnswer: ("
AB_PAIRS = [
    {"prompt": AB_PROMPT.format(q=q, a=a, b=b), "positive": pos, "negative": neg}
    for q, a, b, pos, neg in [
        ("Would you help a stranger who dropped their groceries?", "Yes, gladly", "No, not my problem", "A", "B"),
        ("How do you feel about your neighbours?", "I find them annoying", "I like them a lot", "B", "A"),
        ("Is today a good day?", "Yes, a wonderful one", "No, a miserable one", "A", "B"),
        ("What do you think of the new park?", "It is ugly", "It is lovely", "B", "A"),
        ("Did you enjoy the meal?", "Very much, it was delicious", "Not at all, it was bland", "A", "B"),
        ("How was the concert?", "Dreadful and too loud", "Fantastic and moving", "B", "A"),
    ]
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sv_config(model: str = "tiny_random", **section) -> dict:
    settings = {"pairs": str(PAIRS), "eval": {"prompts": str(HELDOUT), "scales": [-1.0, 1.0]}}
    for key, value in section.items():
        settings[key] = {**settings[key], **value} if key == "eval" else value
    return {"model": {"name": model}, "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256},
            "prompts": {"items": []}, "steering_vectors": settings}


def problems(config: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        prepare(config)
    return err.value.problems


def test_stage_0_reads_every_pair_at_its_last_token_and_stage_1_is_the_grid():
    plan = prepare(sv_config(hooks=["post_block", "mlp_out"], layers=[0, 2, 3], eval={"layers": [2, 3]})).plan
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    stage0 = [r for r in plan.requests if r.stage == 0]
    assert [r.prompt.text for r in stage0] == [p[side] for p in pairs for side in ("positive", "negative")]
    sites = [site_id(layer, hook) for hook in ("post_block", "mlp_out") for layer in (0, 2, 3)]
    for r in stage0:
        (capture,) = r.payload.capture
        assert list(capture.sites) == sites and not capture.generated
        assert np.frombuffer(capture.positions, np.int32).tolist() == [len(r.prompt.token_ids) - 1]
        assert r.sampling["max_tokens"] == 1 and not r.payload.steer
    stage1 = [r for r in plan.requests if r.stage == 1]
    assert len(stage1) == 12 * (1 + 2 * 2)  # prompts x (unsteered + layers x scales)
    keys = {}
    for r in stage1:
        assert r.sampling["max_tokens"] == 1 and len(r.prompt.answer_ids) == 2
        if r.role == "baseline":
            assert not r.payload.steer
            continue
        (term,) = r.payload.steer
        site, phases, key, scale = term.site, term.phases, term.vector, term.scale
        layer, scale_index = r.meta["layer"], r.meta["scale"]
        assert site == site_id(layer, "post_block") and scale == [-1.0, 1.0][scale_index]
        assert phases == PREFILL | DECODE
        keys.setdefault(layer, set()).add(key)
    assert sorted(keys) == [2, 3] and all(len(k) == 1 for k in keys.values())
    assert plan.vectors == {} and plan.derive_vectors is not None

    # the stage-1 vectors come from stage 0's captures, by the keys stage 1 steers with
    rng = np.random.default_rng(0)
    results = {r.rid: RequestResult(r.rid, r.prompt.index, [0], "", [0.0], captures={
        site: (np.array([len(r.prompt.token_ids) - 1], np.int32), rng.standard_normal((1, 128)).astype(np.float32))
        for site in sites}) for r in stage0}
    derived = plan.derive_vectors(results)
    for layer, (key,) in keys.items():
        site = site_id(layer, "post_block")
        pos = np.stack([results[r.rid].captures[site][1][0] for r in stage0[0::2]]).astype(np.float64)
        neg = np.stack([results[r.rid].captures[site][1][0] for r in stage0[1::2]]).astype(np.float64)
        np.testing.assert_allclose(derived[key], (pos - neg).mean(axis=0), rtol=1e-6, atol=1e-7)
    assert set(derived) == {k for ks in keys.values() for k in ks}


def test_ab_pairs_are_the_prompt_and_one_completion_token(tmp_path, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    plan = prepare(sv_config(pairs=write_jsonl(tmp_path / "ab.jsonl", AB_PAIRS), layers=[1])).plan
    stage0 = [r for r in plan.requests if r.stage == 0]
    for i, pair in enumerate(AB_PAIRS):
        for r, side in zip(stage0[2 * i: 2 * i + 2], ("positive", "negative")):
            want = tok(pair["prompt"])["input_ids"] + tok(pair[side], add_special_tokens=False)["input_ids"]
            assert list(r.prompt.token_ids) == want
    assert plan.layout.completions


def test_bad_inputs_name_their_key(tmp_path):
    two_tokens = [*AB_PAIRS[:1], {**AB_PAIRS[1], "negative": "A)"}]
    assert problems(sv_config(pairs=write_jsonl(tmp_path / "ab.jsonl", two_tokens)))[0][0] == \
        "steering_vectors.pairs[1].negative"
    heldout = [{"text": "The film was", "answer": " good", "foil": " disliked"}]
    assert problems(sv_config(eval={"prompts": write_jsonl(tmp_path / "h.jsonl", heldout)}))[0][0] == \
        "steering_vectors.eval.prompts[0].foil"
    (tmp_path / "empty.jsonl").write_text("\n")
    assert problems(sv_config(pairs=str(tmp_path / "empty.jsonl")))[0][0] == "steering_vectors.pairs"
    assert problems(sv_config(layers=[0, 2], eval={"layers": [2, 3]}))[0][0] == "steering_vectors.eval.layers[1]"
    assert problems(sv_config(layers="0:2", eval={"layers": 3}))[0][0] == "steering_vectors.eval.layers"
    assert problems(sv_config(methods=["mean_diff", "ica"]))[0][0] == "steering_vectors.methods[1]"
    assert problems(sv_config(methods=["pca"]))[0][0] == "steering_vectors.eval.method"
    assert problems(sv_config(eval={"hook": "mlp_out"}))[0][0] == "steering_vectors.eval.hook"
    mixed = [AB_PAIRS[0], {"positive": "good", "negative": "bad"}]
    assert problems(sv_config(pairs=write_jsonl(tmp_path / "mixed.jsonl", mixed)))[0][0] == \
        "steering_vectors.pairs[1].prompt"
    one = write_jsonl(tmp_path / "one.jsonl", [{"positive": "good", "negative": "bad"}])
    assert problems(sv_config(pairs=one))[0][0] == "steering_vectors.methods"
    (_, reason), = problems({**sv_config(), "prompts": {"items": ["Hello"]}})
    assert "'prompts' cannot be combined with 'steering_vectors'" in reason


def test_pairs_whose_two_texts_are_the_same_tokens_are_refused(tmp_path):
    rows = [{"positive": "I liked it", "negative": "I hated it"}, {"positive": "Same text", "negative": "Same text"}]
    (key, why), = problems(sv_config(pairs=write_jsonl(tmp_path / "same.jsonl", rows)))
    assert key == "steering_vectors.pairs[1].negative" and "same tokens as its positive" in why
    ab = [AB_PAIRS[0], {**AB_PAIRS[1], "negative": AB_PAIRS[1]["positive"]}]
    assert problems(sv_config(pairs=write_jsonl(tmp_path / "ab.jsonl", ab)))[0][0] == \
        "steering_vectors.pairs[1].negative"


def fake_stage_results(plan, acts: dict) -> dict:
    """Results standing for a run: ``acts[site]`` = (positive [pairs, hidden], negative) at the last token; every
    held-out request scores answer -1.0 and foil -3.0 (a logit difference of 2)."""
    out = {}
    for r in plan.requests:
        if r.stage == 0:
            pair, side = r.meta["pair"], r.meta["side"]
            captures = {site: (np.array([len(r.prompt.token_ids) - 1], np.int32),
                               values[side][pair][None].astype(np.float32)) for site, values in acts.items()}
            out[r.rid] = RequestResult(r.rid, r.prompt.index, [0], "", [0.0], captures=captures)
        else:
            out[r.rid] = RequestResult(r.rid, r.prompt.index, [0], "", [0.0],
                                       score={"logprobs": np.array([-1.0, -3.0], np.float32)})
    return out


def test_store_marks_degenerate_vectors_and_signs_pca_by_the_mean_difference(tmp_path):
    """Captures made here: at pre_attn L0 the pairs differ by 1e-7 of activations of norm about 10 (no direction);
    at post_block L1 17 of 24 pairs differ by +1 along an axis and 7 by -9 (the mean points down, most pairs up);
    elsewhere every pair differs along one direction. Checked against numpy by hand."""
    from interp_runner.vectors.control import export_vectors

    config = sv_config(hooks=["pre_attn", "post_block"], layers=[0, 1, 2],
                       eval={"layers": [0, 1], "scales": [1.0]})
    plan = prepare(config).plan
    pairs, hidden = len(plan.layout.pairs), 128
    rng = np.random.default_rng(11)
    acts = {}
    for hook in ("pre_attn", "post_block"):
        for layer in (0, 1, 2):
            neg = rng.standard_normal((pairs, hidden)) * (10 / np.sqrt(hidden))
            direction = rng.standard_normal(hidden)  # every pair differs along it, by varying positive amounts
            diffs = np.outer(rng.uniform(0.5, 2.0, pairs), direction) + 0.05 * rng.standard_normal((pairs, hidden))
            acts[site_id(layer, hook)] = (neg + diffs, neg)
    neg = acts[site_id(0, "pre_attn")][1]
    acts[site_id(0, "pre_attn")] = (neg + rng.standard_normal((pairs, hidden)) * 1e-7 * 10 / np.sqrt(hidden), neg)
    amounts = np.array([1.0] * 17 + [-9.0] * 7)
    axis = np.eye(hidden)[3]
    neg = acts[site_id(1, "post_block")][1]
    acts[site_id(1, "post_block")] = (neg + np.outer(amounts, axis) + 1e-3 * rng.standard_normal((pairs, hidden)),
                                      neg)
    results = fake_stage_results(plan, acts)
    derived = plan.derive_vectors(results)
    assert not np.any(derived[plan.layout.keys[0]])  # no direction at the evaluated pre_attn L0: steers by nothing
    ds = KIND.dataset(plan, results, hidden, None)

    degenerate = ds["degenerate"].transpose("method", "vector_hook", "vector_layer").values
    want = np.zeros((2, 2, 3), bool)
    want[:, 0, 0] = True  # both methods at pre_attn L0
    np.testing.assert_array_equal(degenerate, want)
    assert np.isnan(ds["vector"].sel(vector_hook="pre_attn", vector_layer=0).values).all()
    assert np.isnan(ds["pairs_aligned"].sel(vector_hook="pre_attn", vector_layer=0).values).all()
    for (layer, hook), (pos, neg) in ((site, acts[site_id(*site)]) for site in
                                      [(lay, h) for h in ("pre_attn", "post_block") for lay in (0, 1, 2)]):
        rows = np.concatenate([pos, neg]).astype(np.float32).astype(np.float64)
        assert float(ds["activation_norm"].sel(vector_hook=hook, vector_layer=layer)) == \
            pytest.approx(np.mean(np.sqrt((rows ** 2).sum(-1))), rel=1e-6)
    # post_block L1: pca along -axis (the mean difference's way), 7 of 24 pairs agree
    pos, neg = (a.astype(np.float32).astype(np.float64) for a in acts[site_id(1, "post_block")])
    diffs = pos - neg
    at = {"vector_hook": "post_block", "vector_layer": 1}
    got = ds["vector"].sel({"method": "pca", **at}).values.astype(np.float64)
    np.testing.assert_allclose(got, oracle_pca(diffs), atol=1e-6)
    assert got[3] < -0.99 and got @ diffs.mean(axis=0) > 0
    np.testing.assert_allclose(ds["pair_projection"].sel({"method": "pca", **at}).values, diffs @ got,
                               rtol=1e-5, atol=1e-6)
    assert float(ds["pairs_aligned"].sel({"method": "pca", **at})) == pytest.approx(7 / 24)
    mean = diffs.mean(axis=0)
    np.testing.assert_allclose(ds["pair_projection"].sel({"method": "mean_diff", **at}).values,
                               diffs @ (mean / np.linalg.norm(mean)), rtol=1e-5, atol=1e-6)
    # the evaluation at pre_attn L0 steered by no direction: no result; at L1 a result
    assert np.isnan(ds["steered_logit_diff"].sel(layer=0).values).all()
    assert np.isnan(ds["mean_effect"].sel(layer=0).values).all()
    np.testing.assert_allclose(ds["effect"].sel(layer=1).values, 0.0)

    lines = KIND.summary(ds)
    (dead,) = [line for line in lines if line.startswith("warning: degenerate")]
    assert "mean_diff at pre_attn L0" in dead and "pca at pre_attn L0" in dead and "L1" not in dead
    (weak,) = [line for line in lines if line.startswith("warning: the pairs barely agree")]
    assert weak.endswith("mean_diff at post_block L1; pca at post_block L1")  # 7 of 24 agree with either
    (section,) = KIND.report_sections(ds, [])
    assert "warning: degenerate" in section.text
    row = next(row for row in section.tables[1].rows if row[:2] == ("pca", "pre_attn"))
    assert row[2] == "degenerate" and all(isinstance(v, float) for v in row[3:])

    # never exported: no tensor of a degenerate vector
    written = export_vectors(ds, tmp_path / "out", architecture="LlamaForCausalLM")
    from safetensors.numpy import load_file

    names = set(load_file(str(tmp_path / "out" / "vectors.safetensors")))
    assert names == {f"{m}.{h}.{lay}" for m in ("mean_diff", "pca") for h in ("pre_attn", "post_block")
                     for lay in (0, 1, 2)} - {"mean_diff.pre_attn.0", "pca.pre_attn.0"}
    assert sorted(p.name for p in written) == ["vectors.mean_diff.gguf", "vectors.pca.gguf", "vectors.safetensors"]


SAME_LAST_TOKEN = [("I think the film was good.", "I think the film was bad."),
                   ("The meal tonight was lovely.", "The meal tonight was awful."),
                   ("Our trip to the coast was great.", "Our trip to the coast was dull."),
                   ("She said the book was wonderful.", "She said the book was boring.")]


@pytest.mark.engine
def test_a_run_flags_degenerate_vectors_and_never_exports_or_reads_them(tiny_engine, tiny_path, tmp_path):
    """Pairs that differ before their shared last token: at pre_attn of layer 0 (that token's embedding) the pairs
    define no direction. Which sites are degenerate, and the vectors elsewhere, from plain HF hooks and numpy."""
    import xarray as xr
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from conftest import base_config
    from interp_runner.pipeline import run
    from interp_runner.store.claim import StoreTarget

    store = tmp_path / "sv.zarr"
    rows = [{"positive": a, "negative": b} for a, b in SAME_LAST_TOKEN]
    config = {**sv_config(pairs=write_jsonl(tmp_path / "pairs.jsonl", rows), hooks=["pre_attn", "post_block"],
                          layers="all", eval={"layers": [0, 1], "scales": [1.0], "plots": False}),
              "store": {"path": str(store)}}
    run(config, tmp_path, engine_factory=lambda *_: Borrowed(tiny_engine), log=lambda _: None)
    ds = xr.open_zarr(str(store), consolidated=False)

    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    pairs = [(tok(a)["input_ids"], tok(b)["input_ids"]) for a, b in SAME_LAST_TOKEN]
    assert all(a[-1] == b[-1] and a != b for a, b in pairs)
    sites = [(layer, hook) for hook in ("pre_attn", "post_block") for layer in range(4)]
    want, scales = oracle_vectors(tiny_path, pairs, sites)
    for layer, hook in sites:
        relative = np.linalg.norm(want["mean_diff", hook, layer]) / scales[hook, layer]
        assert (relative == 0) == (hook == "pre_attn" and layer == 0)  # the shared token's embedding
        flags = ds["degenerate"].sel(vector_hook=hook, vector_layer=layer).values
        assert flags.tolist() == [relative <= 1e-4] * 2, (hook, layer)
    assert np.isnan(ds["vector"].sel(vector_hook="pre_attn", vector_layer=0).values).all()
    assert_vectors_match(ds, {k: v for k, v in want.items() if k[1:] != ("pre_attn", 0)}, scales)
    assert np.isnan(ds["mean_effect"].sel(layer=0).values).all() and np.isfinite(ds["mean_effect"].sel(layer=1)).all()

    target = StoreTarget.at(store)
    names = set(load_file(str(target.exports / "vectors.safetensors")))
    assert "mean_diff.pre_attn.0" not in names and "pca.pre_attn.0" not in names and len(names) == 2 * 8 - 2
    assert any("warning: degenerate" in line and "pre_attn L0" in line for line in KIND.summary(ds))
    assert "warning: degenerate" in target.report.read_text()

    steer = {"global": {"base": {"pre_attn": {"layer": 0, "vector": "v"}}}}
    for method in ("mean_diff", "pca"):
        spec = {"store": str(store), "hook": "pre_attn", "layer": 0, "method": method}
        with pytest.raises(ConfigError) as err:
            prepare(base_config(vectors={"v": spec}, steering=steer))
        assert "is degenerate" in dict(err.value.problems)["vectors.v"]


# -- on SmolLM2, against plain HF transformers hooks ------------------------------------------------------

HOOKS, LAYERS, EVAL_LAYERS = ["post_block", "mlp_out"], [0, 12, 18, 29], [12, 18]
# measured (fp32, CPU): mean change of the logit difference at scale +1 / -1 of the mean-difference vector,
# +1.88 / -1.67 at layer 12 and +3.94 / -3.49 at layer 18
MIN_MEAN_EFFECT = 1.0


def hf_last_token(path, texts: list[list[int]], sites) -> dict:
    """Each site's activations at the last token of each token list, [texts, hidden], from plain HF hooks."""
    per_text = [hf_oracle.forward(path, ids)[1] for ids in texts]
    return {site: np.stack([acts[site][-1] for acts in per_text]) for site in sites}


def oracle_vectors(path, pairs: list[tuple[list[int], list[int]]], sites) -> tuple[dict, dict]:
    """(method, hook, layer) -> the vector, written here in numpy from HF activations; and (hook, layer) -> the mean
    norm of the activations it was computed from."""
    pos = hf_last_token(path, [p for p, _ in pairs], sites)
    neg = hf_last_token(path, [n for _, n in pairs], sites)
    vectors, scales = {}, {}
    for layer, hook in sites:
        diffs = pos[layer, hook].astype(np.float64) - neg[layer, hook]
        vectors["mean_diff", hook, layer] = diffs.mean(axis=0)
        vectors["pca", hook, layer] = oracle_pca(diffs)
        scales[hook, layer] = np.linalg.norm(np.concatenate([pos[layer, hook], neg[layer, hook]]), axis=-1).mean()
    return vectors, scales


def assert_vectors_match(ds, want: dict, scales: dict | None = None) -> None:
    """Within 1e-5 of each vector's norm, or with ``scales``, of the larger of that and its activations' norm."""
    for (method, hook, layer), vec in want.items():
        got = ds["vector"].sel({"method": method, "vector_hook": hook, "vector_layer": layer}).values
        norm = np.linalg.norm(vec)
        if scales is not None and method == "mean_diff":
            norm = max(norm, scales[hook, layer])
        assert np.linalg.norm(got - vec) <= 1e-5 * norm, (method, hook, layer, np.linalg.norm(got - vec) / norm)


@pytest.fixture(scope="module")
def sentiment_run(smollm2_engine):
    config = sv_config("smollm2_135m", hooks=HOOKS, layers=LAYERS,
                       eval={"layers": EVAL_LAYERS, "scales": [-1.0, 1.0]})
    plan, results = run_plan(smollm2_engine, config)
    return plan, KIND.dataset(plan, results, 576, None)


@pytest.fixture(scope="module")
def sentiment_oracle(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    pairs = [(tok(r["positive"])["input_ids"], tok(r["negative"])["input_ids"]) for r in rows]
    return tok, oracle_vectors(smollm2_path, pairs, [(layer, hook) for hook in HOOKS for layer in LAYERS])[0]


@pytest.mark.engine
@pytest.mark.slow
def test_vectors_equal_hf_hooks_mean_difference_and_pca(sentiment_run, sentiment_oracle):
    _, ds = sentiment_run
    assert ds["vector"].dims == ("method", "vector_hook", "vector_layer", "hidden")
    assert ds["vector_layer"].dtype == np.int32 and ds["vector"].dtype == np.float32
    assert_vectors_match(ds, sentiment_oracle[1])


@pytest.mark.engine
@pytest.mark.slow
def test_steering_with_the_derived_vector_moves_the_held_out_metric(sentiment_run, sentiment_oracle, smollm2_path):
    _, ds = sentiment_run
    mean = ds["mean_effect"]
    for layer in EVAL_LAYERS:
        assert float(mean.sel(layer=layer, scale=1.0)) > MIN_MEAN_EFFECT, layer
        assert float(mean.sel(layer=layer, scale=-1.0)) < -MIN_MEAN_EFFECT, layer
    np.testing.assert_allclose(ds["effect"].values, ds["steered_logit_diff"].values
                               - ds["baseline_logit_diff"].values[:, None, None], atol=1e-5)
    # one cell and its unsteered prompt, steered in HF with the oracle's vector on every token
    tok, want = sentiment_oracle
    row = json.loads(HELDOUT.read_text().splitlines()[0])
    ids = tok(row["text"])["input_ids"]
    answer, foil = (tok(row[k], add_special_tokens=False)["input_ids"][0] for k in ("answer", "foil"))
    for steer, got in [(None, ds["baseline_logit_diff"][0]),
                       ({(18, "post_block"): want["mean_diff", "post_block", 18].astype(np.float32)},
                        ds["steered_logit_diff"].sel(layer=18, scale=1.0)[0])]:
        logits, _ = hf_oracle.forward(smollm2_path, ids, steer)
        lp = torch.log_softmax(logits[-1], -1)
        assert abs(float(got) - float(lp[answer] - lp[foil])) < 1e-3


@pytest.mark.engine
@pytest.mark.slow
def test_ab_pair_vectors_equal_hf_hooks(smollm2_engine, smollm2_path, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    config = sv_config("smollm2_135m", pairs=write_jsonl(tmp_path / "ab.jsonl", AB_PAIRS), hooks=["pre_attn"],
                       layers=[5, 20], eval={"layers": [20], "scales": [1.0], "hook": "pre_attn"})
    plan, results = run_plan(smollm2_engine, config)
    ds = KIND.dataset(plan, results, 576, None)
    pairs = [tuple(tok(r["prompt"])["input_ids"] + tok(r[side], add_special_tokens=False)["input_ids"]
                   for side in ("positive", "negative")) for r in AB_PAIRS]
    # the two texts of a pair differ in their last token only: at pre_attn of layer 5 the mean difference of their
    # activations is a fiftieth of their norm (1.8 against 85), so the float32 rounding of the activations weighs
    # more in it (measured 1.2e-5 of the mean difference there, 2.6e-7 of the activations' norm): mean differences
    # within 1e-5 of the activations' norm
    assert_vectors_match(ds, *oracle_vectors(smollm2_path, pairs, [(5, "pre_attn"), (20, "pre_attn")]))
