"""Qwen3-MoE's capture-only ``router_logits`` site (``interp_runner.sites``) against plain HF transformers hooks
(``hf_gpt_moe_oracle``): the router's logits in the compiled engine under both model runners, and the experts each
token chose with their weights as the store derives them; layers without a router are refused by name. (Steering,
patching or a dense model's router are refused before any engine starts: ``test_bad_inputs``.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from support import hf_gpt_moe_oracle as family_oracle
from conftest import MODEL_RUNNERS, base_config, build_engine, rel_err, run_plan, through_buffer_and_direct
from interp_runner.config import ConfigError
from interp_runner.models.materialize import model_path
from interp_runner.pipeline import prepare
from interp_runner.sites import site_id

PROMPTS = ["The Eiffel Tower is located in the city of", "Hello, my name is", "1 2 3 4 5"]
LAYERS = 4


def config(prompts=PROMPTS, **parts) -> dict:
    return base_config("tiny_qwen3_moe", prompts={"items": prompts}, sampling={"max_tokens": 3}, **parts)


def test_router_logits_at_a_dense_layer_of_a_moe_model_are_refused(tmp_path):
    """Qwen3-MoE layers in ``mlp_only_layers`` have a dense MLP: no router there, so capturing its logits is
    refused naming the layers key (the routed layers compile, with the model's routing)."""
    folder = tmp_path / "moe"
    folder.mkdir()
    source = model_path("tiny_qwen3_moe")
    for f in source.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config_json = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config_json, "mlp_only_layers": [1]}))
    routed = {**config(), "model": {"name": "local", "path": str(folder)}}
    with pytest.raises(ConfigError) as err:
        prepare({**routed, "capture": [{"hooks": ["router_logits"], "layers": "0:3"}]})
    assert err.value.problems[0][0] == "capture[0].layers" and "[1]" in err.value.problems[0][1]
    plan = prepare({**routed, "capture": [{"hooks": ["router_logits"], "layers": [0, 2]}]}).plan
    assert plan.captures[0].routing.dense_layers == (1,) and plan.captures[0].routing.renormalize
    assert plan.engine_spec.capture_sites == (site_id(0, "router_logits"), site_id(2, "router_logits"))


CAPTURE = [{"name": "route", "hooks": ["router_logits"], "layers": "all", "positions": "all"},
           {"name": "acts", "hooks": ["mlp_out"], "layers": [2], "positions": "all_prompt"}]


def router_sites() -> tuple[int, ...]:
    """Every layer's router_logits and mlp_out sites."""
    return tuple(sorted(site_id(layer, hook) for layer in range(LAYERS) for hook in ("mlp_out", "router_logits")))


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("model_runner", MODEL_RUNNERS)
def test_compiled_router_logits_and_routing_match_hf(model_runner):
    """Qwen3-MoE's ``router_logits`` site under torch.compile, on each model runner (``check_router_logits``);
    a step whose captured rows overflow the capture buffer copies the same rows and values out directly."""
    engine = build_engine(model_path("tiny_qwen3_moe"), (), router_sites(), enforce_eager=False,
                          model_runner=model_runner)
    try:
        assert engine.model_runner == model_runner
        check_router_logits(engine)
        # a step whose rows exceed the capture buffer copies them out directly: router rows beside hidden-size ones
        through_buffer, direct = through_buffer_and_direct(
            lambda: run_plan(engine, config(capture=CAPTURE), skip_reading_prefix_cache=True)[1])
    finally:
        engine.close()
    for rid, a in through_buffer.items():
        assert a.captures.keys() == direct[rid].captures.keys() and len(a.captures) == LAYERS + 1
        for site, (positions, values) in a.captures.items():
            np.testing.assert_array_equal(positions, direct[rid].captures[site][0])
            np.testing.assert_array_equal(values, direct[rid].captures[site][1])


def check_router_logits(engine) -> None:
    """On a compiled engine with ``router_sites``: the router's logits at every layer, prompt and generated
    position (beside an mlp_out capture), and the store's chosen experts and their weights, as HF's gate computes
    them and HF's routing chooses from them (softmax, top 2, renormalized)."""
    from vllm.config import CompilationMode

    from interp_runner.store.result_arrays import capture_arrays

    assert engine.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    path = model_path("tiny_qwen3_moe")
    plan, results = run_plan(engine, config(capture=CAPTURE))
    pairs = [(request, results[request.rid]) for request in plan.requests]
    route = plan.captures[0]
    assert route.routing is not None and (route.routing.num_experts, route.routing.top_k) == (8, 2)
    stored = capture_arrays(route, pairs, 128)
    assert stored["route"].dims[-1] == "expert" and stored["route"].shape[-1] == 8
    checked_ids = 0
    for i, (request, result) in enumerate(pairs):
        ids = list(request.prompt.token_ids) + result.token_ids[:-1]  # every position the engine computed
        _, ref = family_oracle.forward(path, ids)
        positions, mlp_out = result.captures[site_id(2, "mlp_out")]
        assert rel_err(mlp_out, ref[(2, "mlp_out")][: len(request.prompt.token_ids)]) <= 1e-4
        for layer in range(LAYERS):
            want = ref[(layer, "router")]
            positions, got = result.captures[site_id(layer, "router_logits")]
            assert positions.tolist() == list(range(len(ids))) and got.shape == (len(ids), 8)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"request {i} layer {layer}")
            np.testing.assert_allclose(stored["route"].values[i, 0, layer, : len(ids)], want, atol=1e-4, rtol=0)
            experts, weights = family_oracle.routing(want, 2, True)
            got_ids = stored["route_topk_ids"].values[i, 0, layer, : len(ids)]
            got_weights = stored["route_topk_weights"].values[i, 0, layer, : len(ids)]
            ordered = np.sort(want, -1)[:, ::-1]
            clear = (ordered[:, 0] - ordered[:, 1] > 1e-3) & (ordered[:, 1] - ordered[:, 2] > 1e-3)
            np.testing.assert_array_equal(got_ids[clear], experts[clear])
            np.testing.assert_allclose(got_weights, weights, atol=1e-4, rtol=0)
            checked_ids += int(clear.sum())
    assert checked_ids > 0.9 * sum(LAYERS * (len(r.prompt.token_ids) + len(res.token_ids) - 1) for r, res in pairs)
