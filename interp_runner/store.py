"""The zarr (v3) store of a run: results as named-dimension arrays (xarray) plus a provenance manifest.

Layout (``xarray.open_zarr(path)``):

- ``prompt_tokens`` (request, prompt_position), ``tokens`` / ``logprob`` (request, generated): -1 / NaN padded;
  ``top_token_ids`` / ``top_logprob`` (request, generated, top_k) when ``sampling.logprobs`` > 0;
- ``text`` and ``prompt`` (request);
- per capture entry NAME: ``NAME`` (request, NAME_hook, NAME_layer, NAME_slot, hidden) with coordinate
  ``NAME_position`` (request, NAME_slot) giving the token position of each slot (-1 and NaN where unused).

With answers to score (prompt ``answer``/``foil``): ``answer_logprob``, ``answer_prob``, ``foil_logprob``,
``logit_diff``, ``top_token`` (request), exact whatever the answer's rank. With ``patching``: requests also cover
the patched copies and in-batch baselines (``role``, ``prompt_index``, ``patch``), with ``recovered``
= (patched - corrupt) / (clean - corrupt) on answer probabilities, ``below_noise_floor``, and attributes
``noise_floor`` (largest |in-batch - solo| probability of an unpatched destination), ``skipped_positions`` and
``voided``. A causal trace writes its grids instead (``interp_runner.causal_trace.trace_dataset``): dims
(fact, kind, layer, token), per-fact scores, subject spans, the noise, ROME's averaged effects by token role.

Root attributes hold the manifest (``interp_runner.provenance``) and ``status``: ``running`` while the run goes,
``complete`` only after every array was written, ``failed`` (with ``error``) otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xarray as xr
import zarr
from zarr.codecs import BloscCodec

from .compiler import CaptureLayout, Plan
from .engine import RequestResult
from .sites import site_id

STATUS_RUNNING, STATUS_COMPLETE, STATUS_FAILED = "running", "complete", "failed"


def open_store(path: Path, manifest: dict) -> zarr.Group:
    """Create the store, marked running, with the manifest written first; never replaces one (where a run writes
    its store, and what it may replace, is ``interp_runner.store_claim``'s)."""
    group = zarr.open_group(str(path), mode="w-", zarr_format=3)
    group.attrs.update({"status": STATUS_RUNNING, **manifest})
    return group


def mark(path: Path, status: str, **attrs) -> None:
    group = zarr.open_group(str(path), mode="r+")
    group.attrs.update({"status": status, **attrs})


def _strings(items) -> np.ndarray:
    """Variable-length UTF-8 strings (zarr v3 ``string``), not fixed-width numpy unicode."""
    return np.array(list(items), dtype=np.dtypes.StringDType())


def _padded(rows: list, fill, dtype) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _capture_arrays(layout: CaptureLayout, pairs: list, hidden: int) -> dict:
    name = layout.name
    results = [result for _, result in pairs]
    per_request_positions = []
    for request, result in pairs:
        if result is None or request.role != "prompt" or result.prompt_index not in layout.prompt_indices:
            per_request_positions.append(np.zeros(0, dtype=np.int32))
            continue
        sites = [site_id(layer, hook) for hook in layout.hooks for layer in layout.layers]
        found = [result.captures.get(s, (np.zeros(0, np.int32), None))[0] for s in sites]
        positions = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int32)
        per_request_positions.append(positions)
    width = max(max((len(p) for p in per_request_positions), default=0), 1)
    dtype = np.float32 if layout.dtype == "float32" else np.float16
    values = np.full(
        (len(results), len(layout.hooks), len(layout.layers), width, hidden), np.nan, dtype=np.float32
    )
    for r, (result, positions) in enumerate(zip(results, per_request_positions)):
        if not len(positions):
            continue
        for h, hook in enumerate(layout.hooks):
            for l, layer in enumerate(layout.layers):
                got = result.captures.get(site_id(layer, hook))
                if got is None:
                    continue
                slot = np.searchsorted(positions, got[0])
                values[r, h, l, slot] = got[1]
    dims = ("request", f"{name}_hook", f"{name}_layer", f"{name}_slot", "hidden")
    data = xr.DataArray(values.astype(dtype, copy=False) if layout.dtype != "bfloat16" else values, dims=dims)
    if layout.dtype == "bfloat16":  # numpy has no bfloat16: round to it and keep float32 storage
        import torch

        data = data.copy(data=torch.from_numpy(values).bfloat16().float().numpy())
    data.attrs["stored_dtype"] = layout.dtype
    return {
        name: data,
        f"{name}_position": (("request", f"{name}_slot"), _padded(per_request_positions, -1, np.int32)),
        f"{name}_hook": (f"{name}_hook", _strings(layout.hooks)),
        f"{name}_layer": (f"{name}_layer", np.asarray(layout.layers, dtype=np.int32)),
    }


