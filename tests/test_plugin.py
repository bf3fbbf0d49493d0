"""The plugin's registration: discovered by vLLM, inert unless interp-runner enabled it, keyed into compile cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from interp_runner.payload import EngineSpec, plugin_fingerprint

PROBE = """
import json
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
load_general_plugins()
import torch
print(json.dumps({
    "entry_point": [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "interp_runner"],
    "layers_patched": "_interp_original_forward" in LlamaDecoderLayer.__dict__,
    "qwen3_patched": "_interp_original_forward" in Qwen3DecoderLayer.__dict__,
    "runner_patched": "_interp_original_model_forward" in GPUModelRunner.__dict__,
    "cpu_warm_up_patched": "_interp_original_warm_up" in CPUModelRunner.__dict__,
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


@pytest.mark.cli
def test_plugin_is_inert_unless_enabled():
    inert = probe(enabled=False)
    assert inert["entry_point"] == ["interp_runner.plugin:register"]
    assert not inert["layers_patched"] and not inert["runner_patched"] and not inert["op"]
    assert not inert["cpu_warm_up_patched"]


@pytest.mark.cli
def test_plugin_instruments_when_enabled():
    active = probe(enabled=True)
    assert active["layers_patched"] and active["qwen3_patched"] and active["runner_patched"] and active["op"]
    assert active["cpu_warm_up_patched"]  # this machine has no GPU: vLLM's platform is its CPU


def test_an_eager_interp_engine_on_a_cpu_warms_up_on_a_few_tokens_and_any_other_as_vllm_does(monkeypatch):
    """vLLM's CPU warm-up runs the model over a whole step's tokens for a compile; an eager interp engine compiles
    nothing and warms up on ``WARM_UP_TOKENS``, without the sampler's compile; a compiled one, or an engine without
    interp ops, keeps vLLM's."""
    from vllm.config import CompilationMode
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from interp_runner.plugin import runner_patches

    calls: list = []
    monkeypatch.setattr(CPUModelRunner, "warming_up_model", lambda self: calls.append(("vllm", None)))
    monkeypatch.setattr(CPUModelRunner, "_interp_original_warm_up", None, raising=False)
    monkeypatch.delattr(CPUModelRunner, "_interp_original_warm_up")  # patched afresh; both restored after
    runner_patches.instrument_cpu_warm_up()

    def runner(state, mode):
        return NS(_interp_state=state, compilation_config=NS(mode=mode), max_num_tokens=4096,
                  _dummy_run=lambda n, is_profile: calls.append(("dummy", n)) or (None, "last"),
                  _dummy_sampler_run=lambda last: calls.append(("sampler", last)))

    CPUModelRunner.warming_up_model(runner(object(), CompilationMode.NONE))
    assert calls == [("dummy", runner_patches.WARM_UP_TOKENS)]
    for state, mode in ((None, CompilationMode.NONE), (object(), CompilationMode.VLLM_COMPILE)):
        calls.clear()
        CPUModelRunner.warming_up_model(runner(state, mode))
        assert calls == [("vllm", None)]


def test_only_an_eager_interp_engine_ranks_sampled_tokens_without_compiling(monkeypatch):
    """vLLM compiles the rank of each sampled token on first use; a runner of an eager interp engine switches it to
    an eager count when its state binds, a compiled one or a runner without interp ops leaves it compiled."""
    import torch
    from vllm.config import CompilationMode
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than as compiled

    from interp_runner.plugin import runner_patches

    monkeypatch.setattr(sampler, "batched_count_greater_than", compiled)
    monkeypatch.setattr(runner_patches, "_score_logits", lambda model, state: None)
    monkeypatch.setattr(runner_patches, "V1RunnerView", lambda runner: None)

    def bind(state, mode):
        module = NS(_interp_state=state)
        model = NS(modules=lambda: [module])
        runner_patches.state_of(NS(model=model, get_model=lambda: model, compilation_config=NS(mode=mode)))
        return sampler.batched_count_greater_than

    assert bind(None, CompilationMode.NONE) is compiled
    assert bind(object(), CompilationMode.VLLM_COMPILE) is compiled
    counted = bind(object(), CompilationMode.NONE)
    assert counted is not compiled
    x = torch.tensor([[0.5, -1.0, 2.0, 0.5], [3.0, 1.0, 1.0, -2.0]])
    values = torch.tensor([[0.5], [1.0]])
    assert counted(x, values).tolist() == [3, 3] == compiled.__wrapped__(x, values).tolist()


def test_a_step_of_packed_requests_only_runs_the_lm_head_over_its_cells_alone():
    """vLLM's own logits of packed requests are never read (a cell's token is its score's top): a step of packed
    requests only gives vLLM zeros for them; a step that also holds any other request gets its logits as before."""
    import torch

    from interp_runner.plugin import runner_patches

    weight = torch.arange(20.0).reshape(4, 5)
    rows: list[int] = []

    def lm_head(hidden):
        rows.append(hidden.shape[0])
        return hidden @ weight

    recorded: list = []
    readback = NS(cell_hidden=None, only_packed=False, score_rows=[],
                  record_scores=lambda logits: recorded.append(("scores", logits)),
                  record_cell_scores=lambda logits: recorded.append(("cells", logits)))
    model = NS(compute_logits=lm_head)
    runner_patches._score_logits(model, NS(readback=readback))
    hidden, cells = torch.ones(3, 4), torch.full((7, 4), 2.0)

    readback.cell_hidden, readback.only_packed = cells, True
    logits = model.compute_logits(hidden)
    assert rows == [7] and logits.shape == (3, 5) and not logits.any()
    assert [name for name, _ in recorded] == ["cells"] and torch.equal(recorded[0][1], cells @ weight)

    rows.clear(), recorded.clear()
    readback.cell_hidden, readback.only_packed = cells, False
    assert torch.equal(model.compute_logits(hidden), hidden @ weight)
    assert sorted(rows) == [3, 7] and [name for name, _ in recorded] == ["cells"]

    rows.clear(), recorded.clear()
    readback.only_packed, readback.score_rows = False, [0]  # no packed cells: the step as vLLM runs it, scored
    assert torch.equal(model.compute_logits(hidden), hidden @ weight)
    assert rows == [3] and [name for name, _ in recorded] == ["scores"]


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

    from interp_runner.plugin.staging import PinnedRing

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
