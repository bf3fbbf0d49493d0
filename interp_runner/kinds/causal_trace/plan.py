"""Causal tracing's plan (ROME, Meng et al. 2022): a fact set -> one batched sweep of engine requests.

Per fact: a clean run (stage 0) keeps every state a restore needs on the workers and scores the answer; corrupted runs
(Gaussian noise on the subject's token embeddings, or a counterfactual prompt) give the corrupt score. Stage 1
holds every cell of the grid, each a corrupted run with clean states restored at one (component, layer,
token): ``resid`` restores the residual stream (``resid_hook``) of one layer, ``mlp`` / ``attn`` the MLP /
attention outputs of a window of layers ``range(max(0, L - w/2), min(n_layers, L + w/2))``, as in ROME
(``interp_runner.components``). Stage 1 also reruns
the corrupted baselines inside the batch: their distance to the stage-0 scores is the noise floor. Facts whose
clean prediction is not the answer are filtered out (their cells never run) and listed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from interp_runner.components import COMPONENTS, WINDOWED
from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import RunBase, resolve_path
from interp_runner.compile.inputs import read_rows
from interp_runner.models.facts import ModelFacts
from interp_runner.compile.patching import align, keep_groups, run_digest, span_positions
from interp_runner.contracts import Keep, ReuseKv, StartLayer
from interp_runner.payload import kv_key, ref_key, vector_key
from interp_runner.compile.plan import Plan, bank_rows_for
from interp_runner.compile.prompt_set import answer_token, check_length, check_vocabulary, require_plain_prompts
from interp_runner.compile.requests import (
    EngineRequest, Patch, Prompt, engine_spec_of, make_request, mark_private_kv, requests_hash,
)
from interp_runner.compile.selectors import parse_layers
from interp_runner.sites import site_id, site_of

class FactRow(BaseModel):
    """A line of a causal-trace facts file; other keys (``relation``, ...) are metadata."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    id: str | None = Field(None, min_length=1)
    subject: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    answer: str = Field(min_length=1)
    foil: str | None = Field(None, min_length=1)
    corrupt_prompt: str | None = Field(None, min_length=1)


@dataclass(frozen=True)
class TraceFact:
    index: int
    id: str
    subject: str
    answer: str
    clean: Prompt
    corrupt: Prompt  # the prompt the cells run (the clean one under noise)
    subject_positions: tuple[int, ...]  # in the clean prompt
    skipped: tuple[int, ...] = ()  # corrupt-prompt positions with no clean counterpart

    @property
    def corrupt_subject(self) -> tuple[int, ...]:
        """The subject's positions in the prompt the cells run: the differing middle of a counterfactual prompt
        of another length, else the clean subject's."""
        return self.skipped or self.subject_positions

    @property
    def restored(self) -> dict[int, int]:
        """Corrupt-prompt position -> the clean-prompt position whose states a cell restores there (identity for
        prompts of one length; else the common prefix by identity and the common suffix by the length
        difference, ``patching.align``)."""
        return dict(align(self.clean.token_ids, self.corrupt.token_ids, range(len(self.corrupt.token_ids)))[0])


@dataclass(frozen=True)
class TraceLayout:
    facts: tuple[TraceFact, ...]
    components: tuple[str, ...]
    layers: tuple[int, ...]
    num_layers: int
    window: int
    samples: int
    corruption: str
    noise_std: float
    filter: bool
    noise: dict = field(default_factory=dict)  # fact index -> [samples, subject tokens, hidden]

    def window_layers(self, layer: int) -> list[int]:
        half = self.window // 2
        return list(range(max(0, layer - half), min(self.num_layers, layer + self.window - half)))

    def restore_sites(self, component: str, layer: int, resid_hook: str) -> list[int]:
        hook = COMPONENTS[component].hook
        if hook is None:
            return [site_id(layer, resid_hook)]
        return [site_id(lay, hook) for lay in self.window_layers(layer)]


def clean_rid(f: int) -> str:
    return f"f{f:03d}-clean"


def corrupt_rid(f: int, s: int, in_batch: bool = False) -> str:
    return f"f{f:03d}-corrupt-s{s}" + ("-batch" if in_batch else "")


def cell_rid(f: int, component: str, layer: int, token: int, s: int) -> str:
    return f"f{f:03d}-{component}-L{layer:02d}-t{token:03d}-s{s}"


