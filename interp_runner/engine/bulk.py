"""The bulk path: one-token requests straight into vLLM's engine core (the causal-trace path), packed where the
engine packs cells. ``VllmEngine.run`` takes it when every request generates one token and wants no top-k."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import numpy as np

from interp_runner.compile.packing import PackedRequest, group_cells
from interp_runner.compile.requests import EngineRequest, transported
from interp_runner.engine.results import RequestResult


def run_bulk(adapter, requests: Sequence[EngineRequest], progress=None) -> dict[str, RequestResult]:
    """One-token requests of ``adapter`` (a ``VllmEngine``) straight into the engine core: no input rendering, no
    output processing.

    ``LLM.generate`` spends a large share of a short request's cost in its front end (prompt rendering and
    parameter processing per request; detokenization and ``RequestOutput`` objects on the way out). Here the
    sampling parameters are processed once per distinct setting and shallow-copied per request with its own
    payload; the core's outputs are read directly. Same scheduler, model runner and sampling as ``generate``.
    With ``pack_cells``, cells that share a prompt prefix go in shared engine requests (``packing``)."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.v1.engine import EngineCoreRequest

    engine = adapter.llm.llm_engine
    core = engine.engine_core
    config = engine.vllm_config
    groups, single = [], list(requests)
    if adapter.pack_cells:
        # room for the one token the engine generates
        limit = min(config.model_config.max_model_len - 1, config.scheduler_config.max_num_batched_tokens)
        groups, single = group_cells(requests, config.cache_config.block_size, limit)

    def submissions():
        for r in single:
            yield r.rid, list(r.prompt.token_ids), transported(r.sampling), r
        for group in groups:  # each packed request made as it is submitted
            p = group.request()
            yield p.rid, p.token_ids, p.sampling, p

    # where the engine queues a step and returns (async scheduling, in this process), a step starts as soon as
    # a step's worth of tokens is in: the GPU computes it while the next ones are made and submitted
    step_tokens = (adapter.step_tokens or config.scheduler_config.max_num_batched_tokens) \
        if adapter.steps_overlap() else None
    processed: dict[str, object] = {}
    pending: dict[str, EngineRequest | PackedRequest] = {}
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    cached: dict[str, int] = {}
    done: set[str] = set()

    def take(outputs) -> None:
        for out in outputs.outputs:
            if out.request_id not in pending:
                continue
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(
                    float(x) for x in np.asarray(out.new_logprobs.logprobs)[:, 0])
            if out.prefill_stats is not None:
                cached[out.request_id] = int(out.prefill_stats.num_cached_tokens)
            if out.finished:
                done.add(out.request_id)
                if progress is not None:
                    request = pending[out.request_id]
                    progress(len(request.members) if isinstance(request, PackedRequest) else 1)

    arrival = time.time()
    submitted = 0
    try:
        for rid, token_ids, sampling, request in submissions():
            settings = {k: v for k, v in sampling.items() if k != "extra_args"}
            key = repr(sorted(settings.items()))
            params = processed.get(key)
            if params is None:
                params = engine.input_processor.process_inputs(
                    rid, tokens_input(token_ids), SamplingParams(**settings),
                    supported_tasks=engine.get_supported_tasks(),
                ).sampling_params
                processed[key] = params
            params = copy.copy(params)
            params.extra_args = sampling.get("extra_args")
            adapter.serial += 1
            internal = f"{rid}-{adapter.serial:08x}"
            pending[internal] = request
            core.add_request(EngineCoreRequest(
                request_id=internal, prompt_token_ids=token_ids, mm_features=None,
                sampling_params=params, pooling_params=None, arrival_time=arrival, lora_request=None,
                cache_salt=None, data_parallel_rank=None, external_req_id=rid,
            ))
            submitted += len(token_ids)
            if step_tokens is not None and submitted >= step_tokens:
                take(core.get_output())
                submitted = 0
        while len(done) < len(pending):
            take(core.get_output())
    except BaseException:
        core.abort_requests([k for k in pending if k not in done])
        raise
    collected = adapter.collect([r.rid for r in requests],
                              [r.rid for r in pending.values() if isinstance(r, PackedRequest)])
    decode = adapter.llm.get_tokenizer().decode
    texts: dict[tuple, str] = {}  # one token each: few distinct ones

    def result(request: EngineRequest, ids: list[int], chosen: list[float], cached_tokens: int,
               worker: dict) -> RequestResult:
        key = tuple(ids)
        text = texts.get(key)
        if text is None:
            text = texts[key] = decode(ids, skip_special_tokens=True)
        return RequestResult(
            rid=request.rid, prompt_index=request.prompt.index, token_ids=ids, text=text, logprobs=chosen,
            captures=worker.get("captures", {}), score=worker.get("score"), void=worker.get("void"),
            nonfinite=bool(worker.get("nonfinite", False)), cached_tokens=cached_tokens,
        )

    results = {}
    for internal, request in pending.items():
        if isinstance(request, EngineRequest):
            results[request.rid] = result(request, tokens.get(internal, []), logprobs.get(internal, []),
                                          cached.get(internal, 0), collected.get(request.rid, {}))
            continue
        # a packed cell's token is its greedy choice: the top token its score read
        cached_tokens = min(cached.get(internal, 0), request.prefix)
        for member in request.members:
            worker = collected.get(member.rid, {})
            score = worker.get("score")
            ids, chosen = ([score["top_id"]], [score["top_logprob"]]) if score else ([], [])
            results[member.rid] = result(member, ids, chosen, cached_tokens, worker)
    return results
