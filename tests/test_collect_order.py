"""Utility calls and new requests: a read-back answered after the step that schedules the requests added before
it; a vector registered once however many requests arrive while it registers."""

import queue
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.engine import EngineCoreRequestType  # noqa: E402
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState  # noqa: E402

from interp_runner.plugin import collect_order  # noqa: E402


class Scheduler:
    def __init__(self):
        self.waiting = []

    def get_request_counts(self):
        return 0, len(self.waiting)


class Executor:
    def __init__(self, log):
        self.log = log

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.log.append(("rpc", method))
        return [None]


def _engine(log):
    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.vllm_config = SimpleNamespace(additional_config={})  # not a served engine: no results with outputs
    engine.scheduler = Scheduler()
    engine.model_executor = Executor(log)
    engine.output_queue = queue.Queue()
    engine.shutdown_state = EngineShutdownState.RUNNING
    engine.add_request = lambda request, wave=0: (engine.scheduler.waiting.append(request), log.append(("add",)))

    def step():
        log.append(("step", len(engine.scheduler.waiting)))
        engine.scheduler.waiting.clear()
        return {}, True

    engine.step_fn = step
    engine.post_step = lambda executed: None
    return engine


def _collect(call_id):
    return 0, call_id, "collective_rpc", (collect_order.COLLECT, None, ([], True, [], ""), {})


def test_a_read_back_behind_an_added_request_runs_after_the_step_that_schedules_it():
    collect_order.instrument_engine_core()
    log = []
    engine = _engine(log)
    engine._handle_client_request(EngineCoreRequestType.ADD, ("request", 0))
    engine._handle_client_request(EngineCoreRequestType.UTILITY, _collect(1))
    assert log == [("add",)] and engine.output_queue.empty()
    engine._process_engine_step()
    assert log == [("add",), ("step", 1), ("rpc", collect_order.COLLECT)]
    assert engine.output_queue.get_nowait()[1].utility_output.call_id == 1


def test_a_read_back_with_no_request_waiting_runs_at_once():
    collect_order.instrument_engine_core()
    log = []
    engine = _engine(log)
    engine._handle_client_request(EngineCoreRequestType.UTILITY, _collect(2))
    engine._handle_client_request(EngineCoreRequestType.UTILITY, (0, 3, "collective_rpc", ("other", None, (), {})))
    assert log == [("rpc", collect_order.COLLECT), ("rpc", "other")]
    assert [engine.output_queue.get_nowait()[1].utility_output.call_id for _ in range(2)] == [2, 3]


def test_requests_arriving_while_a_vector_registers_share_its_call():
    import asyncio

    import numpy as np

    from interp_runner.serve.engine_hook import InterpEngine

    class Engine:
        calls = []

        def generate(self, *args, **kwargs):
            raise AssertionError

        async def collective_rpc(self, method, args=()):
            self.calls.append(sorted(args[0]))
            await asyncio.sleep(0.01)

    async def main():
        hook = InterpEngine(Engine())
        vectors = {"a": np.ones(4), "b": np.zeros(4)}
        await asyncio.gather(*(hook.register(vectors) for _ in range(8)))
        await hook.register({"a": np.ones(4), "c": np.ones(4)})
        return hook

    hook = asyncio.run(main())
    assert Engine.calls == [["a", "b"], ["c"]] and hook.registered == {"a", "b", "c"} and not hook.registering
