"""The zarr store without an engine: a real plan on tiny_random, hand-made results, the real writer.

Checks the named dimensions, where each captured value lands, padding, string variables, the provenance
manifest in the root attributes and the status life cycle (running -> complete, or failed with the error).
"""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr

from conftest import FakeEngineBase, base_config
from interp_runner.store import provenance
from interp_runner.engine.results import RequestResult
from interp_runner.kinds.prompts import KIND as PROMPTS
from interp_runner.pipeline import prepare, run
from interp_runner.sites import site_id
from interp_runner.store.writer import (
    STATUS_COMPLETE,
    STATUS_FAILED,
    STATUS_RUNNING,
    mark,
    open_store,
    write_results,
)
from interp_runner.store.claim import StoreTarget

HIDDEN = 128
HOOKS = ["mlp_out", "post_block"]
LAYERS = [1, 3]
NUM_GENERATED = [4, 2, 3]  # per prompt; prompt 2 is not captured by "acts"
TOP_K = 3

# every key the manifest documents (interp_runner/store/provenance.py and README "The store")
MANIFEST_KEYS = {
    "config_yaml", "config_sha256", "command", "overrides", "experiment", "package", "versions", "model",
    "seeds", "requests_sha256", "plugin", "host", "started_at", "run_key", "experiments_dir",
}


def store_config(**overrides) -> dict:
    return base_config(
        prompts={"items": ["The Eiffel Tower is located in the city of", "Hello, my name is", "One two"]},
        sampling={"max_tokens": 4, "logprobs": TOP_K, "seed": 7},
        steering={"global": {"base": {"post_block": {"layer": 0, "vector": {"random": {"seed": 0, "norm": 1.0}}}}}},
        capture=[
            {"name": "acts", "hooks": HOOKS, "layers": LAYERS, "positions": "all", "prompts": [0, 1]},
            {"name": "last", "hooks": ["pre_attn"], "layers": 2, "positions": "last_prompt", "dtype": "float16"},
        ],
        **overrides,
    )


@pytest.fixture(scope="module")
def prepared():
    return prepare(store_config())


def fake_results(plan, seed: int = 0) -> tuple[list[RequestResult], dict]:
    """Results as the engine would return them, plus the captured values by (prompt, capture, site)."""
    rng = np.random.default_rng(seed)
    results, truth = [], {}
    for req, n_gen in zip(plan.requests, NUM_GENERATED):
        n = len(req.prompt.token_ids)
        tokens = [int(t) for t in rng.integers(0, 1000, n_gen)]
        top = [[(int(t), float(-rng.random())) for t in rng.integers(0, 1000, TOP_K)] for _ in range(n_gen)]
        captures = {}
        for layout in plan.captures:
            if req.prompt.index not in layout.prompt_indices:
                continue
            if layout.name == "acts":  # every prompt position, then the generated tokens fed back (all but last)
                positions = np.arange(n + n_gen - 1, dtype=np.int32)
            else:
                positions = np.array([n - 1], dtype=np.int32)
            for hook in layout.hooks:
                for layer in layout.layers:
                    site = site_id(layer, hook)
                    values = rng.standard_normal((len(positions), HIDDEN)).astype(np.float32)
                    captures[site] = (positions, values)
                    truth[(req.prompt.index, layout.name, site)] = (positions, values)
        results.append(
            RequestResult(
                rid=req.rid,
                prompt_index=req.prompt.index,
                token_ids=tokens,
                text=f"generated text {req.prompt.index} é",
                logprobs=[float(-rng.random()) for _ in tokens],
                top_logprobs=top,
                captures=captures,
            )
        )
    return results, truth


def make_manifest(prepared, config: dict) -> dict:
    return provenance.manifest(
        config, prepared.cfg, prepared.facts, prepared.plan, ["+experiment=x", "sampling.seed=7"], provenance.now()
    )


@pytest.fixture(scope="module")
def written(prepared, tmp_path_factory):
    """A store written the way the pipeline writes it, with the status seen at each step."""
    path = tmp_path_factory.mktemp("store") / "results.zarr"
    config = store_config()
    manifest = make_manifest(prepared, config)
    results, truth = fake_results(prepared.plan)
    statuses = []
    open_store(path, manifest)
    statuses.append(dict(zarr.open_group(str(path), mode="r").attrs)["status"])
    # the engine hands results back in completion order, not prompt order
    write_results(path, PROMPTS.dataset(prepared.plan, {r.rid: r for r in results[::-1]}, HIDDEN))
    statuses.append(dict(zarr.open_group(str(path), mode="r").attrs)["status"])
    mark(path, STATUS_COMPLETE, finished_at=provenance.now())
    statuses.append(dict(zarr.open_group(str(path), mode="r").attrs)["status"])
    return path, manifest, results, truth, statuses


