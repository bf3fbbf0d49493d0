"""A short human summary of a finished store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr


def _peak(ds: xr.Dataset, f: int, kind: str, grid: np.ndarray, first_token: int) -> str:
    if not np.isfinite(grid).any():
        return f"{kind} -"
    layer, token = np.unravel_index(np.nanargmax(grid), grid.shape)
    text = str(ds["token_text"].values[f, first_token + token])
    return f"{kind} {grid[layer, token]:+.3f} @ L{int(ds['layer'][layer])} {text!r}"


def _trace_summary(ds: xr.Dataset) -> None:
    print(f"  noise std {ds.attrs['noise_std']:.4f}, {ds.attrs['noise_samples']} sample(s); "
          f"noise floor {ds.attrs['noise_floor']:.2e}; filtered facts: {ds.attrs['filtered_facts'] or 'none'}")
    for f in range(ds.sizes["fact"]):
        line = (f"  [{ds['fact_id'].values[f]}] {str(ds['prompt'].values[f])!r} -> {str(ds['answer'].values[f])!r}: "
                f"p clean {float(ds['clean_prob'][f]):.3f}, corrupt {float(ds['corrupt_prob'][f]):.3f}")
        if bool(ds["filtered"][f]):
            print(line + "  (filtered: the clean run does not predict the answer)")
            continue
        start, end = int(ds["subject_start"][f]), int(ds["subject_end"][f])
        best, at_subject = [], []
        for kind in ds["kind"].values:
            grid = ds["indirect_effect"].sel(kind=kind).isel(fact=f).values
            best.append(_peak(ds, f, kind, grid, 0))
            at_subject.append(_peak(ds, f, kind, grid[:, start:end], start))
        print(line)
        print("    largest indirect effects: " + ", ".join(best))
        # the last token at the last layers is the answer itself; ROME's finding is the peak at the subject
        print("    at the subject tokens:    " + ", ".join(at_subject))


def print_summary(store: Path, max_rows: int = 8) -> None:
    ds = xr.open_zarr(str(store), consolidated=False)
    attrs = ds.attrs
    print(f"\n{attrs['experiment']['name']} v{attrs['experiment']['version']}  status={attrs['status']}  "
          f"model={Path(attrs['model']['path']).name} ({attrs.get('engine', {}).get('dtype')})")
    if "fact" in ds.dims:
        _trace_summary(ds)
        for path in attrs.get("figures", [])[:1]:
            print(f"  figures: {Path(path).parent}")
        print(f"store: {store}")
        return
    for i in range(min(ds.sizes["request"], max_rows)):
        prompt = str(ds["prompt"].values[i])
        text = str(ds["text"].values[i])
        mean_lp = float(ds["logprob"].isel(request=i).mean(skipna=True))
        score = f", p(answer) {float(ds['answer_prob'][i]):.3f}" if "answer_prob" in ds else ""
        print(f"  [{ds['request'].values[i]} {ds['role'].values[i]}] {prompt!r} -> {text!r}  "
              f"(mean logprob {mean_lp:.3f}{score})")
    if ds.sizes["request"] > max_rows:
        print(f"  ... {ds.sizes['request'] - max_rows} more")
    captured = [name for name, v in ds.data_vars.items() if v.ndim == 5]
    for name in captured:
        print(f"  capture {name}: {dict(ds[name].sizes)}")
    print(f"store: {store}")
