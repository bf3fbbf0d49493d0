"""Compiler: validated config + model facts -> engine requests. Pure: no engine, no vLLM needed.

Each request carries its interventions in ``SamplingParams.extra_args`` (see ``interp_runner.payload``); vectors
and patch sources are returned separately, keyed by content hash, to be registered on the workers.

A plan runs in stages: stage 0 holds every prompt as written (steered, captured, scored); stage 1 the requests
that patch in values stage 0 computed and the workers kept (``Plan.refs`` says which request, site and position
each source reference stands for), plus unpatched copies of their destinations run in the same batch (the noise
floor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config.errors import ConfigError
from .config.schema import CaptureSpec, PromptRow, RunConfig, Span, Tiers, resolve_path
from .forcing import force_generations
from .inputs import read_rows
from .models.facts import ModelFacts
from .payload import DECODE, PREFILL, EngineSpec, pack_positions, vector_key
from .request_build import (
    EngineRequest, Patch, Prompt, engine_spec_of, make_request, mark_private_kv, requests_hash,
)
from .selectors import distinct_positions, parse_layers, parse_prompts  # noqa: F401  (re-exported)
from .sites import site_id
from .vectors import load_vector

TIER_PHASES = {"base": PREFILL | DECODE, "prefill": PREFILL, "decode": DECODE}


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
    sources: dict[str, np.ndarray] = field(default_factory=dict)  # patch sources known before the run
    refs: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # ref key -> (rid, site, position)
    skipped: tuple[dict, ...] = ()  # patch positions left out by prompt alignment
    trace: object | None = None  # the causal-trace layout, when the plan is one

    @property
    def num_stages(self) -> int:
        return 1 + max((r.stage for r in self.requests), default=0)


def load_prompts(cfg: RunConfig, tokenize: Callable[[str], Sequence[int]], base: Path | None) -> list[Prompt]:
    if cfg.prompts.file is not None:
        items = read_rows(resolve_path(cfg.prompts.file, base), "prompts.file", PromptRow)
        where = "prompts.file"
    else:
        items = [PromptRow(text=p) if isinstance(p, str) else p for p in cfg.prompts.items]
        where = "prompts.items"
    if not items:
        raise ConfigError.at("prompts", "empty prompt list")
    prompts: list[Prompt] = []
    index_of: dict[str, int] = {}
    for i, item in enumerate(items):
        pid = item.id or f"p{i}"
        if pid in index_of:
            raise ConfigError.at(f"{where}[{i}].id", f"id {pid!r} is prompt {index_of[pid]}'s already")
        index_of[pid] = i
        token_ids = tuple(int(t) for t in tokenize(item.text))
        if not token_ids:
            raise ConfigError.at(f"{where}[{i}]", "prompt tokenizes to nothing")
        scored = tuple(
            answer_token(tokenize, text, f"{where}[{i}].{key}", cfg.scoring.first_token)
            for key, text in (("answer", item.answer), ("foil", item.foil)) if text is not None
        )
        prompts.append(Prompt(index=i, id=pid, text=item.text, token_ids=token_ids, answer_ids=scored))
    return prompts


def answer_token(tokenizer, text: str, where: str, first_token: bool) -> int:
    """The single token an answer is scored by."""
    ids = tokenizer.plain(text)
    if not ids:
        raise ConfigError.at(where, f"{text!r} tokenizes to nothing")
    if len(ids) > 1 and not first_token:
        raise ConfigError.at(
            where, f"{text!r} is {len(ids)} tokens {list(ids)}; scoring needs one (or scoring.first_token: true)"
        )
    return int(ids[0])


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


def prompt_rid(index: int) -> str:
    return f"r{index:05d}"


def compile_steering(cfg: RunConfig, prompts: list[Prompt], facts: ModelFacts, named: dict, base: Path | None):
    """(vectors by key, steering entries per prompt index)."""
    vectors: dict[str, np.ndarray] = {}
    steer: dict[int, list] = {p.index: [] for p in prompts}

    def add_tiers(tiers: Tiers, where: str, targets: list[int]) -> None:
        for tier_name, phases in TIER_PHASES.items():
            for hook, i, term in getattr(tiers, tier_name).terms():
                path = f"{where}.{tier_name}.{hook}" + ("" if i is None else f"[{i}]")
                vec = load_vector(term.vector, path + ".vector", facts.hidden_size, named, base)
                with np.errstate(over="ignore"):
                    if not np.isfinite(vec * np.float32(term.scale)).all():
                        raise ConfigError.at(path + ".scale", f"{term.scale} times the vector leaves float32's range")
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
    return vectors, steer


def compile_capture(cfg: RunConfig, prompts: list[Prompt], facts: ModelFacts):
    """(capture groups per prompt index, store layouts)."""
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
    return capture, layouts


def bank_rows_for(cfg: RunConfig, needed: int) -> int:
    if cfg.engine.patch_bank_rows is None:
        return needed
    if cfg.engine.patch_bank_rows < needed:
        raise ConfigError.at("engine.patch_bank_rows",
                             f"{cfg.engine.patch_bank_rows} is too small: the plan keeps {needed} patch sources")
    return cfg.engine.patch_bank_rows


def check_vocabulary(prompts: Sequence[Prompt], vocab_size: int, where: str) -> None:
    """Every token id within the model's embedding table (a tokenizer that is not the weights' fails in vLLM)."""
    for p in prompts:
        beyond = [t for t in p.token_ids + p.answer_ids if not 0 <= t < vocab_size]
        if beyond:
            raise ConfigError.at(f"{where}[{p.index}]", f"token id {beyond[0]} is beyond the model's vocabulary "
                                                        f"({vocab_size} tokens): its tokenizer is not its weights'")


def check_chat_template(cfg: RunConfig) -> None:
    """Character spans (span positions, causal-trace subjects) need prompts that are the text as written."""
    if not cfg.prompts.chat_template:
        return
    if cfg.causal_trace is not None:
        raise ConfigError.at("prompts.chat_template", "causal tracing finds each subject by its characters in the "
                                                      "prompt: it needs prompts without a chat template")
    for i, spec in enumerate(cfg.patching):
        if isinstance(spec.positions, Span):
            raise ConfigError.at(f"patching[{i}].positions.span", "span positions need prompts without a chat "
                                                                  "template (prompts.chat_template: true)")


def check_length(cfg: RunConfig, prompts: Sequence[Prompt], max_tokens: int) -> None:
    max_len = max(len(p.token_ids) for p in prompts) + max_tokens
    if max_len > cfg.engine.max_model_len:
        raise ConfigError.at(
            "engine.max_model_len",
            f"{cfg.engine.max_model_len} is too small: longest prompt + sampling.max_tokens = {max_len}",
        )


def compile_plan(
    cfg: RunConfig,
    facts: ModelFacts,
    tokenize: Callable[[str], Sequence[int]],
    base: Path | None = None,
    embeddings: Callable | None = None,
) -> Plan:
    """Validate ``cfg`` against the model and turn it into engine requests. ``embeddings(ids)`` gives token
    embedding rows (causal tracing's noise scale)."""
    check_chat_template(cfg)
    if cfg.causal_trace is not None:
        from .causal_trace import compile_trace

        if cfg.sampling.teacher_forcing is not None:
            raise ConfigError.at("sampling.teacher_forcing", "a causal trace generates no text to force")

        return compile_trace(cfg, facts, tokenize, base, embeddings)
    from .patching import compile_patching

    prompts = load_prompts(cfg, tokenize, base)
    check_vocabulary(prompts, facts.vocab_size, "prompts.file" if cfg.prompts.file else "prompts.items")
    check_length(cfg, prompts, cfg.sampling.max_tokens)
    named = {
        name: load_vector(spec, f"vectors.{name}", facts.hidden_size, {}, base)
        for name, spec in cfg.vectors.items()
    }
    vectors, steer = compile_steering(cfg, prompts, facts, named, base)
    capture, layouts = compile_capture(cfg, prompts, facts)
    patching = compile_patching(cfg, prompts, facts, tokenize, named, base, steer)
    s = cfg.sampling
    requests = [make_request(prompt_rid(p.index), p, s, steer[p.index], capture[p.index],
                             keep=patching.keep.get(p.index)) for p in prompts]
    for copy in patching.copies:
        prompt = prompts[copy.prompt]
        rid = f"{prompt_rid(prompt.index)}-{copy.role[0]}{copy.spec:03d}"
        requests.append(make_request(rid, prompt, s, steer[prompt.index], (), Patch.of(copy.entries), stage=1,
                                     role=copy.role, meta={"patch": copy.spec, "source": copy.source}))
    if s.teacher_forcing is not None:
        force_generations(requests, resolve_path(s.teacher_forcing, base))
    bank = bank_rows_for(cfg, len(patching.sources) + len(patching.refs))
    mark_private_kv(requests)
    return Plan(
        requests=tuple(requests),
        vectors=vectors,
        engine_spec=engine_spec_of(requests, bank),
        captures=tuple(layouts),
        requests_sha256=requests_hash(requests),
        sources=patching.sources,
        refs=patching.refs,
        skipped=tuple(patching.skipped),
    )

