"""Instrumented forwards of the decoder blocks, built from each family's block layout (``models.layouts``).

A block with ``fused_add_norm`` (all but GPT-2 and GPT-NeoX, whose blocks return the stream itself:
``plain_blocks``) returns ``(hidden, residual)`` and vLLM defers each add into the next fused add+norm, so the
residual stream at a site is ``hidden + residual``. Steering the stream adds to ``residual``; capturing it adds the
halves on the copied rows only; patching it (``interp::site_pair``) replaces both halves of the patched rows. Under
torch.compile, the ops at ``post_block`` and ``pre_attn`` act on ``residual`` in float32 (``_wide``): there Inductor
keeps the stream that the last fused add made in float32 until the next add reads it, so a site with nothing to do
leaves the model's own numbers, bit for bit. So do the branch ops after a post-branch norm, whose output Inductor
also hands the next add in float32.

A branch hook sees the branch's output after the family's post-branch norm, if any (``BlockLayout.post_attn_norm`` /
``post_mlp_norm``): what is added to the stream. A MoE block's ``router_logits`` site (capture only) runs the router
on the MLP's input and copies its logits out (``interp::capture_only``). Sites without an op cost nothing: which
sites carry one is fixed when the engine is built (``additional_config``), so compiled graphs see plain, static
code. After the last layer, the stream the model's final norm reads is checked for non-finite values
(``nonfinite``).
"""

from __future__ import annotations

import importlib

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index

from interp_runner.models.layouts import BlockLayout, layouts_by_class
from interp_runner.contracts import ENGINE_KEY, plugin_spec_of
from interp_runner.sites import ROUTER_LOGITS, site_id

from interp_runner.plugin import runtime
from interp_runner.plugin.ops import apply_pair, apply_site, capture_only, flag_rows
from interp_runner.plugin.expert_group import ensure_expert_group
from interp_runner.plugin.plain_blocks import plain_forward


def _site_op(self):
    """``at(hook, x, extra)``: (x, extra) after the site's op; extra is only replaced where the site patches the
    stream."""
    sites = self._interp_sites
    state = self._interp_state
    direct = state.direct_sites  # None but in a step run layer by layer (never in a compiled graph)

    def at(hook, x, extra):
        site = sites.get(hook)
        if site is None:
            return x, extra
        pair = extra is not None and site in self._interp_pair_sites
        if direct is not None:  # outside any graph: the op's work called as it is, where it has any
            if site in direct:
                (state.apply_pair if pair else state.apply_site)(x, extra, site)
            return x, extra
        if pair:
            return apply_pair(x, extra, site)
        return apply_site(x, extra, site), extra

    return at


def _capture_router(self, router, mlp_input) -> None:
    """Capture the router's logits for the MLP's input at this layer's ``router_logits`` site. The router runs once
    more here (the model's own call sits inside vLLM's fused-MoE op): the same module on the same rows."""
    logits, _ = router(mlp_input)
    site = self._interp_router_site
    direct = self._interp_state.direct_sites
    if direct is None:
        capture_only(logits, site)
    elif site in direct:
        self._interp_state.capture_only(logits, site)


def _check_final_stream(self, hidden_states, residual) -> None:
    """Rows the final norm cannot normalize: the float32 sum of squares of the stream it reads is not finite."""
    bad = ~torch.isfinite((hidden_states + residual).float().square().sum(-1))
    if self._interp_state.direct_sites is not None:
        self._interp_state.flag_rows(bad)
    else:
        flag_rows(bad)


def _wide(self, at):
    """``at`` for a site whose tensor the next fused add+norm of the same compiled graph reads, acting on it in float32.

    vLLM's norms round their results to the model's dtype, and the next fused add widens them again: Inductor drops
    that round trip, so compiled vLLM hands the float32 value from one to the other (the stream from one fused add to
    the next, a post-branch norm's output to the add after it). An op given the rounded tensor would round it there
    and move every later number; given ``x.float()`` it sees the float32 value, and where it changes nothing the next
    add reads the very same values. Only for torch.compile: outside it (eager engines, steps run layer by layer) the
    round trip stays, so the op takes ``x`` as it is."""

    def at_wide(hook, x, extra):
        if hook not in self._interp_sites:
            return at(hook, x, extra)
        wide, extra = at(hook, x.float(), extra)
        return wide.to(x.dtype), extra

    return at_wide