def load_facts(cfg: RunBase, tokenizer, base: Path | None) -> list[TraceFact]:
    trace = cfg.causal_trace
    path = resolve_path(trace.facts, base)
    rows = read_rows(path, "causal_trace.facts", FactRow)
    if not rows:
        raise ConfigError.at("causal_trace.facts", f"{path} holds no facts")
    if trace.num_facts is not None:
        if trace.num_facts > len(rows):
            raise ConfigError.at("causal_trace.num_facts", f"{trace.num_facts}, but {path} holds {len(rows)} facts")
        rows = rows[: trace.num_facts]
    facts = []
    ids: dict[str, int] = {}
    for i, row in enumerate(rows):
        where = f"causal_trace.facts[{i}]"
        fid = row.id or f"fact{i}"
        if fid in ids:
            raise ConfigError.at(where + ".id", f"id {fid!r} is fact {ids[fid]}'s already")
        ids[fid] = i
        token_ids = tuple(int(t) for t in tokenizer(row.prompt))
        scored = [answer_token(tokenizer, row.answer, where + ".answer", cfg.scoring.first_token)]
        if row.foil is not None:
            scored.append(answer_token(tokenizer, row.foil, where + ".foil", cfg.scoring.first_token))
        clean = Prompt(index=i, id=fid, text=row.prompt, token_ids=token_ids, answer_ids=tuple(scored))
        subject = span_positions(tokenizer, row.prompt, row.subject)
        if not subject:
            raise ConfigError.at(where + ".subject", f"{row.subject!r} is not in the prompt {row.prompt!r}")
        corrupt, skipped = clean, ()
        if trace.corruption == "counterfactual":
            if row.corrupt_prompt is None:
                raise ConfigError.at(where + ".corrupt_prompt", "counterfactual corruption needs a corrupt_prompt")
            cids = tuple(int(t) for t in tokenizer(row.corrupt_prompt))
            corrupt = Prompt(index=i, id=fid, text=row.corrupt_prompt, token_ids=cids, answer_ids=clean.answer_ids)
            mapped, skipped = align(token_ids, cids, range(len(cids)))
            if not mapped:
                raise ConfigError.at(where + ".corrupt_prompt", "cannot be aligned with the prompt")
            skipped = tuple(skipped)
        facts.append(TraceFact(i, fid, row.subject, row.answer, clean, corrupt, tuple(subject), skipped))
    return facts


def noise_scale(facts: list[TraceFact], embeddings, k: float) -> float:
    """k times the standard deviation of the token embeddings of the facts' subjects (ROME)."""
    ids = [f.clean.token_ids[p] for f in facts for p in f.subject_positions]
    std = float(k * np.std(embeddings(ids), ddof=1))
    # the noise is float32 (about 5 std at most, in practice): it must stay finite and nonzero there
    with np.errstate(over="ignore"):
        if not (np.isfinite(np.float32(8 * std)) and np.float32(std) > 0):
            raise ConfigError.at("causal_trace.noise.k", f"{k} gives a noise std of {std:.3g}, which float32, the "
                                                         "precision the engine computes in, cannot hold")
    return std