def test_dims_and_shapes(written, prepared):
    path, *_ = written
    ds = xr.open_zarr(str(path), consolidated=False)
    assert ds["acts"].dims == ("request", "acts_hook", "acts_layer", "acts_slot", "hidden")
    n_prompt = [len(r.prompt.token_ids) for r in prepared.plan.requests]
    width = max(n + g - 1 for n, g in zip(n_prompt[:2], NUM_GENERATED[:2]))
    assert ds["acts"].shape == (3, len(HOOKS), len(LAYERS), width, HIDDEN)
    assert ds["acts_position"].dims == ("request", "acts_slot")
    assert ds["last"].dims == ("request", "last_hook", "last_layer", "last_slot", "hidden")
    assert ds["last"].shape == (3, 1, 1, 1, HIDDEN)
    assert ds["prompt_tokens"].dims == ("request", "prompt_position")
    assert ds["tokens"].dims == ds["logprob"].dims == ("request", "generated")
    assert ds["top_token_ids"].dims == ds["top_logprob"].dims == ("request", "generated", "top_k")
    assert ds.sizes["generated"] == max(NUM_GENERATED) and ds.sizes["top_k"] == TOP_K
    assert [int(x) for x in ds["acts_layer"].values] == LAYERS
    assert list(ds["acts_hook"].values) == HOOKS
    assert list(ds["prompt_len"].values) == n_prompt
    assert list(ds["num_generated"].values) == NUM_GENERATED


def test_captured_values_land_at_their_slots(written, prepared):
    path, _, _, truth, _ = written
    ds = xr.open_zarr(str(path), consolidated=False).load()
    acts, pos = ds["acts"].values, ds["acts_position"].values
    for (index, name, site), (positions, values) in truth.items():
        if name != "acts":
            continue
        layer, hook = site // 5, ["pre_attn", "attn_out", "post_attn", "mlp_out", "post_block"][site % 5]
        h, l = HOOKS.index(hook), LAYERS.index(layer)
        used = pos[index] >= 0
        assert list(pos[index][used]) == list(positions)
        np.testing.assert_array_equal(acts[index, h, l, : len(positions)], values)
        # label-based selection agrees
        sel = ds["acts"].sel(acts_hook=hook, acts_layer=layer).isel(request=index).values
        np.testing.assert_array_equal(sel[: len(positions)], values)
    # a generated position is among them: position prompt_len (the first generated token fed back)
    n0 = len(prepared.plan.requests[0].prompt.token_ids)
    assert n0 in pos[0] and pos[0].max() == n0 + NUM_GENERATED[0] - 2


def test_padding_is_nan_and_minus_one(written, prepared):
    path, *_ = written
    ds = xr.open_zarr(str(path), consolidated=False).load()
    n_prompt = [len(r.prompt.token_ids) for r in prepared.plan.requests]
    acts, pos = ds["acts"].values, ds["acts_position"].values
    for i in range(2):
        used = n_prompt[i] + NUM_GENERATED[i] - 1
        assert (pos[i, used:] == -1).all() and (pos[i, :used] >= 0).all()
        assert np.isfinite(acts[i, :, :, :used]).all() and np.isnan(acts[i, :, :, used:]).all()
    # prompt 2 is outside the capture's prompts: all padding
    assert (pos[2] == -1).all() and np.isnan(acts[2]).all()
    assert pos.dtype == np.int32
    tokens, logprob = ds["tokens"].values, ds["logprob"].values
    top_ids, top_lp = ds["top_token_ids"].values, ds["top_logprob"].values
    prompt_tokens = ds["prompt_tokens"].values
    for i, (n, g) in enumerate(zip(n_prompt, NUM_GENERATED)):
        assert (tokens[i, g:] == -1).all() and (tokens[i, :g] >= 0).all()
        assert np.isnan(logprob[i, g:]).all() and np.isfinite(logprob[i, :g]).all()
        assert (top_ids[i, g:] == -1).all() and np.isnan(top_lp[i, g:]).all()
        assert (prompt_tokens[i, n:] == -1).all()
        assert list(prompt_tokens[i, :n]) == list(prepared.plan.requests[i].prompt.token_ids)


def test_scalar_results_in_prompt_order(written):
    path, _, results, _, _ = written
    ds = xr.open_zarr(str(path), consolidated=False).load()
    for i, r in enumerate(results):  # results were written in reverse order
        g = len(r.token_ids)
        assert list(ds["tokens"].values[i, :g]) == r.token_ids
        np.testing.assert_allclose(ds["logprob"].values[i, :g], r.logprobs, rtol=1e-6)
        assert [list(x) for x in ds["top_token_ids"].values[i, :g]] == [[t for t, _ in s] for s in r.top_logprobs]
        np.testing.assert_allclose(
            ds["top_logprob"].values[i, :g], [[lp for _, lp in s] for s in r.top_logprobs], rtol=1e-6
        )
        assert ds["text"].values[i] == r.text


