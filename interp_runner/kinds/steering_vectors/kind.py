"""Steering vectors from contrastive pairs (contrastive activation addition, Rimsky et al. 2023; repeng's PCA), and
how far steering with them moves a held-out metric.

Stage 0 runs both texts of every pair, capturing the chosen hooks and layers at the last token: a pair is
``{positive, negative}`` (two texts) or CAA's A/B form ``{prompt, positive, negative}`` (one prompt with two
one-token completions, read at the completion). ``Plan.derive_vectors`` turns those captures into vectors
(``interp_runner.vectors.methods``). Stage 1 runs every held-out prompt (``{text, answer, foil}``) steered on every
token with the evaluated method's vector at (hook, layer) x scale, and unsteered beside them, scoring the answer
against the foil (exact log-probabilities of one token each).

Store: ``vector`` (method, vector_hook, vector_layer, hidden), NaN where ``degenerate`` (same dims, bool: the
pairs define no direction there, ``interp_runner.vectors.methods``; such vectors are never exported or read as a
``{store: ...}`` vector), ``activation_norm`` (vector_hook, vector_layer; the scale degeneracy is judged against),
``pair_projection`` (method, vector_hook, vector_layer, pair: each pair's positive - negative on the vector's unit
direction) and ``pairs_aligned`` (the fraction of those above zero; the summary warns below ``WEAK_AGREEMENT``);
the evaluation's ``steered_logit_diff`` and ``effect`` (steered - unsteered) (prompt, layer, scale),
``baseline_logit_diff`` (prompt) and ``mean_effect`` (layer, scale), all logit differences answer - foil, NaN at
a layer whose evaluated vector is degenerate. ``nonfinite`` (prompt, layer, scale) and ``baseline_nonfinite``
(prompt), bool: the request was computed through a non-finite value (``interp_runner.store.result_flags``); its logit
difference is NaN, not a number, and so is every effect and ``mean_effect`` that depends on it (a mean over prompts
with a flagged cell is NaN, never a mean over the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import xarray as xr
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import Float32, LayerSelector, SteeredHook, Strict, distinct, resolve_path
from interp_runner.compile.inputs import read_rows
from interp_runner.contracts import DECODE, PREFILL, Capture, Steer
from interp_runner.payload import digest, pack_positions
from interp_runner.compile.plan import Plan
from interp_runner.compile.prompt_set import check_length, check_vocabulary, prompt_of_row
from interp_runner.compile.requests import Prompt, engine_spec_of, make_request, mark_private_kv, requests_hash
from interp_runner.store.result_arrays import strings
from interp_runner.compile.overflow import FLOAT32_MAX, overflow_reason, squares
from interp_runner.compile.selectors import parse_layers
from interp_runner.sites import site_id
from interp_runner.vectors.methods import DEGENERATE_BELOW, DegenerateDirection, activation_scale, derive, pair_projections
from interp_runner.kinds.base import Headline, Propagated, Section, Table
from interp_runner.kinds.steering_vectors.checks import WEAK_AGREEMENT, vector_warnings

SECTION = "steering_vectors"
Method = Literal["mean_diff", "pca"]
STEER_PHASES = PREFILL | DECODE  # every token, as CAA steers
EFFECT_FIGURE = "steering_effect.png"


class PairRow(BaseModel):
    """A line of a pairs file: two texts, or a prompt and two one-token completions; other keys are metadata."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    prompt: str | None = Field(None, min_length=1)
    positive: str = Field(min_length=1)
    negative: str = Field(min_length=1)


