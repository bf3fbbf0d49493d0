"""Compiler: validated config + model facts -> engine requests. Pure: no engine, no vLLM needed.

Each request carries its interventions in ``SamplingParams.extra_args`` (see ``interp_runner.payload``); vectors
are returned separately, keyed by content hash, to be registered on the workers once per engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config.errors import ConfigError
from .config.schema import CaptureSpec, RunConfig, Tiers, resolve_path
from .models.facts import ModelFacts
from .payload import DECODE, PAYLOAD_KEY, PREFILL, EngineSpec, pack_positions, vector_key
from .sites import site_id
from .vectors import load_vector

TIER_PHASES = {"base": PREFILL | DECODE, "prefill": PREFILL, "decode": DECODE}


@dataclass(frozen=True)
class Prompt:
    index: int
    id: str
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class EngineRequest:
    rid: str
    prompt: Prompt
    sampling: dict  # SamplingParams keyword arguments, payload included
    cache_salt: str | None

    def sampling_params(self):
        from vllm import SamplingParams

        return SamplingParams(**self.sampling)

    def engine_prompt(self) -> dict:
        prompt = {"prompt_token_ids": list(self.prompt.token_ids)}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt


@dataclass(frozen=True)
class CaptureLayout:
    """Where one capture entry's values go in the store."""

    name: str
    hooks: tuple[str, ...]
    layers: tuple[int, ...]
    dtype: str
    prompt_indices: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    requests: tuple[EngineRequest, ...]
    vectors: dict[str, np.ndarray]
    engine_spec: EngineSpec
    captures: tuple[CaptureLayout, ...]
    requests_sha256: str = field(default="")


def parse_layers(selector, num_layers: int, where: str) -> list[int]:
    if isinstance(selector, str):
        if selector == "all":
            return list(range(num_layers))
        try:
            start, stop = (int(s) if s else None for s in selector.split(":"))
        except ValueError:
            raise ConfigError.at(where, f"{selector!r} is not a layer selector (an int, a list, 'all' or 'a:b')")
        layers = list(range(num_layers))[slice(start, stop)]
        if not layers:
            raise ConfigError.at(where, f"{selector!r} selects no layer, model has {num_layers} layers")
        return layers
    layers = [selector] if isinstance(selector, int) else list(selector)
    if len(set(layers)) != len(layers):
        raise ConfigError.at(where, f"layers repeat: {layers}")
    for i, layer in enumerate(layers):
        if not 0 <= layer < num_layers:
            sub = where if isinstance(selector, int) else f"{where}[{i}]"
            raise ConfigError.at(sub, f"{layer} out of range, model has {num_layers} layers")
    return layers


def parse_prompts(selector, num_prompts: int, where: str) -> list[int]:
    if selector == "all":
        return list(range(num_prompts))
    indices = [selector] if isinstance(selector, int) else list(selector)
    for i, index in enumerate(indices):
        if not 0 <= index < num_prompts:
            sub = where if isinstance(selector, int) else f"{where}[{i}]"
            raise ConfigError.at(sub, f"prompt {index} out of range, there are {num_prompts} prompts")
    return indices


def load_prompts(cfg: RunConfig, tokenize: Callable[[str], Sequence[int]], base: Path | None) -> list[Prompt]:
    if cfg.prompts.file is not None:
        path = resolve_path(cfg.prompts.file, base)
        if not path.exists():
            raise ConfigError.at("prompts.file", f"prompt file not found: {path}")
        items = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                items.append((row.get("id"), row.get("text", row.get("prompt"))))
            except (json.JSONDecodeError, AttributeError):
                raise ConfigError.at("prompts.file", f"{path}:{n} is not a JSON object")
            if not isinstance(items[-1][1], str) or not items[-1][1]:
                raise ConfigError.at("prompts.file", f"{path}:{n} has no non-empty 'text' (or 'prompt')")
    else:
        items = [(None, p) if isinstance(p, str) else (p.id, p.text) for p in cfg.prompts.items]
    if not items:
        raise ConfigError.at("prompts", "empty prompt list")
    prompts = []
    for i, (pid, text) in enumerate(items):
        ids = tuple(int(t) for t in tokenize(text))
        if not ids:
            raise ConfigError.at(f"prompts.items[{i}]", "prompt tokenizes to nothing")
        prompts.append(Prompt(index=i, id=pid or f"p{i}", text=text, token_ids=ids))
    return prompts


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
    out = []
    for i, pos in enumerate(spec.positions):
        if not -n <= pos < n:
            raise ConfigError.at(
                f"{where}.positions[{i}]",
                f"position {pos} is beyond prompt {prompt.index} ({prompt.id!r}), which has {n} tokens",
            )
        out.append(pos % n)
    return sorted(set(out)), False


