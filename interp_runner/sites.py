"""Hook points of a pre-norm decoder block and their numbering.

A site is one (layer, hook) pair; its integer id is ``layer * len(HOOKS) + hook index``.
Residual-stream hooks see the stream itself; sub-layer hooks see a sub-layer's output before it is added.

Capture-only hooks (``CAPTURE_ONLY_HOOKS``) are read, never acted on (no steering, no patching), and exist only
in blocks whose layout has them: ``router_logits``, a MoE block's router logits (one per expert), in layouts with
a ``router``. Their sites are numbered from ``CAPTURE_ONLY_BASE`` on (``CAPTURE_ONLY_BASE * (1 + index) + layer``),
so the ids of ``HOOKS``' sites do not depend on them.
"""

from __future__ import annotations

HOOKS: tuple[str, ...] = ("pre_attn", "attn_out", "post_attn", "mlp_out", "post_block")
RESIDUAL_HOOKS = frozenset({"pre_attn", "post_attn", "post_block"})
HOOK_INDEX = {name: i for i, name in enumerate(HOOKS)}
ROUTER_LOGITS = "router_logits"
CAPTURE_ONLY_HOOKS: tuple[str, ...] = (ROUTER_LOGITS,)
CAPTURE_HOOKS: tuple[str, ...] = HOOKS + CAPTURE_ONLY_HOOKS  # every hook a capture entry may name
CAPTURE_ONLY_BASE = 1 << 20  # above layer * len(HOOKS) + index of any model's sites


def site_id(layer: int, hook: str) -> int:
    index = HOOK_INDEX.get(hook)
    if index is not None:
        return layer * len(HOOKS) + index
    return CAPTURE_ONLY_BASE * (1 + CAPTURE_ONLY_HOOKS.index(hook)) + layer


def site_of(site: int) -> tuple[int, str]:
    if site >= CAPTURE_ONLY_BASE:
        return site % CAPTURE_ONLY_BASE, CAPTURE_ONLY_HOOKS[site // CAPTURE_ONLY_BASE - 1]
    return site // len(HOOKS), HOOKS[site % len(HOOKS)]


def capture_only_refusal(hook: str, act: str) -> str:
    """Why ``hook`` (a capture-only hook) cannot be ``act``-ed (steered, patched)."""
    return (f"{hook!r} is a capture-only site (a MoE block's router logits): it can be captured, not {act}; "
            f"hooks that can be {act}: {', '.join(HOOKS)}")
