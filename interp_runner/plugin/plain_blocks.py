"""Instrumented forwards of blocks that return the residual stream itself (``BlockLayout.fused_add_norm`` False).

GPT-2's block is called as ``block(hidden_states)`` and GPT-NeoX's as ``layer(position_ids, hidden_states)``;
their attention modules take the same leading arguments, so the forward passes whatever precedes the stream on to
the attention branch. The stream is one tensor, so every op acts on it alone (``extra`` None): steering adds to
it, capture copies it, patching mixes it.

- sequential (GPT-2): ``x -> pre_attn``; ``a = attn(ln1(x)) -> attn_out``; ``x + a -> post_attn``;
  ``m = mlp(ln2(x + a)) -> mlp_out``; ``x + a + m -> post_block``.
- parallel residual (GPT-NeoX/Pythia): ``x -> pre_attn``; ``a = attn(ln1(x)) -> attn_out``;
  ``m = mlp(ln2(x)) -> mlp_out``; ``m + a + x -> post_block`` (no ``post_attn``: no stream exists between them).
"""

from __future__ import annotations

from collections.abc import Callable

from interp_runner.models.layouts import BlockLayout


def plain_forward(layout: BlockLayout, site_op: Callable, check_final_stream: Callable):
    """The instrumented forward of ``layout``'s block. ``site_op(self)`` gives the block's ``at(hook, x, extra)``;
    ``check_final_stream(self, hidden, residual)`` flags the rows the final norm cannot normalize."""
    ln1, ln2, attn_name, mlp_name = layout.pre_attn_norm, layout.pre_mlp_norm, layout.attn, layout.mlp
    parallel = layout.parallel_residual

    def forward(self, *args, **kwargs):
        if self._interp_sites is None:
            return self._interp_original_forward(*args, **kwargs)
        *lead, x = args if "hidden_states" not in kwargs else (*args, kwargs.pop("hidden_states"))
        at = site_op(self)
        x, _ = at("pre_attn", x, None)
        a = getattr(self, attn_name)(*lead, getattr(self, ln1)(x), **kwargs)
        a, _ = at("attn_out", a, None)
        if parallel:
            m = getattr(self, mlp_name)(getattr(self, ln2)(x))
            m, _ = at("mlp_out", m, None)
            x = m + a + x
        else:
            x = x + a
            x, _ = at("post_attn", x, None)
            m = getattr(self, mlp_name)(getattr(self, ln2)(x))
            m, _ = at("mlp_out", m, None)
            x = x + m
        x, _ = at("post_block", x, None)
        if self._interp_last:
            check_final_stream(self, x, 0.0)
        return x

    return forward
