"""The plugin's registration: discovered by vLLM, inert unless interp-runner enabled it, keyed into compile cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from interp_runner.payload import EngineSpec, plugin_fingerprint

PROBE = """
import json
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
load_general_plugins()
import torch
print(json.dumps({
    "entry_point": [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "interp_runner"],
    "layers_patched": "_interp_original_forward" in LlamaDecoderLayer.__dict__,
    "qwen3_patched": "_interp_original_forward" in Qwen3DecoderLayer.__dict__,
    "runner_patched": "_interp_original_model_forward" in GPUModelRunner.__dict__,
    "op": hasattr(torch.ops.interp, "site") if hasattr(torch.ops, "interp") else False,
}))
"""


def probe(enabled: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "INTERP_RUNNER_PLUGIN"}
    if enabled:
        env["INTERP_RUNNER_PLUGIN"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plugin_is_inert_unless_enabled():
    inert = probe(enabled=False)
    assert inert["entry_point"] == ["interp_runner.plugin:register"]
    assert not inert["layers_patched"] and not inert["runner_patched"] and not inert["op"]


def test_plugin_instruments_when_enabled():
    active = probe(enabled=True)
    assert active["layers_patched"] and active["qwen3_patched"] and active["runner_patched"] and active["op"]


def test_compile_cache_key_carries_plugin_fingerprint_and_sites():
    from vllm.config import VllmConfig

    spec = EngineSpec(steer_sites=(3, 4), capture_sites=(9,))
    extra = spec.as_additional_config()
    assert extra["interp"]["plugin"] == plugin_fingerprint()
    hashes = {
        VllmConfig(additional_config=cfg).compute_hash()
        for cfg in (
            {},
            extra,
            EngineSpec(steer_sites=(3,), capture_sites=(9,)).as_additional_config(),
            {"interp": {**extra["interp"], "plugin": "older-plugin"}},
        )
    }
    assert len(hashes) == 4  # no graph compiled for other ops (or none) is ever reused


def test_pinned_ring_reuses_its_buffer_only_after_a_wait():
    """The planner's host->device ring: arrays come back intact, parts are laid out one after another, and the
    buffer is rewritten from its start only after waiting for the copies queued so far."""
    import numpy as np
    import torch

    from interp_runner.plugin.runtime import PinnedRing

    waits = []
    ring = PinnedRing(256, torch.device("cpu"), synchronize=lambda: waits.append(ring.offset))
    first = ring.upload(np.arange(8, dtype=np.int64))  # 64 bytes
    kept = first.clone()
    second = ring.upload(np.array([1.5, -2.0], dtype=np.float32))  # 8 bytes, aligned to 64
    assert ring.offset == 128 and waits == []
    assert second.tolist() == [1.5, -2.0] and kept.tolist() == list(range(8))
    into = torch.zeros(3, dtype=torch.int32)
    ring.upload(np.array([4, 5, 6], dtype=np.int32), into=into)
    assert into.tolist() == [4, 5, 6] and ring.offset == 192
    ring.upload(np.zeros(20, dtype=np.int64))  # 160 bytes do not fit after 192: wait, then from the start
    assert waits == [192] and ring.offset == 192 and ring.wraps == 1
    big = ring.upload(np.arange(100, dtype=np.int64))  # larger than the ring: copied directly
    assert big.tolist() == list(range(100)) and ring.offset == 192
    with torch.device("meta"):  # vLLM builds the model (and this ring) under a default device
        assert PinnedRing(64, torch.device("cpu")).buffer.device.type == "cpu"
