"""``interp-serve`` on a CUDA GPU as production serves: compiled, with CUDA graphs, SmolLM2. The oracles are plain HF
transformers hooks and stock ``vllm serve`` of the same model and settings, side by side on the same GPU."""

from __future__ import annotations

import asyncio
import signal
import sys

import numpy as np
import pytest
import torch

from support.hf_oracle import forward
from test_serve import _complete, free_port, metric, start_server, stop_server, values_of

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

SETTINGS = {"dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 64, "gpu_memory_utilization": 0.3}


def test_gpu_compiled_server_matches_hf(tmp_path, smollm2_path):
    """On a GPU the server compiles and captures CUDA graphs with the served sites: a steered request's captured
    stream and answer score still match HF hooks (bfloat16 tolerance), concurrent requests equal each alone."""
    import openai
    from transformers import AutoTokenizer

    port = free_port()
    with open(tmp_path / "server.log", "w+") as log:
        proc = start_server(["model=smollm2_135m", "engine.dtype=float32", "engine.enforce_eager=false",
                             "engine.gpu_memory_utilization=0.3",
                             "--", "--port", str(port)], port, log)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            hidden = 576
            vec = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
            prompt = "The Eiffel Tower is located in the city of"
            interp = {"steering": {"base": {"post_block": {"layer": 10, "vector": vec.tolist(), "scale": 0.5}}},
                      "capture": {"layers": [20], "dtype": "float32"}, "answer": " Paris"}
            r = client.completions.create(model="smollm2_135m", prompt=prompt, max_tokens=1, temperature=0,
                                          extra_body={"interp": interp})
            ids = AutoTokenizer.from_pretrained(str(smollm2_path))(prompt)["input_ids"]
            logits, acts = forward(smollm2_path, ids, {(10, "post_block"): 0.5 * vec})
            result = r.model_extra["interp"]
            got, want = values_of(result["captures"][0])[0], acts[(20, "post_block")][-1]
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03
            lp = torch.log_softmax(logits[-1], -1)
            assert abs(result["score"]["answer"]["logprob"] - float(lp[result["score"]["answer"]["token_id"]])) < 0.1

            async def both():
                aclient = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
                requests = [{"prompt": prompt, "max_tokens": 8, "interp": interp if i % 2 else None}
                            for i in range(32)]
                together = await asyncio.gather(*(_complete(aclient, q, "smollm2_135m") for q in requests))
                alone = [await _complete(aclient, q, "smollm2_135m") for q in requests[:2]]
                await aclient.close()
                return together, alone

            together, alone = asyncio.run(both())
            assert all(t[0] == alone[i % 2][0] for i, t in enumerate(together))
            server = {"base": f"http://127.0.0.1:{port}"}  # every steered request's results came with its last output
            assert metric(server, "interp_carried_results_total") == 1 + 16 + 1
            assert metric(server, "interp_collected_requests_total") == 0
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
        finally:
            stop_server(proc)


def test_gpu_unsteered_requests_equal_stock_vllm_serve_bit_for_bit(tmp_path, smollm2_path):
    """Under vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``), compiled with CUDA graphs in bfloat16:
    unsteered requests that interp-serve runs in batches beside steered ones give stock ``vllm serve``'s tokens and
    log-probabilities bit for bit. Stock vLLM runs on the same GPU with the same engine settings. (The stream sites'
    ops see the float32 stream compiled vLLM carries between two fused adds: ``plugin.layers``.)"""
    import openai

    hidden = 576
    vec = (np.random.default_rng(1).standard_normal(hidden) * 2).astype(np.float32).tolist()
    steered = {"steering": {"base": {"post_block": {"layer": "4:20", "vector": vec, "scale": 1.0}}}}
    prompts = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(24)]
    invariant = {"VLLM_BATCH_INVARIANT": "1"}
    stock_port, interp_port = free_port(), free_port()
    stock_flags = ["--served-model-name", "smollm2_135m", "--seed", "0", "--disable-hybrid-kv-cache-manager",
                   *(x for key, value in SETTINGS.items() for x in (f"--{key.replace('_', '-')}", str(value))),
                   "--port", str(stock_port)]
    with open(tmp_path / "stock.log", "w+") as stock_log, open(tmp_path / "interp.log", "w+") as interp_log:
        stock = start_server(stock_flags, stock_port, stock_log, env=invariant,
                             command=[sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(smollm2_path)])
        interp = None
        try:
            interp = start_server(["model=smollm2_135m", "engine.enforce_eager=false", "engine.batch_invariant=true",
                                   *(f"engine.{key}={value}" for key, value in SETTINGS.items()),
                                   "--", "--port", str(interp_port)], interp_port, interp_log, env=invariant)

            async def run(port: int, mixed: bool):
                aclient = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
                requests = [{"prompt": p, "max_tokens": 16, "interp": None} for p in prompts]
                if mixed:  # every unsteered request shares its batches with steered ones
                    requests += [{"prompt": p, "max_tokens": 16, "interp": steered} for p in prompts]
                out = await asyncio.gather(*(_complete(aclient, q, "smollm2_135m") for q in requests))
                await aclient.close()
                return out

            want = asyncio.run(run(stock_port, mixed=False))
            got = asyncio.run(run(interp_port, mixed=True))
            for i in range(len(prompts)):
                assert got[i][0] == want[i][0], i
                assert got[i][1] == want[i][1], i  # log-probabilities equal as floats: bit for bit
            assert any(got[len(prompts) + i][0] != want[i][0] for i in range(len(prompts)))  # steering bites
        finally:
            for proc in (stock, interp):
                if proc is not None:
                    stop_server(proc)