def fused_add_norm_forward(layout: BlockLayout):
    """The instrumented forward of a pre-norm block whose adds vLLM defers into fused add+norms."""
    pre_attn_norm, pre_mlp_norm = layout.pre_attn_norm, layout.pre_mlp_norm
    post_attn_norm, post_mlp_norm = layout.post_attn_norm, layout.post_mlp_norm
    attn_name, mlp_name, router_name = layout.attn, layout.mlp, layout.router

    def forward(self, positions, hidden_states, residual, **kwargs):
        if self._interp_sites is None:
            return self._interp_original_forward(positions, hidden_states, residual, **kwargs)
        at = _site_op(self)
        at_wide = _wide(self, at) if torch.compiler.is_compiling() else at
        at_attn_out = at_wide if post_attn_norm is not None else at
        at_mlp_out = at_wide if post_mlp_norm is not None else at
        if residual is None:
            hidden_states, _ = at("pre_attn", hidden_states, None)
            residual = hidden_states
            hidden_states = getattr(self, pre_attn_norm)(hidden_states)
        else:
            residual, hidden_states = at_wide("pre_attn", residual, hidden_states)
            hidden_states, residual = getattr(self, pre_attn_norm)(hidden_states, residual)
        hidden_states = getattr(self, attn_name)(positions=positions, hidden_states=hidden_states, **kwargs)
        if post_attn_norm is not None:
            hidden_states = getattr(self, post_attn_norm)(hidden_states)
        hidden_states, _ = at_attn_out("attn_out", hidden_states, None)
        residual, hidden_states = at("post_attn", residual, hidden_states)

        hidden_states, residual = getattr(self, pre_mlp_norm)(hidden_states, residual)
        if self._interp_router_site is not None:
            _capture_router(self, getattr(getattr(self, mlp_name), router_name), hidden_states)
        hidden_states = getattr(self, mlp_name)(hidden_states)
        if post_mlp_norm is not None:
            hidden_states = getattr(self, post_mlp_norm)(hidden_states)
        hidden_states, _ = at_mlp_out("mlp_out", hidden_states, None)
        residual, hidden_states = at_wide("post_block", residual, hidden_states)
        if self._interp_last:
            _check_final_stream(self, hidden_states, residual)
        return hidden_states, residual

    return forward


def block_forward(layout: BlockLayout):
    """The instrumented forward for ``layout``'s kind of block; a kind without one is refused."""
    if layout.fused_add_norm and not layout.parallel_residual and layout.pre_attn_norm and layout.pre_mlp_norm:
        return fused_add_norm_forward(layout)
    if not layout.fused_add_norm and layout.pre_attn_norm and layout.pre_mlp_norm and not layout.sandwich \
            and layout.router is None:
        return plain_forward(layout, _site_op, _check_final_stream)
    raise NotImplementedError(f"interp ops have no instrumented forward for {layout.family}'s block layout")


def _instrumented_init(original_init, layout: BlockLayout):
    def __init__(self, *args, **kwargs):
        if layout.router is not None:  # a MoE block's experts need vLLM's expert-parallel group
            ensure_expert_group()
        original_init(self, *args, **kwargs)
        self._interp_sites = None
        spec = (get_current_vllm_config().additional_config or {}).get(ENGINE_KEY)
        if spec is None:
            return
        spec = plugin_spec_of(spec)
        if getattr(self, "ada_rms_norm_t_cond", None) is not None:
            raise NotImplementedError("interp ops do not support adaptive RMS-norm decoder layers")
        state = runtime.state_for_current_engine(spec)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        layer = extract_layer_index(prefix)
        active = set(spec.steer_sites) | set(spec.capture_sites) | set(spec.patch_sites)
        self._interp_sites = {
            hook: site_id(layer, hook)
            for hook in layout.hooks
            if site_id(layer, hook) in active
        }
        router_site = site_id(layer, ROUTER_LOGITS)
        routed = layout.router is not None and hasattr(getattr(self, layout.mlp), layout.router)  # not a dense layer
        self._interp_router_site = router_site if routed and router_site in spec.capture_sites else None
        self._interp_pair_sites = frozenset(s for s in self._interp_sites.values() if s in state.patch_index)
        self._interp_state = state
        # the last layer's output is what the model's final norm reads
        self._interp_last = layer == get_current_vllm_config().model_config.hf_text_config.num_hidden_layers - 1
        state.instrumented_layers.add(layer)

    return __init__


def instrument_decoder_layers() -> None:
    for (module_name, class_name), layout in layouts_by_class().items():
        cls = getattr(importlib.import_module(module_name), class_name)
        if "_interp_original_forward" in cls.__dict__:
            continue
        cls._interp_original_forward = cls.forward
        cls.forward = block_forward(layout)
        cls.__init__ = _instrumented_init(cls.__init__, layout)
