"""``interp-serve``: a real server process (vLLM's OpenAI server with the interp plugin) on tiny_random, float32,
driven by the ``openai`` client. One server for the module (its start is the cost); the oracle of values is plain
HF transformers with hooks (``hf_oracle``) and, for batching and prefix caching, the same request run alone."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from support import servers
from support.hf_oracle import forward

pytestmark = pytest.mark.engine

API_KEY = "test-key"
HIDDEN, LAYERS = 128, 4
START_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(*overrides: str) -> list[str]:
    code = "import sys; del sys.path[0]; from interp_runner.serve.cli import main; main()"
    return [sys.executable, "-c", code, *overrides]


def start_server(overrides: list[str], port: int, log, command: list[str] | None = None,
                 env: dict | None = None) -> subprocess.Popen:
    """``interp-serve`` (or ``command``) in a process of its own, once its /health answers."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    name = "the server" if command else "interp-serve"
    proc = servers.track(subprocess.Popen((command or serve_command()) + overrides, stdout=log,
                                          stderr=subprocess.STDOUT, env=env,
                                          cwd=str(Path(__file__).resolve().parent.parent), start_new_session=True))
    deadline = time.time() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"{name} exited {proc.returncode}:\n{log.read()[-4000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.time() > deadline:
                stop_server(proc)
                pytest.fail(f"{name} did not start")
            time.sleep(0.5)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def group_ends(pgid: int, within: float) -> bool:
    """Whether process group ``pgid`` is gone within ``within`` seconds (an orphan is reaped a moment after it ends)."""
    deadline = time.time() + within
    while group_alive(pgid) and time.time() < deadline:
        time.sleep(0.2)
    return not group_alive(pgid)


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Stop a server from ``start_server`` as its user would (SIGTERM), then kill whatever of its process group is
    left (the engine core a killed server leaves behind, 2 GB each, would outlive the test session)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    if group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    servers.untrack(proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_path):
    folder = tmp_path_factory.mktemp("vectors")
    outside = tmp_path_factory.mktemp("outside")
    np.save(outside / "secret.npy", np.ones(HIDDEN, np.float32))
    (folder / "link.npy").symlink_to(outside / "secret.npy")
    np.save(folder / "ok.npy", np.full(HIDDEN, 0.5, np.float32))
    port = free_port()
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    proc = start_server(["model=tiny_random", "engine.dtype=float32", "engine.block_size=32", "engine.max_num_seqs=64",
                         "serve.sites.steer.hooks=[post_block,mlp_out]", f"serve.vector_dirs=[{folder}]",
                         "--", "--port", str(port), "--api-key", API_KEY, "--disable-uvicorn-access-log"], port, log)
    yield {"proc": proc, "base": f"http://127.0.0.1:{port}", "vector_dir": folder, "log": log}
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0)


