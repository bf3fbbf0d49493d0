"""Closing an engine whose engine core runs in this process: the last such engine shuts its core down (on a GPU that
frees its memory for the next engine, which vLLM refuses to start on less than ``gpu_memory_utilization`` free); one
that others still share the process with leaves vLLM's process-wide parallel groups alone."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest

from interp_runner.engine import adapter as engine_module
from interp_runner.engine.adapter import VllmEngine


def in_process_engine(shutdowns: list) -> VllmEngine:
    """A VllmEngine with a stand-in for vLLM's LLM (close reads only its engine core), registered as __init__ does."""
    made = object.__new__(VllmEngine)
    core = SimpleNamespace(shutdown=lambda: shutdowns.append(made))
    made.llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))
    made.processes = set()
    engine_module._in_process_engines.add(made)
    return made


@pytest.fixture(autouse=True)
def no_other_engines(monkeypatch):
    """The engines of this test alone (a session's shared engines may be alive in this process)."""
    monkeypatch.setattr(engine_module, "_in_process_engines", weakref.WeakSet())


def test_only_the_last_in_process_engine_shuts_its_core_down():
    shutdowns: list = []
    first, second = in_process_engine(shutdowns), in_process_engine(shutdowns)
    first.close()
    assert shutdowns == []  # the second still uses the process's parallel groups
    second.close()
    assert shutdowns == [second]
    assert len(engine_module._in_process_engines) == 0


def test_a_lone_in_process_engine_is_shut_down_so_the_next_one_can_start():
    shutdowns: list = []
    lone = in_process_engine(shutdowns)
    lone.close()
    assert shutdowns == [lone]
