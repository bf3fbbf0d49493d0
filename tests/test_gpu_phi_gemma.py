"""Phi-3, Gemma 2 and Gemma 3 on a CUDA GPU as production runs them (torch.compile, CUDA graphs, vLLM's fused
add+norm kernels that update the residual in place), in float32 with IEEE float32 dots in Triton kernels
(``ieee_float32_dots``), so that plain HF transformers hooks on the CPU (``hf_sandwich_oracle``) stay the reference
at the CPU tests' tolerances: the CPU family tests (``test_families_phi_gemma``), run here on a GPU engine of each
family."""

from __future__ import annotations

import pytest

from support import hf_sandwich_oracle as oracle
from conftest import BANK_ROWS, KV_ROWS, KV_RUNS, build_engine, every_site
from interp_runner.models.materialize import model_path
from test_families_phi_gemma import LAYERS
from test_families_phi_gemma import test_branch_hooks_are_what_the_block_adds  # noqa: F401
from test_families_phi_gemma import test_capture_and_steering_at_every_hook_match_hf  # noqa: F401
from test_families_phi_gemma import test_patching_at_every_hook_mixes_as_hf_hooks_do  # noqa: F401
from test_families_phi_gemma import test_trace_grid_matches_hf_hooks  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

FAMILIES = ("tiny_phi3", "tiny_gemma2", "tiny_gemma3")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, ieee_float32_dots):
    """(name, path, hidden size, a compiled float32 GPU engine with every op at every site)."""
    path = model_path(request.param)
    sites = every_site(LAYERS)
    engine = build_engine(path, sites, sites, sites, BANK_ROWS, KV_ROWS, KV_RUNS, enforce_eager=False,
                          gpu_memory_utilization=0.3)
    from vllm.config import CompilationMode, CUDAGraphMode

    compilation = engine.llm.llm_engine.vllm_config.compilation_config
    assert compilation.mode != CompilationMode.NONE and compilation.cudagraph_mode != CUDAGraphMode.NONE
    assert len(engine.status["instrumented_layers"]) == LAYERS
    yield request.param, path, oracle.load(str(path)).config.hidden_size, engine
    engine.close()
