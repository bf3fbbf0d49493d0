"""Prefix caching that knows about interventions (runs in vLLM's engine-core process).

A request's payload lists ``kv`` ranges: ``[start, end, digest]`` says that positions ``start <= p < end``
(end -1: to the end) were computed under interventions summed up by ``digest``. Each full block's hash gets the
digests of the ranges it overlaps as extra keys, on top of vLLM's own (LoRA, multimodal, cache_salt). Since
block hashes chain, a block is shared only between requests with the same tokens and the same interventions up
to its end: blocks entirely before the first intervened position stay shared with unpatched requests, and
nothing computed under an intervention is served to a request without it (or with another).
"""

from __future__ import annotations

from interp_runner.payload import PAYLOAD_KEY


def _kv_ranges(request) -> list | None:
    params = getattr(request, "sampling_params", None)
    extra = params.extra_args if params is not None else None
    payload = extra.get(PAYLOAD_KEY) if extra else None
    return payload.get("kv") if payload else None


def _with_interventions(original):
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        ranges = _kv_ranges(request)
        if not ranges:
            return keys, next_mm_idx
        ours = tuple(d for s, e, d in ranges if s < end_token_idx and (e < 0 or e > start_token_idx))
        if not ours:
            return keys, next_mm_idx
        return (keys or ()) + ("interp",) + ours, next_mm_idx

    generate_block_hash_extra_keys._interp_wrapped = True
    return generate_block_hash_extra_keys


def instrument_block_hashing() -> None:
    from vllm.v1.core import block_pool, kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(original, "_interp_wrapped", False):
        return
    wrapped = _with_interventions(original)
    kv_cache_utils.generate_block_hash_extra_keys = wrapped  # the request block hasher
    block_pool.generate_block_hash_extra_keys = wrapped  # cache events
