"""``interp-serve`` before any engine: bad configs exit 2 naming the key, ``steering.global`` comes first in every
request's payload and keys its KV, captured values beyond float16's range travel as float32."""

from __future__ import annotations

import numpy as np
import pytest

from test_serve import direction, values_of


@pytest.mark.parametrize("argv, message", [
    (["model=tiny_random", "+steering={global:{base:{post_block:{layer:9,vector:{random:{seed:0}}}}}}"],
     "config error: steering.global.base.post_block.layer: 9 out of range, model has 4 layers"),
    (["model=tiny_random", "serve.sites.capture.layers=7"], "config error: serve.sites.capture.layers: 7 out of range"),
    (["model=tiny_random", "serve.bogus=1"], "config error: serve.bogus"),
    (["model=tiny_random", "serve.sites.capture.hooks=[router_logits]"],
     "config error: serve.sites.capture.hooks[0]: 'router_logits' is not a hook of llama blocks"),
    (["model=tiny_qwen3_moe", "serve.sites.steer.hooks=[router_logits]"],
     "config error: serve.sites.steer.hooks[0]: 'router_logits' is a capture-only site"),
    (["model=tiny_random", "--", "--no-such-flag"], "config error: serve.args: vLLM refuses the server flags"),
])
def test_bad_config_exits_2_before_the_engine(argv, message, capsys):
    from interp_runner.serve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_global_steering_reaches_every_request_and_keys_its_kv(tiny_path):
    """``steering.global`` (from the config, checked there) comes first in every request's entries, with or without
    an ``interp`` object; different interventions give different prefix-cache digests, the same ones the same."""
    from interp_runner.serve.cli import compose, prepare
    from interp_runner.serve.compile import compile_interp
    from interp_runner.serve.settings import validate_interp
    from interp_runner.sites import site_id

    prepared = prepare(compose(["model=tiny_random", "engine.dtype=float32",
                                "+steering={global:{prefill:{mlp_out:{layer:2,vector:{random:{seed:4}}}}}}"]), [])
    assert site_id(2, "mlp_out") in prepared.served.steer_sites
    assert "--additional-config" in prepared.vllm_args

    def payload(interp):
        spec = None if interp is None else validate_interp(interp)
        compiled = compile_interp(spec, prepared.served, prepared.named, prepared.tokenizer, prepared.global_steer,
                                  prepared.global_vectors)
        return compiled.payload("r", list(range(1, 70)))[0]

    plain = payload(None)
    assert [e.site for e in plain.steer] == [site_id(2, "mlp_out")]
    steered = payload({"steering": {"decode": {"post_block": {"layer": 1, "vector": direction(3)}}}})
    assert steered.steer[0] == plain.steer[0] and len(steered.steer) == 2
    assert plain.kv and steered.kv and plain.kv != steered.kv
    assert payload(None).kv == plain.kv
    assert payload({"capture": {"layers": 1}}).kv == plain.kv  # reading changes no KV


def test_engine_limits_are_vllm_serves_own_unless_set():
    """interp-serve leaves the model's length and the concurrency to vLLM, as `vllm serve` does (which also sets the
    largest CUDA graph); a config that sets them passes them on."""
    from interp_runner.serve.cli import compose, prepare

    args = prepare(compose(["model=tiny_random", "engine.dtype=float32"]), []).vllm_args
    assert "--max-num-seqs" not in args and "--max-model-len" not in args
    args = prepare(compose(["model=tiny_random", "engine.dtype=float32", "engine.max_num_seqs=8",
                            "engine.max_model_len=512"]), []).vllm_args
    assert args[args.index("--max-num-seqs") + 1] == "8" and args[args.index("--max-model-len") + 1] == "512"


def test_a_fixed_kv_cache_on_a_gpu_keeps_the_memory_share():
    """vLLM's start checks the GPU's free memory against ``gpu_memory_utilization`` even where the KV cache is fixed,
    so interp-serve passes both there (a CPU takes the fixed cache alone)."""
    from interp_runner.serve.cli import compose, engine_flags
    from interp_runner.config.run import validate_config

    config = dict(compose(["model=tiny_random", "engine.kv_cache_memory_bytes=1073741824",
                           "engine.gpu_memory_utilization=0.4"]))
    config.pop("serve")
    cfg = validate_config(config)
    on_gpu, on_cpu = engine_flags(cfg, None, gpu=True), engine_flags(cfg, None, gpu=False)
    assert on_gpu[on_gpu.index("--kv-cache-memory-bytes") + 1] == "1073741824"
    assert on_gpu[on_gpu.index("--gpu-memory-utilization") + 1] == "0.4"
    assert "--kv-cache-memory-bytes" in on_cpu and "--gpu-memory-utilization" not in on_cpu


def test_capture_beyond_float16_is_sent_as_float32():
    from interp_runner.serve.compile import Compiled, result_json
    from interp_runner.serve.settings import CaptureRequest

    compiled = Compiled(capture_sites=[4], capture=CaptureRequest(layers=0))
    values = np.array([[1.0, 1e6]], np.float32)
    entry = result_json(compiled, {"captures": {4: (np.array([3], np.int32), values)}})["captures"][0]
    assert entry["dtype"] == "float32" and entry["positions"] == [3]
    np.testing.assert_array_equal(values_of(entry), values)
    entry = result_json(compiled, {"captures": {4: (np.array([3], np.int32), values / 1e3)}})["captures"][0]
    assert entry["dtype"] == "float16"
