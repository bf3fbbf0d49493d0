"""A served engine's results ride with each request's last output (runs in vLLM's engine-core process).

In an engine whose plugin spec says ``results_with_outputs`` (``interp-serve``'s), the engine core reads, right after
each step, the results of the interp requests that step finished: one ``interp_collect_each`` call to its workers for
all of them, made where the loop would next take its input, as a read-back from the API server would be. Each
request's results (a ``result_transfer`` record of its own, its arrays carried in it) go in its last
``EngineCoreOutput`` under
``kv_transfer_params[RESULTS_KEY]``, which vLLM's output processor hands on with the request's last
``RequestOutput``; ``serve.engine_hook`` takes them out before vLLM's serving code sees them. A response then waits
for no read-back of its own, and no read-back waits for the engine core's loop.

Requests the engine core does not finish itself keep the read-back: those with stop strings (the API server's
detokenizer finishes them, and the engine core learns of it by an abort) and aborted ones.
"""

from __future__ import annotations

import logging

from interp_runner.contracts import ENGINE_KEY, RESULTS_KEY, payload_of, plugin_spec_of

COLLECT_EACH = "interp_collect_each"  # the worker's method (``plugin.worker``)
RIDS = "_interp_result_rids"  # an engine core's served requests: vLLM's request id -> the payload's rid
STEP = "_interp_results_step"  # whether the engine core's step function carries results
MARK = "_interp_served_results"

logger = logging.getLogger(__name__)


def _rids(core) -> dict[str, str] | None:
    """The engine core's served requests (None: its engine does not carry results with outputs)."""
    rids = core.__dict__.get(RIDS, False)
    if rids is False:
        raw = (getattr(core.vllm_config, "additional_config", None) or {}).get(ENGINE_KEY)
        rids = core.__dict__[RIDS] = {} if raw is not None and plugin_spec_of(raw).results_with_outputs else None
    return rids


def attach_results(core, outputs: dict) -> None:
    """Results of the served requests finished in ``outputs`` (client index -> ``EngineCoreOutputs``), read off the
    workers in one call and put in each one's last output."""
    rids = core.__dict__.get(RIDS)
    if not rids:
        return
    finished = [(out, rid) for batch in outputs.values() for out in batch.outputs
                if out.finish_reason is not None and (rid := rids.pop(out.request_id, None)) is not None]
    if not finished:
        return
    try:
        per_rank = core.collective_rpc(COLLECT_EACH, args=([rid for _, rid in finished],))
        records = next(r for r in per_rank if r is not None)  # the result rank's
    except Exception:  # the requests' own read-backs will meet the error and answer their clients with it
        logger.exception("interp: reading finished requests' results with their outputs failed")
        return
    for out, rid in finished:
        out.kv_transfer_params = {**(out.kv_transfer_params or {}), RESULTS_KEY: records.get(rid)}


def instrument_engine_core() -> None:
    from vllm.v1.engine import core

    if MARK in core.EngineCore.__dict__:
        return
    add, abort = core.EngineCore.add_request, core.EngineCore.abort_requests
    engine_step = core.EngineCoreProc._process_engine_step

    def add_request(self, request, request_wave: int = 0):
        rids = _rids(self)
        if rids is not None:
            params = request.sampling_params
            payload = payload_of(params)
            if payload is not None and not params.stop:  # stop strings end a request in the API server
                rids[request.request_id] = payload.rid
        return add(self, request, request_wave)

    def abort_requests(self, request_ids):
        rids = self.__dict__.get(RIDS)
        if rids:
            for request_id in request_ids:
                rids.pop(request_id, None)
        return abort(self, request_ids)

    def _process_engine_step(self):
        if STEP not in self.__dict__:
            self.__dict__[STEP] = _rids(self) is not None
            if self.__dict__[STEP]:
                step = self.step_fn

                def step_with_results():
                    outputs, executed = step()
                    if outputs:
                        attach_results(self, outputs)
                    return outputs, executed

                self.step_fn = step_with_results
        return engine_step(self)

    core.EngineCore.add_request = add_request
    core.EngineCore.abort_requests = abort_requests
    core.EngineCoreProc._process_engine_step = _process_engine_step
    setattr(core.EngineCore, MARK, True)
