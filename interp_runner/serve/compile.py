"""A request's ``interp`` object -> its payload, with the compiler's own building blocks: ``compile.steering`` turns the
steering tiers into entries (the same checks as a config's), ``compile.requests.make_request`` the payload with its
prefix-cache ranges, so requests with different interventions never share KV. No engine needed."""

from __future__ import annotations

import base64
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import Tiers
from interp_runner.engine.rules import DTYPE_MAX
from interp_runner.models.facts import ModelFacts
from interp_runner.models.hook_check import check_plan_hooks, check_routed_layers
from interp_runner.models.layouts import layout_for
from interp_runner.contracts import DECODE, PAYLOAD_KEY, PREFILL, Capture, RequestPayload, Steer
from interp_runner.payload import pack_positions
from interp_runner.compile.prompt_set import answer_token
from interp_runner.compile.requests import Prompt, make_request
from interp_runner.compile.selectors import parse_layers
from interp_runner.sites import ROUTER_LOGITS, site_id, site_of
from interp_runner.compile.steering import compile_steering
from interp_runner.serve.settings import CaptureRequest, InterpRequest, SiteSet

GLOBAL = "steering.global"
SAMPLING = SimpleNamespace(max_tokens=1, temperature=0.0, top_p=1.0, seed=0, logprobs=0)  # payload only


@dataclass(frozen=True)
class Served:
    """What the engine was started with: the sites requests may use, and the model's facts."""

    facts: ModelFacts
    dtype: str  # the engine's compute dtype
    steer_sites: frozenset[int]
    capture_sites: frozenset[int]


def check_hooks(hooks: list[str], layers: list[int], facts: ModelFacts, where: str) -> None:
    """Every hook must be one of the model's blocks (``router_logits`` only in a MoE model's, at routed layers)."""
    layout = layout_for(facts.architecture)
    for i, hook in enumerate(hooks):
        check_plan_hooks([site_id(0, hook)], layout, f"{where}.hooks[{i}]")
    check_routed_layers(hooks, layers, facts.routing, where + ".layers")


def site_set(sites: SiteSet, facts: ModelFacts, where: str) -> set[int]:
    layers = parse_layers(sites.layers, facts.num_layers, where + ".layers")
    check_hooks(sites.hooks, layers, facts, where)
    return {site_id(layer, hook) for hook in sites.hooks for layer in layers}


def site_width(site: int, facts: ModelFacts) -> int:
    """The width of a captured site's rows: the hidden size, or at ``router_logits`` the number of experts."""
    return facts.routing.num_experts if site_of(site)[1] == ROUTER_LOGITS else facts.hidden_size


def steer_entries(tiers: Tiers, where: str, facts: ModelFacts, named: dict[str, np.ndarray], base=None):
    """(vectors by key, steering entries ``contracts.Steer``) of ``tiers``, checked as a config's
    ``steering.global`` is; errors name keys below ``where``."""
    cfg = SimpleNamespace(steering=SimpleNamespace(global_=tiers, request=[]))
    prompt = Prompt(0, "p", "", (0,))
    try:
        vectors, steer = compile_steering(cfg, [prompt], facts, named, base)
    except ConfigError as err:
        raise ConfigError([(where + path.removeprefix(GLOBAL) if path.startswith(GLOBAL) else path, reason)
                           for path, reason in err.problems]) from None
    return vectors, steer[0]


def check_dtype(steer: list[Steer], vectors: dict[str, np.ndarray], dtype: str, where: str) -> None:
    """Steering sums become the engine's dtype on the workers: they must stay finite there."""
    limit = DTYPE_MAX[dtype]
    terms: dict[tuple, list[Steer]] = defaultdict(list)
    for entry in steer:
        for phase in (PREFILL, DECODE):
            if entry.phases & phase:
                terms[entry.site, phase].append(entry)
    peaks: dict[str, np.float32] = {}  # each vector's largest magnitude, found once
    largest = 0.0
    with np.errstate(over="ignore"):
        for entries in terms.values():
            if len(entries) == 1:  # one term: its peak is the vector's, scaled (float32 rounding keeps the order)
                e = entries[0]
                if e.vector not in peaks:
                    peaks[e.vector] = np.abs(vectors[e.vector]).max()
                peak = float(np.abs(peaks[e.vector] * np.float32(e.scale)))
            else:
                total = sum(vectors[e.vector] * np.float32(e.scale) for e in entries)
                peak = float(np.abs(total).max())
            largest = max(largest, peak)
    if largest > limit:
        raise ConfigError.at(where, f"steering adds up to {largest:.3g} at some site, beyond {dtype}'s range "
                                    f"(±{limit:.4g}), the dtype the engine computes in")


def _no_files(tiers: Tiers, where: str) -> None:
    """A request never has the server read a file: vectors inline, by name, or random."""
    for tier in ("base", "prefill", "decode"):
        for hook, i, term in getattr(tiers, tier).terms():
            if term.vector.file is not None or term.vector.store is not None:
                path = f"{where}.{tier}.{hook}" + ("" if i is None else f"[{i}]") + ".vector"
                raise ConfigError.at(path, "a request cannot name files or stores: give values, a registered "
                                           "name (POST /v1/interp/vectors) or random")


