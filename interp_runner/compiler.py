"""Compiler: validated config + model facts -> engine requests. Pure: no engine, no vLLM needed.

Each request carries its interventions in ``SamplingParams.extra_args`` (see ``interp_runner.payload``); vectors
and patch sources are returned separately, keyed by content hash, to be registered on the workers.

A plan runs in stages: stage 0 holds every prompt as written (steered, captured, scored); stage 1 the requests
that patch in values stage 0 computed and the workers kept (``Plan.refs`` says which request, site and position
each source reference stands for), plus unpatched copies of their destinations run in the same batch (the noise
floor).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from .config.errors import ConfigError
from .config.schema import CaptureSpec, RunConfig, Tiers, resolve_path
from .models.facts import ModelFacts
from .payload import DECODE, PAYLOAD_KEY, PREFILL, EngineSpec, digest, pack_positions, vector_key
from .sites import site_id
from .vectors import load_vector

TIER_PHASES = {"base": PREFILL | DECODE, "prefill": PREFILL, "decode": DECODE}


@dataclass(frozen=True)
class Prompt:
    index: int
    id: str
    text: str
    token_ids: tuple[int, ...]
    answer_ids: tuple[int, ...] = ()  # scored token ids: (answer[, foil])


@dataclass(frozen=True)
class EngineRequest:
    rid: str
    prompt: Prompt
    sampling: dict  # SamplingParams keyword arguments, payload included
    stage: int = 0
    role: str = "prompt"  # prompt | patched | baseline (an unpatched destination beside patched ones)
    meta: dict = field(default_factory=dict)  # what the request stands for in its experiment
    condition: str | None = None  # run only if this request's top token is its answer (ROME's filter)

    @property
    def payload(self) -> dict | None:
        extra = self.sampling.get("extra_args")
        return extra.get(PAYLOAD_KEY) if extra else None

    @property
    def kv_ranges(self) -> list:
        return (self.payload or {}).get("kv", [])

    def sampling_params(self):
        from vllm import SamplingParams

        return SamplingParams(**self.sampling)

    def engine_prompt(self) -> dict:
        return {"prompt_token_ids": list(self.prompt.token_ids)}


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
                items.append((row.get("id"), row.get("text", row.get("prompt")), row.get("answer"), row.get("foil")))
            except (json.JSONDecodeError, AttributeError):
                raise ConfigError.at("prompts.file", f"{path}:{n} is not a JSON object")
            if not isinstance(items[-1][1], str) or not items[-1][1]:
                raise ConfigError.at("prompts.file", f"{path}:{n} has no non-empty 'text' (or 'prompt')")
    else:
        items = [(None, p, None, None) if isinstance(p, str) else (p.id, p.text, p.answer, p.foil)
                 for p in cfg.prompts.items]
    if not items:
        raise ConfigError.at("prompts", "empty prompt list")
    prompts = []
    for i, (pid, text, answer, foil) in enumerate(items):
        where = f"prompts.items[{i}]" if cfg.prompts.file is None else f"prompts.file[{i}]"
        ids = tuple(int(t) for t in tokenize(text))
        if not ids:
            raise ConfigError.at(where, "prompt tokenizes to nothing")
        scored = tuple(
            answer_token(tokenize, text_, f"{where}.{key}", cfg.scoring.first_token)
            for key, text_ in (("answer", answer), ("foil", foil)) if text_ is not None
        )
        prompts.append(Prompt(index=i, id=pid or f"p{i}", text=text, token_ids=ids, answer_ids=scored))
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
    out = []
    for i, pos in enumerate(spec.positions):
        if not -n <= pos < n:
            raise ConfigError.at(
                f"{where}.positions[{i}]",
                f"position {pos} is beyond prompt {prompt.index} ({prompt.id!r}), which has {n} tokens",
            )
        out.append(pos % n)
    return sorted(set(out)), False


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


def kv_ranges(steer: list, patch: list, prompt_len: int) -> list:
    """What changes the KV of which positions (see ``interp_runner.plugin.prefix_cache``)."""
    ranges = []
    for phase, start, end in ((PREFILL, 0, prompt_len), (DECODE, prompt_len, -1)):
        terms = sorted([site, key, scale] for site, phases, key, scale in steer if phases & phase)
        if terms:
            ranges.append([start, end, digest(terms)])
    at: dict[int, list] = {}
    for site, position, key, a, b in patch:
        at.setdefault(int(position), []).append((int(site), key, float(a), float(b)))
    ranges += [[p, p + 1, _entries_digest(tuple(sorted(entries)))] for p, entries in sorted(at.items())]
    return ranges


def mark_private_kv(requests: Sequence[EngineRequest]) -> None:
    """Set each request's ``kv_private``: the first position from which its KV hashes chain in interventions no
    other request of the plan has (a causal-trace cell's restore under its own noise sample, say). Blocks from
    there on cannot be shared within the plan; the plugin neither hashes nor caches them."""
    def prefixes(r):  # the interventions a block hash has chained in by each range's start
        ranges = sorted(tuple(x) for x in r.kv_ranges)
        return [(ranges[k][0], tuple(ranges[: k + 1])) for k in range(len(ranges))]

    chains = [prefixes(r) for r in requests]
    counts = Counter(chain for per_request in chains for _, chain in per_request)
    for r, per_request in zip(requests, chains):
        unique = [start for start, chain in per_request if counts[chain] == 1]
        if unique:
            r.payload["kv_private"] = min(unique)


@lru_cache(maxsize=1 << 16)
def _entries_digest(entries: tuple) -> str:
    """``digest`` of one position's patch entries (JSON makes tuples lists): the noise entries of a causal trace
    recur in every cell of their sample."""
    return digest(entries)


def make_request(
    rid: str,
    prompt: Prompt,
    s,
    steer: list = (),
    capture: list = (),
    patch: list = (),
    stage: int = 0,
    role: str = "prompt",
    meta: dict | None = None,
    condition: str | None = None,
    max_tokens: int | None = None,
    keep: dict | None = None,
    start: list | None = None,
) -> EngineRequest:
    """One engine request; ``patch`` entries are (site, position, source key, a, b); ``keep``: values the workers
    keep as patch sources; ``start``: [layer, run] below which it computes what ``run`` does
    (``interp_runner.payload``)."""
    payload: dict = {"rid": rid}
    if start is not None:
        payload["start"] = list(start)
    if steer:
        payload["steer"] = list(steer)
    if capture:
        payload["capture"] = list(capture)
    if keep:
        payload["keep"] = keep
    if patch:
        sites, positions, keys, a, b = zip(*patch)
        payload["patch"] = {
            "site": pack_positions(sites), "pos": pack_positions(positions), "src": list(keys),
            "a": np.asarray(a, dtype=np.float32).tobytes(), "b": np.asarray(b, dtype=np.float32).tobytes(),
        }
    if prompt.answer_ids:
        payload["score"] = pack_positions(prompt.answer_ids)
    ranges = kv_ranges(list(steer), list(patch), len(prompt.token_ids))
    if ranges:
        payload["kv"] = ranges
    # a captured (or kept) prompt position other than the last would be skipped by a prefix-cache hit
    read = [positions for _, positions, _ in capture] + [positions for _, positions in (keep or {}).get("groups", ())]
    reads_prompt = any(
        np.frombuffer(positions, dtype=np.int32).min(initial=len(prompt.token_ids)) < len(prompt.token_ids) - 1
        for positions in read
    )
    sampling = dict(
        max_tokens=s.max_tokens if max_tokens is None else max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed + prompt.index,
        logprobs=s.logprobs if s.logprobs is not None else 0,
        extra_args={PAYLOAD_KEY: payload} if len(payload) > 1 else None,
        skip_reading_prefix_cache=True if reads_prompt else None,
    )
    return EngineRequest(rid=rid, prompt=prompt, sampling=sampling, stage=stage, role=role, meta=meta or {},
                         condition=condition)


def engine_spec_of(requests: Sequence[EngineRequest], bank_rows: int) -> EngineSpec:
    steer, capture, patch = set(), set(), set()
    for r in requests:
        p = r.payload or {}
        steer.update(e[0] for e in p.get("steer", ()))
        capture.update(s for e in p.get("capture", ()) for s in e[0])
        capture.update(s for e in (p.get("keep") or {}).get("groups", ()) for s in e[0])  # kept through captures
        if "patch" in p:
            patch.update(np.frombuffer(p["patch"]["site"], dtype=np.int32).tolist())
    return EngineSpec(tuple(sorted(steer)), tuple(sorted(capture)), tuple(sorted(patch)), bank_rows)


def bank_rows_for(cfg: RunConfig, needed: int) -> int:
    if cfg.engine.patch_bank_rows is None:
        return needed
    if cfg.engine.patch_bank_rows < needed:
        raise ConfigError.at("engine.patch_bank_rows",
                             f"{cfg.engine.patch_bank_rows} is too small: the plan keeps {needed} patch sources")
    return cfg.engine.patch_bank_rows


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
    if cfg.causal_trace is not None:
        from .causal_trace import compile_trace

        return compile_trace(cfg, facts, tokenize, base, embeddings)
    from .patching import compile_patching

    prompts = load_prompts(cfg, tokenize, base)
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
        requests.append(make_request(rid, prompt, s, steer[prompt.index], (), copy.entries, stage=1,
                                     role=copy.role, meta={"patch": copy.spec, "source": copy.source}))
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


def requests_hash(requests: Sequence[EngineRequest]) -> str:
    def default(obj):
        if isinstance(obj, bytes):
            return obj.hex()
        raise TypeError(type(obj))

    # the hash of the JSON list of every request (keys sorted, no spaces), fed one request at a time; a prompt's
    # tokens are encoded once for all the requests that share it
    encode = json.JSONEncoder(sort_keys=True, default=default, separators=(",", ":")).encode
    tokens: dict[int, str] = {}
    h = hashlib.sha256(b"[")
    for i, r in enumerate(requests):
        key = id(r.prompt.token_ids)
        if key not in tokens:
            tokens[key] = encode(list(r.prompt.token_ids))
        item = (f'{{"condition":{encode(r.condition)},"rid":{encode(r.rid)},"sampling":{encode(r.sampling)},'
                f'"stage":{encode(r.stage)},"tokens":{tokens[key]}}}')
        h.update((b"," if i else b"") + item.encode())
    h.update(b"]")
    return h.hexdigest()
