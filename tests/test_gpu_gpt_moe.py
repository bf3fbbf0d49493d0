"""GPT-2, GPT-NeoX (Pythia) and Qwen3-MoE on a CUDA GPU as production runs them (torch.compile, CUDA graphs,
vLLM's fused kernels), in float32 with IEEE float32 dots in Triton kernels (``ieee_float32_dots``), so that plain
HF transformers hooks on the CPU (``hf_gpt_moe_oracle``) stay the reference at the CPU tests' tolerances: the CPU
family tests (``test_families_gpt_moe``), run here on a GPU engine of each family, and Qwen3-MoE's router logits
(``test_router_logits``)."""

from __future__ import annotations

import pytest

from conftest import BANK_ROWS, KV_ROWS, KV_RUNS, build_engine
from interp_runner.models.materialize import model_path
from interp_runner.sites import site_id
from test_families_gpt_moe import LAYERS, hooks_of
from test_families_gpt_moe import test_capture_and_steering_at_every_hook_match_hf  # noqa: F401
from test_families_gpt_moe import test_patching_at_every_hook_mixes_as_hf_hooks_do  # noqa: F401
from test_families_gpt_moe import test_trace_grid_matches_hf_hooks  # noqa: F401
from test_router_logits import check_router_logits, router_sites

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

FAMILIES = ("tiny_gpt2", "tiny_pythia", "tiny_qwen3_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, ieee_float32_dots):
    """(name, path, hooks, a compiled float32 GPU engine with every op at every site the family has)."""
    name = request.param
    path, hooks = model_path(name), hooks_of(name)
    sites = tuple(sorted(site_id(layer, hook) for layer in range(LAYERS) for hook in hooks))
    engine = build_engine(path, sites, sites, sites, BANK_ROWS, KV_ROWS, KV_RUNS, enforce_eager=False,
                          gpu_memory_utilization=0.3)
    from vllm.config import CompilationMode, CUDAGraphMode

    compilation = engine.llm.llm_engine.vllm_config.compilation_config
    assert compilation.mode != CompilationMode.NONE and compilation.cudagraph_mode != CUDAGraphMode.NONE
    assert len(engine.status["instrumented_layers"]) == LAYERS
    yield name, path, hooks, engine
    engine.close()


def test_router_logits_and_routing_match_hf(ieee_float32_dots):
    """Qwen3-MoE's capture-only router_logits in CUDA graphs: logits, chosen experts and weights as HF computes
    them (``test_router_logits.check_router_logits``)."""
    engine = build_engine(model_path("tiny_qwen3_moe"), (), router_sites(), enforce_eager=False,
                          gpu_memory_utilization=0.3)
    try:
        check_router_logits(engine)
    finally:
        engine.close()
