"""Shared fixtures. Engines are expensive on CPU: one per (model, mode) for the whole session."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # workers share the cores: one OpenMP thread each (and in the processes they start), so that no thread spins on
    # a core the other worker is using; set before torch is imported
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

REPO = Path(__file__).resolve().parent.parent


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from support.xdist_lanes import SharedFileScheduling

    return SharedFileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (a worker is not told the --dist mode; the order suits them all)
        from support.xdist_lanes import order_by_cost

        order_by_cost(items)
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


ENGINE_FIXTURES = {"tiny_engine", "smollm2_engine", "tiny_engine_v2", "runner_engine"}


@contextlib.contextmanager
def _no_engine_unless_marked(item):
    """``make test-fast`` (``-m "not engine"``) starts no engine: a test not marked ``engine`` that asks for a
    session engine, or starts one in this process (its fixtures' set-up included), fails."""
    if "engine" in item.keywords:
        yield
        return
    engines = ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))
    assert not engines, f"{item.nodeid} uses {sorted(engines)}: mark it @pytest.mark.engine"
    from interp_runner.engine import adapter as engine

    def refused():
        raise AssertionError(f"{item.nodeid} starts a vLLM engine: mark it @pytest.mark.engine")

    # called by VllmEngine just before vLLM's LLM, once the settings passed every check
    original = engine._child_pids
    engine._child_pids = refused
    try:
        yield
    finally:
        engine._child_pids = original


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_engine_unless_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_engine_unless_marked(item):
        yield


def pytest_configure(config):
    from support.servers import interrupt_on_sigterm

    interrupt_on_sigterm()


def pytest_sessionfinish(session):
    inprocess = sys.modules.get("support.inprocess")
    if inprocess is not None:  # the engines the in-process CLI runs shared
        inprocess.SHARED.shutdown()


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from interp_runner.models.materialize import model_path

    return model_path("tiny_random")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from interp_runner.models.materialize import model_path

    return model_path("smollm2_135m")


def base_config(model: str = "tiny_random", **overrides) -> dict:
    """A minimal valid run config (plain dict, as Hydra would hand it over)."""
    cfg = {
        "model": {"name": model},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 16},
        "prompts": {"items": ["The Eiffel Tower is located in the city of", "Hello, my name is"]},
        "sampling": {"max_tokens": 4},
    }
    cfg.update(overrides)
    return cfg


BANK_ROWS = 8192
TEST_KV_CACHE_BYTES = 256 << 20  # a CPU test engine's KV cache (the product's CPU default is 1 GiB)
KV_ROWS, KV_RUNS = 4096, 64  # prompt positions whose KV an engine keeps, in that many prompts (corrupted runs)
ALL_HOOKS = ["pre_attn", "attn_out", "post_attn", "mlp_out", "post_block"]


def every_site(num_layers: int) -> tuple[int, ...]:
    from interp_runner.sites import site_id

    return tuple(sorted(site_id(layer, hook) for layer in range(num_layers) for hook in ALL_HOOKS))


def build_engine(path: Path, steer_sites, capture_sites, patch_sites=(), bank_rows=0, kv_rows=0, kv_runs=0,
                 **engine):
    from interp_runner.config.schema import EngineConfig
    from interp_runner.engine.adapter import VllmEngine
    from interp_runner.payload import EngineSpec

    settings = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 16, **engine}
    if not has_cuda():  # a CPU engine's KV cache is resident (vLLM zeroes it): the tests' short prompts need little
        settings.setdefault("kv_cache_memory_bytes", TEST_KV_CACHE_BYTES)
    spec = EngineSpec(tuple(steer_sites), tuple(capture_sites), tuple(patch_sites), bank_rows, kv_rows, kv_runs)
    return VllmEngine(str(path), EngineConfig(**settings), spec)


def run_config(engine, config: dict, **sampling_extra):
    """Compile ``config`` (a plain dict) and run it on ``engine``; the prompts' (stage-0) results in prompt order."""
    plan, results = run_plan(engine, config, **sampling_extra)
    return plan, [results[r.rid] for r in plan.requests if r.role == "prompt"]


def run_plan(engine, config: dict, **sampling_extra):
    """Compile and run every stage of ``config``; (plan, results by request id)."""
    from interp_runner.pipeline import execute, prepare

    plan = prepare(config).plan
    for request in plan.requests:
        request.sampling.update(sampling_extra)
    return plan, execute(engine, plan, log=lambda _: None, use_tqdm=False)


class Borrowed:
    """The session's engine, lent to one pipeline run (which does not close it)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self):
        pass


def through_buffer_and_direct(run):
    """``run()``'s results twice on the active engine: through the persistent capture buffer, then with the buffer
    cut to 3 rows, so every capturing step overflows it and copies its rows out directly (outside CUDA graphs)."""
    import torch

    from interp_runner.plugin import runtime

    through_buffer = run()
    state = runtime.active_state()
    kept = state.cap_out
    state.cap_out = torch.zeros((3, kept.shape[1]), dtype=kept.dtype)  # smaller than any capturing step
    try:
        return through_buffer, run()
    finally:
        state.cap_out = kept


def engine_at_every_site(path: Path, num_layers: int, **engine):
    """An engine (fp32, eager unless overridden) with steering, capture and patch ops at every site; closed
    after use."""
    sites = every_site(num_layers)
    built = build_engine(path, sites, sites, sites, BANK_ROWS, KV_ROWS, KV_RUNS, **engine)
    yield built
    built.close()


@pytest.fixture(scope="session")
def tiny_engine(tiny_path):
    yield from engine_at_every_site(tiny_path, 4)


MODEL_RUNNERS = ("v1", "v2")  # engine.model_runner: the CPU engine tests that matter run under each


@pytest.fixture(scope="session")
def tiny_engine_v2(tiny_path):
    """``tiny_engine`` on vLLM's V2 model runner (a smaller KV cache: both engines live for the session)."""
    yield from engine_at_every_site(tiny_path, 4, model_runner="v2")


@pytest.fixture(params=MODEL_RUNNERS)
def runner_engine(request):
    """The tiny engine of each model runner, one per runner for the session (``tiny_engine`` is vLLM's pick on a
    CPU, V1); the runner its workers report is the one asked for."""
    engine = request.getfixturevalue("tiny_engine" if request.param == "v1" else "tiny_engine_v2")
    assert engine.model_runner == request.param
    return engine


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    yield from engine_at_every_site(smollm2_path, 30)


def rel_err(a, b) -> float:
    """Largest per-row relative error ||a - b|| / ||b|| (the norm is over the hidden dimension)."""
    import numpy as np

    return float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())


@pytest.fixture(scope="module")
def ieee_float32_dots(tmp_path_factory):
    """Float32 dots in Triton kernels at IEEE precision for the engines a module starts after this. vLLM's Triton
    attention and fused-MoE kernels take Triton's default for float32 ``tl.dot``, TF32, which puts a float32 GPU
    engine ~1e-3 off plain HF float32; with IEEE dots the CPU tests' tolerances (1e-4) hold on the GPU. A fresh
    Triton cache keeps kernels compiled with TF32 out; run such a module in a pytest process of its own, as
    kernels a process compiled before stay in memory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_F32_DEFAULT", "ieee")
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_ieee")))
        yield


class FakeEngineBase:
    """The engine interface the pipeline drives, doing nothing."""

    dtype = "float32"
    status = {"loaded": True}

    def __init__(self, *args):
        pass

    def supports(self, spec):
        return True

    def register_sources(self, sources):
        pass

    def release_sources(self, keys):
        pass