def compile_plan(
    cfg: RunConfig,
    facts: ModelFacts,
    tokenize: Callable[[str], Sequence[int]],
    base: Path | None = None,
) -> Plan:
    """Validate ``cfg`` against the model and turn it into engine requests."""
    prompts = load_prompts(cfg, tokenize, base)
    max_len = max(len(p.token_ids) for p in prompts) + cfg.sampling.max_tokens
    if max_len > cfg.engine.max_model_len:
        raise ConfigError.at(
            "engine.max_model_len",
            f"{cfg.engine.max_model_len} is too small: longest prompt + sampling.max_tokens = {max_len}",
        )

    named = {
        name: load_vector(spec, f"vectors.{name}", facts.hidden_size, {}, base)
        for name, spec in cfg.vectors.items()
    }
    vectors: dict[str, np.ndarray] = {}
    steer: dict[int, list] = {p.index: [] for p in prompts}

    def add_tiers(tiers: Tiers, where: str, targets: list[int]) -> None:
        for tier_name, phases in TIER_PHASES.items():
            for hook, i, term in getattr(tiers, tier_name).terms():
                path = f"{where}.{tier_name}.{hook}" + ("" if i is None else f"[{i}]")
                vec = load_vector(term.vector, path + ".vector", facts.hidden_size, named, base)
                key = vector_key(vec)
                vectors[key] = vec
                for layer in parse_layers(term.layer, facts.num_layers, path + ".layer"):
                    entry = [site_id(layer, hook), phases, key, float(term.scale)]
                    for target in targets:
                        steer[target].append(entry)

    add_tiers(cfg.steering.global_, "steering.global", list(steer))
    for r, req in enumerate(cfg.steering.request):
        where = f"steering.request[{r}]"
        add_tiers(req, where, parse_prompts(req.prompts, len(prompts), where + ".prompts"))

    capture: dict[int, list] = {p.index: [] for p in prompts}
    layouts = []
    for c, spec in enumerate(cfg.capture):
        where = f"capture[{c}]"
        layers = parse_layers(spec.layers, facts.num_layers, where + ".layers")
        targets = parse_prompts(spec.prompts, len(prompts), where + ".prompts")
        sites = [site_id(layer, hook) for hook in spec.hooks for layer in layers]
        for index in targets:
            positions, generated = _capture_positions(spec, prompts[index], where)
            capture[index].append([sites, pack_positions(positions), generated])
        layouts.append(CaptureLayout(spec.name, tuple(spec.hooks), tuple(layers), spec.dtype, tuple(targets)))

    requests = []
    s = cfg.sampling
    for p in prompts:
        rid = f"r{p.index:05d}"
        payload = None
        if steer[p.index] or capture[p.index]:
            payload = {"rid": rid}
            if steer[p.index]:
                payload["steer"] = steer[p.index]
            if capture[p.index]:
                payload["capture"] = capture[p.index]
        # a captured prompt position other than the last would be skipped by a prefix-cache hit
        reads_prompt = any(
            np.frombuffer(positions, dtype=np.int32).min(initial=len(p.token_ids)) < len(p.token_ids) - 1
            for _, positions, _ in capture[p.index]
        )
        sampling = dict(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed + p.index,
            logprobs=s.logprobs if s.logprobs is not None else 0,
            extra_args={PAYLOAD_KEY: payload} if payload else None,
            skip_reading_prefix_cache=True if reads_prompt else None,
        )
        requests.append(EngineRequest(rid=rid, prompt=p, sampling=sampling, cache_salt=_cache_salt(steer[p.index])))

    engine_spec = EngineSpec(
        steer_sites=tuple(sorted({e[0] for entries in steer.values() for e in entries})),
        capture_sites=tuple(sorted({s for entries in capture.values() for e in entries for s in e[0]})),
    )
    return Plan(
        requests=tuple(requests),
        vectors=vectors,
        engine_spec=engine_spec,
        captures=tuple(layouts),
        requests_sha256=requests_hash(requests),
    )


def _cache_salt(steer: list) -> str | None:
    """KV computed under steering is only shared with requests steered the same way (vLLM's cache_salt)."""
    if not steer:
        return None
    canonical = json.dumps(sorted(steer), separators=(",", ":"))
    return "interp-" + hashlib.sha256(canonical.encode()).hexdigest()[:24]


def requests_hash(requests: Sequence[EngineRequest]) -> str:
    def default(obj):
        if isinstance(obj, bytes):
            return obj.hex()
        raise TypeError(type(obj))

    canonical = [
        {"rid": r.rid, "tokens": list(r.prompt.token_ids), "sampling": r.sampling, "salt": r.cache_salt}
        for r in requests
    ]
    blob = json.dumps(canonical, sort_keys=True, default=default, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