def http(server, method: str, path: str, body=None, key: str | None = API_KEY, raw: bytes | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(server["base"] + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def values_of(capture: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(capture["data"]), dtype=np.dtype(capture["dtype"]).newbyteorder("<")) \
        .reshape(capture["shape"])


def direction(seed: int, norm: float = 4.0) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(HIDDEN)
    return (v / np.linalg.norm(v) * norm).astype(np.float32).tolist()


# -- values against HF transformers -----------------------------------------------------------------------------


def test_steered_capture_and_score_match_hf(client, tiny_path):
    """Steering at post_block of layer 1 (prompt and generated tokens), the captured last-prompt stream at layers 2
    and 3 and the answer's exact log-probability, against HF forward hooks on the same weights."""
    steered_capture_and_score_match_hf(client, tiny_path)


def test_v2_runner_server_matches_hf(server, tiny_path, tmp_path):
    """``engine.model_runner=v2`` serves on vLLM's V2 model runner (the module's server, ``auto``, on V1 on a CPU,
    as vLLM picks), with the same values against HF hooks; the start-up line names the runner."""
    import openai

    server["log"].seek(0)
    assert "interp ops active on every worker, vLLM's V1 model runner" in server["log"].read()
    port = free_port()
    with open(tmp_path / "server.log", "w+") as log:
        proc = start_server(["model=tiny_random", "engine.dtype=float32", "engine.model_runner=v2",
                             "--", "--port", str(port)], port, log)
        try:
            log.seek(0)
            assert "interp ops active on every worker, vLLM's V2 model runner" in log.read()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            steered_capture_and_score_match_hf(client, tiny_path)
        finally:
            stop_server(proc)


def steered_capture_and_score_match_hf(client, tiny_path) -> None:
    from transformers import AutoTokenizer

    vec = np.asarray(direction(7), np.float32)
    prompt = "The Eiffel Tower is located in the city of"
    r = client.completions.create(
        model="tiny_random", prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
        extra_body={"interp": {"steering": {"base": {"post_block": {"layer": 1, "vector": vec.tolist(), "scale": 2.0}}},
                               "capture": {"layers": [2, 3], "dtype": "float32"}, "answer": " Paris", "foil": " Rome"}})
    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    ids = tok(prompt)["input_ids"]
    logits, acts = forward(tiny_path, ids, {(1, "post_block"): 2.0 * vec})
    result = r.model_extra["interp"]
    assert [(c["hook"], c["layer"], c["positions"]) for c in result["captures"]] == \
        [("post_block", 2, [len(ids) - 1]), ("post_block", 3, [len(ids) - 1])]
    for c in result["captures"]:
        np.testing.assert_allclose(values_of(c)[0], acts[(c["layer"], "post_block")][-1], rtol=1e-4, atol=1e-4)
    lp = torch.log_softmax(logits[-1], -1)
    answer, foil = tok(" Paris", add_special_tokens=False)["input_ids"][0], tok(" Rome", add_special_tokens=False)[
        "input_ids"][0]
    assert result["score"]["answer"]["token_id"] == answer
    assert result["score"]["answer"]["logprob"] == pytest.approx(float(lp[answer]), abs=1e-4)
    assert result["score"]["foil"]["logprob"] == pytest.approx(float(lp[foil]), abs=1e-4)
    assert result["score"]["top"]["token_id"] == int(lp.argmax())
    assert r.choices[0].logprobs.tokens and result["nonfinite"] is False


# -- requests that never reach the engine -------------------------------------------------------------------------


@pytest.mark.parametrize("interp, key, reason", [
    ({"steering": {"base": {"post_block": {"layer": 40, "vector": [0.0] * HIDDEN}}}},
     "interp.steering.base.post_block.layer", "40 out of range, model has 4 layers"),
    ({"steering": {"base": {"post_block": {"layer": 1, "vector": [float("nan")] * HIDDEN}}}},
     "interp.steering.base.post_block.vector.values[0]", "finite"),
    ({"steering": {"base": {"post_block": {"layer": 1, "vector": [1.0] * (HIDDEN + 1)}}}},
     "interp.steering.base.post_block.vector", "model hidden size is 128"),
    ({"steering": {"base": {"post_block": {"layer": 1, "vector": "/etc/passwd.npy"}}}},
     "interp.steering.base.post_block.vector", "cannot name files"),
    ({"steering": {"base": {"attn_out": {"layer": 1, "vector": [0.0] * HIDDEN}}}},
     "interp.steering.attn_out", "not a steered site"),
    ({"capture": {"layers": "all", "hooks": ["pre_attn"]}}, "interp.capture", "not a captured site"),
    ({"capture": {"layers": 1, "hooks": ["post_block", "router_logits"]}}, "interp.capture.hooks[1]",
     "exists in the blocks of MoE families with a router"),
    ({"steering": {"base": {"router_logits": {"layer": 1, "vector": [0.0] * HIDDEN}}}},
     "interp.steering.base.router_logits", "capture-only site"),
    ({"capture": {"layers": 1, "positions": "all_generated"}, "bogus": 1}, "interp.bogus", "unknown key"),
    ({"steering": {"base": {"post_block": {"layer": 1, "vector": {"name": "nobody"}}}}},
     "interp.steering.base.post_block.vector", "no vector named 'nobody'"),
    ({"answer": " the quick brown fox"}, "interp.answer", "scoring needs one"),
    ({"steering": {"base": {"post_block": {"layer": 1, "vector": [1e38] * HIDDEN, "scale": 10.0}}}},
     "interp.steering.base.post_block.scale", "float32"),
])
def test_bad_interp_is_400_naming_the_key(server, interp, key, reason):
    """Sent as JSON allows it (NaN included); the engine never sees the request."""
    status, body = http(server, "POST", "/v1/completions",
                        {"model": "tiny_random", "prompt": "Hi", "max_tokens": 2, "interp": interp})
    assert status == 400 and body["error"]["param"] == key and reason in body["error"]["message"], body
    assert body["error"]["message"].startswith(key + ":")


def test_bad_interp_through_the_openai_client(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny_random", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={"interp": {"steering": {"base": {"post_block": {"layer": 40, "vector": [0.0] * HIDDEN}}}}})
    assert err.value.body["message"] == "interp.steering.base.post_block.layer: 40 out of range, model has 4 layers"


def test_malformed_json_and_oversized_bodies(server):
    status, body = http(server, "POST", "/v1/completions", raw=b'{"model": "tiny_random", "prompt": ')
    assert status == 400, body
    big = {"model": "tiny_random", "prompt": "x", "interp": {"steering": {"base": {"post_block": {
        "layer": 1, "vector": [0.0] * (5 << 20)}}}}}
    status, body = http(server, "POST", "/v1/completions", big)
    assert status == 413 and "serve.max_body_bytes" in body["error"]["message"]
    status, body = http(server, "POST", "/v1/completions", {"model": "tiny_random", "prompt": "x", "interp": {
        "capture": {"layers": "all", "positions": "all_generated"}}})
    assert status == 400 and body["error"]["param"] == "interp.capture.positions"


# -- batching and prefix caching ----------------------------------------------------------------------------------


def _mix(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    # long shared prefixes (several 32-token blocks): prefix caching is tempted across interventions
    stem = "In a quiet village by the sea there lived an old fisherman who told stories every evening " * 2
    prompts = [stem + tail for tail in ("and the children", "and the birds", "while the moon", "as waves")]
    steerings = [None, {"base": {"post_block": {"layer": 1, "vector": direction(1)}}},
                 {"prefill": {"mlp_out": {"layer": "0:2", "vector": direction(2), "scale": -1.0}}},
                 {"decode": {"post_block": {"layer": 3, "vector": {"random": {"seed": 3, "norm": 6.0}}}}}]
    requests = []
    for _ in range(n):
        interp = {}
        steering = rng.choice(steerings)
        if steering is not None:
            interp["steering"] = steering
        positions = rng.choice([None, "last_prompt", "all_generated"])
        if positions is not None:
            interp["capture"] = {"layers": [0, 3], "dtype": "float32", "positions": positions}
        requests.append({"prompt": rng.choice(prompts), "max_tokens": 3, "interp": interp or None})
    return requests


async def _complete(aclient, request: dict, model: str = "tiny_random"):
    extra = {"interp": request["interp"]} if request["interp"] is not None else None
    r = await aclient.completions.create(model=model, prompt=request["prompt"],
                                         max_tokens=request["max_tokens"], temperature=0, logprobs=1, extra_body=extra)
    return r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs, r.model_extra.get("interp")


def test_concurrent_mix_equals_each_alone(server):
    """200 requests at once, a random mix of steering (every tier), capture and none over prompts sharing long
    prefixes: each gives what it gives alone (tokens, log-probabilities, captured values), so steered rows never
    leak into unsteered ones and no KV is shared across different interventions."""
    import openai

    requests = _mix(200)
    distinct = {json.dumps(r, sort_keys=True): r for r in requests}

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0)
        together = await asyncio.gather(*(_complete(aclient, r) for r in requests))
        alone = {key: await _complete(aclient, r) for key, r in distinct.items()}  # one at a time
        await aclient.close()
        return together, alone

    together, alone = asyncio.run(run())
    for request, (tokens, logprobs, result) in zip(requests, together):
        tokens1, logprobs1, result1 = alone[json.dumps(request, sort_keys=True)]
        assert tokens == tokens1, request
        np.testing.assert_allclose(logprobs, logprobs1, atol=1e-4)
        capture = (request["interp"] or {}).get("capture")
        assert (result is not None) == (request["interp"] is not None)
        if capture:
            rows = 1 if capture["positions"] == "last_prompt" else request["max_tokens"] - 1
            for c, c1 in zip(result["captures"], result1["captures"], strict=True):
                assert c["positions"] == c1["positions"] and len(c["positions"]) == rows
                np.testing.assert_allclose(values_of(c), values_of(c1), rtol=1e-4, atol=1e-4)
    # the mix really steers: the same prompt's tokens differ between steerings
    by_prompt = {}
    for request, (tokens, _, _) in zip(requests, together):
        steering = json.dumps((request["interp"] or {}).get("steering"), sort_keys=True)
        by_prompt.setdefault(request["prompt"], {})[steering] = tuple(tokens)
    assert any(len(set(v.values())) > 1 for v in by_prompt.values())


def test_stream_and_disconnect_mid_stream(server, client):
    """A streamed chat request gets its results in a last event (no choices) before [DONE]; a client that drops a
    stream mid-way leaves the server serving."""
    stream = client.chat.completions.create(
        model="tiny_random", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        extra_body={"interp": {"capture": {"layers": 1, "positions": "all_generated", "dtype": "float32"}}})
    chunks = list(stream)
    last = chunks[-1].model_extra["interp"]
    # the generated tokens fed back through the model: all but the last
    assert chunks[-1].choices == [] and values_of(last["captures"][0]).shape == (2, HIDDEN)
    stream = client.completions.create(
        model="tiny_random", prompt="Once upon a time", max_tokens=1000, stream=True, temperature=0,
        extra_body={"interp": {"capture": {"layers": "all", "positions": "all_generated"},
                               "steering": {"base": {"post_block": {"layer": 2, "vector": direction(5)}}}}})
    next(iter(stream))
    stream.close()
    deadline = time.time() + 20
    while running(server) > 0:  # vLLM aborts the request when its client is gone
        assert time.time() < deadline, "the dropped request still runs"
        time.sleep(0.2)
    r = client.completions.create(model="tiny_random", prompt="Once upon a time", max_tokens=2,
                                  extra_body={"interp": {"capture": {"layers": 0}}})
    assert len(r.model_extra["interp"]["captures"]) == 1


def metric(server, name: str) -> float:
    """The server's ``name`` on its /metrics page, summed over its labels."""
    text = urllib.request.urlopen(server["base"] + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


def running(server) -> float:
    return metric(server, "vllm:num_requests_running")


def test_results_come_with_the_last_output_or_by_read_back(server, client):
    """A request the engine core finishes carries its results in its last output (``interp_carried_results_total`` on
    vLLM's own /metrics page), with no read-back. One with stop strings, which the API server's detokenizer may end,
    is read back: one observation of ``interp_collect_seconds`` a call, its requests counted. A request without an
    interp object does neither, and no response shows the output's ``kv_transfer_params``."""
    names = ("interp_carried_results_total", "interp_collect_seconds_count", "interp_collected_requests_total",
             "interp_collect_seconds_sum")
    carried, calls, requests, seconds = (metric(server, name) for name in names)
    capture = {"interp": {"capture": {"layers": 0}}}
    for stop in (None, None, None, ["never in the text"]):
        r = client.completions.create(model="tiny_random", prompt="Once upon a time", max_tokens=2, stop=stop,
                                      extra_body=capture)
        assert len(r.model_extra["interp"]["captures"]) == 1 and not r.model_extra.get("kv_transfer_params")
    r = client.chat.completions.create(model="tiny_random", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, extra_body=capture)
    assert len(r.model_extra["interp"]["captures"]) == 1 and not r.model_extra.get("kv_transfer_params")
    client.completions.create(model="tiny_random", prompt="Once upon a time", max_tokens=2)
    assert metric(server, "interp_carried_results_total") == carried + 4
    assert metric(server, "interp_collect_seconds_count") == calls + 1
    assert metric(server, "interp_collected_requests_total") == requests + 1
    assert metric(server, "interp_collect_seconds_sum") > seconds


# -- named vectors ------------------------------------------------------------------------------------------------


def _npy(vec) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(vec, np.float32))
    return base64.b64encode(buffer.getvalue()).decode()


def test_vector_uploads(server, client, tmp_path):
    from safetensors.numpy import save

    from interp_runner.vectors.control import write_gguf

    write_gguf(tmp_path / "cv.gguf", {1: np.full(HIDDEN, 0.25, np.float32), 2: np.zeros(HIDDEN, np.float32)}, "llama")
    uploads = {
        "inline": {"values": direction(11)},
        "npy": {"npy": _npy(direction(12))},
        "st": {"safetensors": base64.b64encode(save({"a": np.ones(HIDDEN, np.float32),
                                                     "b": np.zeros(HIDDEN, np.float32)})).decode(), "key": "a"},
        "cv": {"gguf": base64.b64encode((tmp_path / "cv.gguf").read_bytes()).decode(), "layer": 1},
        "fromdir": {"file": "ok.npy"},
    }
    for name, source in uploads.items():
        status, body = http(server, "POST", "/v1/interp/vectors", {"name": name, **source})
        assert status == 201, (name, body)
    status, listing = http(server, "GET", "/v1/interp/vectors")
    norms = {v["name"]: v["norm"] for v in listing["data"]}
    assert norms["cv"] == pytest.approx(0.25 * HIDDEN ** 0.5) and norms["st"] == pytest.approx(HIDDEN ** 0.5)
    assert norms["fromdir"] == pytest.approx(0.5 * HIDDEN ** 0.5)
    refused = [({"name": "x", "file": "link.npy"}, "file"), ({"name": "x", "file": "../outside/secret.npy"}, "file"),
               ({"name": "x", "file": "/etc/passwd"}, "file"), ({"name": "inline", "values": direction(1)}, "replace"),
               ({"name": "x", "npy": "not base64!"}, "npy"), ({"name": "x", "values": [1.0] * 3}, "values"),
               ({"name": "x", "st": 1}, "st")]
    for upload, key in refused:
        status, body = http(server, "POST", "/v1/interp/vectors", upload)
        assert status in (400, 409) and body["error"]["param"] == key, (upload, body)
    pickled = base64.b64encode(b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (128,), }"
                               .ljust(128, b" ") + b"\n").decode()
    status, body = http(server, "POST", "/v1/interp/vectors", {"name": "x", "npy": pickled})
    assert status == 400
    r = client.completions.create(model="tiny_random", prompt="Hello", max_tokens=2, temperature=0,
                                  extra_body={"interp": {"steering": {"base": {"post_block": {"layer": 1,
                                                                                             "vector": "cv"}}}}})
    same = client.completions.create(model="tiny_random", prompt="Hello", max_tokens=2, temperature=0,
                                     extra_body={"interp": {"steering": {"base": {"post_block": {
                                         "layer": 1, "vector": [0.25] * HIDDEN}}}}})
    assert r.choices[0].text == same.choices[0].text


def test_replace_and_delete_while_in_flight(server):
    """Requests in flight keep the values they started with when their vector is replaced, then deleted."""
    import openai

    old, new = direction(21, 8.0), direction(22, 8.0)
    assert http(server, "POST", "/v1/interp/vectors", {"name": "moving", "values": old})[0] == 201
    capture = {"layers": [1, 3], "positions": "all_generated", "dtype": "float32"}

    def request(vector):
        return {"prompt": "Once upon a time", "max_tokens": 24, "interp": {
            "steering": {"base": {"post_block": {"layer": 0, "vector": vector}}}, "capture": capture}}

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0)
        flying = [asyncio.create_task(_complete(aclient, request("moving"))) for _ in range(8)]
        await asyncio.sleep(0.05)
        status, _ = await asyncio.to_thread(http, server, "POST", "/v1/interp/vectors",
                                            {"name": "moving", "values": new, "replace": True})
        after = await _complete(aclient, request("moving"))
        deleted = await asyncio.to_thread(http, server, "DELETE", "/v1/interp/vectors/moving")
        results = await asyncio.gather(*flying)
        with_old, with_new = await _complete(aclient, request(old)), await _complete(aclient, request(new))
        await aclient.close()
        return status, after, deleted, results, with_old, with_new

    status, after, deleted, results, with_old, with_new = asyncio.run(run())
    assert status == 200 and deleted[0] == 200
    assert after[0] == with_new[0] and with_old[0] != with_new[0]
    for tokens, _, result in results:  # each started before the replacement (or right after: then all new)
        reference = with_old if tokens == with_old[0] else with_new
        assert tokens == reference[0]
        np.testing.assert_allclose(values_of(result["captures"][1]), values_of(reference[2]["captures"][1]),
                                   rtol=1e-4, atol=1e-4)
    assert any(tokens == with_old[0] for tokens, _, _ in results)
    assert http(server, "DELETE", "/v1/interp/vectors/moving")[0] == 404


def test_api_key_guards_interp_routes(server):
    for method, path, body in (("GET", "/v1/interp/vectors", None), ("DELETE", "/v1/interp/vectors/x", None),
                               ("POST", "/v1/interp/vectors", {"name": "y", "values": direction(1)}),
                               ("POST", "/v1/completions", {"model": "tiny_random", "prompt": "x",
                                                            "interp": {"bogus": 1}})):
        assert http(server, method, path, body, key=None)[0] == 401
        assert http(server, method, path, body, key="wrong")[0] == 401
    assert http(server, "GET", "/v1/interp/vectors")[0] == 200


def test_sigterm_shuts_down_with_exit_0(server):
    """Exit 0, and no process the server started (vLLM's engine core among them) outlives it."""
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert group_ends(proc.pid, within=10)
