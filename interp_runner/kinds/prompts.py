"""The prompts kind, the default: steering, capture, activation patching and answer scoring over a prompt list
(``prompts``, ``vectors``, ``steering``, ``capture``, ``patching``, ``scoring``: keys of every run config).

Each request carries its interventions in ``SamplingParams.extra_args`` (``interp_runner.contracts``); vectors and
patch sources are returned separately, keyed by content hash, to be registered on the workers. Stage 0 holds every
prompt as written (steered, captured, scored); stage 1 the patched copies of destination prompts, plus an unpatched
copy of each destination in the same batch (the noise floor).

Store (``dataset``), one row per request in plan order:

- ``prompt_tokens`` (request, prompt_position), ``tokens`` / ``logprob`` (request, generated): -1 / NaN padded;
  ``top_token_ids`` / ``top_logprob`` (request, generated, top_k) when ``sampling.logprobs`` > 0;
- ``text`` and ``prompt`` (request);
- per capture entry NAME: ``NAME`` (request, NAME_hook, NAME_layer, NAME_slot, hidden) with coordinate
  ``NAME_position`` (request, NAME_slot) giving the token position of each slot (-1 and NaN where unused);
  an entry of a MoE model's ``router_logits`` holds (..., NAME_slot, expert) instead, plus the experts each token
  chose, ``NAME_topk_ids`` and their routing weights ``NAME_topk_weights`` (..., NAME_slot, routed).

With answers to score (prompt ``answer``/``foil``): ``answer_logprob``, ``answer_prob``, ``foil_logprob``,
``logit_diff``, ``top_token`` (request), exact whatever the answer's rank. With ``patching``: requests also cover
the patched copies and in-batch baselines (``role``, ``prompt_index``, ``patch``), with ``recovered``
= (patched - corrupt) / (clean - corrupt) on answer probabilities, ``below_noise_floor``, and attributes
``noise_floor`` (largest |in-batch - solo| probability of an unpatched destination), ``skipped_positions`` and
``voided``.

``nonfinite`` (request, bool): the request was computed through a non-finite value (its residual stream overflowed
the final norm's float32 sum of squares, or its scored logits were not finite: ``interp_runner.store.result_flags``); its
``status`` is "nonfinite" and every number computed from it (``logprob``, ``top_logprob``, scores, captures, and
``recovered`` of a patched request that depends on it) is NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import xarray as xr

from interp_runner.config.schema import RunBase, Span, resolve_path
from interp_runner.compile.forcing import force_generations
from interp_runner.models.facts import ModelFacts
from interp_runner.compile.patching import compile_patching
from interp_runner.compile.plan import Plan, bank_rows_for
from interp_runner.compile.prompt_set import check_length, check_vocabulary, load_prompts, prompt_rid, require_plain_prompts
from interp_runner.compile.requests import Patch, engine_spec_of, make_request, mark_private_kv, requests_hash
from interp_runner.store.result_arrays import (capture_arrays, capture_vars, padded, score_arrays, strings,
                                               value_kind)
from interp_runner.compile.steering import compile_capture, compile_steering, load_named_vectors
from interp_runner.kinds.base import Headline, Section, Table

SUMMARY_ROWS = 8  # requests listed in the summary


class PromptsKind:
    name = "prompts"
    section = None  # its keys are the run config's own
    settings = None
    excludes: dict[str, str] = {}
    verify_rules: dict = {}  # its arrays are judged on their own

    def compile(self, cfg: RunBase, facts: ModelFacts, tokenize: Callable[[str], Sequence[int]],
                base: Path | None = None, embeddings: Callable | None = None) -> Plan:
        for i, spec in enumerate(cfg.patching):
            if isinstance(spec.positions, Span):
                require_plain_prompts(cfg, f"patching[{i}].positions.span",
                                      "span positions need prompts without a chat template (prompts.chat_template: "
                                      "true)")
        prompts = load_prompts(cfg, tokenize, base)
        check_vocabulary(prompts, facts.vocab_size, "prompts.file" if cfg.prompts.file else "prompts.items")
        check_length(cfg, prompts, cfg.sampling.max_tokens)
        named = load_named_vectors(cfg, facts, base)
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
            kind=self.name,
            requests_sha256=requests_hash(requests),
            sources=patching.sources,
            refs=patching.refs,
            skipped=tuple(patching.skipped),
        )

    def dataset(self, plan: Plan, results: dict, hidden: int, tokenizer=None) -> xr.Dataset:
        """Results by request id -> the store's dataset (requests in plan order)."""
        pairs = [(r, results.get(r.rid)) for r in plan.requests]
        ran = [res for _, res in pairs]
        prompts = [r.prompt for r in plan.requests]
        status = ["skipped" if res is None else "void" if res.void else "nonfinite" if res.nonfinite else "done"
                  for res in ran]
        # a request computed through a non-finite value has no numbers: NaN in their place
        numbers = [res if res is not None and not res.nonfinite else None for res in ran]
        data_vars = {
            "prompt_tokens": (("request", "prompt_position"), padded([p.token_ids for p in prompts], -1, np.int32)),
            "prompt_len": ("request", np.array([len(p.token_ids) for p in prompts], dtype=np.int32)),
            "tokens": (("request", "generated"), padded([res.token_ids if res else [] for res in ran], -1, np.int32)),
            "num_generated": ("request", np.array([len(res.token_ids) if res else 0 for res in ran], dtype=np.int32)),
            "logprob": (("request", "generated"), padded([res.logprobs if res else [] for res in numbers], np.nan,
                                                         np.float32)),
            "nonfinite": ("request", np.array([bool(res and res.nonfinite) for res in ran]),
                          {"description": "computed through a non-finite value: its numbers are NaN"}),
            "text": ("request", strings([res.text if res else "" for res in ran])),
            "status": ("request", strings(status)),
        }
        k = plan.requests[0].sampling.get("logprobs") or 0
        if k:
            steps = [res.top_logprobs if res and res.top_logprobs else [] for res in ran]
            flagged = [res is not None and res.nonfinite for res in ran]
            width = max((len(x) for x in steps), default=0)
            top_ids = np.full((len(ran), max(width, 1), k), -1, dtype=np.int32)
            top_lps = np.full(top_ids.shape, np.nan, dtype=np.float32)
            for i, request_steps in enumerate(steps):
                for j, step in enumerate(request_steps):
                    top_ids[i, j, : len(step[:k])] = [t for t, _ in step[:k]]
                    top_lps[i, j, : len(step[:k])] = [lp for _, lp in step[:k]]
            data_vars["top_token_ids"] = (("request", "generated", "top_k"), top_ids)
            top_lps[flagged] = np.nan
            data_vars["top_logprob"] = (("request", "generated", "top_k"), top_lps)
        attrs = {}
        if any(p.answer_ids for p in prompts):
            scores, attrs = score_arrays(plan, pairs)
            data_vars.update(scores)
        if plan.num_stages > 1:
            attrs["skipped_positions"] = list(plan.skipped)
            attrs["voided"] = [{"request": r.rid, "reason": res.void} for r, res in pairs
                               if res is not None and res.void]
        coords = {
            "request": strings([r.rid for r in plan.requests]),
            "prompt_id": ("request", strings([p.id for p in prompts])),
            "prompt": ("request", strings([p.text for p in prompts])),
            "prompt_index": ("request", np.array([p.index for p in prompts], dtype=np.int32)),
            "role": ("request", strings([r.role for r in plan.requests])),
            "patch": ("request", np.array([r.meta.get("patch", -1) for r in plan.requests], dtype=np.int32)),
        }
        ds = xr.Dataset(data_vars, coords=coords, attrs=attrs)
        for layout in plan.captures:
            arrays = capture_arrays(layout, pairs, hidden)
            for var in capture_vars(layout):
                ds[var] = arrays.pop(var)
            ds = ds.assign_coords(arrays)
        return ds

    def figure_count(self, cfg, plan: Plan) -> int:
        return 0

    def figures(self, ds: xr.Dataset, cfg, out_dir: Path, workers=None) -> list[Path]:
        return []

    def exports(self, ds: xr.Dataset, cfg, out_dir: Path) -> list[Path]:
        return []

    def summary(self, ds: xr.Dataset) -> list[str]:
        lines = []
        for i in range(min(ds.sizes["request"], SUMMARY_ROWS)):
            prompt = str(ds["prompt"].values[i])
            text = str(ds["text"].values[i])
            mean_lp = float(ds["logprob"].isel(request=i).mean(skipna=True))
            score = f", p(answer) {float(ds['answer_prob'][i]):.3f}" if "answer_prob" in ds else ""
            lines.append(f"[{ds['request'].values[i]} {ds['role'].values[i]}] {prompt!r} -> {text!r}  "
                         f"(mean logprob {mean_lp:.3f}{score})")
        if ds.sizes["request"] > SUMMARY_ROWS:
            lines.append(f"... {ds.sizes['request'] - SUMMARY_ROWS} more")
        lines += [f"capture {name}: {dict(ds[name].sizes)}" for name in _captured(ds)]
        return lines

    def value_kind(self, name: str) -> str:
        return value_kind(name)

    def report_sections(self, ds: xr.Dataset, figures: list[Path]) -> list[Section]:
        scored, patched = "answer_prob" in ds, "recovered" in ds
        columns = ("id", "role", "prompt", "generated text") + (("answer prob", "logit diff") if scored else ()) \
            + (("recovered",) if patched else ())
        rows = []
        for i in range(ds.sizes["request"]):
            row = (str(ds["request"].values[i]), str(ds["role"].values[i]), str(ds["prompt"].values[i]),
                   str(ds["text"].values[i]))
            if scored:
                row += (float(ds["answer_prob"].values[i]), float(ds["logit_diff"].values[i]))
            if patched:
                row += (float(ds["recovered"].values[i]),)
            rows.append(row)
        sections = [Section("Requests", tables=(Table("requests", columns, tuple(rows)),))]
        captured = _captured(ds)
        if captured:
            shapes = tuple((name, " x ".join(f"{dim} {size}" for dim, size in ds[name].sizes.items()),
                            str(ds[name].attrs.get("stored_dtype", ds[name].dtype))) for name in captured)
            sections.append(Section("Captures", tables=(Table("captured activations", ("name", "shape", "dtype"),
                                                              shapes),)))
        return sections

    def headline(self, ds: xr.Dataset) -> Headline | None:
        if "logit_diff" not in ds:
            return None
        prompts = ds["logit_diff"].values[ds["role"].values == "prompt"].astype(np.float64)
        prompts = prompts[np.isfinite(prompts)]
        if not len(prompts):
            return None
        return Headline("mean logit difference (answer - foil) over the prompts", float(prompts.mean()))

    report_settings = ("Patching results", ("noise_floor", "skipped_positions", "voided"))

    def counts(self, ds: xr.Dataset) -> list[tuple[str, int]]:
        counts = [("prompts", len(np.unique(ds["prompt_index"].values)))]
        if "patch" in ds.coords and (ds["patch"].values >= 0).any():
            counts.append(("patched copies", int((ds["patch"].values >= 0).sum())))
        return counts


def _captured(ds: xr.Dataset) -> list[str]:
    """The capture entries' arrays (request, hook, layer, slot, hidden), by name: a store read back lists its arrays
    in no fixed order."""
    return sorted(str(name) for name, v in ds.data_vars.items() if v.ndim == 5)


KIND = PromptsKind()
