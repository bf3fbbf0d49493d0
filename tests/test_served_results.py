"""A served engine's results ride with each request's last output (``plugin.served_results``): read off the workers
in one call right after the step that finished the requests, and taken out of the output by the API server's engine
client before vLLM's serving code sees it."""

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason  # noqa: E402
from vllm.v1.engine.core import EngineCoreProc  # noqa: E402

from interp_runner.contracts import PAYLOAD_KEY, RESULTS_KEY, RequestPayload, encode_payload, spec_config  # noqa: E402
from interp_runner.contracts import PluginSpec  # noqa: E402
from interp_runner.plugin import served_results  # noqa: E402
from interp_runner.result_transfer import received, send_results  # noqa: E402
from interp_runner.serve.engine_hook import carried_results  # noqa: E402


class Config:
    def __init__(self, serves: bool):
        spec = PluginSpec((), (), plugin="test", results_with_outputs=serves)
        self.additional_config = spec_config(spec)


class Workers:
    """The result rank's ``interp_collect_each``: each request's results as a record of its own (arrays inline)."""

    def __init__(self):
        self.calls = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        rids = args[0]
        self.calls.append((method, list(rids)))
        results = {rid: {"captures": {7: (np.array([3], np.int32), np.full((1, 4), i, np.float32))}, "score": None,
                         "void": None, "nonfinite": rid.endswith("bad")} for i, rid in enumerate(rids)}
        return [{rid: send_results({rid: r}, "") for rid, r in results.items()}, None]  # rank 0's, rank 1's


def _core(serves: bool = True):
    core = EngineCoreProc.__new__(EngineCoreProc)
    core.vllm_config = Config(serves)
    core.model_executor = Workers()
    return core


class Request:
    def __init__(self, request_id: str, rid: str | None, stop=None):
        extra = {PAYLOAD_KEY: encode_payload(RequestPayload(rid=rid))} if rid else None
        self.request_id = request_id
        self.sampling_params = SamplingParams(max_tokens=2, stop=stop, extra_args=extra)
        self.pooling_params = self.kv_transfer_params = self.ec_transfer_params = None
        self.abort_immediately = False


def _add(core, *requests):
    served_results.instrument_engine_core()
    added = []
    core.scheduler = type("Scheduler", (), {"add_request": lambda self, request: added.append(request.request_id),
                                            "finish_requests": lambda self, ids, status: None,
                                            "get_kv_connector": lambda self: None,
                                            "get_ec_connector": lambda self: None})()
    for request in requests:
        type(core).add_request(core, request)
    return added


def _outputs(*pairs):
    return {0: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=rid, new_token_ids=[1], finish_reason=reason)
                                          for rid, reason in pairs])}


def test_finished_served_requests_carry_their_results_after_one_call():
    core = _core()
    added = _add(core, Request("a", "serve-a"), Request("b", "serve-bad"), Request("c", "serve-c"),
                 Request("plain", None), Request("stops", "serve-s", stop=["x"]))
    assert added == ["a", "b", "c", "plain", "stops"]
    outputs = _outputs(("a", FinishReason.LENGTH), ("b", FinishReason.STOP), ("c", None), ("plain", FinishReason.LENGTH),
                       ("stops", FinishReason.LENGTH))
    served_results.attach_results(core, outputs)
    assert core.model_executor.calls == [("interp_collect_each", ["serve-a", "serve-bad"])]
    a, b, c, plain, stops = outputs[0].outputs
    assert c.kv_transfer_params is None and plain.kv_transfer_params is None  # running; no interp object
    assert stops.kv_transfer_params is None  # stop strings: its read-back will ask for it
    got_a = received(a.kv_transfer_params[RESULTS_KEY], "")
    got_b = received(b.kv_transfer_params[RESULTS_KEY], "")
    assert list(got_a) == ["serve-a"] and list(got_b) == ["serve-bad"]
    assert got_b["serve-bad"]["nonfinite"] and not got_a["serve-a"]["nonfinite"]
    positions, values = got_b["serve-bad"]["captures"][7]
    assert positions.tolist() == [3] and values.tolist() == [[1.0] * 4]
    served_results.attach_results(core, _outputs(("a", FinishReason.LENGTH)))  # each request's results once
    assert len(core.model_executor.calls) == 1


def test_aborted_requests_and_unserved_engines_carry_nothing():
    core = _core()
    _add(core, Request("a", "serve-a"))
    type(core).abort_requests(core, ["a"])
    served_results.attach_results(core, _outputs(("a", FinishReason.ABORT)))
    assert core.model_executor.calls == []
    offline = _core(serves=False)
    _add(offline, Request("a", "serve-a"))
    served_results.attach_results(offline, _outputs(("a", FinishReason.LENGTH)))
    assert offline.model_executor.calls == [] and served_results.RIDS in offline.__dict__


def test_the_engine_client_takes_the_results_out_of_the_output():
    class Out:
        def __init__(self, params):
            self.kv_transfer_params = params

    out = Out({RESULTS_KEY: b"r", "other": 1})
    assert carried_results(out) == b"r" and out.kv_transfer_params == {"other": 1}
    out = Out({RESULTS_KEY: b"r"})
    assert carried_results(out) == b"r" and out.kv_transfer_params is None
    out = Out(None)
    assert carried_results(out) is None and out.kv_transfer_params is None
