"""Prefix caching that knows about interventions (runs in vLLM's engine-core process).

A request's payload lists ``kv`` ranges (``contracts.KvRange``): one says that positions ``start <= p < end``
(end -1: to the end) were computed under interventions summed up by ``digest``. Each full block's hash gets the
digests of the ranges it overlaps as extra keys, on top of vLLM's own (LoRA, multimodal, cache_salt). Since
block hashes chain, a block is shared only between requests with the same tokens and the same interventions up
to its end: blocks entirely before the first intervened position stay shared with unpatched requests, and
nothing computed under an intervention is served to a request without it (or with another).

Blocks reaching past the payload's ``kv_private`` position chain in interventions no other request of the plan
has (a causal-trace cell's restore): they get a placeholder hash unique to the request and block instead of a
hash of their contents, and are left out of the prefix cache. That is about half of a trace's blocks, whose
hashing and caching were the largest host cost per request.
"""

from __future__ import annotations

from interp_runner.contracts import payload_of

PRIVATE = "interp-private"


def _interventions(request) -> tuple[tuple, int]:
    """(kv ranges, first private position or -1) of a request, read from its payload once."""
    cached = request.__dict__.get("_interp_kv")
    if cached is None:
        payload = payload_of(getattr(request, "sampling_params", None))
        if payload is None:
            cached = ((), -1)
        else:
            private = payload.kv_private
            cached = (tuple((x.start, x.end, x.digest) for x in payload.kv), -1 if private is None else private)
        request._interp_kv = cached
    return cached


def _with_interventions(original):
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        ranges, private = _interventions(request)
        if 0 <= private < end_token_idx:  # private from here on: a placeholder, not a hash of the contents
            return (PRIVATE, request.request_id, start_token_idx), start_mm_idx
        keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        if not ranges:
            return keys, next_mm_idx
        ours = tuple(d for s, e, d in ranges if s < end_token_idx and (e < 0 or e > start_token_idx))
        if not ours:
            return keys, next_mm_idx
        return (keys or ()) + ("interp",) + ours, next_mm_idx

    generate_block_hash_extra_keys._interp_wrapped = True
    return generate_block_hash_extra_keys


def _private_placeholder(original):
    def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
        if extra_keys and extra_keys[0] == PRIVATE:  # (PRIVATE, request id, first token): never a real hash
            return f"{PRIVATE}:{extra_keys[1]}:{extra_keys[2]}".encode()
        return original(hash_function, parent_block_hash, curr_block_token_ids, extra_keys)

    return hash_block_tokens


def _without_private_blocks(original):
    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None):
        _, private = _interventions(request)
        # placeholders are per hash block: mask only where cache blocks are hash blocks (else they are cached,
        # harmlessly: no other request has their hashes)
        if private >= 0 and block_size == self.hash_block_size and num_full_blocks > num_cached_blocks:
            first = private // block_size
            if first < num_full_blocks:
                mask = [num_cached_blocks + i < first for i in range(num_full_blocks - num_cached_blocks)]
                block_mask = mask if block_mask is None else [a and b for a, b in zip(mask, block_mask)]
        return original(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                        block_mask)

    return cache_full_blocks


def _private_in_bulk(original_factory):
    """vLLM's request block hasher, with a request's private blocks given their placeholders in one go."""
    def get_request_block_hasher(hash_block_size, caching_hash_fn):
        from vllm.v1.core import kv_cache_utils

        hasher = original_factory(hash_block_size, caching_hash_fn)

        def request_block_hasher(request):
            done = len(request.block_hashes)
            if (done + 1) * hash_block_size > request.num_tokens:  # no new full block: most decode steps
                return []
            _, private = _interventions(request)
            if private < 0:
                return hasher(request)
            total = request.num_tokens // hash_block_size
            first_private = private // hash_block_size
            new, prev, mm = [], request.block_hashes[-1] if done else None, 0 if done == 0 else -1
            for b in range(done, min(first_private, total)):  # shared blocks: as vLLM hashes them
                start = b * hash_block_size
                extra, mm = kv_cache_utils.generate_block_hash_extra_keys(request, start, start + hash_block_size, mm)
                prev = kv_cache_utils.hash_block_tokens(
                    caching_hash_fn, prev, request.all_token_ids[start : start + hash_block_size], extra)
                new.append(prev)
            head = f"{PRIVATE}:{request.request_id}:".encode()  # the placeholders hash_block_tokens gives
            new += [head + b"%d" % (b * hash_block_size) for b in range(max(done, first_private), total)]
            return new

        return request_block_hasher

    return get_request_block_hasher


def instrument_block_hashing() -> None:
    from vllm.v1.core import block_pool, kv_cache_utils
    from vllm.v1.engine import core

    original = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(original, "_interp_wrapped", False):
        return
    wrapped = _with_interventions(original)
    kv_cache_utils.generate_block_hash_extra_keys = wrapped  # the request block hasher
    block_pool.generate_block_hash_extra_keys = wrapped  # cache events
    kv_cache_utils.hash_block_tokens = _private_placeholder(kv_cache_utils.hash_block_tokens)
    block_pool.BlockPool.cache_full_blocks = _without_private_blocks(block_pool.BlockPool.cache_full_blocks)
    core.get_request_block_hasher = _private_in_bulk(core.get_request_block_hasher)
