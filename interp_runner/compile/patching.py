"""Activation patching: ``patching:`` entries -> patched copies of their destination prompts (plan side).

A patched copy runs in stage 1 with entries (site, position, source key, value weight, source weight): the value
there becomes ``value weight * value + source weight * source``, the weights (1 - alpha, alpha). Sources are
vectors (or zeros) known now, or values captured from another prompt's stage-0 run, named by a reference key that
holds a digest of that run (its tokens and steering), so equal keys always mean the same computation. Each
destination also gets an unpatched copy in stage 1: compared with its stage-0 run, it measures how much batching
alone moves a score (the noise floor).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import Span
from interp_runner.contracts import Keep, KeepGroup, Steer
from interp_runner.payload import digest, pack_positions, ref_key, vector_key
from interp_runner.compile.prompt_set import prompt_rid
from interp_runner.compile.selectors import distinct_positions, parse_layers, parse_prompts
from interp_runner.sites import site_id
from interp_runner.vectors.load import load_vector


@dataclass(frozen=True)
class PatchCopy:
    spec: int
    prompt: int
    role: str  # patched | baseline
    source: int | None
    entries: list


@dataclass
class Patching:
    copies: list[PatchCopy] = field(default_factory=list)
    sources: dict[str, np.ndarray] = field(default_factory=dict)
    refs: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    keep: dict[int, Keep] = field(default_factory=dict)  # source prompt index -> its payload's ``keep``
    skipped: list[dict] = field(default_factory=list)


def span_positions(tokenizer, text: str, substring: str, occurrence: int = 0) -> list[int] | None:
    """Token positions covering the ``occurrence``-th appearance of ``substring`` in ``text`` (None: absent)."""
    start = -1
    for _ in range(occurrence + 1):
        start = text.find(substring, start + 1)
        if start < 0:
            return None
    end = start + len(substring)
    return [i for i, (a, b) in enumerate(tokenizer.offsets(text)) if a < end and b > start and b > a]


def resolve_positions(selector, prompt, tokenizer, where: str) -> list[int]:
    n = len(prompt.token_ids)
    if selector == "all":
        return list(range(n))
    if isinstance(selector, Span):
        positions = span_positions(tokenizer, prompt.text, selector.span, selector.occurrence)
        if not positions:
            raise ConfigError.at(where + ".span", f"{selector.span!r} (occurrence {selector.occurrence}) is not in "
                                                  f"prompt {prompt.index} ({prompt.text!r})")
        return positions
    return distinct_positions(selector, prompt, where)


def align(source_ids, dest_ids, positions) -> tuple[list[tuple[int, int]], list[int]]:
    """Destination positions -> source positions: identity for equal lengths; otherwise the common token prefix
    by identity and the common suffix by the length difference. Positions in the differing middle are returned
    as skipped, never shifted."""
    ns, nd = len(source_ids), len(dest_ids)
    if ns == nd:
        return [(p, p) for p in positions], []
    prefix = 0
    while prefix < min(ns, nd) and source_ids[prefix] == dest_ids[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(ns, nd) - prefix and source_ids[ns - 1 - suffix] == dest_ids[nd - 1 - suffix]:
        suffix += 1
    mapped, skipped = [], []
    for p in positions:
        if p < prefix:
            mapped.append((p, p))
        elif p >= nd - suffix:
            mapped.append((p, p - nd + ns))
        else:
            skipped.append(p)
    return mapped, skipped


def run_digest(prompt, interventions: list) -> str:
    """A digest of a run's tokens and interventions (``Steer`` terms, or patch entries as tuples)."""
    terms = [[t.site, t.phases, t.vector, t.scale] if isinstance(t, Steer) else list(t) for t in interventions]
    return digest([list(prompt.token_ids), sorted(terms)])


def keep_groups(wanted: dict[int, set[int]]) -> tuple[KeepGroup, ...]:
    """{site: positions} -> ``keep`` groups, sites with the same positions together."""
    by_positions: dict[tuple, list[int]] = defaultdict(list)
    for site, positions in sorted(wanted.items()):
        by_positions[tuple(sorted(positions))].append(site)
    return tuple(KeepGroup(tuple(sites), pack_positions(list(positions))) for positions, sites in by_positions.items())


def compile_patching(cfg, prompts, facts, tokenizer, named, base, steer) -> Patching:
    out = Patching()
    wanted: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    with_baseline: set[int] = set()
    for i, spec in enumerate(cfg.patching):
        where = f"patching[{i}]"
        dests = parse_prompts(spec.prompts, len(prompts), where + ".prompts")
        sites = [site_id(layer, spec.hook) for layer in parse_layers(spec.layers, facts.num_layers, where + ".layers")]
        a, b = float(np.float32(1.0 - spec.alpha)), float(np.float32(spec.alpha))
        src = spec.source
        if src.prompt is not None and src.prompt >= len(prompts):
            raise ConfigError.at(where + ".source.prompt", f"prompt {src.prompt} out of range, there are {len(prompts)} prompts")
        if src.prompt is None:
            vec = (np.zeros(facts.hidden_size, dtype=np.float32) if src.zeros
                   else load_vector(src.vector, where + ".source.vector", facts.hidden_size, named, base))
            key = "vec:" + vector_key(vec)
            out.sources[key] = vec
        for d in dests:
            dest = prompts[d]
            positions = resolve_positions(spec.positions, dest, tokenizer, where + ".positions")
            if src.prompt is None:
                entries = [(site, p, key, a, b) for site in sites for p in positions]
            else:
                if src.prompt == d:
                    raise ConfigError.at(where + ".source.prompt", f"prompt {d} cannot patch itself (a source run is "
                                                                   "a separate request: list the prompt twice)")
                source = prompts[src.prompt]
                mapped, skipped = align(source.token_ids, dest.token_ids, positions)
                if not mapped:
                    raise ConfigError.at(where + ".source.prompt", (
                        f"prompts {src.prompt} and {d} cannot be aligned: positions {positions} all lie in the part "
                        f"where their tokens differ ({len(source.token_ids)} vs {len(dest.token_ids)} tokens)"))
                if skipped:
                    out.skipped.append({"patch": i, "prompt": d, "source": src.prompt, "positions": skipped})
                run = run_digest(source, steer[src.prompt])
                entries = []
                for site in sites:
                    for dpos, spos in mapped:
                        ref = ref_key(run, site, spos)
                        out.refs[ref] = (prompt_rid(src.prompt), site, spos)
                        wanted[src.prompt][site].add(spos)
                        entries.append((site, dpos, ref, a, b))
            out.copies.append(PatchCopy(i, d, "patched", src.prompt, entries))
            if d not in with_baseline:
                with_baseline.add(d)
                out.copies.append(PatchCopy(i, d, "baseline", None, []))
    out.keep = {index: Keep(run_digest(prompts[index], steer[index]), keep_groups(sites))
                for index, sites in wanted.items()}
    return out
