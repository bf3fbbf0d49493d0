"""Closing an engine whose engine core runs in this process: its core is always shut down, which frees its memory
(on a GPU for the next engine, which vLLM refuses to start on less than ``gpu_memory_utilization`` free; on a CPU for
a test session's next engines). Only the last such engine lets that shutdown end by tearing down vLLM's process-wide
parallel groups; while other engines alive in the process still use them, they are kept."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest

from interp_runner.engine import adapter


@pytest.fixture(autouse=True)
def no_other_engines(monkeypatch):
    """The engines of this test alone (a session's shared engines may be alive in this process)."""
    monkeypatch.setattr(adapter, "_in_process_engines", weakref.WeakSet())


def in_process_engine(shutdowns: list) -> adapter.VllmEngine:
    """A VllmEngine with a stand-in for vLLM's LLM (close reads only its engine core), registered as __init__ does.
    Its shutdown records whether vLLM's teardown of the parallel groups would run at its end."""
    import vllm.v1.engine.core as core_module

    real = core_module.cleanup_dist_env_and_memory
    made = object.__new__(adapter.VllmEngine)
    core = SimpleNamespace(shutdown=lambda: shutdowns.append((made, core_module.cleanup_dist_env_and_memory is real)))
    made.llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core),
                               collective_rpc=lambda method: shutdowns.append((made, method)))
    made.processes = set()
    adapter._in_process_engines.add(made)
    return made


def test_every_in_process_engine_is_shut_down_and_only_the_last_tears_the_groups_down():
    shutdowns: list = []
    first, second = in_process_engine(shutdowns), in_process_engine(shutdowns)
    first.close()
    # the plugin lets go of the engine's state, then its core is freed; the second still uses the parallel groups
    assert shutdowns == [(first, "interp_release"), (first, False)]
    second.close()
    assert shutdowns[2:] == [(second, "interp_release"), (second, True)]
    assert len(adapter._in_process_engines) == 0


def test_the_teardown_is_restored_after_a_kept_shutdown():
    import vllm.v1.engine.core as core_module

    real = core_module.cleanup_dist_env_and_memory
    shutdowns: list = []
    first, _second = in_process_engine(shutdowns), in_process_engine(shutdowns)
    first.close()
    assert core_module.cleanup_dist_env_and_memory is real


def test_model_inspection_runs_in_this_process_on_a_cpu_and_is_restored():
    """vLLM's model-class inspection, which it runs in a fresh Python process, runs in this one around an engine's
    start on a CPU (no CUDA to keep uninitialized; a GPU keeps vLLM's way), and vLLM's own way is back afterwards."""
    import os

    from vllm.model_executor.models import registry

    from interp_runner.engine.settings import on_gpu

    original = registry._run_in_subprocess
    with adapter.model_inspection_in_process():
        if on_gpu():
            assert registry._run_in_subprocess is original
        else:
            assert registry._run_in_subprocess(os.getpid) == os.getpid()
    assert registry._run_in_subprocess is original
