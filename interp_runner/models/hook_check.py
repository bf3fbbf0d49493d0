"""Hooks a model's family lacks are refused before any engine starts, naming the config key.

``check_config_hooks`` walks the validated config for every key that names a hook where the run acts (steering
tiers, capture and patch specs, a kind's ``hooks`` / ``hook`` / ``resid_hook``) and refuses each hook that is not
in the family's ``BlockLayout.hooks`` (a capture entry's: in its ``capture_hooks``, which add the capture-only
``router_logits`` where the block has a router). ``check_plan_hooks`` is the backstop for hooks a kind derives (e.g.
a causal trace's ``components``): every site the compiled plan acts at must exist in the family's block.
"""

from __future__ import annotations

from pydantic import BaseModel

from interp_runner.components import COMPONENTS
from interp_runner.config.errors import ConfigError
from interp_runner.sites import CAPTURE_HOOKS, CAPTURE_ONLY_HOOKS, HOOKS, ROUTER_LOGITS, site_of
from interp_runner.models.layouts import BlockLayout, router_families

HOOK_KEYS = ("hook", "hooks", "resid_hook", "eval_hook")
# a vector read from a store names the hook it was derived at (another model's, possibly), not where it acts
NOT_WHERE_IT_ACTS = ("VectorSpec",)


def _walk(value, path: str):
    """(key path, hook) of every hook the config names where the run acts."""
    if isinstance(value, BaseModel):
        if type(value).__name__ in NOT_WHERE_IT_ACTS:
            return
        for name, field in type(value).model_fields.items():
            item = getattr(value, name)
            key = f"{path}.{field.alias or name}" if path else field.alias or name
            if name in HOOKS and item is not None:  # a steering tier: one key per hook
                yield key, name
            elif name in HOOK_KEYS and isinstance(item, str):
                yield key, item
            elif name in HOOK_KEYS and isinstance(item, (list, tuple)):
                yield from ((f"{key}[{i}]", h) for i, h in enumerate(item) if isinstance(h, str))
            elif name == "components" and isinstance(item, (list, tuple)):  # a causal trace's: their hooks
                yield from ((f"{key}[{i}]", COMPONENTS[c].hook) for i, c in enumerate(item) if COMPONENTS[c].hook)
            else:
                yield from _walk(item, key)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _walk(item, f"{path}.{k}")


def _refusal(layout: BlockLayout, hook: str) -> str:
    reason = (f"{hook!r} is not a hook of {layout.family} blocks (architectures {', '.join(layout.architectures)}); "
              f"their hooks: {', '.join(layout.capture_hooks)}")
    if hook in CAPTURE_ONLY_HOOKS:
        reason += f"; {hook} exists in the blocks of MoE families with a router: {', '.join(router_families())}"
    return reason


def check_config_hooks(cfg: BaseModel, layout: BlockLayout) -> None:
    """Every hook the config names must exist in the family's block."""
    problems = [(key, _refusal(layout, hook)) for key, hook in _walk(cfg, "")
                if hook in CAPTURE_HOOKS and hook not in layout.capture_hooks]
    if problems:
        raise ConfigError(problems)


def check_routed_layers(hooks, layers, routing, key: str) -> None:
    """``router_logits`` only at layers whose MLP has a router (``routing``: the model's ``ModelFacts.routing``;
    ``key``: the layers' config key)."""
    dense = sorted(set(layers) & set(routing.dense_layers)) if ROUTER_LOGITS in hooks and routing else []
    if dense:
        raise ConfigError.at(key, f"layers {dense} of this model have a dense MLP, without a router to capture "
                                  f"{ROUTER_LOGITS} from")


def check_plan_hooks(sites, layout: BlockLayout, key: str) -> None:
    """Every site the plan acts at must be a hook of the family's block (``key``: the config key blamed)."""
    missing = sorted({site_of(site)[1] for site in sites} - set(layout.capture_hooks), key=CAPTURE_HOOKS.index)
    if missing:
        raise ConfigError.at(key, "; ".join(_refusal(layout, hook) for hook in missing))
