"""``interp-serve`` on a MoE model (tiny_qwen3_moe, float32): a request captures the capture-only ``router_logits``
site (rows of one logit per expert) beside a hidden-size hook, at the last prompt token and at every generated one,
against plain HF transformers hooks on the same weights (``hf_gpt_moe_oracle``); steering it is refused with a 400
naming the key. One server for the module. (A dense model's ``router_logits``: ``test_serve``.)"""

from __future__ import annotations

import os

import numpy as np
import pytest

from support import hf_gpt_moe_oracle as family_oracle
from test_serve import API_KEY, free_port, group_ends, http, start_server, stop_server, values_of

pytestmark = pytest.mark.engine

MODEL, LAYERS, EXPERTS, HIDDEN = "tiny_qwen3_moe", 4, 8, 128
PROMPT = "The Eiffel Tower is located in the city of"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    proc = start_server([f"model={MODEL}", "engine.dtype=float32", "engine.block_size=32", "engine.max_num_seqs=8",
                         "serve.sites.capture.hooks=[router_logits,post_block]", "--", "--port", str(port),
                         "--api-key", API_KEY, "--disable-uvicorn-access-log"], port, log)
    yield {"proc": proc, "base": f"http://127.0.0.1:{port}", "log": log}
    stop_server(proc)


def complete(server, interp: dict, max_tokens: int) -> dict:
    status, body = http(server, "POST", "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True, "interp": interp})
    assert status == 200, body
    return body


def test_served_router_logits_match_hf(server):
    """The router's logits at every layer (width = num_experts) and post_block (width = hidden size) at the last
    prompt token (float32), and the router's logits at every generated token (the default float16), as HF's gate
    computes them on the prompt and the tokens the server generated."""
    from transformers import AutoTokenizer

    from interp_runner.models.materialize import model_path

    path = model_path(MODEL)
    ids = AutoTokenizer.from_pretrained(str(path))(PROMPT)["input_ids"]
    body = complete(server, {"capture": {"hooks": ["router_logits", "post_block"], "layers": "all",
                                         "dtype": "float32"}}, 1)
    _, ref = family_oracle.forward(path, ids)
    captures = body["interp"]["captures"]
    assert [(c["hook"], c["layer"]) for c in captures] == \
        [("router_logits", layer) for layer in range(LAYERS)] + [("post_block", layer) for layer in range(LAYERS)]
    for c in captures:
        want = ref[(c["layer"], "router" if c["hook"] == "router_logits" else "post_block")][-1]
        width = EXPERTS if c["hook"] == "router_logits" else HIDDEN
        assert c["positions"] == [len(ids) - 1] and c["shape"] == [1, width] and c["dtype"] == "float32"
        np.testing.assert_allclose(values_of(c)[0], want, atol=1e-4, rtol=0, err_msg=f"{c['hook']} {c['layer']}")

    body = complete(server, {"capture": {"hooks": ["router_logits"], "layers": [0, 3],
                                         "positions": "all_generated"}}, 4)
    generated = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
    assert len(generated) == 4
    _, ref = family_oracle.forward(path, ids + generated[:-1])
    for c in body["interp"]["captures"]:
        assert c["positions"] == list(range(len(ids), len(ids) + 3)) and c["shape"] == [3, EXPERTS]
        assert c["dtype"] == "float16"
        np.testing.assert_allclose(values_of(c).astype(np.float32), ref[(c["layer"], "router")][len(ids):],
                                   atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("interp, key, reason", [
    ({"steering": {"base": {"router_logits": {"layer": 0, "vector": [0.0] * EXPERTS}}}},
     "interp.steering.base.router_logits", "capture-only site"),
    ({"capture": {"hooks": ["mlp_out"], "layers": 0}}, "interp.capture", "not a captured site"),
])
def test_bad_moe_interp_is_400_naming_the_key(server, interp, key, reason):
    status, body = http(server, "POST", "/v1/completions",
                        {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "interp": interp})
    assert status == 400 and body["error"]["param"] == key and reason in body["error"]["message"], body


def test_router_logits_at_dense_layers_are_refused_at_start(tmp_path):
    """Qwen3-MoE layers in ``mlp_only_layers`` have no router: naming them in ``serve.sites.capture`` is refused at
    start naming the layers key, and so is a request for one; a response's bound (``serve.max_capture_bytes``) counts
    router rows at their width. No engine."""
    import json

    from interp_runner.config import ConfigError
    from interp_runner.models.materialize import model_path
    from interp_runner.serve.cli import compose, prepare
    from interp_runner.serve.compile import capture_bytes, compile_interp
    from interp_runner.serve.settings import validate_interp

    source = model_path(MODEL)
    for f in source.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config_json = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "mlp_only_layers": [1]}))
    model = [f"model.path={tmp_path}", "model.name=local", "serve.sites.capture.hooks=[router_logits,post_block]"]
    with pytest.raises(ConfigError) as err:
        prepare(compose(model), [])
    assert err.value.problems[0][0] == "serve.sites.capture.layers" and "[1]" in err.value.problems[0][1]
    prepared = prepare(compose([*model, "serve.sites.capture.layers=[0,2]"]), [])

    def compiled(capture: dict):
        return compile_interp(validate_interp({"capture": capture}), prepared.served, prepared.named,
                              prepared.tokenizer, [], {})

    with pytest.raises(ConfigError) as err:
        compiled({"hooks": ["router_logits"], "layers": 1})
    assert err.value.problems[0][0] == "interp.capture.layers" and "dense MLP" in err.value.problems[0][1]
    both = compiled({"hooks": ["router_logits", "post_block"], "layers": [0, 2], "positions": "all_generated"})
    assert capture_bytes(both, prepared.served.facts, 5) == (2 * EXPERTS + 2 * HIDDEN) * 5 * 2  # float16 rows


def test_a_killed_server_leaves_no_engine_core(server):
    """SIGKILL gives the server no chance to stop its engine core (a process of its own, holding the model): the
    core sees its parent gone and ends (``plugin.parent_watch``). Last: it ends the module's server."""
    proc = server["proc"]
    assert len(os.popen(f"pgrep -g {proc.pid}").read().split()) > 1  # the server and its engine core
    proc.kill()
    proc.wait()
    assert group_ends(proc.pid, within=15)
