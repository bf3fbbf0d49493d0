"""Read-backs after the step that schedules the requests added before them (runs in vLLM's engine-core process).

vLLM's engine core handles its input queue in order between steps, and a utility call (``collective_rpc``) blocks its
loop while it runs. A served request's results are read back by one such call (``interp_collect``) once it finished;
a new request added in the same pass over the input queue, ahead of the call, then waited for the read-back before
the step that schedules it. So where requests wait to be scheduled, a read-back is answered right after the next
step instead: the requests go first, and the read-back runs where the loop would next take its input. With none
waiting it runs at once, as any utility call.
"""

from __future__ import annotations

from interp_runner.contracts import COLLECT
DEFERRED = "_interp_deferred_collects"  # an engine core's read-backs waiting for its next step
MARK = "_interp_collect_order"


def _is_collect(request) -> bool:
    _, _, method, args = request  # (client index, call id, method name, arguments)
    return method == "collective_rpc" and bool(args) and args[0] == COLLECT


def instrument_engine_core() -> None:
    from vllm.v1.engine import core

    cls = core.EngineCoreProc
    if MARK in cls.__dict__:
        return
    utility = core.EngineCoreRequestType.UTILITY
    handle, engine_step = cls._handle_client_request, cls._process_engine_step

    def _handle_client_request(self, request_type, request):
        if request_type == utility and _is_collect(request):
            deferred = self.__dict__.setdefault(DEFERRED, [])
            if deferred or self.scheduler.get_request_counts()[1] > 0:  # requests waiting: the step goes first
                deferred.append(request)
                return
        handle(self, request_type, request)

    def _process_engine_step(self):
        executed = engine_step(self)
        deferred = self.__dict__.get(DEFERRED)
        while deferred:
            handle(self, utility, deferred.pop(0))
        return executed

    cls._handle_client_request = _handle_client_request
    cls._process_engine_step = _process_engine_step
    setattr(cls, MARK, True)
