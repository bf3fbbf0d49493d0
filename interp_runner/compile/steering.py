"""Steering and capture entries of a prompt list: ``vectors:``, ``steering:`` and ``capture:`` -> each prompt's
payload entries, the vectors by key and where each capture goes in the store. Below every experiment kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import CaptureSpec, RunBase, Tiers
from interp_runner.models.facts import ModelFacts
from interp_runner.models.hook_check import check_routed_layers
from interp_runner.contracts import DECODE, PREFILL, Capture, Steer
from interp_runner.payload import pack_positions, vector_key
from interp_runner.compile.plan import CaptureLayout
from interp_runner.compile.requests import Prompt
from interp_runner.compile.overflow import FLOAT32_MAX, overflow_reason, squares
from interp_runner.compile.selectors import distinct_positions, parse_layers, parse_prompts
from interp_runner.sites import ROUTER_LOGITS, site_id
from interp_runner.vectors.load import load_vector

TIER_PHASES = {"base": PREFILL | DECODE, "prefill": PREFILL, "decode": DECODE}


def load_named_vectors(cfg: RunBase, facts: ModelFacts, base: Path | None) -> dict[str, np.ndarray]:
    """The vectors declared under ``vectors:``, by name."""
    return {name: load_vector(spec, f"vectors.{name}", facts.hidden_size, {}, base)
            for name, spec in cfg.vectors.items()}


def compile_steering(cfg: RunBase, prompts: list[Prompt], facts: ModelFacts, named: dict, base: Path | None):
    """(vectors by key, steering entries per prompt index)."""
    vectors: dict[str, np.ndarray] = {}
    steer: dict[int, list[Steer]] = {p.index: [] for p in prompts}

    def add_tiers(tiers: Tiers, where: str, targets: list[int]) -> None:
        for tier_name, phases in TIER_PHASES.items():
            for hook, i, term in getattr(tiers, tier_name).terms():
                path = f"{where}.{tier_name}.{hook}" + ("" if i is None else f"[{i}]")
                vec = load_vector(term.vector, path + ".vector", facts.hidden_size, named, base)
                with np.errstate(over="ignore"):
                    if not np.isfinite(vec * np.float32(term.scale)).all():
                        raise ConfigError.at(path + ".scale", f"{term.scale} times the vector leaves float32's range")
                total = squares(term.scale, vec)
                if total > FLOAT32_MAX:  # the stream it is added to overflows the norms, whatever else it holds
                    raise ConfigError.at(path + ".scale", f"{term.scale} times the vector: {overflow_reason(total)}")
                key = vector_key(vec)
                vectors[key] = vec
                for layer in parse_layers(term.layer, facts.num_layers, path + ".layer"):
                    entry = Steer(site_id(layer, hook), phases, key, float(term.scale))
                    for target in targets:
                        steer[target].append(entry)

    add_tiers(cfg.steering.global_, "steering.global", list(steer))
    for r, req in enumerate(cfg.steering.request):
        where = f"steering.request[{r}]"
        add_tiers(req, where, parse_prompts(req.prompts, len(prompts), where + ".prompts"))
    return vectors, steer


def _capture_positions(spec: CaptureSpec, prompt: Prompt, where: str) -> tuple[list[int], bool]:
    n = len(prompt.token_ids)
    if spec.positions == "last_prompt":
        return [n - 1], False
    if spec.positions == "all_prompt":
        return list(range(n)), False
    if spec.positions == "all_generated":
        return [], True
    if spec.positions == "all":
        return list(range(n)), True
    return distinct_positions(spec.positions, prompt, where + ".positions"), False


def compile_capture(cfg: RunBase, prompts: list[Prompt], facts: ModelFacts):
    """(capture groups per prompt index, store layouts)."""
    capture: dict[int, list[Capture]] = {p.index: [] for p in prompts}
    layouts = []
    for c, spec in enumerate(cfg.capture):
        where = f"capture[{c}]"
        layers = parse_layers(spec.layers, facts.num_layers, where + ".layers")
        targets = parse_prompts(spec.prompts, len(prompts), where + ".prompts")
        sites = [site_id(layer, hook) for hook in spec.hooks for layer in layers]
        for index in targets:
            positions, generated = _capture_positions(spec, prompts[index], where)
            capture[index].append(Capture(tuple(sites), pack_positions(positions), generated))
        check_routed_layers(spec.hooks, layers, facts.routing, where + ".layers")
        routing = facts.routing if ROUTER_LOGITS in spec.hooks else None
        layouts.append(CaptureLayout(spec.name, tuple(spec.hooks), tuple(layers), spec.dtype, tuple(targets), routing))
    return capture, layouts