def test_strings_come_back_as_str(written, prepared):
    path, *_ = written
    ds = xr.open_zarr(str(path), consolidated=False).load()
    for name in ("text", "request", "prompt_id", "prompt", "acts_hook"):
        values = list(ds[name].values)
        assert values and all(type(v) is str for v in values), (name, [type(v) for v in values])
    assert list(ds["request"].values) == [r.rid for r in prepared.plan.requests]
    assert list(ds["prompt"].values) == [r.prompt.text for r in prepared.plan.requests]
    assert list(ds["prompt_id"].values) == ["p0", "p1", "p2"]
    assert ds["text"].values[0] == "generated text 0 é"


def test_capture_dtype(written, prepared):
    path, _, _, truth, _ = written
    ds = xr.open_zarr(str(path), consolidated=False).load()
    assert ds["acts"].attrs["stored_dtype"] == "float32" and ds["acts"].dtype == np.float32
    assert ds["last"].attrs["stored_dtype"] == "float16" and ds["last"].dtype == np.float16
    site = site_id(2, "pre_attn")
    for i in range(3):
        positions, values = truth[(i, "last", site)]
        assert list(ds["last_position"].values[i]) == list(positions)
        np.testing.assert_array_equal(ds["last"].values[i, 0, 0, 0], values[0].astype(np.float16))


def test_manifest_survives_results_and_status_goes_running_to_complete(written, prepared):
    path, manifest, _, _, statuses = written
    assert statuses == [STATUS_RUNNING, STATUS_RUNNING, STATUS_COMPLETE]
    attrs = dict(zarr.open_group(str(path), mode="r").attrs)
    assert MANIFEST_KEYS <= set(attrs), MANIFEST_KEYS - set(attrs)
    assert "finished_at" in attrs
    for key in MANIFEST_KEYS:
        assert attrs[key] == manifest[key], key
    # the same attributes through xarray
    ds = xr.open_zarr(str(path), consolidated=False)
    assert ds.attrs["requests_sha256"] == prepared.plan.requests_sha256 and ds.attrs["status"] == STATUS_COMPLETE

    assert attrs["config_yaml"] == provenance.config_yaml(store_config())
    import hashlib

    assert attrs["config_sha256"] == hashlib.sha256(attrs["config_yaml"].encode()).hexdigest()
    assert attrs["overrides"] == ["+experiment=x", "sampling.seed=7"]
    assert isinstance(attrs["command"], list)
    assert attrs["experiment"] == {"name": "adhoc", "version": 1}
    assert {"version", "git_sha", "git_dirty"} <= set(attrs["package"])
    assert attrs["package"]["version"] == "0.1.0"
    assert {"python", "vllm", "torch", "transformers", "zarr", "xarray", "numpy"} <= set(attrs["versions"])
    assert all(isinstance(v, str) and v for v in attrs["versions"].values())
    model = attrs["model"]
    assert {"path", "weights_sha256", "dtype"} <= set(model)
    assert model["path"] == prepared.facts.path and model["dtype"] == "float32"
    assert len(model["weights_sha256"]) == 64 and model["weights_sha256"] == prepared.facts.weights_sha256
    assert model["num_layers"] == 4 and model["hidden_size"] == HIDDEN
    assert attrs["seeds"] == {"sampling": 7, "engine": 0}
    assert attrs["requests_sha256"] == prepared.plan.requests_sha256
    assert attrs["plugin"]["fingerprint"]
    assert attrs["plugin"]["steer_sites"] == list(prepared.plan.engine_spec.steer_sites) == [site_id(0, "post_block")]
    assert attrs["plugin"]["capture_sites"] == list(prepared.plan.engine_spec.capture_sites)
    assert {"hostname", "platform", "gpus"} <= set(attrs["host"])
    assert attrs["started_at"] <= attrs["finished_at"]


def test_open_store_never_replaces_a_store(tmp_path, prepared):
    path = tmp_path / "r.zarr"
    manifest = make_manifest(prepared, store_config())
    results, _ = fake_results(prepared.plan)
    open_store(path, manifest)
    write_results(path, PROMPTS.dataset(prepared.plan, {r.rid: r for r in results}, HIDDEN))
    mark(path, STATUS_COMPLETE)
    with pytest.raises(Exception, match="already contains data"):
        open_store(path, manifest)
    assert dict(zarr.open_group(str(path), mode="r").attrs)["status"] == STATUS_COMPLETE
    assert len(list(zarr.open_group(str(path), mode="r").array_keys())) > 5