def _score_arrays(plan: Plan, pairs: list) -> tuple[dict, dict]:
    """Scores, and for patched requests the recovered fraction and noise floor: (data vars, attributes)."""
    n = len(pairs)
    answer, foil = np.full(n, np.nan), np.full(n, np.nan)
    top = np.full(n, -1, dtype=np.int32)
    for i, (_, result) in enumerate(pairs):
        if result is not None and result.score is not None:
            lps = result.score["logprobs"]
            answer[i] = lps[0]
            foil[i] = lps[1] if len(lps) > 1 else np.nan
            top[i] = result.score["top_id"]
    prob = np.exp(answer)
    data = {
        "answer_logprob": ("request", answer.astype(np.float32)),
        "answer_prob": ("request", prob.astype(np.float32)),
        "foil_logprob": ("request", foil.astype(np.float32)),
        "logit_diff": ("request", (answer - foil).astype(np.float32)),
        "top_token": ("request", top),
    }
    if plan.num_stages == 1:
        return data, {}
    solo = {r.prompt.index: i for i, (r, _) in enumerate(pairs) if r.role == "prompt"}
    recovered = np.full(n, np.nan)
    gaps = []
    for i, (request, result) in enumerate(pairs):
        corrupt = prob[solo[request.prompt.index]]
        if request.role == "baseline":
            gaps.append(abs(prob[i] - corrupt))
        elif request.role == "patched" and request.meta.get("source") is not None:
            clean = prob[solo[request.meta["source"]]]
            with np.errstate(invalid="ignore", divide="ignore"):
                recovered[i] = (prob[i] - corrupt) / (clean - corrupt)
    floor = float(np.nanmax(gaps, initial=0.0)) if gaps else 0.0
    corrupt_of = np.array([prob[solo[r.prompt.index]] for r, _ in pairs])
    data["recovered"] = ("request", recovered.astype(np.float32))
    data["below_noise_floor"] = ("request", np.abs(prob - corrupt_of) <= floor)
    return data, {"noise_floor": floor}


def results_dataset(plan: Plan, results: dict[str, RequestResult], hidden: int, tokenizer=None) -> xr.Dataset:
    """Results by request id -> the store's dataset (requests in plan order)."""
    if plan.trace is not None:
        from .causal_trace import trace_dataset

        return trace_dataset(plan, results, tokenizer)
    pairs = [(r, results.get(r.rid)) for r in plan.requests]
    ran = [res for _, res in pairs]
    prompts = [r.prompt for r in plan.requests]
    status = ["skipped" if res is None else "void" if res.void else "done" for res in ran]
    data_vars = {
        "prompt_tokens": (("request", "prompt_position"), _padded([p.token_ids for p in prompts], -1, np.int32)),
        "prompt_len": ("request", np.array([len(p.token_ids) for p in prompts], dtype=np.int32)),
        "tokens": (("request", "generated"), _padded([res.token_ids if res else [] for res in ran], -1, np.int32)),
        "num_generated": ("request", np.array([len(res.token_ids) if res else 0 for res in ran], dtype=np.int32)),
        "logprob": (("request", "generated"), _padded([res.logprobs if res else [] for res in ran], np.nan,
                                                      np.float32)),
        "text": ("request", _strings([res.text if res else "" for res in ran])),
        "status": ("request", _strings(status)),
    }
    k = plan.requests[0].sampling.get("logprobs") or 0
    if k:
        steps = [res.top_logprobs if res and res.top_logprobs else [] for res in ran]
        width = max((len(x) for x in steps), default=0)
        top_ids = np.full((len(ran), max(width, 1), k), -1, dtype=np.int32)
        top_lps = np.full(top_ids.shape, np.nan, dtype=np.float32)
        for i, request_steps in enumerate(steps):
            for j, step in enumerate(request_steps):
                top_ids[i, j, : len(step[:k])] = [t for t, _ in step[:k]]
                top_lps[i, j, : len(step[:k])] = [lp for _, lp in step[:k]]
        data_vars["top_token_ids"] = (("request", "generated", "top_k"), top_ids)
        data_vars["top_logprob"] = (("request", "generated", "top_k"), top_lps)
    attrs = {}
    if any(p.answer_ids for p in prompts):
        scores, attrs = _score_arrays(plan, pairs)
        data_vars.update(scores)
    if plan.num_stages > 1:
        attrs["skipped_positions"] = list(plan.skipped)
        attrs["voided"] = [{"request": r.rid, "reason": res.void} for r, res in pairs if res is not None and res.void]
    coords = {
        "request": _strings([r.rid for r in plan.requests]),
        "prompt_id": ("request", _strings([p.id for p in prompts])),
        "prompt": ("request", _strings([p.text for p in prompts])),
        "prompt_index": ("request", np.array([p.index for p in prompts], dtype=np.int32)),
        "role": ("request", _strings([r.role for r in plan.requests])),
        "patch": ("request", np.array([r.meta.get("patch", -1) for r in plan.requests], dtype=np.int32)),
    }
    ds = xr.Dataset(data_vars, coords=coords, attrs=attrs)
    for layout in plan.captures:
        arrays = _capture_arrays(layout, pairs, hidden)
        ds[layout.name] = arrays.pop(layout.name)
        ds = ds.assign_coords(arrays)
    return ds


def write_results(path: Path, ds: xr.Dataset) -> None:
    encoding = {}
    for name, var in ds.data_vars.items():
        if var.ndim == 5:  # captures: one chunk per (request, hook), all layers and positions
            # lz4 with byte shuffle: lossless, compresses activations as well as zstd at several times its speed
            # every chunk written as is: zarr's check for all-fill chunks scans each one serially in its event loop
            encoding[name] = {"chunks": (1, 1) + var.shape[2:],
                              "compressors": (BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),),
                              "write_empty_chunks": True}
    # to_zarr replaces the root attributes with the dataset's: carry the manifest over
    ds = ds.assign_attrs({**dict(zarr.open_group(str(path), mode="r").attrs), **ds.attrs})
    # chunks in flight at once: at least one per core (zarr's default is 10), so compression keeps pace with disk
    with zarr.config.set({"async.concurrency": max(os.cpu_count() or 1, zarr.config.get("async.concurrency"))}):
        ds.to_zarr(str(path), mode="a", zarr_format=3, consolidated=False, encoding=encoding)