def compile_trace(cfg: RunBase, facts_: ModelFacts, tokenizer, base: Path | None, embeddings,
                  kind_name: str) -> Plan:
    """The plan of ``cfg.causal_trace``, a plan of the kind ``kind_name``; ``embeddings(ids)`` gives token embedding
    rows (the noise scale)."""
    trace = cfg.causal_trace
    require_plain_prompts(cfg, "prompts.chat_template", "causal tracing finds each subject by its characters in the "
                                                        "prompt: it needs prompts without a chat template")
    if cfg.sampling.teacher_forcing is not None:
        raise ConfigError.at("sampling.teacher_forcing", "a causal trace generates no text to force")
    if set(trace.components) & WINDOWED and trace.window > facts_.num_layers:
        raise ConfigError.at("causal_trace.window",
                             f"{trace.window} is larger than the model, which has {facts_.num_layers} layers")
    layers = tuple(parse_layers(trace.layers, facts_.num_layers, "causal_trace.layers"))
    facts = load_facts(cfg, tokenizer, base)
    check_vocabulary([f.clean for f in facts] + [f.corrupt for f in facts], facts_.vocab_size, "causal_trace.facts")
    check_length(cfg, [f.clean for f in facts] + [f.corrupt for f in facts], 1)
    samples = trace.noise.samples if trace.corruption == "noise" else 1
    std = noise_scale(facts, embeddings, trace.noise.k) if trace.corruption == "noise" else 0.0
    layout = TraceLayout(tuple(facts), tuple(trace.components), layers, facts_.num_layers, trace.window, samples,
                         trace.corruption, std, trace.filter)
    s = cfg.sampling
    embed_site = site_id(0, "pre_attn")
    # the sites some restore reads: the clean runs keep their values there (at the positions cells restore)
    restored_sites = sorted({site for component in trace.components for layer in layers
                             for site in layout.restore_sites(component, layer, trace.resid_hook)})

    # packed cells skip the layers below their lowest restore: there they compute what their corrupted run does,
    # which keeps its residual stream at those layers for them
    skip_layers = cfg.engine.packs_cells()
    stride = cfg.engine.cell_entry_stride
    starts = {}
    for component in trace.components:
        for layer in layers:
            lowest = min(site_of(site)[0] for site in layout.restore_sites(component, layer, trace.resid_hook))
            starts[component, layer] = lowest - lowest % stride
    stream_sites = sorted({site_id(start, "pre_attn") for start in starts.values() if start > 0}) \
        if skip_layers else []

    requests: list[EngineRequest] = []
    sources: dict[str, np.ndarray] = {}
    refs: dict[str, tuple[str, int, int]] = {}
    kv_refs: dict[str, tuple[str, int, int]] = {}
    for fact in facts:
        f = fact.index
        condition = clean_rid(f) if trace.filter else None
        run = run_digest(fact.clean, [])
        mapped = fact.restored
        keep = Keep(run, keep_groups({site: set(mapped.values()) for site in restored_sites}))
        requests.append(make_request(clean_rid(f), fact.clean, s, keep=keep, max_tokens=1,
                                     meta={"fact": f, "part": "clean"}))
        # each restore (the clean values at one component, layer and token) once, for the cells of every noise sample
        restores: dict[tuple[str, int, int], Patch] = {}
        restore_refs: dict[str, tuple[str, int, int]] = {}
        for component in trace.components:
            for layer in layers:
                sites = layout.restore_sites(component, layer, trace.resid_hook)
                for token, clean_pos in sorted(mapped.items()):
                    entries = []
                    for site in sites:
                        ref = ref_key(run, site, clean_pos)
                        restore_refs[ref] = (clean_rid(f), site, clean_pos)
                        entries.append((site, token, ref, 0.0, 1.0))
                    restores[component, layer, token] = Patch.of(entries)
        corrupt_entries = []
        if trace.corruption == "noise":
            noise = np.random.default_rng([trace.noise.seed, f]).standard_normal(
                (samples, len(fact.subject_positions), facts_.hidden_size)) * std
            layout.noise[f] = noise.astype(np.float32)
            for sample in range(samples):
                entries = []
                for j, pos in enumerate(fact.subject_positions):
                    vec = layout.noise[f][sample, j]
                    key = "vec:" + vector_key(vec)
                    sources[key] = vec
                    entries.append((embed_site, pos, key, 1.0, 1.0))  # add the noise to the embedding
                corrupt_entries.append(entries)
        else:
            corrupt_entries.append([])
        for sample, noise_entries in enumerate(corrupt_entries):
            noise_patch = Patch.of(noise_entries)
            meta = {"fact": f, "part": "corrupt", "sample": sample}
            base = run_digest(fact.corrupt, noise_entries)
            positions = range(len(fact.corrupt.token_ids))
            for site in stream_sites:
                for pos in positions:
                    refs[ref_key(base, site, pos)] = (corrupt_rid(f, sample), site, pos)
            stream = None
            if skip_layers:  # its stream at its cells' entry layers, and its KV before their restored tokens
                stream = Keep(base, keep_groups({site: set(positions) for site in stream_sites}), kv=True)
                kv_refs[kv_key(base)] = (corrupt_rid(f, sample), -1, -1)
            requests.append(make_request(corrupt_rid(f, sample), fact.corrupt, s, patch=noise_patch, max_tokens=1,
                                         meta=meta, keep=stream))
            requests.append(make_request(corrupt_rid(f, sample, True), fact.corrupt, s, patch=noise_patch,
                                         max_tokens=1, stage=1, role="baseline", meta={**meta, "in_batch": True},
                                         condition=condition))
            refs.update(restore_refs)  # named by this sample's cells, after its stream refs
            for (component, layer, token), restore in restores.items():
                start = starts[component, layer]
                patch = noise_patch.overlaid(restore)  # a restore wins over the noise at its (site, position)
                requests.append(make_request(
                    cell_rid(f, component, layer, token, sample), fact.corrupt, s, patch=patch, max_tokens=1, stage=1,
                    role="patched", condition=condition,
                    start=StartLayer(start, base) if stream_sites and start > 0 else None,
                    reuse=ReuseKv(base, token) if skip_layers else None,
                    meta={"fact": f, "part": "cell", "component": component, "layer": layer, "token": token,
                          "sample": sample}))
    bank = bank_rows_for(cfg, len(sources) + len(refs))
    refs.update(kv_refs)  # released with the refs, kept outside the bank
    mark_private_kv(requests)
    return Plan(
        requests=tuple(requests), vectors={}, engine_spec=engine_spec_of(requests, bank), captures=(), kind=kind_name,
        requests_sha256=requests_hash(requests), sources=sources, refs=refs,
        skipped=tuple({"fact": f.index, "positions": list(f.skipped)} for f in facts if f.skipped), layout=layout,
    )