@dataclass
class Compiled:
    """A request's interventions before its prompt is known: entries, vectors and what to read back."""

    steer: list[Steer] = field(default_factory=list)
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    capture_sites: list[int] = field(default_factory=list)
    capture: CaptureRequest | None = None
    answer_ids: tuple[int, ...] = ()
    reported: bool = False  # the request asked for ``interp``: its response carries an ``interp`` object

    def payload(self, rid: str, token_ids: list[int]) -> tuple[RequestPayload | None, bool]:
        """(payload, whether the request may not read the prefix cache) of this request for its prompt: as
        ``compile.requests.make_request`` builds a compiled run's, prefix-cache ranges included."""
        n = len(token_ids)
        capture = []
        if self.capture is not None:
            generated = self.capture.positions == "all_generated"
            capture = [Capture(tuple(self.capture_sites), pack_positions([] if generated else [n - 1]), generated)]
        prompt = Prompt(0, rid, "", tuple(token_ids), self.answer_ids)
        sampling = make_request(rid, prompt, SAMPLING, self.steer, capture).sampling
        payload = (sampling["extra_args"] or {}).get(PAYLOAD_KEY)
        return payload, bool(sampling["skip_reading_prefix_cache"])


def compile_interp(spec: InterpRequest | None, served: Served, named: dict[str, np.ndarray], tokenizer,
                   global_steer: list, global_vectors: dict) -> Compiled:
    """The request's interventions (``steering.global``'s first), checked against the served sites."""
    out = Compiled(steer=list(global_steer), vectors=dict(global_vectors), reported=spec is not None)
    if spec is None:
        return out
    facts = served.facts
    _no_files(spec.steering, "interp.steering")
    vectors, steer = steer_entries(spec.steering, "interp.steering", facts, named)
    for entry in steer:
        if entry.site not in served.steer_sites:
            layer, hook = site_of(entry.site)
            raise ConfigError.at(f"interp.steering.{hook}", f"layer {layer} is not a steered site of this server "
                                                            "(serve.sites.steer names them at start)")
    out.steer += steer
    out.vectors.update(vectors)
    check_dtype(out.steer, out.vectors, served.dtype, "interp.steering")
    if spec.capture is not None:
        layers = parse_layers(spec.capture.layers, facts.num_layers, "interp.capture.layers")
        check_hooks(spec.capture.hooks, layers, facts, "interp.capture")
        sites = [site_id(layer, hook) for hook in spec.capture.hooks for layer in layers]
        for site in sites:
            if site not in served.capture_sites:
                layer, hook = site_of(site)
                raise ConfigError.at("interp.capture", f"{hook} at layer {layer} is not a captured site of this "
                                                       "server (serve.sites.capture names them at start)")
        out.capture_sites, out.capture = sites, spec.capture
    scored = [answer_token(tokenizer, text, f"interp.{key}", False)
              for key, text in (("answer", spec.answer), ("foil", spec.foil)) if text is not None]
    out.answer_ids = tuple(scored)
    return out


def capture_bytes(compiled: Compiled, facts: ModelFacts, max_tokens: int | None) -> int | None:
    """Bytes of the values a request's capture returns at most (None: unbounded, no max_tokens)."""
    spec = compiled.capture
    if spec is None:
        return 0
    rows = 1 if spec.positions == "last_prompt" else max_tokens
    if rows is None:
        return None
    width = sum(site_width(site, facts) for site in compiled.capture_sites)
    return width * rows * np.dtype(spec.dtype).itemsize


def result_json(compiled: Compiled, result: dict) -> dict:
    """A request's worker results as the response's ``interp`` object: captures as base64 arrays (little-endian,
    row-major), the scored tokens' exact log-probabilities, and whether a non-finite value was met."""
    out: dict = {"nonfinite": bool(result.get("nonfinite", False))}
    if compiled.capture is not None:
        dtype = np.dtype(compiled.capture.dtype).newbyteorder("<")
        captures = []
        for site in compiled.capture_sites:
            positions, values = result.get("captures", {}).get(site, (np.zeros(0, np.int32), None))
            layer, hook = site_of(site)
            values = np.zeros((0, 0), np.float32) if values is None else np.asarray(values, dtype=np.float32)
            with np.errstate(over="ignore"):
                sent = np.ascontiguousarray(values, dtype=dtype)
            if not np.isfinite(sent).all() and np.isfinite(values).all():  # beyond float16: sent as float32
                sent = np.ascontiguousarray(values, dtype=np.dtype("<f4"))
            values = sent
            captures.append({"hook": hook, "layer": layer, "positions": [int(p) for p in positions],
                             "dtype": values.dtype.name, "shape": list(values.shape),
                             "data": base64.b64encode(values.tobytes()).decode()})
        out["captures"] = captures
    score = result.get("score")
    if compiled.answer_ids:
        if score is None:
            out["score"] = None
        else:
            logprobs = np.asarray(score["logprobs"], dtype=np.float64).reshape(-1)
            names = ("answer", "foil")
            out["score"] = {names[i]: {"token_id": int(t), "logprob": float(logprobs[i])}
                            for i, t in enumerate(compiled.answer_ids)}
            out["score"]["top"] = {"token_id": int(score["top_id"]), "logprob": float(score["top_logprob"])}
    return out
