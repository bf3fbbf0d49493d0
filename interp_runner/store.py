"""The zarr (v3) store of a run: results as named-dimension arrays (xarray) plus a provenance manifest.

Layout (``xarray.open_zarr(path)``):

- ``prompt_tokens`` (request, prompt_position), ``tokens`` / ``logprob`` (request, generated): -1 / NaN padded;
  ``top_token_ids`` / ``top_logprob`` (request, generated, top_k) when ``sampling.logprobs`` > 0;
- ``text`` and ``prompt`` (request);
- per capture entry NAME: ``NAME`` (request, NAME_hook, NAME_layer, NAME_slot, hidden) with coordinate
  ``NAME_position`` (request, NAME_slot) giving the token position of each slot (-1 and NaN where unused).

Root attributes hold the manifest (``interp_runner.provenance``) and ``status``: ``running`` while the run goes,
``complete`` only after every array was written, ``failed`` (with ``error``) otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr
import zarr

from .compiler import CaptureLayout, Plan
from .engine import RequestResult
from .sites import site_id

STATUS_RUNNING, STATUS_COMPLETE, STATUS_FAILED = "running", "complete", "failed"


def open_store(path: Path, manifest: dict) -> zarr.Group:
    """Create (or replace) the store, marked running, with the manifest written first."""
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
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


def _capture_arrays(layout: CaptureLayout, results: list[RequestResult], hidden: int) -> dict:
    name = layout.name
    per_request_positions = []
    for result in results:
        if result.prompt_index not in layout.prompt_indices:
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
        for h, hook in enumerate(layout.hooks):
            for l, layer in enumerate(layout.layers):
                got = result.captures.get(site_id(layer, hook))
                if got is None:
                    continue
                slot = np.searchsorted(positions, got[0])
                values[r, h, l, slot] = got[1]
    dims = ("request", f"{name}_hook", f"{name}_layer", f"{name}_slot", "hidden")
    data = xr.DataArray(values.astype(dtype) if layout.dtype != "bfloat16" else values, dims=dims)
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


def results_dataset(plan: Plan, results: list[RequestResult], hidden: int) -> xr.Dataset:
    by_index = sorted(results, key=lambda r: r.prompt_index)
    prompts = [r.prompt for r in plan.requests]
    data_vars = {
        "prompt_tokens": (("request", "prompt_position"), _padded([p.token_ids for p in prompts], -1, np.int32)),
        "prompt_len": ("request", np.array([len(p.token_ids) for p in prompts], dtype=np.int32)),
        "tokens": (("request", "generated"), _padded([r.token_ids for r in by_index], -1, np.int32)),
        "num_generated": ("request", np.array([len(r.token_ids) for r in by_index], dtype=np.int32)),
        "logprob": (("request", "generated"), _padded([r.logprobs for r in by_index], np.nan, np.float32)),
        "text": ("request", _strings([r.text for r in by_index])),
    }
    k = plan.requests[0].sampling.get("logprobs") or 0
    if k:
        ids = [[[t for t, _ in step[:k]] for step in r.top_logprobs] for r in by_index]
        lps = [[[lp for _, lp in step[:k]] for step in r.top_logprobs] for r in by_index]
        width = max(len(x) for x in ids)
        top_ids = np.full((len(by_index), max(width, 1), k), -1, dtype=np.int32)
        top_lps = np.full(top_ids.shape, np.nan, dtype=np.float32)
        for i, (a, b) in enumerate(zip(ids, lps)):
            for j, (x, y) in enumerate(zip(a, b)):
                top_ids[i, j, : len(x)], top_lps[i, j, : len(y)] = x, y
        data_vars["top_token_ids"] = (("request", "generated", "top_k"), top_ids)
        data_vars["top_logprob"] = (("request", "generated", "top_k"), top_lps)
    coords = {
        "request": _strings([r.rid for r in plan.requests]),
        "prompt_id": ("request", _strings([p.id for p in prompts])),
        "prompt": ("request", _strings([p.text for p in prompts])),
    }
    ds = xr.Dataset(data_vars, coords=coords)
    for layout in plan.captures:
        arrays = _capture_arrays(layout, by_index, hidden)
        ds[layout.name] = arrays.pop(layout.name)
        ds = ds.assign_coords(arrays)
    return ds


def write_results(path: Path, ds: xr.Dataset) -> None:
    encoding = {}
    for name, var in ds.data_vars.items():
        if var.ndim == 5:  # captures: one chunk per (request, hook), all layers and positions
            encoding[name] = {"chunks": (1, 1) + var.shape[2:]}
    # to_zarr replaces the root attributes with the dataset's: carry the manifest over
    ds = ds.assign_attrs(dict(zarr.open_group(str(path), mode="r").attrs))
    ds.to_zarr(str(path), mode="a", zarr_format=3, consolidated=False, encoding=encoding)