def test_results_written_again_replace_an_earlier_attempts(tmp_path, prepared):
    """A resumed run whose figures failed after its arrays were written writes them again: they replace the
    earlier ones, and the manifest stays."""
    path = tmp_path / "r.zarr"
    manifest = make_manifest(prepared, store_config())
    results, _ = fake_results(prepared.plan)
    open_store(path, manifest)
    first = PROMPTS.dataset(prepared.plan, {r.rid: r for r in results}, HIDDEN)
    write_results(path, first.assign(extra=first["num_generated"] * 0))
    write_results(path, first)
    again = xr.open_zarr(str(path), consolidated=False)
    assert "extra" not in again and again.attrs["requests_sha256"] == manifest["requests_sha256"]
    xr.testing.assert_identical(again.drop_attrs().load(), first.drop_attrs())


class FailingEngine:
    def __init__(self, model_path, engine_cfg, spec):
        raise RuntimeError("engine exploded: out of fake memory")


def test_a_run_that_fails_before_any_unit_leaves_nothing(tmp_path):
    store = tmp_path / "failed.zarr"
    config = base_config(store={"path": str(store)}, capture=[{"hooks": ["post_block"], "layers": 1}])
    with pytest.raises(RuntimeError, match="engine exploded"):
        run(config, tmp_path / "run", overrides=["store.path=x"], engine_factory=FailingEngine, log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no store, no unfinished run, no lock
    assert not (tmp_path / "run").exists()


def test_engine_failure_mid_run_keeps_the_unfinished_run_marked_failed(tmp_path):
    store = tmp_path / "failed.zarr"
    staged = StoreTarget.at(store).staged
    config = store_config(store={"path": str(store), "unit_requests": 1})
    results = {r.rid: r for r in fake_results(prepare(config).plan)[0]}

    class DiesInSecondUnit(FakeEngineBase):
        def run(self, requests, vectors=None, use_tqdm=True, **_):
            assert dict(zarr.open_group(str(staged), mode="r").attrs)["status"] == STATUS_RUNNING
            if requests[0].rid != prepare(config).plan.requests[0].rid:
                raise KeyboardInterrupt()
            return {r.rid: results[r.rid] for r in requests}

    logged = []
    with pytest.raises(KeyboardInterrupt):
        run(config, tmp_path, engine_factory=DiesInSecondUnit, log=logged.append)
    attrs = dict(zarr.open_group(str(staged), mode="r").attrs)
    assert attrs["status"] == STATUS_FAILED and "KeyboardInterrupt" in attrs["error"] and "finished_at" in attrs
    assert MANIFEST_KEYS <= set(attrs)
    assert not store.exists() and any("resume=true continues it" in line for line in logged)


def test_pipeline_with_fake_engine_completes(tmp_path):
    store = tmp_path / "ok.zarr"
    config = store_config(store={"path": str(store)})
    seen = {}

    class FakeEngine(FakeEngineBase):
        def __init__(self, model_path, engine_cfg, spec):
            seen["spec"] = spec

        def run(self, requests, vectors=None, use_tqdm=True, **_):
            seen["status"] = dict(zarr.open_group(str(StoreTarget.at(store).staged), mode="r").attrs)["status"]
            seen["published"] = store.exists()
            return {r.rid: r for r in fake_results(prepare(config).plan)[0]}

    assert run(config, tmp_path / "run", engine_factory=FakeEngine, log=lambda _: None) == store
    assert seen["status"] == STATUS_RUNNING and not seen["published"]
    # the store and its report; the unfinished run and the lock are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.zarr", "ok.zarr.report.html"]
    attrs = dict(zarr.open_group(str(store), mode="r").attrs)
    assert attrs["status"] == STATUS_COMPLETE and "error" not in attrs
    assert attrs["engine"].items() >= {"dtype": "float32", "plugin_status": {"loaded": True}, "reused": False,
                                       "intervention_checksums": [], "builds_in_process": 1,
                                       "runs_in_process": 1}.items()
    assert MANIFEST_KEYS <= set(attrs)
    ds = xr.open_zarr(str(store), consolidated=False)
    assert ds.sizes["request"] == 3 and ds["acts"].shape[:3] == (3, 2, 2)


def test_config_error_writes_no_store(tmp_path):
    from interp_runner.config import ConfigError

    store = tmp_path / "never.zarr"
    config = base_config(store={"path": str(store)}, capture=[{"hooks": ["post_block"], "layers": [9]}])
    with pytest.raises(ConfigError) as err:
        run(config, tmp_path, engine_factory=FailingEngine, log=lambda _: None)
    assert err.value.problems == [("capture[0].layers[0]", "9 out of range, model has 4 layers")]
    assert not store.exists()
