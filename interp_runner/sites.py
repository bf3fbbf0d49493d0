"""Hook points of a pre-norm decoder block and their numbering.

A site is one (layer, hook) pair; its integer id is ``layer * len(HOOKS) + hook index``.
Residual-stream hooks see the stream itself; sub-layer hooks see a sub-layer's output before it is added.
"""

from __future__ import annotations

HOOKS: tuple[str, ...] = ("pre_attn", "attn_out", "post_attn", "mlp_out", "post_block")
RESIDUAL_HOOKS = frozenset({"pre_attn", "post_attn", "post_block"})
HOOK_INDEX = {name: i for i, name in enumerate(HOOKS)}


def site_id(layer: int, hook: str) -> int:
    return layer * len(HOOKS) + HOOK_INDEX[hook]


def site_of(site: int) -> tuple[int, str]:
    return site // len(HOOKS), HOOKS[site % len(HOOKS)]
