"""One KV-cache group for models whose sliding-window layers sit beside global ones (Gemma 2, Gemma 3).

The engine asks vLLM for one group (``disable_hybrid_kv_cache_manager``): the plugin's KV reads (kept KV, packed
cells) address one block table. vLLM 0.26 then turns each sliding-window layer's ``SlidingWindowSpec`` into a
``FullAttentionSpec`` (``kv_cache_utils.unify_hybrid_kv_cache_specs``) but keeps the block size a
sliding-window layer picks for itself (``Attention.get_kv_cache_spec``: 16 tokens on the CPU backend, where
global layers use 128) and drops ``indexes_kv_by_block_stride``, so the specs differ and vLLM refuses to start.
This converts those layers first, at the global layers' block size with every other field kept; vLLM's own
function then finds the specs uniform. Each layer still attends within its own window (its attention layer keeps
its ``sliding_window``).
"""

from __future__ import annotations

from dataclasses import fields


def _as_full_attention(spec, full_cls, block_size: int):
    names = {f.name for f in fields(full_cls)}
    kept = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name in names}
    return full_cls(**{**kept, "block_size": block_size})


def keep_fields_when_unifying() -> None:
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    original = kv_cache_utils.unify_hybrid_kv_cache_specs
    if getattr(original, "_interp_patched", False):
        return

    def unify_hybrid_kv_cache_specs(kv_cache_spec):
        kinds = {type(spec) for spec in kv_cache_spec.values()}
        if kinds == {FullAttentionSpec, SlidingWindowSpec}:  # only these two kinds: nothing else to convert
            full = next(spec for spec in kv_cache_spec.values() if type(spec) is FullAttentionSpec)
            for name, spec in kv_cache_spec.items():
                if type(spec) is SlidingWindowSpec:
                    kv_cache_spec[name] = _as_full_attention(spec, FullAttentionSpec, full.block_size)
        return original(kv_cache_spec)

    unify_hybrid_kv_cache_specs._interp_patched = True
    kv_cache_utils.unify_hybrid_kv_cache_specs = unify_hybrid_kv_cache_specs