class HeldOutRow(BaseModel):
    """A line of a held-out file; other keys are metadata."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    id: str | None = Field(None, min_length=1)
    text: str = Field(min_length=1)
    answer: str = Field(min_length=1)
    foil: str = Field(min_length=1)


class VectorEval(Strict):
    prompts: str  # JSONL of {text, answer, foil}
    method: Method = "mean_diff"
    hook: SteeredHook | None = None  # default: the first of steering_vectors.hooks
    scales: Annotated[list[Float32], Field(min_length=1), AfterValidator(distinct)] = [-4.0, -2.0, 2.0, 4.0]
    layers: LayerSelector | None = None  # default: every vector layer
    export: bool = True  # vectors.safetensors, and a GGUF control vector per method of post_block vectors
    plots: bool = True  # the effect figure


class SteeringVectors(Strict):
    """Vectors from contrastive pairs at every (hook, layer) by every method, and their evaluation."""

    pairs: str  # JSONL of {positive, negative} or {prompt, positive, negative}
    hooks: Annotated[list[SteeredHook], Field(min_length=1), AfterValidator(distinct)] = ["post_block"]
    layers: LayerSelector = "all"
    methods: Annotated[list[Method], Field(min_length=1), AfterValidator(distinct)] = ["mean_diff", "pca"]
    eval: VectorEval


def pair_rid(i: int, side: int) -> str:
    return f"pair{i:04d}-{'pos' if side == 0 else 'neg'}"


def eval_rid(j: int, layer: int | None = None, scale_index: int | None = None) -> str:
    return f"eval{j:04d}-" + ("base" if layer is None else f"L{layer:02d}-s{scale_index:02d}")


@dataclass(frozen=True)
class VectorLayout:
    """What the plan's requests stand for: pair i is read from ``pair_rid(i, 0)`` (positive) and ``pair_rid(i, 1)``,
    held-out prompt j from ``eval_rid(j)`` (unsteered) and ``eval_rid(j, layer, s)``."""

    pairs: tuple[tuple[Prompt, Prompt], ...]
    completions: bool  # CAA's A/B form: each text is a shared prompt and a one-token completion
    hooks: tuple[str, ...]
    layers: tuple[int, ...]
    methods: tuple[str, ...]
    heldout: tuple[Prompt, ...]
    answers: tuple[tuple[str, str], ...]  # (answer, foil) text per held-out prompt
    eval_method: str
    eval_hook: str
    eval_layers: tuple[int, ...]
    scales: tuple[float, ...]
    keys: dict = field(default_factory=dict)  # eval layer -> the key its stage-1 requests steer with

    def stacks(self, results: dict, hook: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The pairs' (positive, negative) activations at one site, [pairs, hidden] each."""
        site = site_id(layer, hook)
        return tuple(np.stack([results[pair_rid(i, side)].captures[site][1][0] for i in range(len(self.pairs))])
                     for side in (0, 1))

    def derive_vectors(self, results: dict) -> dict[str, np.ndarray]:
        """The stage-1 steering vectors by key, from the stage-0 results by request id."""
        out = {}
        for layer, key in self.keys.items():
            pos, neg = self.stacks(results, self.eval_hook, layer)
            try:
                out[key] = derive(self.eval_method, pos, neg)
            except DegenerateDirection:  # no direction: its cells steer by nothing and are NaN in the store
                out[key] = np.zeros(pos.shape[-1], dtype=np.float32)
            with np.errstate(over="ignore"):
                if not np.isfinite(out[key] * np.float32(max(map(abs, self.scales)))).all():
                    raise ValueError(f"{SECTION}.eval.scales: {max(map(abs, self.scales))} times the "
                                     f"{self.eval_method} vector of layer {layer} leaves float32's range")
        return out


# -- compile ----------------------------------------------------------------------------------------------


def _one_token(tokenizer, text: str, where: str) -> int:
    ids = tokenizer.plain(text)
    if len(ids) != 1:
        raise ConfigError.at(where, f"{text!r} is {len(ids)} tokens {list(ids)}: an A/B completion must be one "
                                    "token (its activations are read there)")
    return int(ids[0])


def load_pairs(cfg, tokenizer, base: Path | None) -> tuple[list[tuple[Prompt, Prompt]], bool]:
    where = f"{SECTION}.pairs"
    path = resolve_path(getattr(cfg, SECTION).pairs, base)
    rows = read_rows(path, where, PairRow)
    if not rows:
        raise ConfigError.at(where, f"{path} holds no pairs")
    completions = rows[0].prompt is not None
    if not completions and cfg.prompts.chat_template:
        raise ConfigError.at("prompts.chat_template", "pairs of two texts are read at their last token, which a chat "
                                                      "template makes its own: give A/B pairs ({prompt, positive, "
                                                      "negative}) or no template")
    pairs = []
    for i, row in enumerate(rows):
        if (row.prompt is not None) != completions:
            raise ConfigError.at(f"{where}[{i}].prompt", "every pair has a 'prompt' (A/B completions) or none does "
                                                         f"(two texts); pair 0 {'has' if completions else 'has none'}")
        texts = []
        for side, text in enumerate((row.positive, row.negative)):
            key = f"{where}[{i}].{'positive' if side == 0 else 'negative'}"
            if completions:
                ids = tuple(int(t) for t in tokenizer(row.prompt)) + (_one_token(tokenizer, text, key),)
                text = row.prompt + text
            else:
                ids = tuple(int(t) for t in tokenizer(text))
            if not ids:
                raise ConfigError.at(key, f"{text!r} tokenizes to nothing")
            if side == 1 and ids == texts[0].token_ids:
                raise ConfigError.at(key, "is the same tokens as its positive: the pair has no difference to "
                                          "derive a direction from")
            texts.append(Prompt(index=2 * i + side, id=pair_rid(i, side), text=text, token_ids=ids))
        pairs.append(tuple(texts))
    return pairs, completions


