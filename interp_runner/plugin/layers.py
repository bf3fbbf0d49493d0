"""Instrumented forward for the pre-norm decoder blocks of the Llama family (Llama, Mistral, Qwen2, Qwen3).

vLLM's block returns ``(hidden, residual)`` and defers the add into the next fused add+norm, so the residual
stream at a site is ``hidden + residual``. Steering the stream adds to ``residual``; capturing it adds the halves
on the copied rows only; patching it (``interp::site_pair``) replaces both halves of the patched rows. Sites
without an op cost nothing: which sites carry one is fixed when the engine is built (``additional_config``), so
compiled graphs see plain, static code. After the last layer, the stream the model's final norm reads is checked
for non-finite values (``nonfinite``).
"""

from __future__ import annotations

import importlib

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index

from interp_runner.models.architectures import DECODER_LAYERS
from interp_runner.payload import ENGINE_KEY
from interp_runner.sites import HOOKS, site_id

from . import runtime
from .ops import apply_pair, apply_site, flag_rows


def instrumented_forward(self, positions, hidden_states, residual, **kwargs):
    sites = self._interp_sites
    if sites is None:
        return self._interp_original_forward(positions, hidden_states, residual, **kwargs)
    state = self._interp_state
    direct = state.direct_sites  # None but in a step run layer by layer (never in a compiled graph)

    def at(hook, x, extra):
        """(x, extra) after the site's op; extra is only replaced where the site patches the stream."""
        site = sites.get(hook)
        if site is None:
            return x, extra
        pair = extra is not None and site in self._interp_pair_sites
        if direct is not None:  # outside any graph: the op's work called as it is, where it has any
            if site not in direct:
                return x, extra
            return state.apply_pair(x, extra, site) if pair else (state.apply_site(x, extra, site), extra)
        if pair:
            return apply_pair(x, extra, site)
        return apply_site(x, extra, site), extra

    if residual is None:
        hidden_states, _ = at("pre_attn", hidden_states, None)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    else:
        residual, hidden_states = at("pre_attn", residual, hidden_states)
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
    hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
    hidden_states, _ = at("attn_out", hidden_states, None)
    residual, hidden_states = at("post_attn", residual, hidden_states)

    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    hidden_states, _ = at("mlp_out", hidden_states, None)
    residual, hidden_states = at("post_block", residual, hidden_states)
    if self._interp_last:
        # rows the final norm cannot normalize: the float32 sum of squares of the stream it reads is not finite
        bad = ~torch.isfinite((hidden_states + residual).float().square().sum(-1))
        if direct is not None:
            state.flag_rows(bad)
        else:
            flag_rows(bad)
    return hidden_states, residual


def _instrumented_init(original_init):
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._interp_sites = None
        spec = (get_current_vllm_config().additional_config or {}).get(ENGINE_KEY)
        if spec is None:
            return
        if getattr(self, "ada_rms_norm_t_cond", None) is not None:
            raise NotImplementedError("interp ops do not support adaptive RMS-norm decoder layers")
        state = runtime.state_for_current_engine(spec)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        layer = extract_layer_index(prefix)
        active = set(spec["steer_sites"]) | set(spec["capture_sites"]) | set(spec["patch_sites"])
        self._interp_sites = {
            hook: site_id(layer, hook)
            for hook in HOOKS
            if site_id(layer, hook) in active
        }
        self._interp_pair_sites = frozenset(s for s in self._interp_sites.values() if s in state.patch_index)
        self._interp_state = state
        # the last layer's output is what the model's final norm reads
        self._interp_last = layer == get_current_vllm_config().model_config.hf_text_config.num_hidden_layers - 1
        state.instrumented_layers.add(layer)

    return __init__


def instrument_decoder_layers() -> None:
    for module_name, class_name in DECODER_LAYERS.values():
        cls = getattr(importlib.import_module(module_name), class_name)
        if "_interp_original_forward" in cls.__dict__:
            continue
        cls._interp_original_forward = cls.forward
        cls.forward = instrumented_forward
        cls.__init__ = _instrumented_init(cls.__init__)
