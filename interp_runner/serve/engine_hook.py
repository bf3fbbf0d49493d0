"""The engine client's ``generate`` with interp payloads: a request's compiled interventions (handed over by the
HTTP middleware through ``CURRENT``) become its ``SamplingParams.extra_args`` payload once vLLM has rendered its
prompt; the workers' results come with its last output (``plugin.served_results``), or, for a request the engine core
did not finish itself, are read back once that output has been handed on (``Collector``: one ``collective_rpc`` for
all requests that finished meanwhile), and what an aborted request held is freed."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from interp_runner.contracts import COLLECT, PAYLOAD_KEY, RESULTS_KEY, encode_payload
from interp_runner.result_transfer import received, result_block
from interp_runner.serve.compile import Compiled

REGISTER_VECTORS = "interp_register_vectors"


class CollectMetrics:
    """The read-backs of a server's process, on vLLM's ``/metrics`` page (Prometheus): ``interp_collect_seconds``
    (one observation per ``collective_rpc``, from the call to the decoded results) and
    ``interp_collected_requests_total``. One set a process (``collect_metrics``): Prometheus refuses a second
    metric of a name."""

    def __init__(self):
        from prometheus_client import Counter, Histogram

        self.seconds = Histogram("interp_collect_seconds", "interp-serve: one read-back of finished requests' results "
                                 "from the workers (collective_rpc)",
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
        self.requests = Counter("interp_collected_requests", "interp-serve: requests whose results were read back")
        self.carried = Counter("interp_carried_results", "interp-serve: requests whose results came with their last "
                               "output")


collect_metrics = functools.cache(CollectMetrics)


@dataclass
class Call:
    """One HTTP request's interventions and, once it finished, its workers' results."""

    compiled: Compiled
    prompts: int = 0  # engine requests made for it (one allowed)
    result: dict | None = None
    rid: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


CURRENT: contextvars.ContextVar[Call | None] = contextvars.ContextVar("interp_call", default=None)


def carried_results(out) -> bytes | None:
    """The results a finished request's last output carries (``plugin.served_results``), taken out of it: vLLM's
    serving code would put its ``kv_transfer_params`` in the response."""
    params = out.kv_transfer_params
    if not params or RESULTS_KEY not in params:
        return None
    params = dict(params)
    carried = params.pop(RESULTS_KEY)
    out.kv_transfer_params = params or None
    return carried


class Collector:
    """Reads finished requests' results off the workers, all that finished since the last read in one call."""

    def __init__(self, engine):
        self.engine = engine
        self.waiting: dict[str, asyncio.Future | None] = {}
        self.task: asyncio.Task | None = None
        self.metrics = collect_metrics()

    def collect(self, rid: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiting[rid] = future
        self._kick()
        return future

    def release(self, rid: str) -> None:
        """An aborted request: whatever it left on the workers is freed, nobody waits for it."""
        self.waiting.setdefault(rid, None)
        self._kick()

    def _kick(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self.waiting:
            batch, self.waiting = self.waiting, {}
            try:
                results: dict = {}
                t0 = time.perf_counter()
                with result_block() as block:
                    per_rank = await self.engine.collective_rpc(COLLECT, args=(list(batch), True, [], block))
                    for message in per_rank:
                        if message is not None:  # None: a rank other than the result rank
                            results.update(received(message, block))
                self.metrics.seconds.observe(time.perf_counter() - t0)
                self.metrics.requests.inc(len(batch))
            except Exception as err:  # the engine died: every waiter hears of it
                for future in batch.values():
                    if future is not None and not future.done():
                        future.set_exception(err)
                continue
            for rid, future in batch.items():
                if future is not None and not future.done():
                    future.set_result(results.get(rid, {}))


class InterpEngine:
    """Installs the interp ``generate`` on vLLM's engine client (an instance attribute: vLLM's serving classes call
    ``engine_client.generate``) and registers vectors on its workers."""

    def __init__(self, engine):
        self.engine = engine
        self.collector = Collector(engine)
        self.registered: set[str] = set()
        self.registering: dict[str, asyncio.Future] = {}  # vector -> its registration on its way
        self._generate = engine.generate
        engine.generate = self.generate

    async def register(self, vectors: dict[str, np.ndarray]) -> None:
        """Vectors onto the workers, each once: requests arriving while one is on its way wait for that call (each
        call blocks the engine core's loop, and requests added ahead of it wait for it too)."""
        pending = self.registering
        new = {k: np.asarray(v, dtype=np.float32).tobytes() for k, v in vectors.items()
               if k not in self.registered and k not in pending}
        calls = {pending[k] for k in vectors if k in pending}
        if new:
            call = asyncio.ensure_future(self.engine.collective_rpc(REGISTER_VECTORS, args=(new,)))
            pending.update(dict.fromkeys(new, call))
            call.add_done_callback(lambda done: self._registered(new, done))
            calls.add(call)
        for call in calls:
            await asyncio.shield(call)  # a request gone does not cancel the others' registration

    def _registered(self, names, call: asyncio.Future) -> None:
        for name in names:
            self.registering.pop(name, None)
        if not call.cancelled() and call.exception() is None:
            self.registered.update(names)

    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        call = CURRENT.get()
        if call is None:
            return self._generate(prompt, sampling_params, request_id, *args, **kwargs)
        call.prompts += 1
        if call.prompts > 1:
            raise ValueError("interp: a request with an interp object takes one prompt and n = 1")
        return self._run(call, prompt, sampling_params, request_id, args, kwargs)

    async def _run(self, call: Call, prompt, sampling_params, request_id, args, kwargs):
        token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if token_ids is None:
            raise ValueError("interp: the prompt reached the engine without token ids")
        rid = call.rid = f"serve-{uuid.uuid4().hex}"
        payload, private = call.compiled.payload(rid, list(token_ids))
        if payload is None:  # nothing to apply
            outputs = self._generate(prompt, sampling_params, request_id, *args, **kwargs)
            try:
                async for out in outputs:
                    yield out
            finally:
                await outputs.aclose()
            call.done.set()
            return
        await self.register(call.compiled.vectors)
        sampling_params.extra_args = {**(sampling_params.extra_args or {}), PAYLOAD_KEY: encode_payload(payload)}
        if private:
            sampling_params.skip_reading_prefix_cache = True
        collected = False
        outputs = self._generate(prompt, sampling_params, request_id, *args, **kwargs)
        try:
            async for out in outputs:
                carried = carried_results(out)
                yield out
                if out.finished:  # its last tokens are on their way: its results come with them or are read back
                    # after them, before the response ends (vLLM's serving code reads this generator to its end
                    # before a stream's [DONE] or a whole response)
                    if carried is not None:
                        call.result = received(carried, "").get(rid, {})
                        self.collector.metrics.carried.inc()
                    else:
                        call.result = await self.collector.collect(rid)
                    collected = True
                    call.done.set()
        finally:
            await outputs.aclose()  # a client gone: vLLM aborts the request now, not when this is collected
            if not collected:
                self.collector.release(rid)