def load_heldout(cfg, tokenizer, base: Path | None) -> tuple[list[Prompt], list[tuple[str, str]]]:
    where = f"{SECTION}.eval.prompts"
    path = resolve_path(getattr(cfg, SECTION).eval.prompts, base)
    rows = read_rows(path, where, HeldOutRow)
    if not rows:
        raise ConfigError.at(where, f"{path} holds no prompts")
    prompts, ids = [], {}
    for j, row in enumerate(rows):
        prompt = prompt_of_row(j, row, where, "h", ids, tokenizer, cfg.scoring.first_token)
        answer, foil = prompt.answer_ids
        if answer == foil:
            raise ConfigError.at(f"{where}[{j}].foil", f"{row.foil!r} is scored by the answer's token {answer}")
        prompts.append(prompt)
    return prompts, [(row.answer, row.foil) for row in rows]


def compile_vectors(cfg, facts, tokenizer, base: Path | None) -> Plan:
    if cfg.sampling.teacher_forcing is not None:
        raise ConfigError.at("sampling.teacher_forcing", "steering-vector runs generate no text to force")
    sv = getattr(cfg, SECTION)
    layers = parse_layers(sv.layers, facts.num_layers, f"{SECTION}.layers")
    if sv.eval.method not in sv.methods:
        raise ConfigError.at(f"{SECTION}.eval.method", f"{sv.eval.method!r} is not among {SECTION}.methods "
                                                       f"{sv.methods}: it derives no vector to evaluate")
    hook = sv.eval.hook or sv.hooks[0]
    if hook not in sv.hooks:
        raise ConfigError.at(f"{SECTION}.eval.hook", f"{hook!r} is not among {SECTION}.hooks {sv.hooks}: no vector "
                                                     "is derived there")
    where = f"{SECTION}.eval.layers"
    eval_layers = layers if sv.eval.layers is None else parse_layers(sv.eval.layers, facts.num_layers, where)
    for n, layer in enumerate(eval_layers):
        if layer not in layers:
            at = where if isinstance(sv.eval.layers, (int, str)) else f"{where}[{n}]"
            raise ConfigError.at(at, f"layer {layer} has no vector: {SECTION}.layers selects {layers}")
    for k, scale in enumerate(sv.eval.scales):  # vectors come from the run: the scale alone is known here
        if squares(scale) > FLOAT32_MAX:
            raise ConfigError.at(f"{SECTION}.eval.scales[{k}]", f"{scale} times a unit vector (pca's): "
                                                                f"{overflow_reason(squares(scale))}")
    pairs, completions = load_pairs(cfg, tokenizer, base)
    if "pca" in sv.methods and len(pairs) < 2:
        raise ConfigError.at(f"{SECTION}.methods", f"pca needs at least 2 pairs ({SECTION}.pairs holds 1)")
    heldout, answers = load_heldout(cfg, tokenizer, base)
    texts = [p for pair in pairs for p in pair]
    check_vocabulary(texts, facts.vocab_size, f"{SECTION}.pairs")
    check_vocabulary(heldout, facts.vocab_size, f"{SECTION}.eval.prompts")
    check_length(cfg, texts + heldout, 1)

    # a derived vector's key names what it is computed from (method, site, every pair's tokens), so no vector of
    # another run with the same name is ever taken for it
    pair_tokens = [p.token_ids for p in texts]
    keys = {layer: "derived:" + digest([sv.eval.method, site_id(layer, hook), pair_tokens]) for layer in eval_layers}
    s = cfg.sampling
    sites = [site_id(layer, h) for h in sv.hooks for layer in layers]
    requests = [make_request(p.id, p, s, capture=[Capture(tuple(sites), pack_positions([len(p.token_ids) - 1]), False)],
                             max_tokens=1, meta={"pair": p.index // 2, "side": p.index % 2}) for p in texts]
    for p in heldout:
        requests.append(make_request(eval_rid(p.index), p, s, stage=1, role="baseline", max_tokens=1,
                                     meta={"heldout": p.index}))
        for layer in eval_layers:
            for k, scale in enumerate(sv.eval.scales):
                steer = [Steer(site_id(layer, hook), STEER_PHASES, keys[layer], float(scale))]
                requests.append(make_request(eval_rid(p.index, layer, k), p, s, steer, stage=1, role="steered",
                                             max_tokens=1, meta={"heldout": p.index, "layer": layer, "scale": k}))
    mark_private_kv(requests)
    layout = VectorLayout(tuple(pairs), completions, tuple(sv.hooks), tuple(layers), tuple(sv.methods),
                          tuple(heldout), tuple(answers), sv.eval.method, hook, tuple(eval_layers),
                          tuple(float(x) for x in sv.eval.scales), keys)
    return Plan(requests=tuple(requests), vectors={}, engine_spec=engine_spec_of(requests, 0), captures=(),
                kind=SECTION, requests_sha256=requests_hash(requests), layout=layout,
                derive_vectors=layout.derive_vectors)


# -- the store --------------------------------------------------------------------------------------------


def _logit_diff(result) -> float:
    if result is None or result.score is None or result.nonfinite:
        return np.nan
    answer, foil = result.score["logprobs"][:2]
    return float(answer) - float(foil)


def vectors_dataset(plan: Plan, results: dict, hidden: int) -> xr.Dataset:
    layout: VectorLayout = plan.layout
    shape = (len(layout.methods), len(layout.hooks), len(layout.layers))
    vector = np.full(shape + (hidden,), np.nan, dtype=np.float32)
    degenerate = np.zeros(shape, dtype=bool)
    projection = np.full(shape + (len(layout.pairs),), np.nan, dtype=np.float32)
    scale = np.zeros(shape[1:], dtype=np.float32)
    for h, hook in enumerate(layout.hooks):
        for l, layer in enumerate(layout.layers):
            pos, neg = layout.stacks(results, hook, layer)
            scale[h, l] = activation_scale(pos, neg)
            for m, method in enumerate(layout.methods):
                try:
                    vector[m, h, l] = derive(method, pos, neg)
                except DegenerateDirection:
                    degenerate[m, h, l] = True  # stays NaN: no direction
                    continue
                projection[m, h, l] = pair_projections(pos, neg, vector[m, h, l])
    with np.errstate(invalid="ignore"):
        aligned = np.where(degenerate, np.nan, (projection > 0).mean(axis=-1)).astype(np.float32)
    heldout, scales = layout.heldout, layout.scales
    baseline = np.array([_logit_diff(results.get(eval_rid(p.index))) for p in heldout])
    steered = np.array([[[_logit_diff(results.get(eval_rid(p.index, layer, k))) for k in range(len(scales))]
                         for layer in layout.eval_layers] for p in heldout])
    m, h = layout.methods.index(layout.eval_method), layout.hooks.index(layout.eval_hook)
    no_vector = [degenerate[m, h, layout.layers.index(layer)] for layer in layout.eval_layers]
    steered[:, no_vector] = np.nan  # steered by no direction: no result
    effect = steered - baseline[:, None, None]
    flagged = np.array([[[getattr(results.get(eval_rid(p.index, layer, k)), "nonfinite", False)
                          for k in range(len(scales))] for layer in layout.eval_layers] for p in heldout], dtype=bool)
    baseline_flagged = np.array([getattr(results.get(eval_rid(p.index)), "nonfinite", False) for p in heldout],
                                dtype=bool)
    pair_dim = ("pair",)
    data_vars = {
        "vector": (("method", "vector_hook", "vector_layer", "hidden"), vector),
        "degenerate": (("method", "vector_hook", "vector_layer"), degenerate),
        "activation_norm": (("vector_hook", "vector_layer"), scale),
        "pair_projection": (("method", "vector_hook", "vector_layer", "pair"), projection),
        "pairs_aligned": (("method", "vector_hook", "vector_layer"), aligned),
        "steered_logit_diff": (("prompt", "layer", "scale"), steered.astype(np.float32)),
        "baseline_logit_diff": (("prompt",), baseline.astype(np.float32)),
        "effect": (("prompt", "layer", "scale"), effect.astype(np.float32)),
        "mean_effect": (("layer", "scale"), effect.mean(axis=0).astype(np.float32)),
        "nonfinite": (("prompt", "layer", "scale"), flagged.reshape(steered.shape)),
        "baseline_nonfinite": (("prompt",), baseline_flagged.reshape(baseline.shape)),
    }
    coords = {
        "method": ("method", strings(layout.methods)),
        "vector_hook": ("vector_hook", strings(layout.hooks)),
        "vector_layer": ("vector_layer", np.asarray(layout.layers, dtype=np.int32)),
        "pair_positive": (pair_dim, strings(positive.text for positive, _ in layout.pairs)),
        "pair_negative": (pair_dim, strings(negative.text for _, negative in layout.pairs)),
        "prompt_id": ("prompt", strings(p.id for p in heldout)),
        "prompt_text": ("prompt", strings(p.text for p in heldout)),
        "answer": ("prompt", strings(a for a, _ in layout.answers)),
        "foil": ("prompt", strings(f for _, f in layout.answers)),
        "layer": ("layer", np.asarray(layout.eval_layers, dtype=np.int32)),
        "scale": ("scale", np.asarray(scales, dtype=np.float32)),
    }
    attrs = {"pair_form": "completions" if layout.completions else "texts", "eval_method": layout.eval_method,
             "eval_hook": layout.eval_hook, "metric": "logit difference (answer - foil) after the prompt",
             "degenerate_below": DEGENERATE_BELOW, "weak_agreement_below": WEAK_AGREEMENT}
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)


# -- reading a store --------------------------------------------------------------------------------------


def slopes(ds: xr.Dataset) -> np.ndarray:
    """Per evaluated layer, the least-squares slope through the origin of the mean effect against the scale: the
    mean logit-difference change per unit scale."""
    scale = ds["scale"].values.astype(np.float64)
    mean = ds["mean_effect"].transpose("layer", "scale").values.astype(np.float64)
    return mean @ scale / max(float(scale @ scale), np.finfo(float).tiny)


def best_layer(ds: xr.Dataset) -> tuple[int, float]:
    per_layer = slopes(ds)
    if not np.isfinite(per_layer).any():
        return -1, np.nan
    i = int(np.nanargmax(per_layer))
    return int(ds["layer"].values[i]), float(per_layer[i])


def effect_figure(ds: xr.Dataset, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = ds["scale"].values.astype(float)
    order = np.argsort(scales)
    layers = ds["layer"].values
    colours = plt.get_cmap("viridis")(np.linspace(0, 1, max(len(layers), 2)))
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for i, layer in enumerate(layers):
        mean = ds["mean_effect"].sel(layer=layer).values.astype(float)
        ax.plot(scales[order], mean[order], marker="o", ms=3, color=colours[i], label=f"L{int(layer)}")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel(f"scale of the {ds.attrs['eval_method']} vector at {ds.attrs['eval_hook']}")
    ax.set_ylabel("mean change of logit diff (answer - foil)")
    ax.set_title(f"Steering effect on {ds.sizes['prompt']} held-out prompts", fontsize=10)
    ax.legend(fontsize=7, ncol=max(1, len(layers) // 10), title="layer", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


ITS_PROMPTS = "its pairs and held-out prompts are the prompts"


class SteeringVectorsKind:
    name = SECTION
    section = SECTION
    settings = SteeringVectors
    excludes = {"steering": "", "capture": "", "patching": "", "vectors": "", "prompts.items": ITS_PROMPTS,
                "prompts.file": ITS_PROMPTS}
    # as ``vectors_dataset`` computes them: effect = steered - baseline, mean_effect its mean over prompts
    verify_rules = {"effect": Propagated(("steered_logit_diff", "baseline_logit_diff")),
                    "mean_effect": Propagated(("effect",))}

    def compile(self, cfg, facts, tokenizer, base: Path | None, embeddings) -> Plan:
        return compile_vectors(cfg, facts, tokenizer, base)

    def dataset(self, plan: Plan, results: dict, hidden: int, tokenizer) -> xr.Dataset:
        return vectors_dataset(plan, results, hidden)

    def figure_count(self, cfg, plan: Plan) -> int:
        return int(getattr(cfg, SECTION).eval.plots)

    def figures(self, ds: xr.Dataset, cfg, out_dir: Path, workers=None) -> list[Path]:
        if not getattr(cfg, SECTION).eval.plots:
            return []
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        return [effect_figure(ds, out_dir / EFFECT_FIGURE)]

    def exports(self, ds: xr.Dataset, cfg, out_dir: Path) -> list[Path]:
        if not getattr(cfg, SECTION).eval.export:
            return []
        from interp_runner.vectors.control import export_vectors

        return export_vectors(ds, Path(out_dir))

    def summary(self, ds: xr.Dataset) -> list[str]:
        form = "A/B pairs (prompt and two completions)" if ds.attrs["pair_form"] == "completions" else "pairs of texts"
        lines = [f"{ds.sizes['pair']} {form} -> {', '.join(map(str, ds['method'].values))} vectors at "
                 f"{', '.join(map(str, ds['vector_hook'].values))}, {ds.sizes['vector_layer']} layers"]
        method, hook = ds.attrs["eval_method"], ds.attrs["eval_hook"]
        norms = np.linalg.norm(ds["vector"].sel({"method": method, "vector_hook": hook}).values, axis=-1)
        aligned = ds["pairs_aligned"].sel({"method": method, "vector_hook": hook}).values
        if np.isfinite(norms).any():
            lines.append(f"{method} at {hook}: norm {np.nanmin(norms):.3g} to {np.nanmax(norms):.3g}; pairs whose "
                         f"positive projects higher: {np.nanmin(aligned):.0%} to {np.nanmax(aligned):.0%}")
        lines += vector_warnings(ds)
        layer, slope = best_layer(ds)
        baseline = float(ds["baseline_logit_diff"].mean())
        lines.append(f"held-out ({ds.sizes['prompt']} prompts): unsteered mean logit diff {baseline:+.3f}; best mean "
                     f"change per unit scale {slope:+.4f} at layer {layer}")
        top = float(ds["scale"].max())
        at_top = ds["mean_effect"].sel(scale=top).values
        for i in np.argsort(-at_top)[:3]:
            lines.append(f"  layer {int(ds['layer'].values[i])}: mean change {float(at_top[i]):+.3f} at scale {top:g}")
        return lines

    def value_kind(self, name: str) -> str:
        return "other"  # activations, directions, fractions and logit differences

    def report_sections(self, ds: xr.Dataset, figures: list[Path]) -> list[Section]:
        scales = [float(s) for s in ds["scale"].values]
        per_layer = slopes(ds)
        rows = tuple((int(layer), *(round(float(v), 4) for v in ds["mean_effect"].sel(layer=layer).values),
                      round(float(per_layer[i]), 4)) for i, layer in enumerate(ds["layer"].values))
        table = Table("Mean change of the logit difference (answer - foil) on the held-out prompts",
                      ("layer", *(f"scale {s:g}" for s in scales), "per unit scale"), rows)
        def agreement(m, h) -> tuple:
            at = {"method": m, "vector_hook": h}
            flags = ds["degenerate"].sel(at).values if "degenerate" in ds else [False] * ds.sizes["vector_layer"]
            return tuple("degenerate" if bad else round(float(v), 3)
                         for v, bad in zip(ds["pairs_aligned"].sel(at).values, flags))

        vectors = Table("Vectors: fraction of pairs whose positive projects above its negative",
                        ("method", "hook", *(f"L{int(x)}" for x in ds["vector_layer"].values)),
                        tuple((str(m), str(h), *agreement(m, h))
                              for m in ds["method"].values for h in ds["vector_hook"].values))
        text = (f"Vectors from {ds.sizes['pair']} contrastive pairs (pca signed to agree with the mean difference). "
                f"Each of {ds.sizes['prompt']} held-out prompts "
                f"runs steered on every token with scale x the {ds.attrs['eval_method']} vector at "
                f"{ds.attrs['eval_hook']} of one layer, and unsteered; the effect is the change of its logit "
                "difference (answer - foil). Per unit scale: the least-squares slope through the origin of the mean "
                "effect against the scale.")
        text = "\n\n".join([text, *vector_warnings(ds)])
        shown = tuple(Path(f) for f in figures if Path(f).name == EFFECT_FIGURE)
        return [Section("Steering vectors", text, (table, vectors), shown)]

    def headline(self, ds: xr.Dataset) -> Headline | None:
        layer, slope = best_layer(ds)
        if layer < 0:
            return None
        return Headline(f"best mean logit-diff change per unit scale ({ds.attrs['eval_method']}, layer {layer})",
                        slope)

    report_settings = ("Steering-vector settings", ("pair_form", "eval_method", "eval_hook", "metric",
                                                    "degenerate_below", "weak_agreement_below"))

    def counts(self, ds: xr.Dataset) -> list[tuple[str, int]]:
        return [("pairs", ds.sizes["pair"]), ("held-out prompts", ds.sizes["prompt"]),
                ("steered layers", ds.sizes["layer"]), ("scales", ds.sizes["scale"])]


KIND = SteeringVectorsKind()
